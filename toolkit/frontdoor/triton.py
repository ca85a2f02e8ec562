"""The primary tier over Triton's gRPC stream: the repository's ``tensorrt_llm`` model (token ids, the text
side done in the front door: tokens.py), its ``ensemble`` (or ``tensorrt_llm_bls``), or the llmapi model.

Each request has a ``ModelStreamInfer`` call of its own on a shared ``grpc.aio`` channel, so a request
can be cancelled on its own: cancelling the call makes Triton mark the request cancelled, and the cpu
``tensorrt_llm`` model then cancels it in the engine, which frees its KV blocks (docs/serving.md,
Cancellation).  Opening a call costs a round of HTTP/2 and Triton's stream set-up, so a call whose
request ended normally is kept open and the next request is written to it (:class:`StreamPool`);
a cancelled or failed call is never reused.  Inputs the model does not declare are never sent; a
request that needs one is refused with 400 naming the field.  Health and the engine's gauges are
polled in the background; the gauges are read over one kept-alive HTTP/1.1 connection with h11
(:class:`MetricsReader`), not httpx's client, which took ~2.8 ms of the event loop per read, 10 reads a
second.
"""

from __future__ import annotations

import asyncio
import re
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from ..triton.wire import bytes_elements, bytes_tensor
from .protocol import APIError, GenRequest, bad

GAUGE = re.compile(r"^(nv_trt_llm_(?:request|kv_cache_block)_metrics)\{([^}]*)\}\s+([0-9.eE+-]+)", re.MULTILINE)
OVERLOAD = ("Exceeds maximum queue size", "Request timeout expired")
LLMAPI_MARK = "sampling_param_max_tokens"  # an input only TensorRT-LLM's llmapi model declares
IDS_MARK = "input_ids"  # the tensorrt_llm model's prompt: token ids


@dataclass
class Piece:
    """One response of the stream: new text, and on the last one the token counts."""

    text: str
    final: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    logprobs: list[float] | None = None  # the log-probabilities of this response's new tokens
    finish_reason: str | None = None  # what the model says ended it (llmapi's finish_reason)


class TritonRefused(Exception):
    """Triton answered the request with an error before its first token.  ``unreachable``: the server was not
    reached at all (the gRPC call failed with UNAVAILABLE), so the request can go to another replica."""

    def __init__(self, message: str, overload: bool, unreachable: bool = False):
        super().__init__(message)
        self.overload = overload
        self.unreachable = unreachable


@dataclass
class EngineGauges:
    """``nv_trt_llm_request_metrics`` / ``nv_trt_llm_kv_cache_block_metrics`` summed over instances."""

    active: int = 0
    waiting: int = 0
    scheduled: int = 0
    max_batch: int = 0
    kv_free: int = 0
    kv_max: int = 0
    read_at: float = 0.0
    present: bool = False
    by_instance: dict = field(default_factory=dict)


def parse_gauges(text: str) -> EngineGauges:
    g = EngineGauges(read_at=time.monotonic())
    for name, labels, value in GAUGE.findall(text):
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        v = int(float(value))
        g.present = True
        if name == "nv_trt_llm_request_metrics":
            key = {"active": "active", "waiting": "waiting", "scheduled": "scheduled", "max": "max_batch"}.get(
                lab.get("request_type")
            )
        else:
            key = {"free": "kv_free", "max": "kv_max"}.get(lab.get("kv_cache_block_type"))
        if key:
            setattr(g, key, getattr(g, key) + v)
    return g


