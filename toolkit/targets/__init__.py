"""Targets: what ``build.target`` can be, in one table that every target-dependent decision reads.

Each target has a compile step in this package (``cpu.py``, ``trt_engine.py``, ``llmapi.py``:
``build(spec, quantized_dir, output, force) -> StageResult``) and a row in :data:`TARGETS`: the
quantization formats it runs, whether it needs a GPU, the lowest compute capability per format,
how Triton serves its LLM (toolkit/triton/ renders and launches from this), the host checks that
``rtk build`` runs before its first stage and ``rtk serve`` runs before it starts Triton, and the
``rtk doctor`` checks.  This module imports nothing heavy, so the spec can validate against it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

# The supported GPU software stack: one NGC image family (triton-inference-server/server
# docs/introduction/compatibility.md; the 26.04-26.07 -trtllm-python-py3 images ship TensorRT-LLM 1.2.1).
NGC_CONTAINER = "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
GPU_STACK = {
    "triton_container": ("26.04", "26.07"),
    "tensorrt_llm": "1.2.1",
    "tensorrt": "10.14.1",
    "cuda": "13.1",
    "driver_min": "590.44",
    "min_sm": 80,  # TensorRT-LLM 1.x: Ampere and newer
}
TRTLLM_VERSION = GPU_STACK["tensorrt_llm"]

# Lowest compute capability (sm) that runs each format (ModelOpt support matrix: FP8 and W4A8 on Ada
# and later, FP4 on Blackwell, INT8/INT4 on Ampere; TensorRT-LLM 1.x supports Ampere and later).
MIN_SM = {"none": 80, "fp8": 89, "int8_sq": 80, "int4_awq": 80, "w4a8_awq": 89, "nvfp4": 100}
MIN_SM_KV = {"none": 80, "fp8": 89, "int8": 80}

LLMBackend = Literal["rtk-cpu", "tensorrtllm", "llmapi"]
DEFAULT_MAX_QUEUE_SIZE = 64
_DEADLINE = "for a deadline use serving.guard.ttft_deadline_ms (the front door's admission)"


def _call(module: str, name: str) -> Callable:
    """A function of a module in this package, imported when first called (keeps this table light)."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module, __package__), name)(*args, **kwargs)

    call.__name__ = name
    return call


@dataclass(frozen=True)
class Target:
    """One row of the table."""

    name: str
    formats: frozenset[str]  # quantization.format values it can run
    kv_formats: frozenset[str]  # quantization.kv_cache values it can run
    llm_backend: LLMBackend  # what serves the LLM in Triton (toolkit/triton/ renders it)
    needs_gpu: bool
    build: Callable  # build(spec, quantized_dir, output, *, force) -> StageResult
    doctor_checks: Callable  # doctor_checks(host) -> list[doctor.Check]
    # build_host_problems(spec, host) -> list[str]: why this host cannot build the target ([] = it can)
    build_host_problems: Callable | None = None
    # serve_host_check(engine_manifest, host): raise HostMismatchError when the artifact cannot run here
    serve_host_check: Callable | None = None
    # triton_launch(build: BuildSpec, serving: ServingSpec) -> toolkit.triton.server.Launch; None: one process
    triton_launch: Callable | None = None
    max_world_size: int | None = None  # None: tp x pp as the GPUs allow
    ensemble: bool = True  # the repository has preprocessing/postprocessing/ensemble/BLS
    # serving settings the target cannot enforce -> why; the spec refuses them when set
    unenforceable: dict[str, str] = field(default_factory=dict)
    default_max_queue_size: int | None = DEFAULT_MAX_QUEUE_SIZE
    # serving.server_niceness when the spec leaves it unset: the cpu engine shares the cores with the front door
    # and clients, which deliver its tokens and make its refusals (docs/guard-measurements.md, "Refusals under
    # saturation")
    default_server_niceness: int = 0

    def min_sm(self, fmt: str, kv: str) -> int:
        return max(MIN_SM[fmt], MIN_SM_KV[kv])


TARGETS: dict[str, Target] = {
    "cpu": Target(
        name="cpu",
        # The CPU engine dequantizes the export (toolkit/runtime/checkpoint.py); NVFP4 has no CPU path.
        formats=frozenset({"none", "fp8", "int8_sq", "int4_awq", "w4a8_awq"}),
        kv_formats=frozenset({"none", "fp8", "int8"}),
        llm_backend="rtk-cpu",
        needs_gpu=False,
        build=_call(".cpu", "build"),
        doctor_checks=_call("..doctor", "cpu_checks"),
        max_world_size=1,
        default_server_niceness=5,
    ),
    "trt-engine": Target(
        name="trt-engine",
        formats=frozenset({"none", "fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4"}),
        kv_formats=frozenset({"none", "fp8", "int8"}),
        llm_backend="tensorrtllm",
        needs_gpu=True,
        build=_call(".trt_engine", "build"),
        doctor_checks=_call("..doctor", "trt_engine_checks"),
        build_host_problems=_call(".trt_engine", "build_host_problems"),
        serve_host_check=_call("..hostinfo", "check_engine_host"),
        triton_launch=_call(".trt_engine", "triton_launch"),
        unenforceable={
            "queue_timeout_ms": (
                "TensorRT-LLM's C++ backend hands every request to its executor at once, so Triton's queue timeout "
                "never applies and the backend forwards only max_queue_size (model_instance_state.cc); remove it, "
                + _DEADLINE
            )
        },
    ),
    "llmapi": Target(
        name="llmapi",
        formats=frozenset({"none", "fp8", "int4_awq", "w4a8_awq", "nvfp4"}),
        kv_formats=frozenset({"none", "fp8"}),
        llm_backend="llmapi",
        needs_gpu=True,
        build=_call(".llmapi", "build"),
        doctor_checks=_call("..doctor", "llmapi_checks"),
        serve_host_check=_call("..hostinfo", "check_llmapi_host"),
        triton_launch=_call(".llmapi", "triton_launch"),
        ensemble=False,
        unenforceable={
            "max_queue_size": (
                "the llmapi model's execute() returns at once, so Triton's queue never fills, and the "
                "LLM API has no queue bound; remove it, " + _DEADLINE
            ),
            "queue_timeout_ms": "requests never wait in Triton's queue for the llmapi model; remove it, " + _DEADLINE,
        },
        default_max_queue_size=None,
    ),
}
TARGET_NAMES = tuple(TARGETS)


def target_of(spec_or_name) -> Target:
    name = spec_or_name if isinstance(spec_or_name, str) else spec_or_name.build.target
    return TARGETS[name]


def build(spec, quantized_dir: Path | str, output: Path | str | None = None, *, force: bool = False):
    """Build for ``spec.build.target`` from the quantize stage's directory (``hf/``, ``trtllm/``)."""
    return target_of(spec).build(spec, Path(quantized_dir), Path(output) if output else None, force=force)
