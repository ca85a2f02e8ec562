#!/usr/bin/env bash
# The main job on the embedded default model, end to end on a CPU host:
#   build (fetch → quantize with quality report → cpu engine → Triton repository)
#   → serve (tritonserver on 127.0.0.1) → stream a chat answer → SLO check (exit code = verdict).
# With no SPEC argument it runs examples/smollm2-cpu.yaml: FP8 weights on a CPU with native bf16
# (AVX512-BF16). A CPU without it (AVX2, or AVX512 without BF16) computes in float32, where the FP8 build misses the
# example's gate; there the example is built as INT8-SQ with its LM head quantized, whose products
# are integer and which meets the gate on a quiet 2-core AVX2 host (docs/engine-measurements.md, "Prompt rows
# through the fused layers"; `rtk doctor --target cpu` says which path a host gets), with its down
# projections W8A16: with their inputs quantized too, SmolLM2 answers "France" for the capital of
# France (docs/engine-measurements.md, "INT8-SQ's down projections as W8A16"); and with a 45 ms time budget for
# steps in which someone decodes (instead of the example's step_budget_ratio), prompt chunks in 8-token units,
# so that a newcomer's prompt chunk beside the decoding streams stays inside the gate's ITL p99 whatever the
# host's speed of the hour (docs/engine-measurements.md, "A step budget in time").
set -euo pipefail
cd "$(dirname "$0")/.."
RTK=.venv/bin/rtk
SPEC=examples/smollm2-cpu.yaml
ARGS=()
if [ $# -gt 0 ]; then
  SPEC=$1
elif ! grep -qw avx512_bf16 /proc/cpuinfo; then
  echo "this CPU has no native bf16 (no AVX512-BF16): building the example as INT8-SQ (LM head and down projections" \
       "W8A16), steps of at most 45 ms"
  ARGS=(--set quantization.format=int8_sq --set quantization.quantize_lm_head=true
        --set 'quantization.weight_only_modules=[down_proj]' --set build.max_num_tokens=32
        --set build.context_chunk_unit=8 --set build.step_budget_ms=45 --set build.step_budget_ratio=null)
fi
# The example's objectives were measured on an AVX512-BF16 host without AMX (AMD Zen 4) and hold on an Intel AMX
# host (docs/engine-measurements.md, "The main job's gate on the AMX host"); without AVX512-BF16 the gate is the one measured
# before (examples/smollm2-cpu.yaml, docs/engine-measurements.md "The main job's gate")
SLO_ARGS=()
if [ $# -eq 0 ] && ! grep -qw avx512_bf16 /proc/cpuinfo; then
  SLO_ARGS=(--objective 'ttft:p99<=680' --objective 'itl:p99<=75' --objective 'error_rate<=0.001')
fi
$RTK build "$SPEC" "${ARGS[@]}"
$RTK serve "$SPEC" "${ARGS[@]}" --detach
trap '$RTK serve "$SPEC" "${ARGS[@]}" --stop' EXIT
$RTK chat "$SPEC" "${ARGS[@]}" "What is the capital of France?" --no-build
$RTK slo "$SPEC" "${ARGS[@]}" "${SLO_ARGS[@]}"
