"""The OpenAI wire format: request validation into :class:`GenRequest`, errors, and response bodies.

Every refusal is an OpenAI-style error object ``{"error": {"message", "type", "param", "code"}}``;
``param`` names the offending field so a client can fix it.  Only ``n=1`` is served.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
MAX_SEED = 2**63 - 1


class APIError(Exception):
    """An error the front door answers with (status, OpenAI error body, extra headers)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"'{param}': {message}", param=param, code="invalid_value")


@dataclass
class GenRequest:
    """One validated generation request, independent of the endpoint it came from."""

    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict] | None = None  # chat: [{"role", "content"}] with string content
    prompt: str | None = None  # completion
    max_tokens: int = 128
    temperature: float | None = None  # None: the deployment's default (greedy on rtk's engines)
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens tokens (benchmarks)
    ttft_deadline_ms: float | None = None
    session_id: str | None = None  # the conversation the front door keeps (toolkit/frontdoor/sessions.py)
    logprobs: bool = (
        False  # the chosen tokens' log-probabilities (chat ``logprobs: true``, completions ``logprobs: 0``)
    )
    rendered: str | None = None  # the chat rendered by the front door, for a model that takes a plain prompt (llmapi)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def deterministic(self) -> bool:
        """Greedy, or sampled with a fixed seed: the same request gives the same answer (not in a session,
        whose history is part of the prompt)."""
        return (not self.temperature or self.seed is not None) and self.session_id is None and not self.logprobs

    def text_input(self) -> str:
        """What the Triton model takes: a plain prompt, the chat as a JSON message list (the ensemble renders
        it), or the chat already rendered with the chat template (:attr:`rendered`)."""
        if self.kind == "completion":
            return self.prompt
        return self.rendered if self.rendered is not None else json.dumps(self.messages, ensure_ascii=False)

    def cache_key(self) -> str:
        """Exact match on the normalised content and every parameter that changes the answer."""
        norm = {
            "kind": self.kind,
            "model": self.model,
            "messages": self.messages,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature or 0.0,
            "top_p": self.top_p if self.temperature else None,
            "top_k": self.top_k if self.temperature else None,
            "seed": self.seed if self.temperature else None,
            "stop": sorted(self.stop),
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
            "frequency_penalty": self.frequency_penalty,
        }
        return hashlib.sha256(json.dumps(norm, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def prompt_text(self) -> str:
        return self.prompt if self.kind == "completion" else "\n".join(m["content"] for m in self.messages)


# -- validation ---------------------------------------------------------------------------------


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"must be a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise bad(name, f"must be a finite number, got {v}")
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise bad(name, f"{v:g} is out of range; use a value in {left}{lo:g}, {hi:g}]")
    return v


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"must be an integer, got {v!r}")
    if v < lo or v > hi:
        raise bad(name, f"{v} is out of range; use a value in [{lo}, {hi}]")
    return v


def _logprobs(kind: str, body: dict) -> bool:
    """Whether the chosen tokens' log-probabilities are asked for.  Only those are served (the engines return
    no alternatives): chat ``top_logprobs`` above 0 and completions ``logprobs`` above 0 are refused."""
    if kind == "chat":
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise bad("logprobs", "must be true or false")
        top = _integer(body, "top_logprobs", 0, 20)
        if top and not want:
            raise bad("top_logprobs", "needs logprobs: true")
        if top:
            raise bad(
                "top_logprobs",
                f"{top} alternatives per token are not served (only the chosen token's log-probability); "
                "send 0 or leave it unset",
            )
        return bool(want)
    top = _integer(body, "logprobs", 0, 5)
    if top:
        raise bad(
            "logprobs",
            f"{top} alternatives per token are not served (only the chosen token's log-probability); send 0",
        )
    return top == 0


def logprob_items(text: str, lps) -> list[tuple[str, float]]:
    """One response's text and its tokens' log-probabilities as (token text, log-prob) pairs.  The text goes
    with the last token: a token whose characters are completed by a later one carries an empty text."""
    vals = [float(v) if math.isfinite(v) else -9999.0 for v in lps]  # OpenAI's stand-in for -inf
    return [("", v) for v in vals[:-1]] + [(text, vals[-1])] if vals else []


def logprobs_field(req: GenRequest, items: list[tuple[str, float]], offset: int = 0) -> dict:
    """The ``logprobs`` of a choice (chat: ``content``; completions: ``tokens`` / ``token_logprobs``)."""
    if req.kind == "chat":
        content = [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in items]
        return {"content": content}
    offsets = []
    for t, _ in items:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": [t for t, _ in items],
        "token_logprobs": [lp for _, lp in items],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _content(i: int, m: Any) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for j, p in enumerate(c):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad(f"messages[{i}].content[{j}]", 'only text parts ({"type": "text", "text": ...}) are served')
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", "must be a string or a list of text parts")


def parse_request(kind: str, body: Any, *, served_model: str, max_seq_len: int, default_max_tokens: int) -> GenRequest:
    """Validate an OpenAI request body; raises :class:`APIError` (400) naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", param=None, code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", f"is required; this server serves '{served_model}'")
    if model != served_model:
        raise APIError(
            400,
            f"'model': '{model}' is not served here; use '{served_model}' (see /v1/models)",
            param="model",
            code="model_not_found",
        )
    req = GenRequest(kind=kind, model=model)
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad("messages", 'must be a non-empty list of {"role", "content"} objects')
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise bad(f"messages[{i}]", "must be an object with 'role' and 'content'")
            if m.get("role") not in ROLES:
                raise bad(f"messages[{i}].role", f"{m.get('role')!r} is not served; use one of {', '.join(ROLES)}")
            out.append({"role": m["role"], "content": _content(i, m)})
        if out[-1]["role"] != "user":
            raise bad(f"messages[{len(out) - 1}].role", "the last message must be the user's")
        req.messages = out
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise bad("prompt", "must be a non-empty string (one prompt per request)")
        req.prompt = prompt
    n = _integer(body, "n", 1, 1 << 30)
    if n not in (None, 1):
        raise bad("n", f"{n} choices are not served; send n=1")
    mt = body.get("max_completion_tokens", None) if kind == "chat" else None
    name = "max_completion_tokens" if mt is not None else "max_tokens"
    max_tokens = _integer(body, name, 1, max_seq_len - 1)
    req.max_tokens = max_tokens if max_tokens is not None else default_max_tokens
    req.temperature = None if body.get("temperature") is None else _number(body, "temperature", 1.0, 0.0, 2.0)
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    req.top_k = _integer(body, "top_k", 0, 1 << 20)
    req.seed = _integer(body, "seed", 0, MAX_SEED)
    req.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    req.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop)
    ):
        raise bad("stop", "must be a non-empty string or a list of up to 4 non-empty strings")
    req.stop = stop or []
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be true or false")
    req.stream = stream
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", "must be true or false")
    req.ignore_eos = ignore_eos
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise bad("stream_options", 'must be {"include_usage": true|false}')
        req.include_usage = bool(opts.get("include_usage"))
    req.logprobs = _logprobs(kind, body)
    for name in (
        "logit_bias",
        "tools",
        "functions",
        "response_format",
        "best_of",
        "echo",
        "suffix",
    ):
        v = body.get(name)
        if v not in (None, False, {}, [], 1 if name == "best_of" else None):
            raise bad(name, "is not supported by this deployment; leave it unset")
    if body.get("session_id") is not None:
        from .sessions import session_id_of

        if kind != "chat":
            raise bad("session_id", "sessions are kept for /v1/chat/completions; send the whole prompt here")
        req.session_id = session_id_of(body)
        if req.logprobs:
            raise bad(
                "logprobs", "is not served for session turns; leave it unset or send the request without session_id"
            )
    if "ttft_deadline_ms" in body:
        req.ttft_deadline_ms = _number(body, "ttft_deadline_ms", 0.0, 0.0, 3_600_000.0, lo_open=True)
    return req


# -- responses ------------------------------------------------------------------------------------


def chunk(
    req: GenRequest,
    text: str | None,
    finish: str | None = None,
    *,
    first: bool = False,
    extra: dict | None = None,
    logprobs: dict | None = None,
) -> dict:
    """One streamed chunk (chat.completion.chunk or text_completion)."""
    if req.kind == "chat":
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = {"id": f"chatcmpl-{req.id}", "object": "chat.completion.chunk"}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = {"id": f"cmpl-{req.id}", "object": "text_completion"}
    obj.update(created=req.created, model=req.model, choices=[choice])
    if extra:
        obj.update(extra)
    return obj


def sse(obj) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ContentFramer:
    """``sse(chunk(req, text))`` for the many middle chunks of a stream, byte for byte, without building
    and encoding the whole object per token: the request's fixed parts are encoded once, then each
    chunk is those bytes around the JSON string of its text (unit-tested against the general path)."""

    MARK = "\x00rtk-text\x00"

    def __init__(self, req: GenRequest):
        framed = sse(chunk(req, self.MARK))
        mark = json.dumps(self.MARK, ensure_ascii=False).encode()
        self.head, self.tail = framed.split(mark)

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail


def usage_chunk(req: GenRequest, usage: dict) -> dict:
    obj = chunk(req, None)
    obj["choices"] = []
    obj["usage"] = usage
    return obj


def full_response(
    req: GenRequest, text: str, finish: str, usage: dict, extra: dict | None = None, logprobs: dict | None = None
) -> dict:
    if req.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        obj = {"id": f"chatcmpl-{req.id}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = {"id": f"cmpl-{req.id}", "object": "text_completion"}
    obj.update(created=req.created, model=req.model, choices=[choice], usage=usage)
    if extra:
        obj.update(extra)
    return obj


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
