"""Text to the ``tensorrt_llm`` model's token ids and back, done in the front door.

Requests without a session go straight to the repository's ``tensorrt_llm`` model by default
(``serving.frontend.primary_model``), and session turns always do (sessions.py).  The front door then does
what the ensemble's ``preprocessing`` and ``postprocessing`` models would, with the same code
(toolkit/triton/models/rtk_text.py) and the same settings: the chat template, the context window and its
policy, stop words in TensorRT-LLM's word-list format, and incremental detokenisation against the
preceding tokens.  Skipping the ensemble saves one python-stub round trip per token (``postprocessing``)
and one per request (``preprocessing``); docs/guard-measurements.md, "The primary path, measured", has the measurements.
"""

from __future__ import annotations

import sys
from array import array
from pathlib import Path

from ..triton.models import rtk_text
from .protocol import GenRequest, bad
from .triton import raw_tensor


def render_chat(tokenizer, messages: list[dict], *, generation_prompt: bool = True) -> str:
    """``messages`` through ``tokenizer``'s chat template; a conversation the template refuses is a 400 naming
    ``messages``."""
    try:
        return rtk_text.render_chat(tokenizer, messages, generation_prompt=generation_prompt)
    except rtk_text.PromptError as exc:
        raise bad("messages", str(exc)) from None


class ChatTokens:
    """The repository's tokenizer and chat template, as the preprocessing model uses them."""

    def __init__(self, tokenizer_dir: Path):
        self.tok = rtk_text.load_tokenizer(str(tokenizer_dir))
        self.end_id, self.pad_id = rtk_text.end_id_of(self.tok), rtk_text.pad_id_of(self.tok)

    def render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        return render_chat(self.tok, msgs, generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return rtk_text.encode(self.tok, text, add_special_tokens=False)

    def delta(self, preceding: list[int], new: list[int]) -> str:
        return rtk_text.decode_delta(self.tok, preceding[-rtk_text.PRECEDING_WINDOW :], new)


class PromptRules:
    """The preprocessing model's settings for a request's prompt (toolkit/triton/config.py ``preprocessing``)."""

    def __init__(self, tokens: ChatTokens, *, max_input_len: int, max_seq_len: int, context_policy: str):
        self.tokens = tokens
        self.max_input_len, self.max_seq_len, self.context_policy = max_input_len, max_seq_len, context_policy

    def prompt_ids(self, req: GenRequest) -> list[int]:
        """The ids ``preprocessing`` would make of ``req``; a prompt that does not fit is refused with 400.
        The messages are the ones :func:`~.protocol.parse_request` checked (``preprocessing``'s rules, as
        ``rtk_text.parse_query`` applies them), so they go to the chat template as they are."""
        from .triton import TritonRefused, classify_refusal

        tok = self.tokens.tok
        try:
            window = rtk_text.prompt_window(self.max_input_len, self.max_seq_len, req.max_tokens)
            if req.kind == "chat":
                ids, _ = rtk_text.encode_chat(tok, req.messages, window=window, policy=self.context_policy)
            else:  # a completion's prompt is plain text, whatever it looks like
                ids = rtk_text.encode_plain(tok, req.text_input(), window=window, add_special_tokens=True)
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

    def add(name, datatype, value, shape=None):
        """A scalar (shape [1]), a list (shape [n]) or a word list (``shape`` [2, n], ``value`` flat), with a
        batch dimension of 1 when the model has one; packed with ``struct`` (:func:`~.triton.raw_tensor`)."""
        values = value if isinstance(value, list) else [value]
        shape = shape or [len(values)]
        msg.inputs.add(name=name, datatype=datatype, shape=[1, *shape] if backend.batched else shape)
        msg.raw_input_contents.append(raw_tensor(datatype, values))

    def optional(name, field_name, wanted):
        if wanted and name not in backend.inputs:
            raise bad(field_name, f"is not supported by this deployment's '{backend.model}' model; leave it unset")
        return wanted

    add("input_ids", "INT32", list(ids))
    add("input_lengths", "INT32", len(ids))
    add("request_output_len", "INT32", req.max_tokens)
    add("end_id", "INT32", -1 if req.ignore_eos else tokens.end_id)  # -1: no end token (TensorRT-LLM's rule)
    add("pad_id", "INT32", tokens.pad_id)
    add("streaming", "BOOL", True)
    if "exclude_input_in_output" in backend.inputs:
        add("exclude_input_in_output", "BOOL", True)
    if outputs and "return_perf_metrics" in backend.inputs:  # the kv_cache_* outputs come with the perf metrics
        add("return_perf_metrics", "BOOL", True)
    if req.temperature:  # greedy is what the engine does when no sampling input is sent
        add("temperature", "FP32", req.temperature)
        if optional("runtime_top_p", "top_p", req.top_p < 1.0):
            add("runtime_top_p", "FP32", req.top_p)
        if optional("runtime_top_k", "top_k", bool(req.top_k)):
            add("runtime_top_k", "INT32", req.top_k)
        if optional("seed", "seed", req.seed is not None):
            add("seed", "UINT64", req.seed)
    if req.stop:
        words = rtk_text.word_list(tokens.tok, [req.stop])[0]  # [2, N]
        add("stop_words_list", "INT32", words.ravel().tolist(), list(words.shape))
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if optional(name, name, v != 0.0):
            add(name, "FP32", v)
    if req.logprobs:
        if not ("return_log_probs" in backend.inputs and "output_log_probs" in backend.outputs):
            raise bad("logprobs", "is not supported by this deployment (its model returns no log-probabilities)")
        add("return_log_probs", "BOOL", True)
    for name in ("output_ids", "sequence_length", *outputs, *(("output_log_probs",) if req.logprobs else ())):
        if name in backend.outputs:
            msg.outputs.add(name=name)
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    return msg


def _little(a: array) -> list:
    """A tensor's raw contents (little-endian, as Triton sends them) as numbers."""
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


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
            name = o.name
            if name == "output_ids":
                new = _little(array("i", raws[i]))
            elif name == "sequence_length":
                lengths = int.from_bytes(raws[i][:4], "little", signed=True)
            elif name == "kv_cache_reused_blocks":
                self.reused_blocks = int.from_bytes(raws[i][:4], "little", signed=True)
            elif name == "output_log_probs":
                logprobs = _little(array("f", raws[i]))
        if lengths is not None:
            new = new[:lengths]
        new = [t for t in new if t != self.tokens.end_id]
        if logprobs is not None:
            logprobs = logprobs[: len(new)]
        # the ids just before: the prompt's last few, then the generated ones (a window, not the whole answer)
        before = self.prompt_tail + self.generated[-rtk_text.PRECEDING_WINDOW :]
        text = self.tokens.delta(before, new) if new else ""
        self.generated += new
        return text, logprobs
