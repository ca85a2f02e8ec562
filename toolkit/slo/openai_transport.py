"""Streaming load at any OpenAI-compatible server: rtk's front door, trtllm-serve, vLLM, NIM.

``POST /v1/chat/completions`` (endpoint ``chat``: the prompt is one user message) or
``/v1/completions`` (endpoint ``completions``: the prompt as is), with ``stream: true`` and
``stream_options.include_usage`` so the final chunk carries ``usage.completion_tokens``.  Each SSE
``data:`` line is timestamped when it arrives; a chunk whose ``choices[0]`` carries text
(``delta.content`` or ``text``) is a token-carrying response; ``data: [DONE]`` (or the end of the
stream) ends the request.  When the server counts more tokens than chunks carried, the last chunk
takes the rest, so TPOT and throughput use the server's count.

Multi-turn conversations (``slo.turns`` > 1, or a dataset's ``turns``) at a server that keeps sessions
(rtk's front door: ``GET /v1/sessions/{id}`` answers ``session_not_found`` for an unknown id) go through
them: each turn sends only its new user message with ``"session_id": "rtk-slo-<run>-<conversation>"``,
and the server supplies the history (so turn k's ``usage.prompt_tokens`` grows with it).  At any other
server each turn sends the whole history as one user message, as the Triton transports do.

Outcomes follow outcome.py: HTTP 429 and 503 are refusals (shed); a fallback tier named in the
:data:`~toolkit.slo.outcome.TIER_HEADER` response header or the final chunk's
:data:`~toolkit.slo.outcome.TIER_FIELD` field is shed as well; any other status, an ``error``
event or a broken stream is a failure.  ``OPENAI_API_KEY``, when set, is sent as a bearer token
and never written anywhere.  A ``Server-Timing: frontdoor;dur=<ms>`` header (rtk's front door) becomes
the record's server arrival → first token (``server_ttft``).
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
import uuid
from typing import Any

from ..errors import ServerError, UsageError
from .outcome import TIER_FIELD, TIER_HEADER, TIMING_HEADER, server_timing_ms
from .records import ARRIVAL, FIRST_TOKEN
from .transport import Decoded, HttpTransport, ModelInfo, Payload, now_ns

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# Keys of the pseudo-payload that carries the response's head to the decoder: the tier header, the front door's
# own time to the head (Server-Timing) and when the head arrived here.
HEADER_TIER, HEADER_SERVER_MS, HEADER_AT = "header_tier", "header_server_ms", "header_at"
SESSION_PREFIX = "rtk-slo-"


def decode_openai(info: ModelInfo, payload: Any, *, content: bool = True, stamps: bool = True) -> Decoded:
    """One SSE ``data:`` payload (or the response head's pseudo-payload) → tokens, text, tier, usage, server stamps."""
    if isinstance(payload, dict):
        # A front door that times itself (rtk's: Server-Timing ``frontdoor;dur``) sends its head with the first
        # token: its arrival → first token, placed on this clock so that only the difference is the server's.
        ms = payload.get(HEADER_SERVER_MS)
        at = payload.get(HEADER_AT)
        found = {ARRIVAL: at - round(ms * 1e6), FIRST_TOKEN: at} if stamps and ms is not None and at else {}
        return Decoded(0, tier=payload.get(HEADER_TIER), stamps=found)
    obj = json.loads(payload)
    usage = obj.get("usage") or {}
    total = usage.get("completion_tokens")
    tier = obj.get(TIER_FIELD)
    choices = obj.get("choices") or []
    piece = None
    if choices:
        c = choices[0]
        piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
    if not piece:
        return Decoded(0, tier=tier, total_tokens=total)
    return Decoded(1, text=piece if content else None, tier=tier, total_tokens=total)


class OpenAITransport(HttpTransport):
    name = "openai"

    def __init__(self, url: str, model: str, interface: str, timeout_s: float = 10.0):
        super().__init__(url, model, interface, timeout_s)
        self.url = self.url.removesuffix("/v1")
        key = os.environ.get("OPENAI_API_KEY")
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        self.run_tag = SESSION_PREFIX + uuid.uuid4().hex[:12]  # this run's conversations are new to the server

    def session_id(self, conversation: int) -> str:
        return f"{self.run_tag}-{conversation}"

    def _keeps_sessions(self) -> bool:
        """Whether the server keeps conversations: rtk's front door answers an unknown session id with
        ``session_not_found`` (and ``sessions_unavailable`` when its sessions are off)."""
        req = urllib.request.Request(f"{self.url}/v1/sessions/{self.run_tag}-probe", headers=self._headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s):
                return False  # nothing can exist under this run's fresh tag
        except urllib.error.HTTPError as exc:
            try:
                code = (json.loads(exc.read()).get("error") or {}).get("code")
            except (ValueError, AttributeError):
                return False
            return exc.code == 404 and code == "session_not_found"
        except (urllib.error.URLError, OSError):
            return False

    def model_info(self) -> ModelInfo:
        if self.interface not in PATHS:
            raise UsageError(
                f"endpoint '{self.interface}' is not an OpenAI endpoint; use chat or completions (slo.endpoint)"
            )
        req = urllib.request.Request(self.url + "/v1/models", headers=self._headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            hint = "; set OPENAI_API_KEY" if exc.code in (401, 403) else ""
            raise ServerError(f"{self.url}/v1/models answered HTTP {exc.code}{hint}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ServerError(
                f"cannot reach an OpenAI-compatible server at {self.url}: {getattr(exc, 'reason', exc)}. "
                "Is it running (rtk serve starts rtk's front door)?"
            ) from None
        names = [m.get("id") for m in body.get("data") or [] if isinstance(m, dict)]
        if not self.model:
            if not names:
                raise UsageError(f"{self.url}/v1/models lists no model; pass slo.model / --model")
            self.model = names[0]
        elif names and self.model not in names:
            raise UsageError(f"model '{self.model}' is not served at {self.url}; it serves {names} (slo.model)")
        self.info = ModelInfo(
            name=self.model,
            interface=self.interface,
            max_batch_size=0,
            inputs=set(),
            outputs=set(),
            decoupled=True,
            sessions=self.interface == "chat" and self._keeps_sessions(),
        )
        return self.info

    def prepare(self, rid: str, p: Payload) -> tuple[str, bytes]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": p.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.interface == "chat" and p.conversation is not None and self.info is not None and self.info.sessions:
            body["messages"] = [{"role": "user", "content": p.turn_text}]
            body["session_id"] = self.session_id(p.conversation)
        elif self.interface == "chat":
            body["messages"] = [{"role": "user", "content": p.text}]
        else:
            body["prompt"] = p.text
        return rid, json.dumps(body).encode()

    async def _one(self, rid: str, body: bytes) -> None:
        import aiohttp

        try:
            async with self._session.post(self.url + PATHS[self.interface], data=body, headers=self._headers) as resp:
                t = now_ns()
                tier = resp.headers.get(TIER_HEADER)
                if resp.status != 200:
                    text = await resp.text()
                    self._on_error(rid, now_ns(), f"HTTP {resp.status}: {text.strip()[:500]}", status=resp.status)
                    return
                server_ms = server_timing_ms(resp.headers.get(TIMING_HEADER))
                if tier is not None or server_ms is not None:
                    head = {HEADER_TIER: tier, HEADER_SERVER_MS: server_ms, HEADER_AT: t}
                    self._on_response(rid, t, head, False)
                async for line in resp.content:
                    t = now_ns()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    if data.startswith(b'{"error"'):
                        err = json.loads(data).get("error")
                        msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                        self._on_error(rid, t, f"error event: {msg}")
                        return
                    self._on_response(rid, t, data, False)
            self._on_response(rid, now_ns(), None, True)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            self._on_error(rid, now_ns(), f"HTTP stream failed: {type(exc).__name__}: {exc}")
