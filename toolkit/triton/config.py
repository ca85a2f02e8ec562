"""Every ``config.pbtxt`` of the emitted repository, built through Triton's ModelConfig protobuf.

Configs are ``tritonclient.grpc.model_config_pb2.ModelConfig`` messages filled from the spec and
rendered with protobuf's ``text_format``; :func:`render` parses the text back as a check, so a
config can never carry a ``${placeholder}`` (the failure mode of TensorRT-LLM's
``fill_template.py``, which leaves a placeholder it has no value for in the file).

Model names and tensor names follow TensorRT-LLM's ``triton_backend/all_models/inflight_batcher_llm``
(NVIDIA/TensorRT-LLM: ``triton_backend/all_models/inflight_batcher_llm/{ensemble,preprocessing,
postprocessing,tensorrt_llm,tensorrt_llm_bls}/config.pbtxt``), so existing clients work unchanged.
rtk adds a few tensors, all optional, named in :data:`RTK_EXTENSIONS`.

Two constraints of Triton's ensemble scheduler shape the design (checked on tritonserver 2.51):
a step, and the ensemble's outputs, may not take tensors that originate from different decoupled
models ("receives inputs originated from different decoupled models").  So nothing produced by
``preprocessing`` can reach ``postprocessing`` or the response directly: the cpu ``tensorrt_llm``
model passes what is needed through (``dropped_turns``) and emits ``preceding_ids`` so that
``postprocessing`` can detokenize incrementally without per-request state.  And Triton 2.51 marks
only the ensemble steps created *after* a client cancels as cancelled (triton-inference-server/core
PR 263), never the running ``tensorrt_llm`` request: so ``tensorrt_llm`` also emits its
``request_key``, and a ``postprocessing`` request that finds itself cancelled stops the engine
request by that key (TensorRT-LLM's ``stop`` input).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import StageError
from .models.rtk_text import PERF_OUTPUTS
from .wire import bytes_tensor

# Names of the models, as in TensorRT-LLM's inflight_batcher_llm repository.
PREPROCESSING = "preprocessing"
TENSORRT_LLM = "tensorrt_llm"
POSTPROCESSING = "postprocessing"
ENSEMBLE = "ensemble"
BLS = "tensorrt_llm_bls"


RTK_EXTENSIONS = {
    "preprocessing.DROPPED_TURNS": "chat turns dropped to fit the context window (context_policy: truncate_oldest)",
    "tensorrt_llm.dropped_turns": "input passed through to the output of the same name (ensemble constraint, "
    "see module doc)",
    "tensorrt_llm.preceding_ids": "output: up to 8 token ids just before this response's output_ids (prompt tail "
    "for the first)",
    "postprocessing.PRECEDING_IDS": "optional input: lets postprocessing detokenize a stream correctly without state",
    "tensorrt_llm.request_key / postprocessing.REQUEST_KEY": "the engine request's id: postprocessing stops it "
    "when the client cancels",
    "ensemble.dropped_turns / tensorrt_llm_bls.dropped_turns": "output: how many chat turns were dropped (0 when none)",
}


@dataclass(frozen=True)
class Tensor:
    """One tensor: name, Triton dtype name (or a placeholder such as ``MODEL``, given when the config is
    built), dims without the batch dimension."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False
    scalar: bool = False  # dims [1] reshaped to [] (the C++ backend's scalars)
    ragged: bool = False  # allow_ragged_batch


# model.dtype / a checkpoint's logits_dtype -> Triton's type name
TORCH_TO_TRITON = {"bfloat16": "BF16", "float16": "FP16", "float32": "FP32"}


def pb():
    """tritonclient's ``model_config_pb2`` (imported when a config is built)."""
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2


def add_tensors(
    field, tensors: Iterable[Tensor], *, is_input: bool, placeholders: dict[str, str] | None = None
) -> None:
    """Append ModelInput / ModelOutput entries to ``field`` (``config.input`` or ``config.output``).

    ``placeholders`` gives the Triton type of placeholder dtypes (e.g. ``{"MODEL": "BF16"}``).
    """
    types = pb().DataType
    for t in tensors:
        dtype = (placeholders or {}).get(t.dtype, t.dtype)
        msg = field.add(name=t.name, data_type=types.Value(f"TYPE_{dtype}"), dims=list(t.dims))
        if is_input and t.optional:
            msg.optional = True
        if is_input and t.ragged:
            msg.allow_ragged_batch = True
        if t.scalar:
            msg.reshape.SetInParent()  # reshape: { shape: [ ] }


