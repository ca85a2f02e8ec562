#!/usr/bin/env bash
# The main job on the embedded default model: fetch → quantize (FP8, quality report).
# Later stages (build → serve → SLO check) are appended here as they land.
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC=${1:-examples/smollm2-cpu.yaml}
RTK=.venv/bin/rtk
$RTK fetch "$SPEC"
$RTK quantize "$SPEC"
