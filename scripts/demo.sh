#!/usr/bin/env bash
# The main job on the embedded default model, end to end on a CPU host:
#   build (fetch → quantize FP8 with quality report → cpu engine → Triton repository)
#   → serve (tritonserver on 127.0.0.1) → stream a chat answer → SLO check (exit code = verdict).
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC=${1:-examples/smollm2-cpu.yaml}
RTK=.venv/bin/rtk
$RTK build "$SPEC"
$RTK serve "$SPEC" --detach
trap '$RTK serve "$SPEC" --stop' EXIT
$RTK chat "$SPEC" "What is the capital of France?" --no-build
$RTK slo "$SPEC"
