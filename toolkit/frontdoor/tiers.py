"""The fallback tiers: a response cache (in-process or Redis), another deployment, a rule answer.

Each tier either answers (an :class:`Answer`: the text and counts, or an async iterator of text
pieces) or declines by returning None; the front door then tries the next tier.  Everything here
is decided before the first byte goes to the client.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from .protocol import GenRequest


@dataclass
class Answer:
    text: str
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0


def read_secret(source: str | None) -> list[str]:
    """Keys from 'env:VARIABLE' or 'file:PATH' (one per line or comma-separated). Never logged."""
    if not source:
        return []
    kind, _, where = source.partition(":")
    if kind == "env":
        raw = os.environ.get(where, "")
    else:
        raw = Path(where).expanduser().read_text()
    return [k.strip() for k in raw.replace(",", "\n").splitlines() if k.strip()]


# -- cache ----------------------------------------------------------------------------------------


class MemoryCache:
    """In-process LRU with a TTL."""

    kind = "memory"

    def __init__(self, ttl_s: float, max_entries: int):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._d: collections.OrderedDict[str, tuple[float, Answer]] = collections.OrderedDict()

    async def get(self, key: str) -> Answer | None:
        item = self._d.get(key)
        if item is None:
            return None
        if item[0] < time.monotonic():
            del self._d[key]
            return None
        self._d.move_to_end(key)
        return item[1]

    async def put(self, key: str, answer: Answer) -> None:
        self._d[key] = (time.monotonic() + self.ttl_s, answer)
        self._d.move_to_end(key)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)

    async def close(self) -> None:
        self._d.clear()


class RedisCache:
    """Redis (``serving.cache.url``): shared by every front door that names it; TTL by Redis."""

    kind = "redis"
    PREFIX = "rtk:answer:"

    def __init__(self, url: str, ttl_s: float, timeout_s: float = 0.05):
        import redis.asyncio as redis

        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._r = redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=1.0)
        self.errors = 0

    async def get(self, key: str) -> Answer | None:
        try:
            raw = await self._r.get(self.PREFIX + key)
        except Exception:  # noqa: BLE001 — an unreachable cache is a miss, never a failed request
            self.errors += 1
            return None
        return Answer(**json.loads(raw)) if raw else None

    async def put(self, key: str, answer: Answer) -> None:
        try:
            await self._r.set(self.PREFIX + key, json.dumps(answer.__dict__), px=self.ttl_ms)
        except Exception:  # noqa: BLE001
            self.errors += 1

    async def close(self) -> None:
        await self._r.aclose()


def make_cache(cache_spec):
    if cache_spec.url:
        return RedisCache(cache_spec.url, cache_spec.ttl_s)
    return MemoryCache(cache_spec.ttl_s, cache_spec.max_entries)


# -- another deployment (any OpenAI-compatible server) ----------------------------------------------


class DeploymentTier:
    """Streams the same request from another OpenAI-compatible server (e.g. a smaller rtk build)."""

    def __init__(self, label: str, base_url, model: str | None, api_key: str | None, client):
        # base_url: a URL, or a function giving one (another rtk spec: its front door, read when needed)
        self.label, self._base_url, self.model, self.client = label, base_url, model, client
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    @property
    def base_url(self) -> str:
        url = self._base_url() if callable(self._base_url) else self._base_url
        return url.rstrip("/")

    async def _model(self) -> str:
        if self.model is None:
            r = await self.client.get(f"{self.base_url}/models", headers=self.headers, timeout=2.0)
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def open(
        self, req: GenRequest, body: dict, first_byte_s: float
    ) -> tuple[str, AsyncIterator[str], dict] | None:
        """Start the stream and wait for its first piece within ``first_byte_s``; None when it cannot."""
        try:
            return await asyncio.wait_for(self._open(req, body), timeout=max(0.001, first_byte_s))
        except Exception:  # noqa: BLE001
            return None

    async def _open(self, req: GenRequest, body: dict):
        model = await self._model()
        path = "/chat/completions" if req.kind == "chat" else "/completions"
        payload = {k: v for k, v in body.items() if k not in ("ttft_deadline_ms", "stream_options")}
        payload.update(model=model, stream=True, stream_options={"include_usage": True})
        cm = self.client.stream("POST", self.base_url + path, json=payload, headers=self.headers, timeout=None)
        resp = await cm.__aenter__()
        if resp.status_code != 200:
            await cm.__aexit__(None, None, None)
            return None
        usage: dict = {}
        lines = resp.aiter_lines()

        async def pieces():
            try:
                async for line in lines:
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    obj = json.loads(data)
                    if obj.get("usage"):
                        usage.update(obj["usage"])
                    for c in obj.get("choices") or []:
                        text = (c.get("delta") or {}).get("content") if req.kind == "chat" else c.get("text")
                        if c.get("finish_reason"):
                            usage["finish_reason"] = c["finish_reason"]
                        if text:
                            yield text
            finally:
                await cm.__aexit__(None, None, None)

        it = pieces()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = ""

        async def chained():
            if first:
                yield first
            async for p in it:
                yield p

        return self.label, chained(), usage


class RuleTier:
    def __init__(self, label: str, template: str):
        self.label, self.template = label, template

    def answer(self, req: GenRequest, deadline_ms: float | None) -> Answer:
        text = self.template.replace("{model}", req.model).replace("{deadline_ms}", f"{deadline_ms or 0:.0f}")
        return Answer(text, "stop", 0, 0)
