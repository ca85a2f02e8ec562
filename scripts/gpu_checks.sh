#!/usr/bin/env bash
# GPU checks that need an NVIDIA GPU but not TensorRT-LLM or Triton (docs/gpu-checks.md):
#   1. `rtk doctor` on the GPU host, its probe compared field by field with nvidia-smi and torch.cuda;
#   2. scripts/gpu_smoke.sh outside the TensorRT-LLM container: it must stop early and say why;
#   3. ModelOpt's fake-quant forward on the GPU (NVFP4, and FP8 / INT4-AWQ as controls) against
#      rtk's reading of the export (scripts/gpu_checks.py numerics).
#
#   bash scripts/gpu_checks.sh [OUTDIR]        # from the repository root; OUTDIR default /tmp/rtk-gpu-checks
#
# Needs python3 with CUDA torch, transformers, and rtk's dependencies (click, pydantic, rich, pyyaml,
# nvidia-modelopt).  Wheels found in .whl/ (GPU_CHECKS_WHEELS) are installed into /tmp/site first, for
# a host that cannot reach a package index.  ModelOpt JIT-builds its CUDA extensions (nvcc + ninja) on
# first use: about 60 s each on an H200 host; SKIP_CUDA_EXT=int,fp8 skips them (ModelOpt's torch
# fallback runs on the GPU instead).  The numerics step is limited to NUMERICS_S (300) seconds.
# Exit status: non-zero when the host probe disagrees with nvidia-smi or the numerics check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-/tmp/rtk-gpu-checks}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
T0=$(date +%s)
section() { printf '\n===== %s (t=%ss)\n' "$1" "$(( $(date +%s) - T0 ))"; }

WHEELS=${GPU_CHECKS_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    section "installing carried wheels ($WHEELS) into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 COLUMNS=${COLUMNS:-160}
rtk() { "$PY" -m toolkit.cli "$@"; }

section "host"
nvidia-smi --query-gpu=index,name,memory.total,compute_cap,driver_version --format=csv
nvidia-smi | sed -n '1,4p'
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
echo "CUDA_VERSION=${CUDA_VERSION:-unset}; nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo none)"

section "rtk doctor --target trt-engine"
rtk doctor --target trt-engine; echo "exit status: $?"
rtk doctor --target trt-engine --json >"$OUT_DIR/doctor-trt-engine.json"; echo "exit status (--json): $?"
section "rtk doctor --target cpu"
rtk doctor --target cpu; echo "exit status: $?"
section "rtk doctor's host probe vs nvidia-smi and torch.cuda"
"$PY" scripts/gpu_checks.py host "$OUT_DIR/doctor-trt-engine.json"; HOST_RC=$?

section "scripts/gpu_smoke.sh outside the TensorRT-LLM container (60 s limit)"
RTK_VENV=/tmp/rtk-gpu-venv timeout 60 bash scripts/gpu_smoke.sh; echo "exit status: $? (124 = killed at the limit)"

section "numerics: ModelOpt fake-quant on the GPU vs rtk's reading of the export"
timeout "${NUMERICS_S:-300}" "$PY" scripts/gpu_checks.py numerics --device cuda --json "$OUT_DIR/numerics.json" \
    --skip-cuda-ext "${SKIP_CUDA_EXT:-}" 2>&1 | grep -v -e 'jit.script' -e '_warnings.warn' -e 'warnings.warn(' -e 'Writing model shards'
NUM_RC=${PIPESTATUS[0]}

section "summary"
echo "host probe vs nvidia-smi: $([ $HOST_RC = 0 ] && echo agree || echo MISMATCH); numerics: $([ $NUM_RC = 0 ] && echo pass || echo FAIL)"
[ $HOST_RC = 0 ] && [ $NUM_RC = 0 ]
