"""Every ``config.pbtxt`` of the emitted repository, built through Triton's ModelConfig protobuf.

Configs are ``tritonclient.grpc.model_config_pb2.ModelConfig`` messages filled from the spec and
rendered with protobuf's ``text_format``; :func:`render` parses the text back as a check, so a
config can never carry a ``${placeholder}`` (the failure mode of TensorRT-LLM's
``fill_template.py``; reference/tensorrt-llm-and-triton.md §5).

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

from dataclasses import dataclass
from typing import Iterable

# Names of the models, as in TensorRT-LLM's inflight_batcher_llm repository.
PREPROCESSING = "preprocessing"
TENSORRT_LLM = "tensorrt_llm"
POSTPROCESSING = "postprocessing"
ENSEMBLE = "ensemble"
BLS = "tensorrt_llm_bls"

PERF_OUTPUTS = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")

RTK_EXTENSIONS = {
    "preprocessing.DROPPED_TURNS": "chat turns dropped to fit the context window (context_policy: truncate_oldest)",
    "tensorrt_llm.dropped_turns": "input passed through to the output of the same name (ensemble constraint, see module doc)",
    "tensorrt_llm.preceding_ids": "output: up to 8 token ids just before this response's output_ids (prompt tail for the first)",
    "postprocessing.PRECEDING_IDS": "optional input: lets postprocessing detokenize a stream correctly without state",
    "tensorrt_llm.request_key / postprocessing.REQUEST_KEY": "the engine request's id: postprocessing stops it when the client cancels",
    "ensemble.dropped_turns / tensorrt_llm_bls.dropped_turns": "output: how many chat turns were dropped (0 when none)",
}


@dataclass(frozen=True)
class T:
    """One tensor: name, Triton dtype name, dims without the batch dimension."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False
    scalar: bool = False  # dims [1] reshaped to [] (the C++ backend's scalars)


def _pb():
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2


def _add(field, tensors: Iterable[T], *, is_input: bool) -> None:
    pb = _pb()
    for t in tensors:
        msg = field.add(name=t.name, data_type=pb.DataType.Value(f"TYPE_{t.dtype}"), dims=list(t.dims))
        if is_input and t.optional:
            msg.optional = True
        if t.scalar:
            msg.reshape.SetInParent()  # reshape: { shape: [ ] }


def _params(cfg, values: dict) -> None:
    for k, v in values.items():
        if v is None:
            continue
        cfg.parameters[k].string_value = ("true" if v else "false") if isinstance(v, bool) else str(v)


def _cpu_instances(cfg, count: int) -> None:
    cfg.instance_group.add(count=count, kind=_pb().ModelInstanceGroup.KIND_CPU)


# -- tensor interfaces ------------------------------------------------------------------------

def tensorrt_llm_inputs(*, rtk_extensions: bool) -> list[T]:
    """The C++ ``tensorrtllm`` backend's inputs that rtk's targets honour."""
    s = dict(scalar=True, optional=True)
    out = [
        T("input_ids", "INT32", (-1,)),
        T("input_lengths", "INT32", (1,), scalar=True),
        T("request_output_len", "INT32", (1,), scalar=True),
        T("end_id", "INT32", (1,), **s),
        T("pad_id", "INT32", (1,), **s),
        T("beam_width", "INT32", (1,), **s),
        T("num_return_sequences", "INT32", (1,), **s),
        T("runtime_top_k", "INT32", (1,), **s),
        T("runtime_top_p", "FP32", (1,), **s),
        T("temperature", "FP32", (1,), **s),
        T("seed", "UINT64", (1,), **s),
        T("min_tokens", "INT32", (1,), **s),
        T("stop_words_list", "INT32", (2, -1), optional=True),
        T("bad_words_list", "INT32", (2, -1), optional=True),
        T("streaming", "BOOL", (1,), **s),
        T("stop", "BOOL", (1,), **s),
        T("exclude_input_in_output", "BOOL", (1,), **s),
        T("return_perf_metrics", "BOOL", (1,), **s),
        T("return_num_input_tokens", "BOOL", (1,), **s),
        T("return_num_output_tokens", "BOOL", (1,), **s),
    ]
    if rtk_extensions:
        out.append(T("dropped_turns", "INT32", (1,), **s))
    return out


