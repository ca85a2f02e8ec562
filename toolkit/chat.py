"""``rtk chat``: build a spec if needed, reach its server (or start one for the question), stream one answer."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from .client import Generation, stream_chat


def chat(
    source,
    question: str,
    *,
    overrides=(),
    url: str | None = None,
    model: str = "ensemble",
    system: str | None = None,
    max_tokens: int = 128,
    build: bool = True,
    out: TextIO | None = None,
) -> Generation:
    """Build ``source`` if it is a spec (cached stages are skipped), then stream the answer from ``url``,
    else from the background server of its repository, else from a server started for this one question."""
    source = Path(source)
    if build and source.is_file():
        from .pipeline import build as run_pipeline
        from .spec import load_spec

        run_pipeline(load_spec(source, list(overrides)))
    if url is None:
        from .triton.launch import resolve
        from .triton.server import http_ready, read_state

        state = read_state(resolve(source, overrides).repository)
        if state is not None and http_ready(state.http_url):
            url = state.grpc_url
    if url is not None:
        return stream_chat(url, question, system=system, max_tokens=max_tokens, model=model, out=out)
    from .console import info
    from .triton.launch import running

    info(
        "[dim]starting tritonserver for this question (models load and warm up; "
        "`rtk serve --detach` keeps one running)[/]"
    )
    with running(source, overrides=overrides) as server:
        return stream_chat(server.grpc_url, question, system=system, max_tokens=max_tokens, model=model, out=out)