def set_parameters(cfg, values: dict) -> None:
    """``parameters`` as strings (booleans as "true"/"false"); None values are left out."""
    for k, v in values.items():
        if v is None:
            continue
        cfg.parameters[k].string_value = ("true" if v else "false") if isinstance(v, bool) else str(v)


def cpu_instances(cfg, count: int) -> None:
    cfg.instance_group.add(count=count, kind=pb().ModelInstanceGroup.KIND_CPU)


def queue_policy(cfg, spec) -> None:
    """``dynamic_batching.default_queue_policy.max_queue_size`` from serving.max_queue_size (the C++ backend
    hands it to its executor; the spec refuses a queue timeout it could not enforce)."""
    cfg.dynamic_batching.default_queue_policy.max_queue_size = spec.serving.max_queue_size or 0


# -- tensor interfaces ------------------------------------------------------------------------
# Transcribed from NVIDIA/TensorRT-LLM triton_backend/all_models/inflight_batcher_llm/: ensemble/config.pbtxt
# (2a9abd9), tensorrt_llm_bls/config.pbtxt (0193dbd), preprocessing/config.pbtxt (08dc37e),
# postprocessing/config.pbtxt (89fd9b7); recorded as data in tests/data/trtllm_1_2_1_triton_models.json.
# Placeholder dtypes: "MODEL" the model's dtype (upstream's ${prompt_embedding_table_data_type}; the
# ensemble template writes TYPE_FP16, which must equal the tensorrt_llm model's for the ensemble to
# load), "LOGITS" the engine's logits dtype (${logits_datatype}).

_O = dict(optional=True)
_OS = dict(optional=True, scalar=True)
# Outputs of tensorrt_llm that ensemble and BLS hand to the client under the same name.
KV_CACHE_OUTPUTS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")
ENGINE_OUTPUTS = (
    "cum_log_probs",
    "output_log_probs",
    "context_logits",
    "generation_logits",
    "batch_index",
    "sequence_index",
    *KV_CACHE_OUTPUTS,
    *PERF_OUTPUTS,
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
    "num_input_tokens",
    "num_output_tokens",
)
# client input of ensemble / BLS -> tensorrt_llm input, where the two names differ
CLIENT_TO_LLM = {
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "length_penalty": "len_penalty",
    "stream": "streaming",
    "prompt_table_extra_id": "prompt_table_extra_ids",
}
# client inputs the ensemble hands to tensorrt_llm unchanged (the others go through preprocessing)
CLIENT_PASS_THROUGH = (
    "exclude_input_in_output",
    "top_k",
    "top_p",
    "temperature",
    "length_penalty",
    "repetition_penalty",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "return_log_probs",
    "return_context_logits",
    "return_generation_logits",
    "return_perf_metrics",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "num_return_sequences",
    "beam_width",
    "stream",
    "prompt_embedding_table",
    "prompt_vocab_size",
    "lora_task_id",
    "lora_weights",
    "lora_config",
    "guided_decoding_guide_type",
    "guided_decoding_guide",
)


def tensorrt_llm_inputs(*, rtk_extensions: bool) -> list[Tensor]:
    """Every input of the C++ ``tensorrtllm`` backend (gpu_models.CPP_INPUTS); the cpu model serves a
    value of each or refuses it naming the input.  ``input_ids`` is required there."""
    from .gpu_models import CPP_INPUTS

    out = [Tensor("input_ids", "INT32", (-1,)) if t.name == "input_ids" else t for t in CPP_INPUTS]
    if rtk_extensions:
        out.append(Tensor("dropped_turns", "INT32", (1,), **_OS))
    return out


def tensorrt_llm_outputs(*, rtk_extensions: bool) -> list[Tensor]:
    from .gpu_models import CPP_OUTPUTS

    out = list(CPP_OUTPUTS)
    if rtk_extensions:
        out += [
            Tensor("preceding_ids", "INT32", (-1,)),
            Tensor("dropped_turns", "INT32", (1,)),
            Tensor("request_key", "STRING", (1,)),
        ]
    return out