def tensorrt_llm_outputs(*, rtk_extensions: bool) -> list[T]:
    out = [
        T("output_ids", "INT32", (-1, -1)),
        T("sequence_length", "INT32", (-1,)),
        *(T(n, "INT64", (1,)) for n in PERF_OUTPUTS),
        T("num_input_tokens", "INT32", (1,)),
        T("num_output_tokens", "INT32", (1,)),
    ]
    if rtk_extensions:
        out += [T("preceding_ids", "INT32", (-1,)), T("dropped_turns", "INT32", (1,)), T("request_key", "STRING", (1,))]
    return out


def client_inputs() -> list[T]:
    """What a client sends to ``ensemble`` and ``tensorrt_llm_bls``."""
    o = dict(optional=True)
    return [
        T("text_input", "STRING", (1,)),
        T("max_tokens", "INT32", (1,), **o),  # optional here: defaults to serving.default_max_tokens
        T("bad_words", "STRING", (-1,), **o),
        T("stop_words", "STRING", (-1,), **o),
        T("end_id", "INT32", (1,), **o),
        T("pad_id", "INT32", (1,), **o),
        T("top_k", "INT32", (1,), **o),
        T("top_p", "FP32", (1,), **o),
        T("temperature", "FP32", (1,), **o),
        T("seed", "UINT64", (1,), **o),
        T("stream", "BOOL", (1,), **o),
        T("exclude_input_in_output", "BOOL", (1,), **o),
        T("return_perf_metrics", "BOOL", (1,), **o),
        T("return_num_input_tokens", "BOOL", (1,), **o),
        T("return_num_output_tokens", "BOOL", (1,), **o),
    ]


def client_outputs(*, dropped_turns: bool) -> list[T]:
    out = [
        T("text_output", "STRING", (-1,)),
        *(T(n, "INT64", (1,)) for n in PERF_OUTPUTS),
        T("num_input_tokens", "INT32", (1,)),
        T("num_output_tokens", "INT32", (1,)),
    ]
    if dropped_turns:
        out.append(T("dropped_turns", "INT32", (1,)))
    return out


# -- the models -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RepoSettings:
    """What the configs need beyond the spec: where things are inside the emitted repository."""

    tokenizer_dir: str            # relative to the repository root, or absolute
    engine_dir: str | None = None  # cpu: the engine stage directory
    rtk_extensions: bool = True    # the tensorrt_llm model passes dropped_turns / emits preceding_ids


def preprocessing(spec, s: RepoSettings):
    pb = _pb()
    cfg = pb.ModelConfig(name=PREPROCESSING, backend="python", max_batch_size=spec.build.max_batch_size)
    o = dict(optional=True)
    _add(cfg.input, [
        T("QUERY", "STRING", (1,)),
        T("REQUEST_OUTPUT_LEN", "INT32", (1,), **o),
        T("BAD_WORDS_DICT", "STRING", (-1,), **o),
        T("STOP_WORDS_DICT", "STRING", (-1,), **o),
        T("END_ID", "INT32", (1,), **o),
        T("PAD_ID", "INT32", (1,), **o),
    ], is_input=True)
    _add(cfg.output, [
        T("INPUT_ID", "INT32", (-1,)),
        T("REQUEST_INPUT_LEN", "INT32", (1,)),
        T("BAD_WORDS_IDS", "INT32", (2, -1)),
        T("STOP_WORDS_IDS", "INT32", (2, -1)),
        T("REQUEST_OUTPUT_LEN", "INT32", (-1,)),
        T("OUT_END_ID", "INT32", (1,)),
        T("OUT_PAD_ID", "INT32", (1,)),
        T("DROPPED_TURNS", "INT32", (1,)),
    ], is_input=False)
    _params(cfg, {
        "tokenizer_dir": s.tokenizer_dir,
        "add_special_tokens": True,
        "max_input_len": spec.build.max_input_len,
        "max_seq_len": spec.build.max_seq_len,
        "context_policy": spec.serving.context_policy,
        "default_max_tokens": spec.serving.default_max_tokens,
    })
    _cpu_instances(cfg, spec.serving.preprocessing_instances)
    cfg.dynamic_batching.SetInParent()
    return cfg


