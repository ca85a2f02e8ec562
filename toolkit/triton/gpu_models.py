"""The ``tensorrt_llm`` model of the GPU targets, rendered through the same helpers as every other config.

* ``trt-engine``: TensorRT-LLM's C++ ``tensorrtllm`` backend over the built engine.  Tensors and
  parameters as in NVIDIA/TensorRT-LLM ``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/
  config.pbtxt`` (0c8de69) and ``triton_backend/inflight_batcher_llm/src/model_instance_state.cc``
  (c8c6df0); the interface is kept as data in tests/data/trtllm_1_2_1_triton_models.json.
* ``llmapi``: Triton's ``llmapi`` python model (NVIDIA/TensorRT-LLM ``triton_backend/all_models/
  llmapi/tensorrt_llm/config.pbtxt``, c8c6df0) whose ``1/model.yaml`` is the build stage's; its
  ``model.py`` comes from the NGC image, rtk ships no copy of upstream code.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from . import config as cfgs
from .config import Tensor

# -- trt-engine: the C++ tensorrtllm backend -----------------------------------------------------

_OPT_SCALAR = dict(optional=True, scalar=True)  # optional, dims [1] reshaped to [] (the backend's scalars)
# Placeholders as in the upstream template: "MODEL" the model's dtype (encoder_input_features,
# prompt_embedding_table), "LOGITS" the checkpoint's logits_dtype (its ${logits_datatype}).
CPP_INPUTS = [
    Tensor("input_ids", "INT32", (-1,), optional=True, ragged=True),
    Tensor("encoder_input_features", "MODEL", (-1, -1), optional=True, ragged=True),
    Tensor("encoder_output_lengths", "INT32", (1,), **_OPT_SCALAR),
    Tensor("input_lengths", "INT32", (1,), scalar=True),
    Tensor("request_output_len", "INT32", (1,), scalar=True),
    Tensor("num_return_sequences", "INT32", (1,), **_OPT_SCALAR),
    Tensor("draft_input_ids", "INT32", (-1,), optional=True, ragged=True),
    Tensor("decoder_input_ids", "INT32", (-1,), optional=True, ragged=True),
    Tensor("decoder_input_lengths", "INT32", (1,), **_OPT_SCALAR),
    Tensor("draft_logits", "FP32", (-1, -1), optional=True, ragged=True),
    Tensor("draft_acceptance_threshold", "FP32", (1,), **_OPT_SCALAR),
    Tensor("end_id", "INT32", (1,), **_OPT_SCALAR),
    Tensor("pad_id", "INT32", (1,), **_OPT_SCALAR),
    Tensor("stop_words_list", "INT32", (2, -1), optional=True, ragged=True),
    Tensor("bad_words_list", "INT32", (2, -1), optional=True, ragged=True),
    Tensor("embedding_bias", "FP32", (-1,), optional=True, ragged=True),
    Tensor("beam_width", "INT32", (1,), **_OPT_SCALAR),
    Tensor("temperature", "FP32", (1,), **_OPT_SCALAR),
    Tensor("runtime_top_k", "INT32", (1,), **_OPT_SCALAR),
    Tensor("runtime_top_p", "FP32", (1,), **_OPT_SCALAR),
    Tensor("runtime_top_p_min", "FP32", (1,), **_OPT_SCALAR),
    Tensor("runtime_top_p_decay", "FP32", (1,), **_OPT_SCALAR),
    Tensor("runtime_top_p_reset_ids", "INT32", (1,), **_OPT_SCALAR),
    Tensor("len_penalty", "FP32", (1,), **_OPT_SCALAR),
    Tensor("early_stopping", "BOOL", (1,), **_OPT_SCALAR),
    Tensor("repetition_penalty", "FP32", (1,), **_OPT_SCALAR),
    Tensor("min_tokens", "INT32", (1,), **_OPT_SCALAR),
    Tensor("beam_search_diversity_rate", "FP32", (1,), **_OPT_SCALAR),
    Tensor("presence_penalty", "FP32", (1,), **_OPT_SCALAR),
    Tensor("frequency_penalty", "FP32", (1,), **_OPT_SCALAR),
    Tensor("seed", "UINT64", (1,), **_OPT_SCALAR),
    Tensor("return_log_probs", "BOOL", (1,), **_OPT_SCALAR),
    Tensor("return_context_logits", "BOOL", (1,), **_OPT_SCALAR),
    Tensor("return_generation_logits", "BOOL", (1,), **_OPT_SCALAR),
    Tensor("return_perf_metrics", "BOOL", (1,), **_OPT_SCALAR),
    Tensor("return_num_input_tokens", "BOOL", (1,), **_OPT_SCALAR),
    Tensor("return_num_output_tokens", "BOOL", (1,), **_OPT_SCALAR),
    Tensor("exclude_input_in_output", "BOOL", (1,), **_OPT_SCALAR),
    Tensor("stop", "BOOL", (1,), **_OPT_SCALAR),
    Tensor("streaming", "BOOL", (1,), **_OPT_SCALAR),
    Tensor("prompt_embedding_table", "MODEL", (-1, -1), optional=True, ragged=True),
    Tensor("prompt_table_extra_ids", "UINT64", (-1,), optional=True, ragged=True),
    Tensor("prompt_vocab_size", "INT32", (1,), **_OPT_SCALAR),
    Tensor("cross_attention_mask", "BOOL", (-1, -1), optional=True, ragged=True),
    Tensor("mrope_rotary_cos_sin", "FP32", (-1,), optional=True),
    Tensor("mrope_position_deltas", "INT64", (1,), optional=True),
    Tensor("lora_task_id", "UINT64", (1,), **_OPT_SCALAR),
    Tensor("lora_weights", "FP16", (-1, -1), optional=True, ragged=True),
    Tensor("lora_config", "INT32", (-1, 3), optional=True, ragged=True),
    Tensor("context_phase_params", "UINT8", (-1,), optional=True, ragged=True),
    Tensor("skip_cross_attn_blocks", "BOOL", (1,), optional=True, ragged=True),
    Tensor("retention_token_range_starts", "INT32", (-1,), optional=True, ragged=True),
    Tensor("retention_token_range_ends", "INT32", (-1,), optional=True, ragged=True),
    Tensor("retention_token_range_priorities", "INT32", (-1,), optional=True, ragged=True),
    Tensor("retention_token_range_durations_ms", "INT32", (-1,), optional=True, ragged=True),
    Tensor("retention_decode_priority", "INT32", (1,), optional=True, ragged=True),
    Tensor("retention_decode_duration_ms", "INT32", (1,), optional=True, ragged=True),
    Tensor("guided_decoding_guide_type", "STRING", (1,), optional=True, ragged=True),
    Tensor("guided_decoding_guide", "STRING", (1,), optional=True, ragged=True),
    Tensor("lookahead_window_size", "INT32", (1,), optional=True, ragged=True),
    Tensor("lookahead_ngram_size", "INT32", (1,), optional=True, ragged=True),
    Tensor("lookahead_verification_set_size", "INT32", (1,), optional=True, ragged=True),
]
CPP_OUTPUTS = [
    Tensor("output_ids", "INT32", (-1, -1)),
    Tensor("sequence_length", "INT32", (-1,)),
    Tensor("cum_log_probs", "FP32", (-1,)),
    Tensor("output_log_probs", "FP32", (-1, -1)),
    Tensor("context_logits", "LOGITS", (-1, -1)),
    Tensor("generation_logits", "LOGITS", (-1, -1, -1)),
    Tensor("batch_index", "INT32", (1,)),
    Tensor("sequence_index", "INT32", (1,)),
    Tensor("context_phase_params", "UINT8", (-1,)),
    Tensor("kv_cache_alloc_new_blocks", "INT32", (1,)),
    Tensor("kv_cache_reused_blocks", "INT32", (1,)),
    Tensor("kv_cache_alloc_total_blocks", "INT32", (1,)),
    Tensor("arrival_time_ns", "INT64", (1,)),
    Tensor("first_scheduled_time_ns", "INT64", (1,)),
    Tensor("first_token_time_ns", "INT64", (1,)),
    Tensor("last_token_time_ns", "INT64", (1,)),
    Tensor("acceptance_rate", "FP32", (1,)),
    Tensor("total_accepted_draft_tokens", "INT32", (1,)),
    Tensor("total_draft_tokens", "INT32", (1,)),
    Tensor("num_input_tokens", "INT32", (1,)),
    Tensor("num_output_tokens", "INT32", (1,)),
]
EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
WARMUP_PROMPT_TOKENS = 16
WARMUP_OUTPUT_TOKENS = 4


def tensorrt_llm_cpp(spec, engine_dir: Path | str, *, name: str = cfgs.TENSORRT_LLM, logits_dtype: str = "float32"):
    """The ``tensorrt_llm`` model for the C++ ``tensorrtllm`` backend.

    ``logits_dtype`` is the engine's (its config.json ``pretrained_config.logits_dtype``; ModelOpt's
    export writes float16): the logits outputs carry what the engine produces.

    ``engine_dir`` is the engine directory as the server will see it.  Every parameter the backend
    reads is set from the spec, including the three it reads without a default (``tokenizer_dir``,
    ``xgrammar_tokenizer_info_path``, ``guided_decoding_backend``: model_instance_state.cc
    getGuidedDecodingConfigFromParams throws when they are absent).  With ``serving.warmup`` the
    config names the files :func:`cpp_warmup_files` writes.
    """
    pb = cfgs.pb()
    b, s = spec.build, spec.serving
    config = pb.ModelConfig(name=name, backend="tensorrtllm", max_batch_size=b.max_batch_size)
    config.model_transaction_policy.decoupled = s.decoupled
    config.dynamic_batching.preferred_batch_size.append(b.max_batch_size)
    config.dynamic_batching.max_queue_delay_microseconds = 0
    cfgs.queue_policy(config, spec)  # the backend hands max_queue_size to the executor too
    types = {"MODEL": cfgs.TORCH_TO_TRITON[spec.model.dtype], "LOGITS": cfgs.TORCH_TO_TRITON[logits_dtype]}
    cfgs.add_tensors(config.input, CPP_INPUTS, is_input=True, placeholders=types)
    cfgs.add_tensors(config.output, CPP_OUTPUTS, is_input=False, placeholders=types)
    # KIND_CPU: the backend places the engine on the GPUs itself (upstream template).
    cfgs.cpu_instances(config, s.instance_count)
    params = {
        "gpt_model_type": s.batching_strategy,
        "gpt_model_path": str(engine_dir),
        "max_beam_width": b.max_beam_width,
        "batch_scheduler_policy": s.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": b.kv_cache_free_gpu_mem_fraction,
        "enable_kv_cache_reuse": b.enable_kv_cache_reuse,
        "enable_chunked_context": b.enable_chunked_context,
        "exclude_input_in_output": True,  # text_output carries the answer only; a request may override
        "normalize_log_probs": True,
        "decoding_mode": "top_k_top_p",
        "cancellation_check_period_ms": 100,
        "stats_check_period_ms": 100,
        "multi_block_mode": True,
        "enable_context_fmha_fp32_acc": False,
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "executor_worker_path": EXECUTOR_WORKER,
        "tokenizer_dir": "",
        "xgrammar_tokenizer_info_path": "",
        "guided_decoding_backend": "",
    }
    if s.instance_count > 1:
        # One engine copy per instance on its own GPUs ("0,1;2,3"), served in orchestrator mode
        # (toolkit/targets/trt_engine.py triton_launch).
        params["gpu_device_ids"] = gpu_device_ids(b.world_size, s.instance_count)
    cfgs.set_parameters(config, params)
    if s.warmup:
        prompt, _ = _cpp_warmup_lengths(spec)
        cfgs.add_warmup(
            config,
            "rtk_warmup",
            {
                "input_ids": ("INT32", (prompt,), "input_ids"),
                "input_lengths": ("INT32", (1,), "input_lengths"),
                "request_output_len": ("INT32", (1,), "request_output_len"),
            },
        )
    return config


def gpu_device_ids(world_size: int, instance_count: int) -> str:
    return ";".join(",".join(str(i * world_size + r) for r in range(world_size)) for i in range(instance_count))


def _cpp_warmup_lengths(spec) -> tuple[int, int]:
    prompt = min(WARMUP_PROMPT_TOKENS, spec.build.max_input_len)
    return prompt, max(1, min(WARMUP_OUTPUT_TOKENS, spec.build.max_seq_len - prompt))


def cpp_warmup_files(spec, prompt_ids: list[int] | None = None) -> dict[str, bytes]:
    """Files for ``<repo>/tensorrt_llm/warmup/`` (raw little-endian tensors, as Triton reads them).

    ``prompt_ids`` defaults to arbitrary small token ids: warm-up exercises the kernels, not the text.
    """
    prompt, out = _cpp_warmup_lengths(spec)
    ids = list(prompt_ids or range(100, 100 + prompt))[:prompt]
    ids += [ids[-1]] * (prompt - len(ids))
    return {
        "input_ids": struct.pack(f"<{prompt}i", *ids),
        "input_lengths": struct.pack("<i", prompt),
        "request_output_len": struct.pack("<i", out),
    }


def engine_logits_dtype(engine_dir: Path | str) -> str:
    """The built engine's ``pretrained_config.logits_dtype`` (float32 when it does not say)."""
    try:
        config = json.loads((Path(engine_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    return (config.get("pretrained_config") or config).get("logits_dtype") or "float32"


def write_tensorrt_llm_cpp(spec, model_dir: Path | str, engine_dir: Path | str) -> Path:
    """The ``tensorrt_llm`` model directory of the trt-engine target: config.pbtxt, warmup/, 1/."""
    model_dir = Path(model_dir)
    config = tensorrt_llm_cpp(spec, engine_dir, name=model_dir.name, logits_dtype=engine_logits_dtype(engine_dir))
    cfgs.write_model_dir(model_dir, config, warmup=cpp_warmup_files(spec) if spec.serving.warmup else {})
    return model_dir


# -- llmapi: Triton's llmapi python model --------------------------------------------------------

LLMAPI_INPUTS = [
    Tensor("text_input", "STRING", (-1,)),
    *(
        Tensor(n, dt, (1,), optional=True)
        for n, dt in (
            ("streaming", "BOOL"),
            ("sampling_param_best_of", "INT32"),
            ("sampling_param_temperature", "FP32"),
            ("sampling_param_top_k", "INT32"),
            ("sampling_param_top_p", "FP32"),
            ("sampling_param_frequency_penalty", "FP32"),
            ("sampling_param_presence_penalty", "FP32"),
            ("sampling_param_max_tokens", "INT32"),
        )
    ),
    Tensor("sampling_param_stop", "STRING", (-1,), optional=True),
    *(
        Tensor(n, dt, (1,), optional=True)
        for n, dt in (
            ("sampling_param_seed", "UINT64"),
            ("sampling_param_exclude_input_from_output", "BOOL"),
            ("sampling_param_return_perf_metrics", "BOOL"),
            ("return_finish_reason", "BOOL"),
            ("return_stop_reason", "BOOL"),
            ("return_cumulative_logprob", "BOOL"),
            ("stop", "BOOL"),
        )
    ),
]
LLMAPI_OUTPUTS = [
    Tensor("text_output", "STRING", (-1,)),
    Tensor("finish_reason", "STRING", (-1,)),
    Tensor("stop_reason", "STRING", (-1,)),
    Tensor("cumulative_logprob", "FP32", (-1,)),
    *(
        Tensor(n, "INT32", (-1,))
        for n in (
            "kv_cache_reused_block",
            "kv_cache_missed_block",
            "kv_cache_alloc_new_blocks",
            "kv_cache_alloc_total_blocks",
        )
    ),
    Tensor("kv_cache_hit_rate", "FP32", (-1,)),
    *(Tensor(n, "INT64", (1,)) for n in cfgs.PERF_OUTPUTS),
    Tensor("acceptance_rate", "FP32", (1,)),
    Tensor("total_accepted_draft_tokens", "INT32", (1,)),
    Tensor("total_draft_tokens", "INT32", (1,)),
]
# TensorRT-LLM's llmapi model sources (triton_backend/all_models/llmapi/tensorrt_llm/1/), where the NGC
# -trtllm-python-py3 images keep the backend templates.
UPSTREAM_MODEL_FILES = ("model.py", "helpers.py")
UPSTREAM_MODEL_DIRS = ("/app/all_models/llmapi/tensorrt_llm/1",)
LLMAPI_WARMUP_PROMPT = "Hello"
LLMAPI_WARMUP_MAX_TOKENS = 4


def tensorrt_llm_llmapi(spec, *, name: str = cfgs.TENSORRT_LLM):
    """The llmapi ``tensorrt_llm`` model (python backend) with the ``triton_config`` values of model.yaml.

    ``launch_triton_server.py`` starts the server with ``--disable-auto-complete-config``, so what
    model.yaml's ``triton_config`` says must also be written here.
    """
    from ..targets.llmapi import check_spec, triton_config

    check_spec(spec)
    tc = triton_config(spec)
    pb = cfgs.pb()
    config = pb.ModelConfig(name=name, backend="python", max_batch_size=tc["max_batch_size"])
    config.model_transaction_policy.decoupled = tc["decoupled"]
    # No queue policy: execute() hands each request to the LLM and returns, so Triton's queue never fills.
    cfgs.add_tensors(config.input, LLMAPI_INPUTS, is_input=True)
    cfgs.add_tensors(config.output, LLMAPI_OUTPUTS, is_input=False)
    cfgs.cpu_instances(config, 1)
    if spec.serving.warmup:
        cfgs.add_warmup(
            config,
            "rtk_warmup",
            {
                "text_input": ("STRING", (1,), "text_input"),
                "sampling_param_max_tokens": ("INT32", (1,), "sampling_param_max_tokens"),
            },
        )
    return config


def llmapi_warmup_files(spec) -> dict[str, bytes]:
    """Files for ``<repo>/tensorrt_llm/warmup/``: Triton's raw encoding (BYTES: 4-byte length + bytes)."""
    text = LLMAPI_WARMUP_PROMPT.encode()
    return {
        "text_input": struct.pack("<I", len(text)) + text,
        "sampling_param_max_tokens": struct.pack("<i", min(LLMAPI_WARMUP_MAX_TOKENS, spec.build.max_seq_len - 1)),
    }


def upstream_llmapi_model_dir() -> Path | None:
    """Where TensorRT-LLM's llmapi model.py lives on this host (the NGC image, or ``$RTK_LLMAPI_MODEL_DIR``)."""
    for cand in (os.environ.get("RTK_LLMAPI_MODEL_DIR"), *UPSTREAM_MODEL_DIRS):
        if cand and all((Path(cand) / n).is_file() for n in UPSTREAM_MODEL_FILES):
            return Path(cand)
    return None


def write_tensorrt_llm_llmapi(spec, model_dir: Path | str, engine_dir: Path | str) -> Path:
    """The llmapi ``tensorrt_llm`` model directory: config.pbtxt, warmup/, 1/model.yaml (+ upstream model.py).

    ``1/model.yaml`` is the build stage's own file, so the repository runs exactly what was built.
    """
    from ..targets.llmapi import MODEL_YAML

    model_dir = Path(model_dir)
    files = {MODEL_YAML: (Path(engine_dir) / MODEL_YAML).read_text()}
    src = upstream_llmapi_model_dir()
    if src is not None:
        files.update({n: (src / n).read_text() for n in UPSTREAM_MODEL_FILES})
    cfgs.write_model_dir(
        model_dir,
        tensorrt_llm_llmapi(spec, name=model_dir.name),
        warmup=llmapi_warmup_files(spec) if spec.serving.warmup else {},
        version_files=files,
    )
    return model_dir