def client_inputs(*, bls: bool = False) -> list[Tensor]:
    """What a client sends to ``ensemble``, or with ``bls`` to ``tensorrt_llm_bls`` (the same, some
    scalars reshaped to [] as upstream's BLS config does, plus its multimodal and draft inputs)."""
    r = dict(optional=True, scalar=bls)
    out = [
        Tensor("text_input", "STRING", (1,)),
        Tensor("decoder_text_input", "STRING", (1,), **_O),
        Tensor("max_tokens", "INT32", (1,), **_O),  # required upstream; here it defaults to serving.default_max_tokens
        Tensor("num_return_sequences", "INT32", (1,), **r),
        Tensor("bad_words", "STRING", (-1,), **_O),
        Tensor("stop_words", "STRING", (-1,), **_O),
        Tensor("exclude_input_in_output", "BOOL", (1,), **_O),
        Tensor("end_id", "INT32", (1,), **_O),
        Tensor("pad_id", "INT32", (1,), **_O),
        Tensor("top_k", "INT32", (1,), **_O),
        Tensor("top_p", "FP32", (1,), **_O),
        Tensor("temperature", "FP32", (1,), **_O),
        Tensor("length_penalty", "FP32", (1,), **_O),
        Tensor("repetition_penalty", "FP32", (1,), **_O),
        Tensor("min_tokens", "INT32", (1,), **_O),
        Tensor("presence_penalty", "FP32", (1,), **_O),
        Tensor("frequency_penalty", "FP32", (1,), **_O),
        Tensor("seed", "UINT64", (1,), **_O),
        Tensor("return_log_probs", "BOOL", (1,), **r),
        Tensor("return_context_logits", "BOOL", (1,), **r),
        Tensor("return_generation_logits", "BOOL", (1,), **r),
        Tensor("return_perf_metrics", "BOOL", (1,), **r),
        Tensor("return_num_input_tokens", "BOOL", (1,), **r),
        Tensor("return_num_output_tokens", "BOOL", (1,), **r),
        Tensor("beam_width", "INT32", (1,), **_O),
        Tensor("stream", "BOOL", (1,), **_O),
        Tensor("prompt_embedding_table", "MODEL", (-1, -1), **_O),
        Tensor("prompt_table_extra_id", "UINT64", (1,), **_O),
        Tensor("prompt_vocab_size", "INT32", (1,), **_O),
        Tensor("embedding_bias_words", "STRING", (-1,), **_O),
        Tensor("embedding_bias_weights", "FP32", (-1,), **_O),
        Tensor("lora_task_id", "UINT64", (1,), **r),
        Tensor("lora_weights", "FP16", (-1, -1), optional=True, ragged=True),
        Tensor("lora_config", "INT32", (-1, 3), optional=True, ragged=True),
        Tensor("guided_decoding_guide_type", "STRING", (1,), optional=True, ragged=not bls),
        Tensor("guided_decoding_guide", "STRING", (1,), optional=True, ragged=not bls),
    ]
    if bls:
        out += [
            Tensor("image_input", "FP16", (-1, 3, -1, -1), **_O),
            Tensor("image_bytes_input", "UINT8", (-1, -1, -1, -1), **_O),
            Tensor("image_url_input", "STRING", (1,), **_O),
            Tensor("video_bytes_input", "UINT8", (-1, -1, -1, -1), **_O),
            Tensor("num_draft_tokens", "INT32", (1,), **_O),
            Tensor("use_draft_logits", "BOOL", (1,), **_OS),
        ]
    return out


def client_outputs(*, dropped_turns: bool) -> list[Tensor]:
    """What ``ensemble`` and ``tensorrt_llm_bls`` return (upstream declares kv_cache_alloc_total_blocks
    twice; once here)."""
    from .gpu_models import CPP_OUTPUTS

    engine = {t.name: t for t in CPP_OUTPUTS}
    out = [Tensor("text_output", "STRING", (-1,)), *(engine[n] for n in ENGINE_OUTPUTS)]
    if dropped_turns:
        out.append(Tensor("dropped_turns", "INT32", (1,)))
    return out


def placeholder_types(spec, s: RepoSettings) -> dict[str, str]:
    return {"MODEL": TORCH_TO_TRITON[spec.model.dtype], "LOGITS": TORCH_TO_TRITON[s.logits_dtype]}


