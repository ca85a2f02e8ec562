"""Text to the ``tensorrt_llm`` model's token ids and back, done in the front door.

Requests without a session go straight to the repository's ``tensorrt_llm`` model by default
(``serving.frontend.primary_model``), and session turns always do (sessions.py).  The front door then does
what the ensemble's ``preprocessing`` and ``postprocessing`` models would, with the same code
(toolkit/triton/models/rtk_text.py) and the same settings: the chat template, the context window and its
policy, stop words in TensorRT-LLM's word-list format, and incremental detokenisation against the
preceding tokens.  Skipping the ensemble saves one python-stub round trip per token (``postprocessing``)
and one per request (``preprocessing``); docs/guard.md, "The primary path", has the measurements.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..triton.models import rtk_text
from .protocol import GenRequest, bad


class ChatTokens:
    """The repository's tokenizer and chat template, as the preprocessing model uses them."""

    def __init__(self, tokenizer_dir: Path):
        self.tok = rtk_text.load_tokenizer(str(tokenizer_dir))
        self.end_id, self.pad_id = rtk_text.end_id_of(self.tok), rtk_text.pad_id_of(self.tok)

    def render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def delta(self, preceding: list[int], new: list[int]) -> str:
        return rtk_text.decode_delta(self.tok, preceding[-rtk_text.PRECEDING_WINDOW :], new)


class PromptRules:
    """The preprocessing model's settings for a request's prompt (toolkit/triton/config.py ``preprocessing``)."""

    def __init__(self, tokens: ChatTokens, *, max_input_len: int, max_seq_len: int, context_policy: str):
        self.tokens = tokens
        self.max_input_len, self.max_seq_len, self.context_policy = max_input_len, max_seq_len, context_policy

    def prompt_ids(self, req: GenRequest) -> list[int]:
        """The ids ``preprocessing`` would make of ``req``; a prompt that does not fit is refused with 400."""
        from .triton import TritonRefused, classify_refusal

        try:
            window = rtk_text.prompt_window(self.max_input_len, self.max_seq_len, req.max_tokens)
            ids, _ = rtk_text.encode_prompt(
                self.tokens.tok, req.text_input(), window=window, policy=self.context_policy, add_special_tokens=True
            )
        except rtk_text.PromptError as exc:  # the same 400 (and field) as when preprocessing refuses it
            raise classify_refusal(TritonRefused(str(exc), overload=False), req) from None
        return ids


def ids_request(backend, req: GenRequest, ids: list[int], tokens: ChatTokens, outputs: tuple[str, ...] = ()):
    """The ``ModelInferRequest`` for ``tensorrt_llm`` (TensorRT-LLM's tensor names): ``ids`` as the prompt,
    ``req``'s sampling, stop words, end token and log-probs, streamed; ``outputs``: more outputs to ask for
    (``kv_cache_*``: with ``return_perf_metrics``).  An input the served model does not declare is refused
    with 400 naming the request's field."""
    from tritonclient.grpc import service_pb2 as pb

    msg = pb.ModelInferRequest(model_name=backend.model, id=req.id)

    def add(name, datatype, arr):
        """One request's scalar, list or word list, with a batch dimension of 1 when the model has one."""
        arr = np.asarray(arr)
        arr = arr[np.newaxis] if arr.ndim >= 2 else arr.reshape(1, -1)
        if not backend.batched:
            arr = arr[0]
        msg.inputs.add(name=name, datatype=datatype, shape=list(arr.shape))
        msg.raw_input_contents.append(arr.tobytes())

    def optional(name, field_name, wanted):
        if wanted and name not in backend.inputs:
            raise bad(field_name, f"is not supported by this deployment's '{backend.model}' model; leave it unset")
        return wanted

    i32 = lambda v: np.array(v, dtype=np.int32)  # noqa: E731
    add("input_ids", "INT32", i32(ids))
    add("input_lengths", "INT32", i32(len(ids)))
    add("request_output_len", "INT32", i32(req.max_tokens))
    add("end_id", "INT32", i32(-1 if req.ignore_eos else tokens.end_id))  # -1: no end token (TensorRT-LLM's rule)
    add("pad_id", "INT32", i32(tokens.pad_id))
    add("streaming", "BOOL", np.array(True))
    if "exclude_input_in_output" in backend.inputs:
        add("exclude_input_in_output", "BOOL", np.array(True))
    if outputs and "return_perf_metrics" in backend.inputs:  # the kv_cache_* outputs come with the perf metrics
        add("return_perf_metrics", "BOOL", np.array(True))
    if req.temperature:  # greedy is what the engine does when no sampling input is sent
        add("temperature", "FP32", np.array(req.temperature, dtype=np.float32))
        if optional("runtime_top_p", "top_p", req.top_p < 1.0):
            add("runtime_top_p", "FP32", np.array(req.top_p, dtype=np.float32))
        if optional("runtime_top_k", "top_k", bool(req.top_k)):
            add("runtime_top_k", "INT32", i32(req.top_k))
        if optional("seed", "seed", req.seed is not None):
            add("seed", "UINT64", np.array(req.seed, dtype=np.uint64))
    if req.stop:
        add("stop_words_list", "INT32", rtk_text.word_list(tokens.tok, [req.stop])[0])  # [2, N]
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if optional(name, name, v != 0.0):
            add(name, "FP32", np.array(v, dtype=np.float32))
    if req.logprobs:
        if not ("return_log_probs" in backend.inputs and "output_log_probs" in backend.outputs):
            raise bad("logprobs", "is not supported by this deployment (its model returns no log-probabilities)")
        add("return_log_probs", "BOOL", np.array(True))
    for name in ("output_ids", "sequence_length", *outputs, *(("output_log_probs",) if req.logprobs else ())):
        if name in backend.outputs:
            msg.outputs.add(name=name)
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    return msg


class IdsText:
    """A stream's token ids back to text pieces, as the postprocessing model decodes them: each response's new
    ids against the ones before (the prompt's last few, then the generated ones), so a character split across
    tokens comes out whole.  The end token is not text and not counted (TensorRT-LLM leaves it out too)."""

    def __init__(self, tokens: ChatTokens, prompt_ids: list[int]):
        self.tokens = tokens
        self.prompt_tokens = len(prompt_ids)
        self.prompt_tail = list(prompt_ids[-rtk_text.PRECEDING_WINDOW :])
        self.generated: list[int] = []
        self.reused_blocks: int | None = None  # kv_cache_reused_blocks, when asked for and sent

    def text(self, outputs, raws) -> tuple[str, list[float] | None]:
        """The new text of one response (its ``outputs`` and ``raw_output_contents``), and its log-probs."""
        new: list[int] = []
        lengths = None
        logprobs = None
        for i, o in enumerate(outputs):
            if o.name == "output_ids":
                new = np.frombuffer(raws[i], dtype=np.int32).tolist()
            elif o.name == "sequence_length":
                lengths = int(np.frombuffer(raws[i], dtype=np.int32)[0])
            elif o.name == "kv_cache_reused_blocks":
                self.reused_blocks = int(np.frombuffer(raws[i], dtype=np.int32)[0])
            elif o.name == "output_log_probs":
                logprobs = np.frombuffer(raws[i], dtype=np.float32).tolist()
        if lengths is not None:
            new = new[:lengths]
        new = [t for t in new if t != self.tokens.end_id]
        if logprobs is not None:
            logprobs = logprobs[: len(new)]
        text = self.tokens.delta(self.prompt_tail + self.generated, new) if new else ""
        self.generated += new
        return text, logprobs
