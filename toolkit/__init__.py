"""rtk: compile LLMs for low-latency serving on NVIDIA's stack, testable end to end on a CPU.

Library API (the CLI only calls these)::

    from toolkit import load_spec, fetch, quantize
    spec = load_spec("examples/smollm2-cpu.yaml", ["quantization.format=int4_awq"])
    ckpt = fetch(spec)            # StageResult(path=engines/<name>/checkpoint, skipped=...)
    q = quantize(spec)            # engines/<name>/quantized/{hf,trtllm}/ + quality.json

Heavy dependencies (torch, transformers, modelopt) are imported only inside the stages, so
``import toolkit`` and ``rtk --help`` stay fast, and ``tensorrt_llm`` is never imported on a host
without a GPU.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load_spec", "fetch", "quantize", "StageResult"]


def __getattr__(name: str):
    if name == "load_spec":
        from .spec import load_spec

        return load_spec
    if name == "fetch":
        from .fetch import fetch

        return fetch
    if name == "quantize":
        from .quantize import quantize

        return quantize
    if name == "StageResult":
        from .artifacts import StageResult

        return StageResult
    raise AttributeError(name)
