"""Talking to Triton: the gRPC bidirectional stream and the HTTP ``generate_stream`` SSE endpoint.

Both transports are non-blocking: :meth:`submit` hands a request over and returns; every response
is timestamped (``time.perf_counter_ns``) the moment the transport's reader sees it, stored raw on
the record, and decoded only after the run, so the per-token cost on the client stays small
(decoding each gRPC message in the reader instead, to hold less in memory, cost more CPU per token
in ``scripts/bench_client.py``).

**gRPC** uses the ``ModelStreamInfer`` RPC through the stub generated from Triton's protocol
(``tritonclient.grpc.service_pb2_grpc``) on a ``grpc.aio`` channel: one stream for all requests,
written and read by one event loop in its own thread.  grpc.aio polls its completion queue without
the GIL and hands the loop whole batches of events, so a streamed token costs no thread handoff
(the synchronous API's channel-spin thread hands every message to the reading thread through a
condition variable: about 20 µs more CPU per token in ``scripts/bench_client.py``, docs/slo.md).
tritonclient's own stream wrapper (``tritonclient/grpc/
_infer_stream.py``) is not used because its callback drops the request id of error responses, so
a failed request could not be told from the others.  Responses carry
``triton_final_response`` (``triton_enable_empty_final_response`` is set) — the end of a request.

**HTTP** posts ``/v2/models/<m>/generate_stream`` with aiohttp from an event loop in its own
thread; each ``data:`` line is one response, an event starting ``{"error"`` is a failure, and the
end of the stream is the end of the request (Triton sends no end event; reference
triton-on-cpu.md §4.1).

Interfaces (reference tensorrt-llm-and-triton.md §5): ``ensemble`` takes ``text_input``,
``max_tokens``, ``stream`` and returns ``text_output``; ``tensorrt_llm`` takes ``input_ids``,
``input_lengths``, ``request_output_len``, ``streaming`` and returns ``output_ids``.  Both take
``return_perf_metrics`` and ``min_tokens`` when the model declares them.
"""

from __future__ import annotations

import asyncio
import json
import queue
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ServerError, UsageError
from ..triton.wire import bytes_elements, bytes_tensor
from .records import SERVER_STAMPS, RequestRecord

now_ns = time.perf_counter_ns
_INT64 = struct.Struct("<q")  # a server stamp: one little-endian int64
_STAMP_NAMES = frozenset(SERVER_STAMPS)
_OUTPUT_AT: dict[tuple[str, int], int] = {}  # (output name, outputs in the response) -> where it was last

# What each interface needs and returns.
INTERFACES = {
    "ensemble": {"required": ("text_input", "max_tokens"), "output": "text_output", "stream": "stream"},
    "tensorrt_llm": {
        "required": ("input_ids", "input_lengths", "request_output_len"),
        "output": "output_ids",
        "stream": "streaming",
    },
}


@dataclass
class ModelInfo:
    name: str
    interface: str
    max_batch_size: int
    inputs: set[str]
    outputs: set[str]
    decoupled: bool | None = None
    sessions: bool = False  # openai: the server keeps conversations (session_id), so a turn sends only its message

    @property
    def stamps(self) -> list[str]:
        """Server timestamp outputs we can ask for."""
        if "return_perf_metrics" not in self.inputs:
            return []
        return [s for s in SERVER_STAMPS if s in self.outputs]

    def check(self) -> None:
        spec = INTERFACES[self.interface]
        missing = [n for n in spec["required"] if n not in self.inputs]
        if missing or spec["output"] not in self.outputs:
            want = ", ".join(spec["required"]) + f" → {spec['output']}"
            raise UsageError(
                f"model '{self.name}' does not have the {self.interface} interface ({want}); it takes "
                f"{sorted(self.inputs)} and returns {sorted(self.outputs)}. "
                "Set slo.endpoint (ensemble or tensorrt_llm) "
                "or slo.model to the right model"
            )
        if self.decoupled is False:
            raise UsageError(
                f"model '{self.name}' is not decoupled, so it cannot stream; serve it with serving.decoupled: true"
            )


@dataclass
class Payload:
    """One request's content, independent of the transport."""

    text: str | None = None  # the whole prompt: a multi-turn session's history and the new user text
    ids: list[int] | None = None
    output_tokens: int = 16
    turn_text: str | None = None  # the new user text alone (servers that keep the history)
    conversation: int | None = None  # the session's number when it has several turns


