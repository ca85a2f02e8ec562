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
  ``triton_config`` values must also be written into ``config.pbtxt`` (:func:`triton_model_config`).

LLM kwargs used (TensorRT-LLM 1.x ``TorchLlmArgs``; examples/llm-api/llm_runtime.py):
``model, backend, tensor_parallel_size, pipeline_parallel_size, trust_remote_code, max_batch_size,
max_num_tokens, max_seq_len, max_input_len, max_beam_width, enable_chunked_prefill,
kv_cache_config{free_gpu_memory_fraction, enable_block_reuse, tokens_per_block, dtype},
scheduler_config{capacity_scheduler_policy}, cuda_graph_config{max_batch_size, enable_padding}``
(``cuda_graph_config: null`` turns CUDA graphs off).
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import yaml

from ..artifacts import atomic_stage, is_complete, read_manifest, sha256_json, stage_key
from ..errors import SpecError, UsageError
from ..hostinfo import HostInfo, probe_host
from ..spec import Spec
from ..stages import StageResult, default_output
from .trt_engine import MIN_SM, MIN_SM_KV, add_tensors, add_warmup, set_queue_policy, write_model_dir

MODEL_YAML = "model.yaml"
TRTLLM_MIN_VERSION = "1.0"
CANCELLATION_CHECK_PERIOD_MS = 100
SCHEDULER_POLICY = {"guaranteed_no_evict": "GUARANTEED_NO_EVICT", "max_utilization": "MAX_UTILIZATION"}

# triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt (c8c6df0): (name, type, dims, optional).
LLMAPI_INPUTS = [
    ("text_input", "TYPE_STRING", [-1], False),
    ("streaming", "TYPE_BOOL", [1], True),
    ("sampling_param_best_of", "TYPE_INT32", [1], True),
    ("sampling_param_temperature", "TYPE_FP32", [1], True),
    ("sampling_param_top_k", "TYPE_INT32", [1], True),
    ("sampling_param_top_p", "TYPE_FP32", [1], True),
    ("sampling_param_frequency_penalty", "TYPE_FP32", [1], True),
    ("sampling_param_presence_penalty", "TYPE_FP32", [1], True),
    ("sampling_param_max_tokens", "TYPE_INT32", [1], True),
    ("sampling_param_stop", "TYPE_STRING", [-1], True),
    ("sampling_param_seed", "TYPE_UINT64", [1], True),
    ("sampling_param_exclude_input_from_output", "TYPE_BOOL", [1], True),
    ("sampling_param_return_perf_metrics", "TYPE_BOOL", [1], True),
    ("return_finish_reason", "TYPE_BOOL", [1], True),
    ("return_stop_reason", "TYPE_BOOL", [1], True),
    ("return_cumulative_logprob", "TYPE_BOOL", [1], True),
    ("stop", "TYPE_BOOL", [1], True),
]
LLMAPI_OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("finish_reason", "TYPE_STRING", [-1]),
    ("stop_reason", "TYPE_STRING", [-1]),
    ("cumulative_logprob", "TYPE_FP32", [-1]),
    ("kv_cache_reused_block", "TYPE_INT32", [-1]),
    ("kv_cache_missed_block", "TYPE_INT32", [-1]),
    ("kv_cache_alloc_new_blocks", "TYPE_INT32", [-1]),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32", [-1]),
    ("kv_cache_hit_rate", "TYPE_FP32", [-1]),
    ("arrival_time_ns", "TYPE_INT64", [1]),
    ("first_scheduled_time_ns", "TYPE_INT64", [1]),
    ("first_token_time_ns", "TYPE_INT64", [1]),
    ("last_token_time_ns", "TYPE_INT64", [1]),
    ("acceptance_rate", "TYPE_FP32", [1]),
    ("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    ("total_draft_tokens", "TYPE_INT32", [1]),
]
# TensorRT-LLM's llmapi model sources (triton_backend/all_models/llmapi/tensorrt_llm/1/), as the NGC
# -trtllm-python-py3 images ship the backend templates (reference/tensorrt-llm-and-triton.md §5).
UPSTREAM_MODEL_FILES = ("model.py", "helpers.py")
UPSTREAM_MODEL_DIRS = ("/app/all_models/llmapi/tensorrt_llm/1",)
WARMUP_PROMPT = "Hello"
WARMUP_MAX_TOKENS = 4


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
    head = (f"# Rendered by rtk from spec '{spec.name}'. Read by Triton's llmapi model (tensorrt_llm/1/model.py):\n"
            "# triton_config configures Triton; every other key is passed to tensorrt_llm.LLM(**kwargs).\n")
    return head + yaml.safe_dump(model_yaml(spec, model_path), sort_keys=False)


