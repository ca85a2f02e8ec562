"""A small streaming client for an rtk repository served by Triton (the ``ensemble`` or ``tensorrt_llm_bls`` model).

::

    from toolkit.client import stream_chat
    answer = stream_chat("127.0.0.1:8001", "What is the capital of France?")   # prints tokens as they come

It speaks Triton's streaming gRPC (``ModelStreamInfer``, grpc_service.proto in triton-inference-server/common):
one request, one response per token, the last flagged ``triton_final_response``.
"""

from __future__ import annotations

import json
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from .errors import ServerError, UsageError
from .triton.config import PERF_OUTPUTS


@dataclass
class Generation:
    """What a streamed request returned."""

    text: str = ""
    chunks: list[str] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # perf_counter() at each non-empty chunk
    sent_at: float = 0.0
    dropped_turns: int = 0
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    server_times_ns: dict = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None


def chat_messages(question: str, system: str | None = None, history: list[dict] | None = None) -> str:
    """``text_input`` for a chat: the JSON message list the repository's preprocessing renders."""
    messages = ([{"role": "system", "content": system}] if system else []) + list(history or [])
    messages.append({"role": "user", "content": question})
    return json.dumps(messages)


def _inputs(text: str, max_tokens: int, stream: bool, temperature: float | None, extra: dict | None):
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype, np_dtype):
        t = grpcclient.InferInput(name, [1, 1], dtype)
        t.set_data_from_numpy(np.array([[value]], dtype=np_dtype))
        return t

    ins = [
        tensor("text_input", text.encode("utf-8"), "BYTES", np.object_),
        tensor("max_tokens", max_tokens, "INT32", np.int32),
        tensor("stream", stream, "BOOL", np.bool_),
        tensor("exclude_input_in_output", True, "BOOL", np.bool_),
        tensor("return_perf_metrics", True, "BOOL", np.bool_),
        tensor("return_num_input_tokens", True, "BOOL", np.bool_),
        tensor("return_num_output_tokens", True, "BOOL", np.bool_),
    ]
    if temperature is not None:
        ins.append(tensor("temperature", temperature, "FP32", np.float32))
    for name, (value, dtype, np_dtype) in (extra or {}).items():
        ins.append(tensor(name, value, dtype, np_dtype))
    return ins


def generate(
    url: str,
    text: str,
    *,
    model: str = "ensemble",
    max_tokens: int = 128,
    stream: bool = True,
    temperature: float | None = None,
    on_text: Callable[[str], None] | None = None,
    timeout_s: float = 300.0,
    request_id: str = "",
) -> Generation:
    """Send ``text`` (a prompt or :func:`chat_messages` JSON) and collect the streamed answer.

    ``on_text`` is called with each new piece of text as it arrives.  Raises ServerError with the
    server's message when the request fails.
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()

    def callback(result, error):  # tritonclient calls it with keywords result= and error=
        results.put((result, error, time.perf_counter()))

    out = Generation()
    try:
        client.start_stream(callback=callback)
        out.sent_at = time.perf_counter()
        client.async_stream_infer(
            model,
            _inputs(text, max_tokens, stream, temperature, None),
            request_id=request_id,
            enable_empty_final_response=True,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result, error, at = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ServerError(f"no answer from {url} within {timeout_s:.0f} s") from None
            if error is not None:
                raise ServerError(f"{model}: {error}")
            response = result.get_response()
            names = {o.name for o in response.outputs}
            if "text_output" in names:
                piece = b"".join(result.as_numpy("text_output").reshape(-1)).decode("utf-8")
                if piece:
                    out.chunks.append(piece)
                    out.chunk_times.append(at)
                    out.text += piece
                    if on_text:
                        on_text(piece)
            for name in PERF_OUTPUTS:
                if name in names:
                    out.server_times_ns[name] = int(result.as_numpy(name).reshape(-1)[0])
            for name in ("num_input_tokens", "num_output_tokens", "dropped_turns"):
                if name in names:
                    setattr(out, name, int(result.as_numpy(name).reshape(-1)[0]))
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return out
    except InferenceServerException as exc:
        raise ServerError(f"cannot reach Triton at {url}: {exc.message()}; is `rtk serve` running?") from None
    finally:
        client.stop_stream()
        client.close()


def stream_chat(
    url: str,
    question: str,
    *,
    system: str | None = None,
    max_tokens: int = 128,
    model: str = "ensemble",
    out: TextIO | None = None,
    **kwargs,
) -> Generation:
    """Ask ``question`` as a chat turn and print the answer to ``out`` (stdout) as it streams."""
    if not question.strip():
        raise UsageError("the question is empty; pass some text")
    out = out or sys.stdout

    def show(piece: str) -> None:
        out.write(piece)
        out.flush()

    result = generate(url, chat_messages(question, system), model=model, max_tokens=max_tokens, on_text=show, **kwargs)
    out.write("\n")
    out.flush()
    return result
