"""An OpenAI-compatible streaming adapter over Triton, for tests of ``rtk slo --transport openai``.

It is *not* an LLM: the tokens and their timing come from the deterministic fake LLM served by a
real tritonserver (tests/triton_helpers.py ``write_fake_llm``), read over Triton's HTTP
``generate_stream``.  The adapter adds only what the client must understand: OpenAI's SSE chunk
format for ``/v1/chat/completions`` and ``/v1/completions`` with a final ``usage`` chunk and
``[DONE]``, ``/v1/models``, an admission limit answered with 429 + ``Retry-After`` before any
token, and the tier header / final-chunk field that rtk's front door uses.  Starlette + uvicorn,
on 127.0.0.1 and a free port, in a thread.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Iterator

from toolkit.slo.outcome import TIER_FIELD, TIER_HEADER


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_app(triton_http: str, *, model: str = "ensemble", served_name: str = "fake-llm", capacity: int = 1000,
             tier: str = "primary"):
    import aiohttp
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    state = {"inflight": 0, "session": None}

    async def session():
        if state["session"] is None:
            state["session"] = aiohttp.ClientSession()
        return state["session"]

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [{"id": served_name, "object": "model"}]})

    async def complete(request: Request):
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if state["inflight"] >= capacity:
            return JSONResponse({"error": {"message": "over capacity", "type": "rate_limit_exceeded"}}, status_code=429,
                                headers={"Retry-After": "1"})
        state["inflight"] += 1
        s = await session()
        triton_body = {"text_input": prompt, "max_tokens": int(body.get("max_tokens", 16)), "stream": True}

        async def events():
            n = 0
            try:
                async with s.post(f"{triton_http}/v2/models/{model}/generate_stream", json=triton_body) as resp:
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        text = json.loads(line[5:])["text_output"]
                        n += 1
                        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                        yield f"data: {json.dumps({'object': 'chunk', 'choices': [choice]})}\n\n"
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n, "total_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage, TIER_FIELD: tier})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["inflight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream", headers={TIER_HEADER: tier})

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if state["session"] is not None:
            await state["session"].close()

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", complete, methods=["POST"]),
                             Route("/v1/completions", complete, methods=["POST"])], lifespan=lifespan)


@contextlib.contextmanager
def openai_adapter(triton_http: str, **kwargs) -> Iterator[str]:
    """Serve :func:`make_app` in a thread; yields its base URL (``http://127.0.0.1:PORT``)."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(triton_http, **kwargs), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the OpenAI adapter did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