def triton_model_config(spec: Spec, engine_dir: Path | str | None = None, *, name: str = "tensorrt_llm"):
    """The llmapi ``tensorrt_llm`` model (python backend) with the same triton_config values as model.yaml.

    (``engine_dir`` is accepted for symmetry with the trt-engine target and not needed.)  With
    ``serving.warmup`` the config names files in ``<model>/warmup/`` (:func:`warmup_files`);
    :func:`write_triton_model` writes config, warm-up files and ``1/`` together.
    """
    from tritonclient.grpc import model_config_pb2 as mc

    check_spec(spec)
    tc = triton_config(spec)
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=tc["max_batch_size"])
    config.model_transaction_policy.decoupled = tc["decoupled"]
    set_queue_policy(config, spec)  # Triton's own queue in front of the model (rejects beyond max_queue_size)
    add_tensors(config, [(n, t, d, o, False, False) for n, t, d, o in LLMAPI_INPUTS], LLMAPI_OUTPUTS)
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    if spec.serving.warmup:
        add_warmup(config, spec, {
            "text_input": ("TYPE_STRING", [1], "text_input"),
            "sampling_param_max_tokens": ("TYPE_INT32", [1], "sampling_param_max_tokens"),
        })
    return config


def model_files(spec: Spec, engine_dir: Path | str) -> dict[str, str]:
    """Files for the model's version directory ``1/``: model.yaml pointing at ``<engine_dir>/hf``, plus
    TensorRT-LLM's own ``model.py`` and ``helpers.py`` when this host has them (the NGC image's
    template directory, or ``$RTK_LLMAPI_MODEL_DIR``); rtk does not ship a copy of upstream code.
    """
    files = {MODEL_YAML: model_yaml_text(spec, (Path(engine_dir) / "hf").resolve())}
    src = upstream_model_dir()
    if src is not None:
        for name in UPSTREAM_MODEL_FILES:
            files[name] = (src / name).read_text()
    return files


def upstream_model_dir() -> Path | None:
    """Where TensorRT-LLM's llmapi model.py lives on this host, if anywhere."""
    for cand in (os.environ.get("RTK_LLMAPI_MODEL_DIR"), *UPSTREAM_MODEL_DIRS):
        if cand and all((Path(cand) / n).is_file() for n in UPSTREAM_MODEL_FILES):
            return Path(cand)
    return None


def write_triton_model(spec: Spec, model_dir: Path | str, engine_dir: Path | str) -> Path:
    """Write the llmapi ``tensorrt_llm`` model directory: config.pbtxt, warmup/, 1/model.yaml (+ upstream model.py)."""
    model_dir = Path(model_dir)
    write_model_dir(model_dir, triton_model_config(spec, name=model_dir.name),
                    warmup_files(spec) if spec.serving.warmup else {}, model_files(spec, engine_dir))
    return model_dir


def warmup_files(spec: Spec) -> dict[str, bytes]:
    """Files for ``<repo>/tensorrt_llm/warmup/``: Triton's raw encoding (BYTES: 4-byte length + bytes)."""
    text = WARMUP_PROMPT.encode()
    return {
        "text_input": struct.pack("<I", len(text)) + text,
        "sampling_param_max_tokens": struct.pack("<i", min(WARMUP_MAX_TOKENS, spec.build.max_seq_len - 1)),
    }


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


def _link_tree(src: Path, dest: Path) -> None:
    for f in sorted(src.rglob("*")):
        if f.is_file():
            target = dest / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)


def build(spec: Spec, quantized_dir: Path | str, output: Path | str | None = None, *, force: bool = False,
          host: HostInfo | None = None) -> StageResult:
    """Link the unified HF checkpoint into ``output/hf`` and write ``output/model.yaml``. Needs no GPU."""
    check_spec(spec)
    hf = Path(quantized_dir) / "hf"
    if not (hf / "config.json").is_file():
        raise UsageError(f"'{hf}' holds no HF checkpoint (no config.json); run `rtk quantize SPEC` first")
    output = Path(output) if output else default_output(spec, "build")
    section = {"build": spec.build.model_dump(mode="json"), "quantization": spec.quantization.model_dump(mode="json"),
               "serving": {k: getattr(spec.serving, k) for k in ("decoupled", "batch_scheduler_policy")}}
    m = read_manifest(Path(quantized_dir))
    inputs = {"quantized_key": m.get("key") if m else None,
              "hf_files": {p.relative_to(hf).as_posix(): p.stat().st_size for p in sorted(hf.rglob("*")) if p.is_file()}}
    host = host or probe_host(triton_version=False)
    tools = {"tensorrt_llm": host.packages.get("tensorrt_llm")}
    key = stage_key("build", section, inputs, tools)
    if not force and is_complete(output, key):
        return StageResult("build", output, True, read_manifest(output))
    with atomic_stage("build", output, key, inputs=inputs, spec_section=section, tools=tools) as out:
        _link_tree(hf, out.tmp / "hf")
        # The path the LLM loads from once the stage directory is renamed into place.
        (out.tmp / MODEL_YAML).write_text(model_yaml_text(spec, (output / "hf").resolve()))
        out.manifest.update({"target": "llmapi", "model_yaml": MODEL_YAML, "runs_on": runs_on_record(spec, host)})
    return StageResult("build", output, False, read_manifest(output))


build_llmapi = build