# -- the models -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepoSettings:
    """What the configs need beyond the spec: where things are inside the emitted repository."""

    tokenizer_dir: str  # relative to the repository root, or absolute
    engine_dir: str | None = None  # cpu: the engine stage directory
    rtk_extensions: bool = True  # the tensorrt_llm model passes dropped_turns / emits preceding_ids
    logits_dtype: str = "float32"  # the engine's logits (trt-engine: its config.json logits_dtype)


def preprocessing(spec, s: RepoSettings):
    cfg = pb().ModelConfig(name=PREPROCESSING, backend="python", max_batch_size=spec.build.max_batch_size)
    add_tensors(
        cfg.input,
        [
            Tensor("QUERY", "STRING", (1,)),
            Tensor("DECODER_QUERY", "STRING", (1,), **_O),
            Tensor("REQUEST_OUTPUT_LEN", "INT32", (1,), **_O),
            Tensor("BAD_WORDS_DICT", "STRING", (-1,), **_O),
            Tensor("STOP_WORDS_DICT", "STRING", (-1,), **_O),
            Tensor("EMBEDDING_BIAS_WORDS", "STRING", (-1,), **_O),
            Tensor("EMBEDDING_BIAS_WEIGHTS", "FP32", (-1,), **_O),
            Tensor("END_ID", "INT32", (1,), **_O),
            Tensor("PAD_ID", "INT32", (1,), **_O),
            Tensor("PROMPT_TABLE_EXTRA_ID", "UINT64", (1,), **_O),
        ],
        is_input=True,
    )
    add_tensors(
        cfg.output,
        [
            Tensor("INPUT_ID", "INT32", (-1,)),
            Tensor("REQUEST_INPUT_LEN", "INT32", (1,)),
            Tensor("BAD_WORDS_IDS", "INT32", (2, -1)),
            Tensor("STOP_WORDS_IDS", "INT32", (2, -1)),
            Tensor("EMBEDDING_BIAS", "FP32", (-1,)),
            Tensor("REQUEST_OUTPUT_LEN", "INT32", (-1,)),
            Tensor("OUT_END_ID", "INT32", (1,)),
            Tensor("OUT_PAD_ID", "INT32", (1,)),
            Tensor("OUT_PROMPT_TABLE_EXTRA_IDS", "UINT64", (-1,)),
            Tensor("DROPPED_TURNS", "INT32", (1,)),
        ],
        is_input=False,
    )
    set_parameters(
        cfg,
        {
            "tokenizer_dir": s.tokenizer_dir,
            "add_special_tokens": True,
            "max_input_len": spec.build.max_input_len,
            "max_seq_len": spec.build.max_seq_len,
            "context_policy": spec.serving.context_policy,
            "default_max_tokens": spec.serving.default_max_tokens,
            "target": spec.build.target,
        },
    )
    cpu_instances(cfg, spec.serving.preprocessing_instances)
    cfg.dynamic_batching.SetInParent()
    return cfg


def postprocessing(spec, s: RepoSettings):
    cfg = pb().ModelConfig(name=POSTPROCESSING, backend="python", max_batch_size=spec.build.max_batch_size)
    add_tensors(
        cfg.input,
        [
            Tensor("TOKENS_BATCH", "INT32", (-1, -1)),
            Tensor("SEQUENCE_LENGTH", "INT32", (-1,)),
            Tensor("PRECEDING_IDS", "INT32", (-1,), optional=True),
            Tensor("REQUEST_KEY", "STRING", (1,), optional=True),
        ],
        is_input=True,
    )
    add_tensors(cfg.output, [Tensor("OUTPUT", "STRING", (-1,))], is_input=False)
    set_parameters(
        cfg, {"tokenizer_dir": s.tokenizer_dir, "skip_special_tokens": True, "tensorrt_llm_model_name": TENSORRT_LLM}
    )
    cpu_instances(cfg, spec.serving.postprocessing_instances)
    # No dynamic_batching: the dynamic batcher drops a cancelled request before the model sees it,
    # and postprocessing must see it to stop the engine request (module doc; checked on 2.51).
    return cfg