def postprocessing(spec, s: RepoSettings):
    pb = _pb()
    cfg = pb.ModelConfig(name=POSTPROCESSING, backend="python", max_batch_size=spec.build.max_batch_size)
    _add(cfg.input, [
        T("TOKENS_BATCH", "INT32", (-1, -1)),
        T("SEQUENCE_LENGTH", "INT32", (-1,)),
        T("PRECEDING_IDS", "INT32", (-1,), optional=True),
        T("REQUEST_KEY", "STRING", (1,), optional=True),
    ], is_input=True)
    _add(cfg.output, [T("OUTPUT", "STRING", (-1,))], is_input=False)
    _params(cfg, {"tokenizer_dir": s.tokenizer_dir, "skip_special_tokens": True, "tensorrt_llm_model_name": TENSORRT_LLM})
    _cpu_instances(cfg, spec.serving.postprocessing_instances)
    # No dynamic_batching: the dynamic batcher drops a cancelled request before the model sees it,
    # and postprocessing must see it to stop the engine request (module doc; checked on 2.51).
    return cfg


def tensorrt_llm_cpu(spec, s: RepoSettings):
    """The cpu target's ``tensorrt_llm``: a decoupled python model running rtk's CPU engine."""
    pb = _pb()
    b, sv = spec.build, spec.serving
    cfg = pb.ModelConfig(name=TENSORRT_LLM, backend="python", max_batch_size=b.max_batch_size)
    _add(cfg.input, tensorrt_llm_inputs(rtk_extensions=True), is_input=True)
    _add(cfg.output, tensorrt_llm_outputs(rtk_extensions=True), is_input=False)
    cfg.model_transaction_policy.decoupled = sv.decoupled
    # The queue forms in the engine, not in Triton: execute() hands requests over and returns at
    # once.  So the model enforces serving.max_queue_size / queue_timeout_ms itself, and the config
    # has no default_queue_policy: with one, tritonserver 2.51's dynamic batcher held the 3rd and 4th
    # of 4 simultaneous requests back 0.5 s and 1.0 s (tests/test_serve_tiny.py; reference §4.2).
    cfg.dynamic_batching.max_queue_delay_microseconds = 0
    _cpu_instances(cfg, sv.instance_count)
    _params(cfg, {
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
    pb = _pb()
    cfg = pb.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=spec.build.max_batch_size)
    _add(cfg.input, client_inputs(), is_input=True)
    _add(cfg.output, client_outputs(dropped_turns=s.rtk_extensions), is_input=False)
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
    pb = _pb()
    sv = spec.serving
    cfg = pb.ModelConfig(name=BLS, backend="python", max_batch_size=spec.build.max_batch_size)
    _add(cfg.input, client_inputs(), is_input=True)
    _add(cfg.output, client_outputs(dropped_turns=True), is_input=False)
    cfg.model_transaction_policy.decoupled = sv.decoupled
    _cpu_instances(cfg, sv.instance_count)
    _params(cfg, {
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
    pb = _pb()
    w = cfg.model_warmup.add(name=name, batch_size=1, count=count)
    for tensor, (dtype, dims, filename) in inputs.items():
        w.inputs[tensor].data_type = pb.DataType.Value(f"TYPE_{dtype}")
        w.inputs[tensor].dims.extend(dims)
        w.inputs[tensor].input_data_file = filename


# -- rendering --------------------------------------------------------------------------------

def render(cfg) -> str:
    """``config.pbtxt`` text of ``cfg``, parsed back into a ModelConfig as a check."""
    from google.protobuf import text_format

    text = text_format.MessageToString(cfg)
    back = parse(text)
    if back != cfg:
        raise AssertionError(f"config of '{cfg.name}' does not survive a text round trip")
    return text


def parse(text: str):
    """Parse ``config.pbtxt`` text against Triton's ModelConfig schema (raises ParseError)."""
    from google.protobuf import text_format

    return text_format.Parse(text, _pb().ModelConfig())