def _info_from_config(cfg: dict, model: str, interface: str) -> ModelInfo:
    decoupled = (cfg.get("model_transaction_policy") or {}).get("decoupled")
    return ModelInfo(
        name=model,
        interface=interface,
        max_batch_size=int(cfg.get("max_batch_size") or 0),
        inputs={i["name"] for i in cfg.get("input", [])},
        outputs={o["name"] for o in cfg.get("output", [])},
        decoupled=bool(decoupled) if decoupled is not None else None,
    )


# -- decoding (after the run) ---------------------------------------------------------------


@dataclass
class Decoded:
    tokens: int  # tokens carried (0 for an empty final response)
    text: str | None = None
    ids: list[int] | None = None
    stamps: dict[str, int] = field(default_factory=dict)
    tier: str | None = None  # OpenAI-compatible front doors: the tier that answered
    total_tokens: int | None = None  # OpenAI ``usage.completion_tokens`` (final chunk), when sent


def decode_grpc(info: ModelInfo, resp, *, content: bool = True, stamps: bool = True) -> Decoded:
    """A ``ModelInferResponse`` → tokens (from the output's shape), and, when asked, text/ids and
    server stamps, read straight from ``raw_output_contents`` in one pass over the outputs (no
    InferResult, no numpy for the stamps: this runs for every response)."""
    name = INTERFACES[info.interface]["output"]
    raws = resp.raw_output_contents
    outputs = resp.outputs
    st: dict[str, int] = {}
    at = -1
    if not stamps:
        # A server lists a model's outputs in the same order in every response: look where the
        # output was last time first (one element read instead of a pass over all of them).
        key = (name, len(outputs))
        i = _OUTPUT_AT.get(key, -1)
        if 0 <= i < len(outputs) and outputs[i].name == name:
            at = i
    if at < 0:
        for i, out in enumerate(outputs):
            n = out.name
            if n == name:
                at = i
                _OUTPUT_AT[(name, len(outputs))] = i
            elif stamps and n in _STAMP_NAMES:
                st[n] = _INT64.unpack_from(raws[i])[0]
    if at < 0:
        return Decoded(0, stamps=st)
    if info.interface == "ensemble":
        if not content:
            return Decoded(1, stamps=st)
        text = "".join(x.decode("utf-8", "replace") for x in bytes_elements(raws[at]))
        return Decoded(1, text=text, stamps=st)
    shape = resp.outputs[at].shape
    n = int(shape[-1]) if len(shape) else 0  # [batch, beam, tokens]: the first beam is the first n values
    ids = np.frombuffer(raws[at], dtype=np.int32)[:n].tolist() if content else None
    return Decoded(n, ids=ids, stamps=st)


def _first_beam(arr: np.ndarray) -> list[int]:
    a = np.asarray(arr)
    while a.ndim > 1:
        a = a[0]
    return [int(x) for x in a.reshape(-1)]


def decode_http(info: ModelInfo, body: bytes, *, content: bool = True, stamps: bool = True) -> Decoded:
    """One SSE ``data:`` payload → tokens, and when asked text/ids and server stamps."""
    obj = json.loads(body)
    st = (
        {s: int(obj[s][0] if isinstance(obj[s], list) else obj[s]) for s in SERVER_STAMPS if s in obj} if stamps else {}
    )
    name = INTERFACES[info.interface]["output"]
    if name not in obj:
        return Decoded(0, stamps=st)
    val = obj[name]
    if info.interface == "ensemble":
        text = ("".join(map(str, val)) if isinstance(val, list) else str(val)) if content else None
        return Decoded(1, text=text, stamps=st)
    ids = _first_beam(np.asarray(val))
    return Decoded(len(ids), ids=ids if content else None, stamps=st)


def _decoder(transport: str):
    if transport == "openai":
        from .openai_transport import decode_openai

        return decode_openai
    return decode_grpc if transport == "grpc" else decode_http


