#!/usr/bin/env bash
# GPU smoke test of the trt-engine target: build the embedded SmolLM2-135M-Instruct into TensorRT
# engines, serve it with Triton's C++ tensorrtllm backend, stream one answer, run a short SLO check.
# Prints each step's time; fails if any step fails or the timed steps take more than ten minutes.
#
# Run it from the repository root, inside the Triton TensorRT-LLM container on a GPU host:
#
#   docker run --rm -it --gpus all --net host -v "$PWD":/rtk -w /rtk \
#       nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3 bash scripts/gpu_smoke.sh
#
# (26.04 to 26.07 ship TensorRT-LLM 1.2.1, TensorRT 10.14.1, CUDA 13.1; the host needs driver >= 590.44.)
#
# rtk runs from its own venv (created once, not timed): CPU torch for fetch/quantize, and the
# container's packages visible through --system-site-packages, so `rtk doctor` sees TensorRT-LLM.
# TensorRT-LLM itself runs only inside `trtllm-build` and tritonserver; rtk never imports it.
#
# Environment: RTK_VENV (default /tmp/rtk-gpu-venv), SMOKE_NAME (default smollm2-trt),
# SMOKE_FORMAT (default: fp8 on sm89+, int4_awq below), SMOKE_BUDGET_S (default 600).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${RTK_VENV:-/tmp/rtk-gpu-venv}
NAME=${SMOKE_NAME:-smollm2-trt}
BUDGET=${SMOKE_BUDGET_S:-600}
SPEC=examples/smollm2-cpu.yaml
# The versions rtk's CPU test suite runs with; the container's own (transformers 4.57, ModelOpt 0.37)
# stay what TensorRT-LLM uses inside trtllm-build and tritonserver.
TESTED_PINS=("transformers==5.24.0" "nvidia-modelopt==0.47.0")

