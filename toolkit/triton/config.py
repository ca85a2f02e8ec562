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

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from ..errors import StageError
from .models.rtk_text import PERF_OUTPUTS

# Names of the models, as in TensorRT-LLM's inflight_batcher_llm repository.
PREPROCESSING = "preprocessing"
TENSORRT_LLM = "tensorrt_llm"
POSTPROCESSING = "postprocessing"
ENSEMBLE = "ensemble"
BLS = "tensorrt_llm_bls"


RTK_EXTENSIONS = {
    "preprocessing.DROPPED_TURNS": "chat turns dropped to fit the context window (context_policy: truncate_oldest)",
    "tensorrt_llm.dropped_turns": "input passed through to the output of the same name (ensemble constraint, see module doc)",
    "tensorrt_llm.preceding_ids": "output: up to 8 token ids just before this response's output_ids (prompt tail for the first)",
    "postprocessing.PRECEDING_IDS": "optional input: lets postprocessing detokenize a stream correctly without state",
    "tensorrt_llm.request_key / postprocessing.REQUEST_KEY": "the engine request's id: postprocessing stops it when the client cancels",
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


def add_tensors(field, tensors: Iterable[Tensor], *, is_input: bool, placeholders: dict[str, str] | None = None) -> None:
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

def tensorrt_llm_inputs(*, rtk_extensions: bool) -> list[Tensor]:
    """The C++ ``tensorrtllm`` backend's inputs that rtk's targets honour."""
    s = dict(scalar=True, optional=True)
    out = [
        Tensor("input_ids", "INT32", (-1,)),
        Tensor("input_lengths", "INT32", (1,), scalar=True),
        Tensor("request_output_len", "INT32", (1,), scalar=True),
        Tensor("end_id", "INT32", (1,), **s),
        Tensor("pad_id", "INT32", (1,), **s),
        Tensor("beam_width", "INT32", (1,), **s),
        Tensor("num_return_sequences", "INT32", (1,), **s),
        Tensor("runtime_top_k", "INT32", (1,), **s),
        Tensor("runtime_top_p", "FP32", (1,), **s),
        Tensor("temperature", "FP32", (1,), **s),
        Tensor("seed", "UINT64", (1,), **s),
        Tensor("min_tokens", "INT32", (1,), **s),
        Tensor("stop_words_list", "INT32", (2, -1), optional=True),
        Tensor("bad_words_list", "INT32", (2, -1), optional=True),
        Tensor("streaming", "BOOL", (1,), **s),
        Tensor("stop", "BOOL", (1,), **s),
        Tensor("exclude_input_in_output", "BOOL", (1,), **s),
        Tensor("return_perf_metrics", "BOOL", (1,), **s),
        Tensor("return_num_input_tokens", "BOOL", (1,), **s),
        Tensor("return_num_output_tokens", "BOOL", (1,), **s),
    ]
    if rtk_extensions:
        out.append(Tensor("dropped_turns", "INT32", (1,), **s))
    return out


def tensorrt_llm_outputs(*, rtk_extensions: bool) -> list[Tensor]:
    out = [
        Tensor("output_ids", "INT32", (-1, -1)),
        Tensor("sequence_length", "INT32", (-1,)),
        *(Tensor(n, "INT64", (1,)) for n in PERF_OUTPUTS),
        Tensor("num_input_tokens", "INT32", (1,)),
        Tensor("num_output_tokens", "INT32", (1,)),
    ]
    if rtk_extensions:
        out += [Tensor("preceding_ids", "INT32", (-1,)), Tensor("dropped_turns", "INT32", (1,)), Tensor("request_key", "STRING", (1,))]
    return out


def client_inputs() -> list[Tensor]:
    """What a client sends to ``ensemble`` and ``tensorrt_llm_bls``."""
    o = dict(optional=True)
    return [
        Tensor("text_input", "STRING", (1,)),
        Tensor("max_tokens", "INT32", (1,), **o),  # optional here: defaults to serving.default_max_tokens
        Tensor("bad_words", "STRING", (-1,), **o),
        Tensor("stop_words", "STRING", (-1,), **o),
        Tensor("end_id", "INT32", (1,), **o),
        Tensor("pad_id", "INT32", (1,), **o),
        Tensor("top_k", "INT32", (1,), **o),
        Tensor("top_p", "FP32", (1,), **o),
        Tensor("temperature", "FP32", (1,), **o),
        Tensor("seed", "UINT64", (1,), **o),
        Tensor("stream", "BOOL", (1,), **o),
        Tensor("exclude_input_in_output", "BOOL", (1,), **o),
        Tensor("return_perf_metrics", "BOOL", (1,), **o),
        Tensor("return_num_input_tokens", "BOOL", (1,), **o),
        Tensor("return_num_output_tokens", "BOOL", (1,), **o),
    ]


def client_outputs(*, dropped_turns: bool) -> list[Tensor]:
    out = [
        Tensor("text_output", "STRING", (-1,)),
        *(Tensor(n, "INT64", (1,)) for n in PERF_OUTPUTS),
        Tensor("num_input_tokens", "INT32", (1,)),
        Tensor("num_output_tokens", "INT32", (1,)),
    ]
    if dropped_turns:
        out.append(Tensor("dropped_turns", "INT32", (1,)))
    return out


# -- the models -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RepoSettings:
    """What the configs need beyond the spec: where things are inside the emitted repository."""

    tokenizer_dir: str            # relative to the repository root, or absolute
    engine_dir: str | None = None  # cpu: the engine stage directory
    rtk_extensions: bool = True    # the tensorrt_llm model passes dropped_turns / emits preceding_ids


def preprocessing(spec, s: RepoSettings):
    cfg = pb().ModelConfig(name=PREPROCESSING, backend="python", max_batch_size=spec.build.max_batch_size)
    o = dict(optional=True)
    add_tensors(cfg.input, [
        Tensor("QUERY", "STRING", (1,)),
        Tensor("REQUEST_OUTPUT_LEN", "INT32", (1,), **o),
        Tensor("BAD_WORDS_DICT", "STRING", (-1,), **o),
        Tensor("STOP_WORDS_DICT", "STRING", (-1,), **o),
        Tensor("END_ID", "INT32", (1,), **o),
        Tensor("PAD_ID", "INT32", (1,), **o),
    ], is_input=True)
    add_tensors(cfg.output, [
        Tensor("INPUT_ID", "INT32", (-1,)),
        Tensor("REQUEST_INPUT_LEN", "INT32", (1,)),
        Tensor("BAD_WORDS_IDS", "INT32", (2, -1)),
        Tensor("STOP_WORDS_IDS", "INT32", (2, -1)),
        Tensor("REQUEST_OUTPUT_LEN", "INT32", (-1,)),
        Tensor("OUT_END_ID", "INT32", (1,)),
        Tensor("OUT_PAD_ID", "INT32", (1,)),
        Tensor("DROPPED_TURNS", "INT32", (1,)),
    ], is_input=False)
    set_parameters(cfg, {
        "tokenizer_dir": s.tokenizer_dir,
        "add_special_tokens": True,
        "max_input_len": spec.build.max_input_len,
        "max_seq_len": spec.build.max_seq_len,
        "context_policy": spec.serving.context_policy,
        "default_max_tokens": spec.serving.default_max_tokens,
    })
    cpu_instances(cfg, spec.serving.preprocessing_instances)
    cfg.dynamic_batching.SetInParent()
    return cfg


def postprocessing(spec, s: RepoSettings):
    cfg = pb().ModelConfig(name=POSTPROCESSING, backend="python", max_batch_size=spec.build.max_batch_size)
    add_tensors(cfg.input, [
        Tensor("TOKENS_BATCH", "INT32", (-1, -1)),
        Tensor("SEQUENCE_LENGTH", "INT32", (-1,)),
        Tensor("PRECEDING_IDS", "INT32", (-1,), optional=True),
        Tensor("REQUEST_KEY", "STRING", (1,), optional=True),
    ], is_input=True)
    add_tensors(cfg.output, [Tensor("OUTPUT", "STRING", (-1,))], is_input=False)
    set_parameters(cfg, {"tokenizer_dir": s.tokenizer_dir, "skip_special_tokens": True, "tensorrt_llm_model_name": TENSORRT_LLM})
    cpu_instances(cfg, spec.serving.postprocessing_instances)
    # No dynamic_batching: the dynamic batcher drops a cancelled request before the model sees it,
    # and postprocessing must see it to stop the engine request (module doc; checked on 2.51).
    return cfg


def tensorrt_llm_cpu(spec, s: RepoSettings):
    """The cpu target's ``tensorrt_llm``: a decoupled python model running rtk's CPU engine."""
    b, sv = spec.build, spec.serving
    cfg = pb().ModelConfig(name=TENSORRT_LLM, backend="python", max_batch_size=b.max_batch_size)
    add_tensors(cfg.input, tensorrt_llm_inputs(rtk_extensions=True), is_input=True)
    add_tensors(cfg.output, tensorrt_llm_outputs(rtk_extensions=True), is_input=False)
    cfg.model_transaction_policy.decoupled = sv.decoupled
    # The queue forms in the engine, not in Triton: execute() hands requests over and returns at
    # once.  So the model enforces serving.max_queue_size / queue_timeout_ms itself, and the config
    # has no default_queue_policy: with one, tritonserver 2.51's dynamic batcher held the 3rd and 4th
    # of 4 simultaneous requests back 0.5 s and 1.0 s (tests/test_serve_tiny.py; reference §4.2).
    cfg.dynamic_batching.max_queue_delay_microseconds = 0
    cpu_instances(cfg, sv.instance_count)
    set_parameters(cfg, {
        "engine_dir": s.engine_dir,
        "max_queue_size": sv.max_queue_size,
        "queue_timeout_ms": sv.queue_timeout_ms,
        "batch_scheduler_policy": sv.batch_scheduler_policy,
        "cancellation_check_period_ms": 50,  # TensorRT-LLM's backend: 100
    })
    return cfg


def _map(step, mapping: dict[str, str], *, inputs: bool) -> None:
    target = step.input_map if inputs else step.output_map
    for k, v in mapping.items():
        target[k] = v


def ensemble(spec, s: RepoSettings):
    """pre -> tensorrt_llm -> post, the tensor mapping of TensorRT-LLM's ensemble template."""
    cfg = pb().ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=spec.build.max_batch_size)
    add_tensors(cfg.input, client_inputs(), is_input=True)
    add_tensors(cfg.output, client_outputs(dropped_turns=s.rtk_extensions), is_input=False)
    sched = cfg.ensemble_scheduling

    pre = sched.step.add(model_name=PREPROCESSING, model_version=-1)
    _map(pre, {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
               "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id"}, inputs=True)
    pre_out = {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
               "BAD_WORDS_IDS": "_BAD_WORDS_IDS", "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
               "OUT_END_ID": "_PREPROCESSOR_END_ID", "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID"}
    if s.rtk_extensions:
        pre_out["DROPPED_TURNS"] = "_DROPPED_TURNS"
    _map(pre, pre_out, inputs=False)

    llm = sched.step.add(model_name=TENSORRT_LLM, model_version=-1)
    llm_in = {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN", "request_output_len": "_REQUEST_OUTPUT_LEN",
              "end_id": "_PREPROCESSOR_END_ID", "pad_id": "_PREPROCESSOR_PAD_ID",
              "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS",
              "runtime_top_k": "top_k", "runtime_top_p": "top_p", "temperature": "temperature", "seed": "seed",
              "streaming": "stream", "exclude_input_in_output": "exclude_input_in_output",
              "return_perf_metrics": "return_perf_metrics", "return_num_input_tokens": "return_num_input_tokens",
              "return_num_output_tokens": "return_num_output_tokens"}
    llm_out = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH",
               **{n: n for n in PERF_OUTPUTS}, "num_input_tokens": "num_input_tokens", "num_output_tokens": "num_output_tokens"}
    if s.rtk_extensions:
        llm_in["dropped_turns"] = "_DROPPED_TURNS"
        llm_out.update({"preceding_ids": "_PRECEDING_IDS", "dropped_turns": "dropped_turns", "request_key": "_REQUEST_KEY"})
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
    add_tensors(cfg.input, client_inputs(), is_input=True)
    add_tensors(cfg.output, client_outputs(dropped_turns=True), is_input=False)
    cfg.model_transaction_policy.decoupled = sv.decoupled
    cpu_instances(cfg, sv.instance_count)
    set_parameters(cfg, {
        "tokenizer_dir": s.tokenizer_dir,
        "tensorrt_llm_model_name": TENSORRT_LLM,
        "max_input_len": spec.build.max_input_len,
        "max_seq_len": spec.build.max_seq_len,
        "context_policy": sv.context_policy,
        "default_max_tokens": sv.default_max_tokens,
        "skip_special_tokens": True,
    })
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
        items = (x if isinstance(x, bytes) else str(x).encode() for x in array.reshape(-1))
        return b"".join(struct.pack("<I", len(b)) + b for b in items)
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


def write_model_dir(model_dir: Path, cfg, *, warmup: dict[str, bytes] | None = None,
                    version_files: dict[str, str] | None = None) -> Path:
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