def finish_record(rec: RequestRecord, info: ModelInfo, transport: str, keep_output: bool = True) -> None:
    """Turn a record's raw responses into chunk times, token counts, output, server stamps and tier."""
    decode = _decoder(transport)
    text, ids = [], []
    total = None
    for t, payload in rec.raw:
        try:
            d = decode(info, payload, content=keep_output, stamps=False)
        except Exception as exc:  # a response we cannot read is the request's failure, not ours
            rec.error = rec.error or f"unreadable response: {exc}"
            continue
        rec.tier = d.tier or rec.tier
        total = d.total_tokens if d.total_tokens is not None else total
        if d.tokens:
            rec.chunk_ns.append(t)
            rec.chunk_tokens.append(d.tokens)
            if d.text is not None:
                text.append(d.text)
            if d.ids is not None:
                ids.extend(d.ids)
    if total is not None and rec.chunk_tokens and total > sum(rec.chunk_tokens):
        # The server counted more tokens than chunks carried (several per chunk): the last takes the rest.
        rec.chunk_tokens[-1] += total - sum(rec.chunk_tokens)
    # Each response repeats the server stamps known so far: the last one that has them has all.
    for _, payload in reversed(rec.raw):
        try:
            found = {k: v for k, v in decode(info, payload, content=False).stamps.items() if v}
        except Exception:
            continue
        if found:
            rec.server.update(found)
            break
    rec.raw = []
    if keep_output:
        if info.interface != "tensorrt_llm":
            rec.text = "".join(text)
        else:
            rec.output_ids = ids
    if rec.error is None and rec.final_ns is not None and not rec.chunk_ns:
        rec.error = "the request finished without any token"


# -- transports -----------------------------------------------------------------------------

OnResponse = Callable[[str, int, Any, bool], None]  # (request id, arrival ns, raw payload, final)
OnError = Callable[..., None]  # (request id or None for all, ns, message, status=HTTP status or None)