class MetricsReader:
    """``GET`` of Triton's metrics text on one kept-alive HTTP/1.1 connection: asyncio streams for the
    bytes, h11 (the HTTP/1.1 state machine under httpx and uvicorn) for the protocol.

    The gauges are read every ``metrics_poll_ms`` (100 ms by default) for as long as the front door runs;
    httpx's client spent ~2.8 ms of the event loop per read (its connection pool, anyio events, a failed
    ``import sniffio`` per request), about 28 ms of CPU a second taken from the engine's cores on a CPU
    target; this reads the same text for a small fraction of that.  One read at a time (the poller's)."""

    def __init__(self, url: str, timeout_s: float):
        from urllib.parse import urlsplit

        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"not an http:// URL: {url!r}")
        self.host, self.port, self.timeout_s = u.hostname, u.port or 80, timeout_s
        self.target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        self.headers = [("Host", u.netloc), ("Accept", "text/plain")]
        self._conn: tuple | None = None  # (reader, writer, h11.Connection)

    async def text(self) -> str:
        async with asyncio.timeout(self.timeout_s):
            while True:
                reused = self._conn is not None
                try:
                    if self._conn is None:
                        import h11

                        self._conn = (*await asyncio.open_connection(self.host, self.port), h11.Connection(h11.CLIENT))
                    code, body = await self._get(*self._conn)
                    break
                except (OSError, EOFError):
                    self.close()
                    if not reused:
                        raise
                    # The server closed the kept connection meanwhile: once more on a new one.
                except BaseException:
                    self.close()  # a timeout, a cancel or a protocol error mid-answer: its state is unknown
                    raise
        if code != 200:
            raise OSError(f"the metrics server answered {code}")
        return body.decode("utf-8", "replace")

    async def _get(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, http) -> tuple[int, bytes]:
        import h11

        writer.write(http.send(h11.Request(method="GET", target=self.target, headers=self.headers)))
        writer.write(http.send(h11.EndOfMessage()))
        code, parts = 0, []
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                if not data and not code:
                    raise EOFError("the metrics server closed the connection")
                http.receive_data(data)  # b"" ends a body delimited by the connection's close
            elif isinstance(event, h11.Response):
                code = event.status_code
            elif isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise EOFError("the metrics server closed the connection")
        if http.our_state is h11.DONE and http.their_state is h11.DONE:
            http.start_next_cycle()  # kept alive for the next read
        else:
            self.close()  # the server said Connection: close, or ended the body by closing
        return code, b"".join(parts)

    def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


_PACK = {"BOOL": "?", "INT32": "i", "UINT64": "Q", "FP32": "f"}


def raw_tensor(datatype: str, values: list) -> bytes:
    """The raw contents of a tensor of ``values`` as Triton reads them: little-endian scalars, or BYTES."""
    if datatype == "BYTES":
        return bytes_tensor(values)
    return struct.pack(f"<{len(values)}{_PACK[datatype]}", *values)


