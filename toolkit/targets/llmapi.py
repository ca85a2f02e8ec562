"""The ``llmapi`` target: TensorRT-LLM's PyTorch backend behind Triton's ``llmapi`` python model.

There is no engine to compile: the artifact is the quantize stage's unified HF checkpoint
(``<quantized>/hf``, which the LLM API loads directly: ModelOpt checkpoints are recognised by
``hf_quant_config.json``) linked into ``engines/<name>/engine/hf`` plus the runtime config the
Triton model reads, ``model.yaml``, rendered from the spec by :func:`model_yaml`.

Written against NVIDIA/TensorRT-LLM ``triton_backend/all_models/llmapi/tensorrt_llm/``:
``1/model.py`` (b35ac1b, a 1.2.0rc2-era commit) passes every key of ``model.yaml`` except
``triton_config`` to ``LLM(**kwargs)`` and reads ``triton_config.{decoupled, max_batch_size,
cancellation_check_period_ms}``; ``config.pbtxt`` (c8c6df0) gives the tensors.  Two facts from
that code shape what rtk renders:

* ``model.py`` refuses a ``text_input`` with more than one dimension, so Triton-level batching is
  off (``max_batch_size: 0``, as upstream's ``model.yaml`` says); in-flight batching happens
  inside the LLM (``max_batch_size`` among the LLM kwargs).
* ``launch_triton_server.py`` starts the server with ``--disable-auto-complete-config``, so the
  ``triton_config`` values must also be written into ``config.pbtxt`` (toolkit/triton/gpu_models.py
  renders it from :func:`triton_config`, and copies this stage's ``model.yaml`` into the repository).

LLM kwargs used (TensorRT-LLM 1.x ``TorchLlmArgs``; examples/llm-api/llm_runtime.py):
``model, backend, tensor_parallel_size, pipeline_parallel_size, trust_remote_code, max_batch_size,
max_num_tokens, max_seq_len, max_input_len, max_beam_width, enable_chunked_prefill,
kv_cache_config{free_gpu_memory_fraction, enable_block_reuse, tokens_per_block, dtype},
scheduler_config{capacity_scheduler_policy}, cuda_graph_config{max_batch_size, enable_padding}``
(``cuda_graph_config: null`` turns CUDA graphs off).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ..artifacts import StageResult, default_output, link_or_copy, read_manifest, run_stage, sha256_json
from ..errors import SpecError, UsageError
from ..hostinfo import HostInfo, probe_host
from ..spec import Spec
from . import MIN_SM, MIN_SM_KV

MODEL_YAML = "model.yaml"
TRTLLM_MIN_VERSION = "1.0"
CANCELLATION_CHECK_PERIOD_MS = 100
SCHEDULER_POLICY = {"guaranteed_no_evict": "GUARANTEED_NO_EVICT", "max_utilization": "MAX_UTILIZATION"}


def check_spec(spec: Spec) -> None:
    if spec.build.target != "llmapi":
        raise SpecError(f"this builds the llmapi target, not '{spec.build.target}'", field="build.target")
    if spec.serving.instance_count != 1:
        raise SpecError(
            "the llmapi model runs one LLM per server (its model.py has no per-instance GPU placement); "
            "set it to 1 and scale with build.tp_size or more servers",
            field="serving.instance_count",
        )


def llm_kwargs(spec: Spec, model_path: Path | str) -> dict:
    """The ``LLM(**kwargs)`` part of model.yaml."""
    b, q = spec.build, spec.quantization
    kv = {
        "free_gpu_memory_fraction": b.kv_cache_free_gpu_mem_fraction,
        "enable_block_reuse": b.enable_kv_cache_reuse,
        "tokens_per_block": b.tokens_per_block,
    }
    if q.kv_cache == "fp8":
        kv["dtype"] = "fp8"
    return {
        "model": str(model_path),
        "backend": "pytorch",
        "tensor_parallel_size": b.tp_size,
        "pipeline_parallel_size": b.pp_size,
        "trust_remote_code": spec.model.trust_remote_code,
        "max_batch_size": b.max_batch_size,
        "max_num_tokens": b.max_num_tokens,
        "max_seq_len": b.max_seq_len,
        "max_input_len": b.max_input_len,
        "max_beam_width": b.max_beam_width,
        "enable_chunked_prefill": b.enable_chunked_context,
        "kv_cache_config": kv,
        "scheduler_config": {"capacity_scheduler_policy": SCHEDULER_POLICY[spec.serving.batch_scheduler_policy]},
        # Decode batches up to max_batch_size replay captured graphs; padding rounds odd sizes up.
        "cuda_graph_config": {"max_batch_size": b.max_batch_size, "enable_padding": True} if b.use_cuda_graph else None,
    }


def triton_config(spec: Spec) -> dict:
    return {
        "max_batch_size": 0,  # model.py takes one prompt per request; the LLM batches in flight
        "decoupled": spec.serving.decoupled,
        "cancellation_check_period_ms": CANCELLATION_CHECK_PERIOD_MS,
    }


def model_yaml(spec: Spec, model_path: Path | str) -> dict:
    """model.yaml as a dict: the LLM kwargs plus ``triton_config``."""
    check_spec(spec)
    return {**llm_kwargs(spec, model_path), "triton_config": triton_config(spec)}


def model_yaml_text(spec: Spec, model_path: Path | str) -> str:
    head = (
        f"# Rendered by rtk from spec '{spec.name}'. Read by Triton's llmapi model (tensorrt_llm/1/model.py):\n"
        "# triton_config configures Triton; every other key is passed to tensorrt_llm.LLM(**kwargs).\n"
    )
    return head + yaml.safe_dump(model_yaml(spec, model_path), sort_keys=False)


def runs_on_record(spec: Spec, host: HostInfo | None) -> dict:
    q = spec.quantization
    return {
        "target": "llmapi",
        "spec_name": spec.name,
        "spec_hash": sha256_json(spec.model_dump(mode="json")),
        "tensorrt_llm_min": TRTLLM_MIN_VERSION,
        "tensorrt_llm_at_build": host.packages.get("tensorrt_llm") if host else None,
        "min_sm": max(MIN_SM[q.format], MIN_SM_KV[q.kv_cache]),
        "gpu_count": spec.build.world_size,
        "tp_size": spec.build.tp_size,
        "pp_size": spec.build.pp_size,
        "quantization": {"format": q.format, "kv_cache": q.kv_cache},
    }


def build(
    spec: Spec,
    quantized_dir: Path | str,
    output: Path | str | None = None,
    *,
    force: bool = False,
    host: HostInfo | None = None,
) -> StageResult:
    """Link the unified HF checkpoint into ``output/hf`` and write ``output/model.yaml``. Needs no GPU."""
    check_spec(spec)
    hf = Path(quantized_dir) / "hf"
    if not (hf / "config.json").is_file():
        raise UsageError(f"'{hf}' holds no HF checkpoint (no config.json); run `rtk quantize SPEC` first")
    output = Path(output) if output else default_output(spec, "build")
    section = {
        "build": spec.build.model_dump(mode="json"),
        "quantization": spec.quantization.model_dump(mode="json"),
        "serving": {k: getattr(spec.serving, k) for k in ("decoupled", "batch_scheduler_policy")},
    }
    m = read_manifest(Path(quantized_dir))
    inputs = {
        "quantized_key": m.get("key") if m else None,
        "hf_files": {p.relative_to(hf).as_posix(): p.stat().st_size for p in sorted(hf.rglob("*")) if p.is_file()},
    }
    host = host or probe_host(triton_version=False)
    tools = {"tensorrt_llm": host.packages.get("tensorrt_llm")}

    def write(out) -> None:
        link_or_copy(hf, out.tmp / "hf", recursive=True)
        # The path the LLM loads from once the stage directory is renamed into place.
        (out.tmp / MODEL_YAML).write_text(model_yaml_text(spec, (output / "hf").resolve()))
        out.manifest.update({"target": "llmapi", "model_yaml": MODEL_YAML, "runs_on": runs_on_record(spec, host)})

    return run_stage("build", output, section=section, inputs=inputs, tools=tools, write=write, force=force)


def triton_launch(build, serving):
    """With tp x pp > 1 the server runs under ``mpirun -n 1`` (TensorRT-LLM's launch_triton_server.py,
    0a2e2c1, launches through MPI by default): the LLM API then starts its tensor/pipeline-parallel
    workers inside that MPI job."""
    from ..triton.server import Launch

    return Launch(mpirun=build.tp_size * build.pp_size > 1)