def tensorrt_llm_cpu(spec, s: RepoSettings):
    """The cpu target's ``tensorrt_llm``: a decoupled python model running rtk's CPU engine."""
    b, sv = spec.build, spec.serving
    cfg = pb().ModelConfig(name=TENSORRT_LLM, backend="python", max_batch_size=b.max_batch_size)
    types = placeholder_types(spec, s)
    add_tensors(cfg.input, tensorrt_llm_inputs(rtk_extensions=True), is_input=True, placeholders=types)
    add_tensors(cfg.output, tensorrt_llm_outputs(rtk_extensions=True), is_input=False, placeholders=types)
    cfg.model_transaction_policy.decoupled = sv.decoupled
    # The queue forms in the engine, not in Triton: execute() hands requests over and returns at
    # once.  So the model enforces serving.max_queue_size / queue_timeout_ms itself, and the config
    # has no default_queue_policy: with one, tritonserver 2.51's dynamic batcher held the 3rd and 4th
    # of 4 simultaneous requests back 0.5 s and 1.0 s (tests/test_serve_tiny.py).
    cfg.dynamic_batching.max_queue_delay_microseconds = 0
    cpu_instances(cfg, sv.instance_count)
    set_parameters(
        cfg,
        {
            "engine_dir": s.engine_dir,
            "max_queue_size": sv.max_queue_size,
            "queue_timeout_ms": sv.queue_timeout_ms,
            "batch_scheduler_policy": sv.batch_scheduler_policy,
            "cancellation_check_period_ms": 50,  # TensorRT-LLM's backend: 100
            "target": b.target,
        },
    )
    return cfg


def _map(step, mapping: dict[str, str], *, inputs: bool) -> None:
    target = step.input_map if inputs else step.output_map
    for k, v in mapping.items():
        target[k] = v