class TritonBackend:
    def __init__(self, grpc_url: str, model: str = "ensemble", metrics_url: str | None = None, timeout_s: float = 5.0):
        self.grpc_url, self.model, self.metrics_url, self.timeout_s = (
            grpc_url.removeprefix("grpc://"),
            model,
            metrics_url,
            timeout_s,
        )
        self.inputs: set[str] = set()
        self.outputs: set[str] = set()
        self.batched = True
        # "ensemble" (text in and out), "llmapi" (TensorRT-LLM's llmapi model: sampling_param_* inputs) or
        # "tensorrt_llm" (token ids in and out: the front door tokenises with ``prompts``)
        self.interface = "ensemble"
        self.prompts = None  # tokens.PromptRules, for the tensorrt_llm interface
        self.ready = False
        self.ready_reason = "not checked yet"
        self.gauges = EngineGauges()
        self._channel = None
        self.pool: StreamPool | None = None
        self._metrics: MetricsReader | None = None

    async def open(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self._channel = grpc.aio.insecure_channel(self.grpc_url, options=opts)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self.pool = StreamPool(self._stub)
        await self.check_health()

    async def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self.pool is not None:
            self.pool.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def check_health(self) -> bool:
        """Ready when Triton and the model are ready; reads the model's interface the first time."""
        import grpc
        from google.protobuf import json_format
        from tritonclient.grpc import service_pb2 as pb

        try:
            if not (await self._stub.ServerReady(pb.ServerReadyRequest(), timeout=self.timeout_s)).ready:
                return self._not_ready("tritonserver is not ready")
            if not (await self._stub.ModelReady(pb.ModelReadyRequest(name=self.model), timeout=self.timeout_s)).ready:
                return self._not_ready(f"model '{self.model}' is not ready")
            if not self.inputs:
                cfg = (
                    await self._stub.ModelConfig(pb.ModelConfigRequest(name=self.model), timeout=self.timeout_s)
                ).config
                d = json_format.MessageToDict(cfg, preserving_proto_field_name=True)
                self.inputs = {i["name"] for i in d.get("input", [])}
                self.outputs = {o["name"] for o in d.get("output", [])}
                self.batched = int(d.get("max_batch_size") or 0) > 0
                self.interface = (
                    "llmapi"
                    if LLMAPI_MARK in self.inputs
                    else "tensorrt_llm"
                    if IDS_MARK in self.inputs
                    else "ensemble"
                )
        except grpc.aio.AioRpcError as exc:
            return self._not_ready(f"tritonserver at {self.grpc_url} does not answer: {exc.code().name}")
        self.ready, self.ready_reason = True, "ready"
        return True

    def _not_ready(self, reason: str) -> bool:
        """Not ready: no new request goes here, and the idle gRPC calls are closed (a tritonserver that is shutting
        down waits for its open streams before it exits)."""
        self.ready, self.ready_reason = False, reason
        if self.pool is not None:
            self.pool.close()
        return False

    def mark_unreachable(self, reason: str) -> None:
        """A request could not reach this server: not ready until a health check says otherwise."""
        self._not_ready(f"tritonserver at {self.grpc_url} could not be reached: {reason}")

    async def read_gauges(self, client=None) -> None:
        """Read the engine's gauges from Triton's metrics endpoint: over :class:`MetricsReader`'s connection, or
        with ``client`` (an httpx.AsyncClient) for a URL that is not plain ``http://``."""
        if not self.metrics_url:
            return
        try:
            url = self.metrics_url.rstrip("/")
            url = url if url.endswith("/metrics") else url + "/metrics"
            if url.startswith("http://"):
                if self._metrics is None:
                    self._metrics = MetricsReader(url, self.timeout_s)
                text = await self._metrics.text()
            else:
                text = (await client.get(url, timeout=self.timeout_s)).text
            self.gauges = parse_gauges(text)
        except Exception:  # noqa: BLE001 — the next poll retries; until then the front door counts alone
            self.gauges = EngineGauges(read_at=time.monotonic())

    # -- a request ------------------------------------------------------------------------------
    def build(self, req: GenRequest):
        from tritonclient.grpc import service_pb2 as pb

        msg = pb.ModelInferRequest(model_name=self.model, id=req.id)
        if self.interface == "llmapi":
            return self._build_llmapi(req, msg)

        batch = [1] if self.batched else []

        def add(name, datatype, value):
            """A scalar (shape [1]) or a list (shape [n]: the ensemble's ``stop_words`` has dims [-1]), with the batch
            dimension when the model has one."""
            values = value if isinstance(value, list) else [value]
            shape = [*batch, len(values)] if isinstance(value, list) else [*batch, 1]
            msg.inputs.add(name=name, datatype=datatype, shape=shape)
            msg.raw_input_contents.append(raw_tensor(datatype, values))

        def optional(name, field_name, wanted):
            if wanted and name not in self.inputs:
                raise bad(
                    field_name, f"is not supported by this deployment (its model has no '{name}' input); leave it unset"
                )
            return wanted

        add("text_input", "BYTES", req.text_input().encode("utf-8"))
        add("max_tokens", "INT32", req.max_tokens)
        if "stream" in self.inputs:
            add("stream", "BOOL", True)
        if "exclude_input_in_output" in self.inputs:
            add("exclude_input_in_output", "BOOL", True)
        for name in ("return_num_input_tokens", "return_num_output_tokens"):
            if name in self.inputs:
                add(name, "BOOL", True)
        if req.temperature:
            # Greedy is what the engine does when no sampling input is sent (TensorRT-LLM's rule).
            if optional("temperature", "temperature", True):
                add("temperature", "FP32", req.temperature)
            if optional("top_p", "top_p", req.top_p < 1.0):
                add("top_p", "FP32", req.top_p)
            if optional("top_k", "top_k", bool(req.top_k)):
                add("top_k", "INT32", req.top_k)
            if optional("seed", "seed", req.seed is not None):
                add("seed", "UINT64", req.seed)
        if optional("stop_words", "stop", bool(req.stop)):
            add("stop_words", "BYTES", [s.encode() for s in req.stop])
        if optional("end_id", "ignore_eos", req.ignore_eos):
            add("end_id", "INT32", -1)  # no end token: exactly max_tokens tokens
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(req, name)
            if optional(name, name, v != 0.0):
                add(name, "FP32", v)
        if req.logprobs:
            # TensorRT-LLM's return_log_probs: output_log_probs holds each response's new tokens' log-probs.
            if not ("return_log_probs" in self.inputs and "output_log_probs" in self.outputs):
                raise bad("logprobs", "is not supported by this deployment (its model returns no log-probabilities)")
            add("return_log_probs", "BOOL", True)
        for name in ("text_output", "num_input_tokens", "num_output_tokens"):
            if name in self.outputs:
                msg.outputs.add(name=name)
        if req.logprobs:
            msg.outputs.add(name="output_log_probs")
        msg.parameters["triton_enable_empty_final_response"].bool_param = True
        return msg

    def _build_llmapi(self, req: GenRequest, msg):
        """TensorRT-LLM's llmapi model (NVIDIA/TensorRT-LLM ``triton_backend/all_models/llmapi/tensorrt_llm/1/``,
        model.py b35ac1b, helpers.py fab2f90): ``text_input[0]`` is the prompt as is (the chat is rendered
        by the front door, :attr:`GenRequest.rendered`), each ``sampling_param_X`` scalar becomes
        ``SamplingParams(X=...)``, ``sampling_param_stop`` the stop strings, ``streaming`` streams.  Its
        max_batch_size is 0, so tensors carry no batch dimension: scalars have shape [1]."""

        def add(name, datatype, values, field_name):
            if name not in self.inputs:
                raise bad(
                    field_name, f"is not supported by this deployment (its model has no '{name}' input); leave it unset"
                )
            shape = [1, len(values)] if self.batched else [len(values)]
            msg.inputs.add(name=name, datatype=datatype, shape=shape)
            msg.raw_input_contents.append(raw_tensor(datatype, values))

        where = "messages" if req.kind == "chat" else "prompt"
        add("text_input", "BYTES", [req.text_input().encode("utf-8")], where)
        add("streaming", "BOOL", [True], "stream")
        add("sampling_param_max_tokens", "INT32", [req.max_tokens], "max_tokens")
        if req.temperature is not None:  # else the LLM API's default sampling
            add("sampling_param_temperature", "FP32", [req.temperature], "temperature")
        if req.top_p < 1.0:
            add("sampling_param_top_p", "FP32", [req.top_p], "top_p")
        if req.top_k:
            add("sampling_param_top_k", "INT32", [req.top_k], "top_k")
        if req.seed is not None:
            add("sampling_param_seed", "UINT64", [req.seed], "seed")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(req, name)
            if v != 0.0:
                add(f"sampling_param_{name}", "FP32", [v], name)
        if req.stop:
            add("sampling_param_stop", "BYTES", [x.encode() for x in req.stop], "stop")
        if req.ignore_eos:
            raise bad("ignore_eos", "is not supported by the llmapi model (it has no input for it); leave it unset")
        if req.logprobs:
            raise bad(
                "logprobs",
                "is not supported by the llmapi model (it returns only cumulative_logprob, no per-token "
                "log-probabilities); leave it unset",
            )
        if "return_finish_reason" in self.inputs:
            add("return_finish_reason", "BOOL", [True], "stream")
        for name in ("text_output", "finish_reason"):
            if name in self.outputs:
                msg.outputs.add(name=name)
        msg.parameters["triton_enable_empty_final_response"].bool_param = True
        return msg

    def stream(self, req: GenRequest, ids: list[int] | None = None) -> TritonStream:
        """``req`` on its own gRPC call; ``ids``: its prompt's token ids when the caller already made them
        (``prompts.prompt_ids``), for the ``tensorrt_llm`` interface."""
        if self.interface == "tensorrt_llm":
            from .tokens import IdsText, ids_request

            if self.prompts is None:
                raise APIError(
                    503,
                    f"the '{self.model}' model takes token ids and this front door has no tokenizer for it; "
                    "serve the repository's ensemble (serving.frontend.primary_model: ensemble)",
                    kind="server_error",
                    code="unavailable",
                )
            ids = ids if ids is not None else self.prompts.prompt_ids(req)
            tokens = self.prompts.tokens
            return TritonStream(self, ids_request(self, req, ids, tokens), IdsText(tokens, ids))
        return TritonStream(self, self.build(req))


class StreamPool:
    """Open ``ModelStreamInfer`` calls with no request on them, reused by the next request.

    Triton answers the requests of one call in order and ends each with a final response
    (``triton_enable_empty_final_response``), so a call whose request has ended is clean.  At most
    ``max_idle`` calls are kept; a call Triton or the network has closed is dropped when taken.
    """

    def __init__(self, stub, max_idle: int = 16):
        self.stub, self.max_idle = stub, max_idle
        self.idle: list = []
        self.opened = 0  # calls opened (for tests: reuse keeps this low)

    def take(self):
        while self.idle:
            call = self.idle.pop()
            if not call.done():
                return call, True
        self.opened += 1
        return self.stub.ModelStreamInfer(), False

    def give_back(self, call) -> None:
        if len(self.idle) < self.max_idle and not call.done():
            self.idle.append(call)
        else:
            call.cancel()  # no request on it: nothing to cancel in Triton, the call just ends

    def close(self) -> None:
        while self.idle:
            self.idle.pop().cancel()


class TritonStream:
    """One request's responses; :meth:`cancel` ends it in Triton (and the engine frees its KV)."""

    def __init__(self, backend: TritonBackend, msg, ids_text=None):
        self.pool, self.msg = backend.pool, msg
        self.ids_text = ids_text  # tokens.IdsText: responses carry token ids (the tensorrt_llm interface)
        # llmapi's text_output is the whole text so far (TensorRT-LLM's CompletionOutput.text; the model sends
        # it, not text_diff: NVIDIA/TensorRT-LLM tensorrt_llm/executor/result.py a678b91): the new text is
        # what follows the text already seen.
        self._cumulative = backend.interface == "llmapi"
        self._seen = ""
        self.call, self._reused = self.pool.take()
        self._sent = False
        self._ended = False  # Triton sent the request's final response: the call is clean
        self.finished = False

    async def _send(self) -> None:
        import grpc

        self._sent = True
        try:
            await self.call.write(self.msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            if not self._reused:
                raise
            self.call.cancel()  # a kept call that was closed meanwhile: once more on a new one
            self.call, self._reused = self.pool.take()[0], False
            await self.call.write(self.msg)

    async def raw(self):
        """The next ``ModelStreamInferResponse``; StopAsyncIteration when the call ended first."""
        import grpc

        if not self._sent:
            await self._send()
        resp = await self.call.read()
        if resp is grpc.aio.EOF:
            raise StopAsyncIteration
        if not resp.error_message:
            p = resp.infer_response.parameters.get("triton_final_response")
            self._ended = p is not None and p.bool_param
        return resp

    @property
    def _it(self):
        return self  # ``await stream._it.__anext__()``: the raw responses

    async def __anext__(self):
        return await self.raw()

    async def next(self) -> Piece:
        import grpc

        try:
            resp = await self.raw()
        except StopAsyncIteration:
            self.finished = True
            raise TritonRefused("the stream ended without a final response", overload=False) from None
        except grpc.aio.AioRpcError as exc:
            self.finished = True
            code = exc.code()
            overload = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
            unreachable = code == grpc.StatusCode.UNAVAILABLE
            raise TritonRefused(f"{code.name}: {exc.details()}", overload=overload, unreachable=unreachable) from None
        except asyncio.InvalidStateError:  # a new call that failed before the request was written to it
            self.finished = True
            raise TritonRefused(
                "UNAVAILABLE: the gRPC call ended before the request was sent", overload=True, unreachable=True
            ) from None
        if resp.error_message:
            self.close()
            raise TritonRefused(resp.error_message, overload=any(s in resp.error_message for s in OVERLOAD))
        r = resp.infer_response
        raws = r.raw_output_contents
        if self.ids_text is not None:
            ids = self.ids_text
            text, logprobs = ids.text(r.outputs, raws)
            piece = Piece(text, self._ended, ids.prompt_tokens, len(ids.generated), logprobs)
            if piece.final:
                self.close()
            return piece
        piece = Piece("", final=self._ended)
        for i, o in enumerate(r.outputs):
            name = o.name
            if name == "text_output":
                raw = raws[i]
                # One BYTES element: a 4-byte length, then the text (tritonclient's serialize_byte_tensor).
                if len(raw) >= 4 and int.from_bytes(raw[:4], "little") == len(raw) - 4:
                    piece.text = raw[4:].decode("utf-8", "replace")
                else:
                    piece.text = "".join(x.decode("utf-8", "replace") for x in bytes_elements(raw))
            elif name == "num_input_tokens":
                piece.prompt_tokens = int.from_bytes(raws[i][:4], "little", signed=True)
            elif name == "num_output_tokens":
                piece.completion_tokens = int.from_bytes(raws[i][:4], "little", signed=True)
            elif name == "output_log_probs":
                piece.logprobs = np.frombuffer(raws[i], dtype=np.float32).tolist()
            elif name == "finish_reason":
                reasons = bytes_elements(raws[i])
                reason = reasons[0].decode("utf-8", "replace") if len(reasons) else ""
                piece.finish_reason = reason if reason not in ("", "None") else None
        if self._cumulative:
            full = piece.text
            piece.text = full[len(self._seen) :] if full.startswith(self._seen) else full
            self._seen = full
        if piece.final:
            self.close()
        return piece

    def close(self) -> None:
        """Done with the request: an ended one's call goes back to the pool, any other is cancelled
        (an error response, or responses still to come, must not reach the next request)."""
        if self.finished:
            return
        self.finished = True
        if self._ended:
            self.pool.give_back(self.call)
        else:
            self.call.cancel()

    def cancel(self) -> None:
        self.close()


# What rtk's preprocessing and cpu engine say when the request, not the server, is at fault (Triton's
# stream carries only the message, not the status code), and the field it is about.
CLIENT_FAULTS = (
    ("context window", "{prompt}"),
    ("chat message", "messages"),
    ("text_input is empty", "{prompt}"),
    ("max_tokens", "max_tokens"),
    ("request_output_len", "max_tokens"),
    ("is not supported by", None),
    ("unexpected inference input", None),
    ("end_id", None),
    ("stop sequence", "stop"),
)


def classify_refusal(exc: TritonRefused, req: GenRequest) -> APIError:
    """Triton's error before the first token → 400 naming the field when the request is at fault, else 502."""
    text = str(exc)
    for marker, field_name in CLIENT_FAULTS:
        if marker in text:
            if field_name == "{prompt}":
                field_name = "messages" if req.kind == "chat" else "prompt"
            where = f"'{field_name}': " if field_name else ""
            return APIError(400, f"{where}{text}", param=field_name, code="invalid_value")
    return APIError(502, f"the model failed: {text}", kind="server_error", code="upstream_error")
