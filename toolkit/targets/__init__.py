"""Stage 3, build: turn the quantized checkpoint into what the target runs.

One module per target: ``cpu.py`` (rtk's CPU engine: an engine config plus the quantized HF
checkpoint), ``trt_engine.py`` (TensorRT engines from ``trtllm-build``) and ``llmapi.py``
(TensorRT-LLM's PyTorch backend: the checkpoint plus a runtime config).  ``build`` dispatches on
``spec.build.target``; each target module exposes ``build(spec, quantized_dir, output=None,
force=False) -> StageResult`` writing ``engines/<name>/engine/`` atomically with a manifest.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..spec import Spec
from ..stages import StageResult

TARGET_MODULES = {"cpu": "cpu", "trt-engine": "trt_engine", "llmapi": "llmapi"}


def build(spec: Spec, quantized_dir: Path | str, output: Path | str | None = None, *, force: bool = False) -> StageResult:
    """Build for ``spec.build.target`` from the quantize stage's directory (``hf/``, ``trtllm/``)."""
    module = importlib.import_module(f".{TARGET_MODULES[spec.build.target]}", __package__)
    return module.build(spec, Path(quantized_dir), Path(output) if output else None, force=force)