def ensemble(spec, s: RepoSettings):
    """pre -> tensorrt_llm -> post, the tensor mapping of TensorRT-LLM's ensemble template."""
    cfg = pb().ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=spec.build.max_batch_size)
    types = placeholder_types(spec, s)
    add_tensors(cfg.input, client_inputs(), is_input=True, placeholders=types)
    add_tensors(cfg.output, client_outputs(dropped_turns=s.rtk_extensions), is_input=False, placeholders=types)
    sched = cfg.ensemble_scheduling

    pre = sched.step.add(model_name=PREPROCESSING, model_version=-1)
    _map(
        pre,
        {
            "QUERY": "text_input",
            "DECODER_QUERY": "decoder_text_input",
            "REQUEST_OUTPUT_LEN": "max_tokens",
            "BAD_WORDS_DICT": "bad_words",
            "STOP_WORDS_DICT": "stop_words",
            "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
            "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights",
            "END_ID": "end_id",
            "PAD_ID": "pad_id",
            "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id",
        },
        inputs=True,
    )
    pre_out = {
        "INPUT_ID": "_INPUT_ID",
        "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
        "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
        "BAD_WORDS_IDS": "_BAD_WORDS_IDS",
        "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
        "EMBEDDING_BIAS": "_EMBEDDING_BIAS",
        "OUT_END_ID": "_PREPROCESSOR_END_ID",
        "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID",
        "OUT_PROMPT_TABLE_EXTRA_IDS": "_OUT_PROMPT_TABLE_EXTRA_IDS",
    }
    if s.rtk_extensions:
        pre_out["DROPPED_TURNS"] = "_DROPPED_TURNS"
    _map(pre, pre_out, inputs=False)

    llm = sched.step.add(model_name=TENSORRT_LLM, model_version=-1)
    llm_in = {
        "input_ids": "_INPUT_ID",
        "input_lengths": "_REQUEST_INPUT_LEN",
        "request_output_len": "_REQUEST_OUTPUT_LEN",
        "end_id": "_PREPROCESSOR_END_ID",
        "pad_id": "_PREPROCESSOR_PAD_ID",
        "embedding_bias": "_EMBEDDING_BIAS",
        "stop_words_list": "_STOP_WORDS_IDS",
        "bad_words_list": "_BAD_WORDS_IDS",
        "prompt_table_extra_ids": "_OUT_PROMPT_TABLE_EXTRA_IDS",
        **{CLIENT_TO_LLM.get(n, n): n for n in CLIENT_PASS_THROUGH},
    }
    llm_out = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH", **{n: n for n in ENGINE_OUTPUTS}}
    if s.rtk_extensions:
        llm_in["dropped_turns"] = "_DROPPED_TURNS"
        llm_out.update(
            {"preceding_ids": "_PRECEDING_IDS", "dropped_turns": "dropped_turns", "request_key": "_REQUEST_KEY"}
        )
    _map(llm, llm_in, inputs=True)
    _map(llm, llm_out, inputs=False)

    post = sched.step.add(model_name=POSTPROCESSING, model_version=-1)
    post_in = {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"}
    if s.rtk_extensions:
        post_in.update(PRECEDING_IDS="_PRECEDING_IDS", REQUEST_KEY="_REQUEST_KEY")
    _map(post, post_in, inputs=True)
    _map(post, {"OUTPUT": "text_output"}, inputs=False)
    return cfg


def bls(spec, s: RepoSettings):
    """``tensorrt_llm_bls``: one python model doing pre- and postprocessing around BLS calls to ``tensorrt_llm``."""
    sv = spec.serving
    cfg = pb().ModelConfig(name=BLS, backend="python", max_batch_size=spec.build.max_batch_size)
    types = placeholder_types(spec, s)
    add_tensors(cfg.input, client_inputs(bls=True), is_input=True, placeholders=types)
    add_tensors(cfg.output, client_outputs(dropped_turns=True), is_input=False, placeholders=types)
    cfg.model_transaction_policy.decoupled = sv.decoupled
    cpu_instances(cfg, sv.instance_count)
    set_parameters(
        cfg,
        {
            "tokenizer_dir": s.tokenizer_dir,
            "tensorrt_llm_model_name": TENSORRT_LLM,
            "max_input_len": spec.build.max_input_len,
            "max_seq_len": spec.build.max_seq_len,
            "context_policy": sv.context_policy,
            "default_max_tokens": sv.default_max_tokens,
            "skip_special_tokens": True,
            "target": spec.build.target,
        },
    )
    return cfg


# -- warm-up ----------------------------------------------------------------------------------


def add_warmup(cfg, name: str, inputs: dict[str, tuple[str, tuple[int, ...], str]], count: int = 1) -> None:
    """``model_warmup`` sample whose inputs come from files in ``<model>/warmup/``.

    ``inputs`` maps an input name to (dtype, dims, file name).  Triton runs the sample before it
    reports the model ready, so no user meets a cold model.
    """
    w = cfg.model_warmup.add(name=name, batch_size=1, count=count)
    for tensor, (dtype, dims, filename) in inputs.items():
        w.inputs[tensor].data_type = pb().DataType.Value(f"TYPE_{dtype}")
        w.inputs[tensor].dims.extend(dims)
        w.inputs[tensor].input_data_file = filename


def raw_tensor(array: np.ndarray) -> bytes:
    """A warm-up input file: raw little-endian values; strings as 4-byte length + bytes (Triton's BYTES)."""
    if array.dtype == np.object_:
        return bytes_tensor(x if isinstance(x, bytes) else str(x).encode() for x in array.reshape(-1))
    return array.astype(array.dtype.newbyteorder("<")).tobytes()


# -- rendering --------------------------------------------------------------------------------


def render(cfg) -> str:
    """``config.pbtxt`` text of ``cfg``, parsed back into a ModelConfig as a check."""
    from google.protobuf import text_format

    text = text_format.MessageToString(cfg)
    if parse(text) != cfg:
        raise StageError(f"the config of model '{cfg.name}' does not survive a text round trip")
    return text


def parse(text: str):
    """Parse ``config.pbtxt`` text against Triton's ModelConfig schema (raises ParseError)."""
    from google.protobuf import text_format

    return text_format.Parse(text, pb().ModelConfig())


def write_model_dir(
    model_dir: Path, cfg, *, warmup: dict[str, bytes] | None = None, version_files: dict[str, str] | None = None
) -> Path:
    """One model directory: ``config.pbtxt`` (rendered and checked), ``warmup/`` files and version ``1/``."""
    model_dir = Path(model_dir)
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(render(cfg))
    for name, data in (warmup or {}).items():
        (model_dir / "warmup").mkdir(exist_ok=True)
        (model_dir / "warmup" / name).write_bytes(data)
    for name, text in (version_files or {}).items():
        (model_dir / "1" / name).write_text(text)
    return model_dir