# -- preflight: outside the container, stop now and say so (before creating a venv that needs a
# package index; on a GPU host without the container that failed late, as a pip/venv error) -------
MISSING=()
command -v nvidia-smi >/dev/null || MISSING+=("nvidia-smi (NVIDIA driver)")
command -v trtllm-build >/dev/null || MISSING+=("trtllm-build (TensorRT-LLM)")
command -v tritonserver >/dev/null || [ -x /opt/tritonserver/bin/tritonserver ] || MISSING+=("tritonserver")
if [ ${#MISSING[@]} -gt 0 ]; then
    printf -v FOUND_NOT '%s, ' "${MISSING[@]}"
    echo "gpu_smoke.sh runs inside the Triton TensorRT-LLM container on a GPU host; not found here: ${FOUND_NOT%, }." >&2
    echo "Run: docker run --rm -it --gpus all --net host -v \"\$PWD\":/rtk -w /rtk nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3 bash scripts/gpu_smoke.sh" >&2
    echo "(\`rtk doctor --target trt-engine\` lists every requirement of the trt-engine target.)" >&2
    exit 2
fi

declare -a STEP_NAMES STEP_TIMES
TIMED_TOTAL=0
now() { date +%s.%N; }
step() {  # step "name" command...: run, time, record; abort the script on failure
    local name=$1; shift
    printf '\n\033[1m== %s\033[0m\n' "$name"
    local t0 t1 dt
    t0=$(now)
    if ! "$@"; then
        printf '\033[31mFAILED: %s\033[0m\n' "$name"
        exit 1
    fi
    t1=$(now)
    dt=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
    STEP_NAMES+=("$name"); STEP_TIMES+=("$dt")
    TIMED_TOTAL=$(python3 -c "print(f'{$TIMED_TOTAL + $dt:.1f}')")
    printf '\033[32mok\033[0m %s (%s s)\n' "$name" "$dt"
}

# -- environment (once, not timed) -------------------------------------------------------------
if [ ! -x "$VENV/bin/rtk" ]; then
    echo "Creating $VENV (once; not part of the timed run)"
    python3 -m venv --system-site-packages "$VENV"
    RTK_VENV="$VENV" PIP_INDEX_URL=https://download.pytorch.org/whl/cpu PIP_EXTRA_INDEX_URL=https://pypi.org/simple \
        bash scripts/setup.sh
    "$VENV/bin/python" -m pip --disable-pip-version-check -q install -c .ci/constraints.txt "${TESTED_PINS[@]}"
fi
RTK="$VENV/bin/rtk"
PY="$VENV/bin/python"
export HF_HUB_DISABLE_TELEMETRY=1

SM=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
FORMAT=${SMOKE_FORMAT:-$([ "${SM:-0}" -ge 89 ] && echo fp8 || echo int4_awq)}
SETS=(--set "name=$NAME" --set build.target=trt-engine --set "quantization.format=$FORMAT"
      --set slo.num_requests=40 --set slo.concurrency=4 --set slo.warmup_requests=2)
REPO=$("$PY" -c "from toolkit.spec import load_spec; import sys; print(load_spec('$SPEC', sys.argv[1:]).repository_dir().resolve())" \
       "name=$NAME" build.target=trt-engine "quantization.format=$FORMAT")
echo "GPU sm$SM, format $FORMAT, repository $REPO"

stop_server() { "$PY" -c "from toolkit.triton.server import stop_detached; stop_detached('$REPO')" >/dev/null 2>&1 || true; }
trap stop_server EXIT

# -- timed steps ---------------------------------------------------------------------------------
step "doctor: this host can run trt-engine" "$RTK" doctor --target trt-engine

check_flags() {  # every flag rtk passes exists in this container's trtllm-build
    "$PY" - "$SPEC" "$NAME" "$FORMAT" <<'PY'
import re, subprocess, sys
from toolkit.targets.trt_engine import trtllm_build_command
from toolkit.spec import load_spec
spec = load_spec(sys.argv[1], [f"name={sys.argv[2]}", "build.target=trt-engine", f"quantization.format={sys.argv[3]}"])
algo = {"fp8": "FP8", "int4_awq": "W4A16_AWQ"}[sys.argv[3]]
argv = trtllm_build_command(spec, "ckpt", "out", {"quantization": {"quant_algo": algo}})
help_text = subprocess.run(["trtllm-build", "--help"], capture_output=True, text=True, check=True).stdout
known = set(re.findall(r"--[a-z0-9_]+", help_text))
used = [a for a in argv if a.startswith("--")]
missing = [a for a in used if a not in known]
print(f"{len(used)} flags used, all in `trtllm-build --help`" if not missing else f"unknown to this trtllm-build: {missing}")
sys.exit(1 if missing else 0)
PY
}
step "trtllm-build --help knows every flag rtk passes" check_flags

step "build: fetch, quantize ($FORMAT), trtllm-build, emit" "$RTK" build "$SPEC" "${SETS[@]}"

step "doctor: the engine's manifest matches this host" "$RTK" doctor --target trt-engine --engine "engines/$NAME/engine"

step "serve: tritonserver up, models ready and warm" "$RTK" serve "$SPEC" "${SETS[@]}" --detach

stream_one() {
    local out
    out=$(curl -sSN --max-time 60 -X POST http://127.0.0.1:8000/v2/models/ensemble/generate_stream \
        -H 'Content-Type: application/json' \
        -d '{"text_input": "What is the capital of France?", "max_tokens": 32, "stream": true}')
    printf '%s\n' "$out" | head -40
    local n
    n=$(printf '%s\n' "$out" | grep -c '^data: ' || true)
    echo "-- $n streamed responses"
    [ "$n" -ge 2 ] || { echo "expected a stream of several responses"; return 1; }
    ! printf '%s\n' "$out" | grep -q '"error"' || { echo "the stream carried an error"; return 1; }
    printf '%s\n' "$out" | grep -qi paris && echo "-- the answer names Paris" || echo "-- note: the answer does not name Paris"
}
step "stream one answer (HTTP generate_stream on the ensemble)" stream_one

step "slo: 40 requests at concurrency 4 against the spec's objectives" "$RTK" slo "$SPEC" "${SETS[@]}"

stop_server
trap - EXIT

# -- summary -------------------------------------------------------------------------------------
printf '\n%-62s %8s\n' "step" "seconds"
for i in "${!STEP_NAMES[@]}"; do printf '%-62s %8s\n' "${STEP_NAMES[$i]}" "${STEP_TIMES[$i]}"; done
printf '%-62s %8s\n' "total (budget $BUDGET s)" "$TIMED_TOTAL"
python3 -c "import sys; sys.exit(0 if $TIMED_TOTAL <= $BUDGET else 1)" || { echo "over the ${BUDGET} s budget"; exit 1; }
echo "GPU smoke test passed"