class LoopThread:
    """An asyncio event loop running in its own daemon thread: where a transport writes its requests
    and reads its responses while the load generator's thread keeps the schedule."""

    def __init__(self, name: str):
        self.name = name
        self.loop = asyncio.new_event_loop()
        self.thread: threading.Thread | None = None

    def start(self, setup: Callable[[], Any]) -> None:
        """Run the coroutine function ``setup`` on the loop, then keep the loop running; what ``setup``
        raises is raised here, in the caller's thread."""
        ready: queue.SimpleQueue = queue.SimpleQueue()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(setup())
            except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
                ready.put(exc)
                return
            ready.put(None)
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name=self.name, daemon=True)
        self.thread.start()
        failed = ready.get()
        if failed is not None:
            self.thread.join(timeout=10)
            self.loop.close()
            raise failed

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on the loop, from any thread."""
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, shutdown: Callable[[], Any]) -> None:
        """Run the coroutine function ``shutdown`` on the loop, then stop the loop and its thread.

        Tasks still pending after ``shutdown`` (grpc.aio's own, waiting for a cancelled call's status)
        are cancelled and awaited first, as ``asyncio.run`` does, so none is destroyed pending."""

        async def shutdown_all() -> None:
            await shutdown()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        if self.thread is not None and self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown_all(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        self.loop.close()


class Transport:
    name: str

    def __init__(self, url: str, model: str, interface: str, timeout_s: float = 10.0):
        self.url, self.model, self.interface, self.timeout_s = url, model, interface, timeout_s
        self.info: ModelInfo | None = None

    def model_info(self) -> ModelInfo: ...

    def open(self, on_response: OnResponse, on_error: OnError) -> None: ...

    def prepare(self, rid: str, payload: Payload) -> Any:
        """Build the wire request ahead of its due time (so sending is cheap)."""

    def submit(self, prepared: Any) -> None: ...

    def close(self) -> None: ...


class GrpcTransport(Transport):
    name = "grpc"

    def _stub(self):
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        if not hasattr(self, "_channel"):
            opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
            self._channel = grpc.insecure_channel(self.url, options=opts)
            self._grpc_stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._grpc_stub

    def model_info(self) -> ModelInfo:
        import grpc
        from google.protobuf import json_format
        from tritonclient.grpc import service_pb2

        stub = self._stub()
        try:
            if not stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=self.timeout_s).ready:
                raise ServerError(
                    f"tritonserver at {self.url} is up but not ready; wait for it (rtk serve waits) and retry"
                )
            if not stub.ModelReady(service_pb2.ModelReadyRequest(name=self.model), timeout=self.timeout_s).ready:
                raise UsageError(
                    f"model '{self.model}' is not ready on {self.url}; "
                    "check slo.model / slo.endpoint and the server log"
                )
            cfg = stub.ModelConfig(service_pb2.ModelConfigRequest(name=self.model), timeout=self.timeout_s).config
        except grpc.RpcError as exc:
            raise ServerError(
                f"cannot reach tritonserver over gRPC at {self.url}: {exc.code().name} {exc.details()}. "
                "Is it running (rtk serve)?"
            ) from None
        d = json_format.MessageToDict(cfg, preserving_proto_field_name=True)
        self.info = _info_from_config(d, self.model, self.interface)
        self.info.check()
        return self.info

    def _template(self):
        """The parts of every request that do not change (model, fixed inputs, outputs, parameters),
        built once: each request copies it (one C-level merge) and fills in its own values."""
        from tritonclient.grpc import service_pb2

        info = self.info
        lead = [1] if info.max_batch_size > 0 else []  # the batch dimension of a batched model
        req = service_pb2.ModelInferRequest(model_name=self.model)
        slots = {}  # input name -> index of its raw content
        one_int = struct.pack("<i", 0)

        def add(name, datatype, raw, shape=(1,)):
            slots[name] = len(req.raw_input_contents)
            req.inputs.add(name=name, datatype=datatype, shape=[*lead, *shape])
            req.raw_input_contents.append(raw)

        if info.interface == "ensemble":
            add("text_input", "BYTES", b"")
            add("max_tokens", "INT32", one_int)
            if "stream" in info.inputs:
                add("stream", "BOOL", b"\x01")
        else:
            add("input_ids", "INT32", b"", shape=(0,))
            add("input_lengths", "INT32", one_int)
            add("request_output_len", "INT32", one_int)
            if "streaming" in info.inputs:
                add("streaming", "BOOL", b"\x01")
        if "min_tokens" in info.inputs:
            add("min_tokens", "INT32", one_int)
        if info.stamps:
            add("return_perf_metrics", "BOOL", b"\x01")
        for out in [INTERFACES[info.interface]["output"], *info.stamps]:
            req.outputs.add(name=out)
        req.parameters["triton_enable_empty_final_response"].bool_param = True
        self._tmpl = (req, slots, len(lead))
        return self._tmpl

    def prepare(self, rid: str, p: Payload):
        from tritonclient.grpc import service_pb2

        template, slots, batched = getattr(self, "_tmpl", None) or self._template()
        req = service_pb2.ModelInferRequest()
        req.CopyFrom(template)
        req.id = rid
        raw = req.raw_input_contents
        n = struct.pack("<i", p.output_tokens)
        if "text_input" in slots:
            text = p.text.encode()
            raw[slots["text_input"]] = bytes_tensor([text])
            raw[slots["max_tokens"]] = n
        else:
            i = slots["input_ids"]
            raw[i] = np.asarray(p.ids, dtype="<i4").tobytes()
            req.inputs[i].shape[batched] = len(p.ids)
            raw[slots["input_lengths"]] = struct.pack("<i", len(p.ids))
            raw[slots["request_output_len"]] = n
        if "min_tokens" in slots:
            raw[slots["min_tokens"]] = n
        return req

    def open(self, on_response: OnResponse, on_error: OnError) -> None:
        """Open the stream on a :class:`LoopThread` that writes what :meth:`submit` hands over and reads
        every response, in that one thread (grpc.aio polls its completion queue without the GIL), so a
        streamed token costs no thread handoff."""
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self._on_response, self._on_error = on_response, on_error
        self._loop = LoopThread("rtk-slo-grpc")

        async def setup() -> None:
            opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
            self._aio_channel = grpc.aio.insecure_channel(self.url, options=opts)
            self._call = service_pb2_grpc.GRPCInferenceServiceStub(self._aio_channel).ModelStreamInfer()
            self._outbox: asyncio.Queue = asyncio.Queue()
            self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._write())]

        try:
            self._loop.start(setup)
        except Exception as exc:  # noqa: BLE001 - any failure to open is the server's side of the run
            del self._loop
            raise ServerError(f"cannot open a gRPC stream to {self.url}: {type(exc).__name__}: {exc}") from None

    async def _read(self) -> None:
        import grpc

        call, on_response, on_error, eof = self._call, self._on_response, self._on_error, grpc.aio.EOF
        try:
            while True:
                msg = await call.read()
                t = now_ns()
                if msg is eof:
                    return
                resp = msg.infer_response
                if msg.error_message:
                    # An error without a request id cannot be matched; the request it belonged to
                    # then ends by its timeout.  Only a broken stream (below) fails everything.
                    on_error(resp.id, t, msg.error_message)
                    continue
                p = resp.parameters
                on_response(resp.id, t, resp, "triton_final_response" in p and p["triton_final_response"].bool_param)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                on_error(None, now_ns(), f"gRPC stream broke: {exc.code().name} {exc.details()}")

    def submit(self, prepared) -> None:
        self._loop.call(self._outbox.put_nowait, prepared)

    async def _write(self) -> None:
        """Writes what :meth:`submit` queued, in order (grpc.aio takes one write at a time per call)."""
        import grpc

        while True:
            prepared = await self._outbox.get()
            try:
                await self._call.write(prepared)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                self._on_error(None, now_ns(), f"gRPC stream broke on write: {exc}")
                return

    def close(self) -> None:
        if hasattr(self, "_loop"):

            async def shutdown():
                self._call.cancel()
                for task in self._tasks:
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                await self._aio_channel.close()

            self._loop.stop(shutdown)
            del self._loop
        if hasattr(self, "_channel"):
            self._channel.close()
            del self._channel


class HttpTransport(Transport):
    name = "http"

    def __init__(self, url: str, model: str, interface: str, timeout_s: float = 10.0):
        url = url if url.startswith(("http://", "https://")) else f"http://{url}"
        super().__init__(url.rstrip("/"), model, interface, timeout_s)

    def model_info(self) -> ModelInfo:
        def get(path):
            try:
                with urllib.request.urlopen(self.url + path, timeout=self.timeout_s) as r:
                    return r.status, r.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()
            except (urllib.error.URLError, OSError) as exc:
                raise ServerError(
                    f"cannot reach tritonserver over HTTP at {self.url}: {getattr(exc, 'reason', exc)}. "
                    "Is it running (rtk serve)?"
                ) from None

        status, _ = get("/v2/health/ready")
        if status != 200:
            raise ServerError(f"tritonserver at {self.url} is not ready (HTTP {status}); wait for it and retry")
        status, _ = get(f"/v2/models/{self.model}/ready")
        if status != 200:
            raise UsageError(
                f"model '{self.model}' is not ready on {self.url} (HTTP {status}); check slo.model / slo.endpoint"
            )
        status, body = get(f"/v2/models/{self.model}/config")
        self.info = _info_from_config(json.loads(body), self.model, self.interface)
        self.info.check()
        return self.info

    def prepare(self, rid: str, p: Payload) -> tuple[str, bytes]:
        info = self.info
        body: dict[str, Any] = {}
        if info.interface == "ensemble":
            body.update(text_input=p.text, max_tokens=p.output_tokens)
            if "stream" in info.inputs:
                body["stream"] = True
        else:
            body.update(input_ids=list(p.ids), input_lengths=len(p.ids), request_output_len=p.output_tokens)
            if "streaming" in info.inputs:
                body["streaming"] = True
        if "min_tokens" in info.inputs:
            body["min_tokens"] = p.output_tokens
        if info.stamps:
            body["return_perf_metrics"] = True
        return rid, json.dumps(body).encode()

    def open(self, on_response: OnResponse, on_error: OnError) -> None:
        import aiohttp

        self._on_response, self._on_error = on_response, on_error
        self._loop = LoopThread("rtk-slo-http")
        self._tasks: set[asyncio.Task] = set()

        async def setup() -> None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout_s),
            )

        self._loop.start(setup)

    def submit(self, prepared) -> None:
        self._loop.call(self._spawn, prepared)

    def _spawn(self, prepared) -> None:
        task = self._loop.loop.create_task(self._one(*prepared))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _one(self, rid: str, body: bytes) -> None:
        import aiohttp

        url = f"{self.url}/v2/models/{self.model}/generate_stream"
        try:
            async with self._session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    self._on_error(rid, now_ns(), f"HTTP {resp.status}: {text.strip()[:500]}", status=resp.status)
                    return
                async for line in resp.content:
                    t = now_ns()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data.startswith(b'{"error"'):
                        self._on_error(rid, t, json.loads(data).get("error", data.decode(errors="replace")))
                        return
                    self._on_response(rid, t, data, False)
            self._on_response(rid, now_ns(), None, True)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            self._on_error(rid, now_ns(), f"HTTP stream failed: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        if not hasattr(self, "_loop"):
            return

        async def shutdown():
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._session.close()

        self._loop.stop(shutdown)
        del self._loop


class Replicas(Transport):
    """Several servers of the same model behind one transport (``--url`` given several times).

    ``round_robin`` sends each request to the next URL; ``least_loaded`` to the one with the fewest
    requests in flight from this client (ties in round-robin order).  A replica whose connection
    breaks fails only its own requests in flight and receives no more; the run fails as a whole
    only when every replica is gone.  :attr:`assigned` maps each request id to its replica.
    """

    def __init__(self, parts: list[Transport], balance: str = "round_robin"):
        if balance not in ("round_robin", "least_loaded"):
            raise UsageError(f"balance '{balance}' is not round_robin or least_loaded")
        first = parts[0]
        super().__init__(first.url, first.model, first.interface, first.timeout_s)
        self.name, self.parts, self.balance = first.name, parts, balance
        self.urls = [p.url for p in parts]
        self.inflight = [0] * len(parts)
        self.dead = [False] * len(parts)
        self.assigned: dict[str, int] = {}
        self._live: dict[str, int] = {}
        self._next = 0
        self._lock = threading.Lock()

    def model_info(self) -> ModelInfo:
        infos = [p.model_info() for p in self.parts]
        for p, info in zip(self.parts[1:], infos[1:], strict=True):
            if info.interface != infos[0].interface or info.inputs != infos[0].inputs:
                raise UsageError(
                    f"{p.url} serves '{info.name}' with another interface than {self.parts[0].url}; "
                    "every --url must serve the same model"
                )
        self.info = infos[0]
        self.model = self.info.name
        return self.info

    def open(self, on_response: OnResponse, on_error: OnError) -> None:
        def response(rid, t, payload, final):
            if final:
                self._release(rid)
            on_response(rid, t, payload, final)

        def error_of(i):
            def error(rid, t, message, status=None):
                if rid is not None:
                    self._release(rid)
                    on_error(rid, t, message, status=status)
                    return
                with self._lock:
                    self.dead[i] = True
                    lost = [r for r, j in self._live.items() if j == i]
                    everything = all(self.dead)
                for r in lost:
                    self._release(r)
                    on_error(r, t, f"{self.urls[i]}: {message}")
                if everything:
                    on_error(None, t, message)

            return error

        for i, p in enumerate(self.parts):
            p.open(response, error_of(i))

    def _release(self, rid: str) -> None:
        with self._lock:
            i = self._live.pop(rid, None)
            if i is not None:
                self.inflight[i] -= 1

    def prepare(self, rid: str, payload: Payload):
        return rid, self.parts[0].prepare(rid, payload)

    def _choose(self) -> int:
        n = len(self.parts)
        order = [(self._next + j) % n for j in range(n)]
        live = [i for i in order if not self.dead[i]] or order
        i = min(live, key=lambda j: self.inflight[j]) if self.balance == "least_loaded" else live[0]
        self._next = (i + 1) % n
        return i

    def submit(self, prepared) -> None:
        rid, inner = prepared
        with self._lock:
            i = self._choose()
            self.inflight[i] += 1
            self._live[rid] = i
            self.assigned[rid] = i
        self.parts[i].submit(inner)

    def close(self) -> None:
        for p in self.parts:
            p.close()


def make_transport(
    kind: str, url: str | list[str], model: str, interface: str, balance: str = "round_robin"
) -> Transport:
    """A transport to one server, or to several (a list of URLs) through :class:`Replicas`."""
    if isinstance(url, (list, tuple)):
        if len(url) > 1:
            return Replicas([make_transport(kind, u, model, interface) for u in url], balance)
        url = url[0]
    if kind == "grpc":
        return GrpcTransport(url.removeprefix("grpc://"), model, interface)
    if kind == "http":
        return HttpTransport(url, model, interface)
    if kind == "openai":
        from .openai_transport import OpenAITransport

        return OpenAITransport(url, model, interface)
    raise UsageError(f"unknown transport '{kind}'; use grpc, http or openai (slo.transport)")
