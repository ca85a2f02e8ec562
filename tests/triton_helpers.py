"""Helpers for tests that start a real tritonserver.

* :func:`write_python_model` writes a python-backend model (``config.pbtxt`` built through Triton's
  ModelConfig protobuf schema, ``1/model.py``) into a repository directory.
* :func:`write_fake_llm` writes a deterministic decoupled "LLM" with the interface of either the
  TensorRT-LLM ``ensemble`` (text in, text out) or the ``tensorrt_llm`` model (ids in, ids out).  Its
  time to first token and inter-token delay come from model parameters; it can serve requests one
  at a time and stall once, for coordinated-omission tests.  It is a stand-in for an engine, not
  for Triton: the server, the protocol and the client are real.
* :func:`running_server` starts a server on free ports and stops it afterwards.
"""

from __future__ import annotations

import contextlib
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

from toolkit.errors import ServerError
from toolkit.triton.server import TritonServer

# Triton dtype names -> ModelConfig DataType enum names.
_TYPES = {
    "BOOL": "TYPE_BOOL",
    "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64",
    "FP32": "TYPE_FP32",
    "STRING": "TYPE_STRING",
    "UINT64": "TYPE_UINT64",
}


def model_config_text(
    name: str,
    inputs: list[tuple],
    outputs: list[tuple],
    *,
    backend: str = "python",
    max_batch_size: int = 0,
    decoupled: bool = False,
    instance_count: int = 1,
    parameters: dict[str, str] | None = None,
) -> str:
    """A config.pbtxt built through tritonclient's ModelConfig protobuf; tensors are
    ``(name, dtype, dims)`` or ``(name, dtype, dims, optional)``."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    cfg = mc.ModelConfig(name=name, backend=backend, max_batch_size=max_batch_size)
    for t in inputs:
        tname, dtype, dims, *opt = t
        cfg.input.add(
            name=tname, data_type=mc.DataType.Value(_TYPES[dtype]), dims=list(dims), optional=bool(opt and opt[0])
        )
    for tname, dtype, dims in outputs:
        cfg.output.add(name=tname, data_type=mc.DataType.Value(_TYPES[dtype]), dims=list(dims))
    cfg.instance_group.add(count=instance_count, kind=mc.ModelInstanceGroup.KIND_CPU)
    if decoupled:
        cfg.model_transaction_policy.decoupled = True
    for k, v in (parameters or {}).items():
        cfg.parameters[k].string_value = str(v)
    text = text_format.MessageToString(cfg)
    text_format.Parse(text, mc.ModelConfig())  # parse back as a check
    return text


def write_python_model(repo: Path, name: str, model_py: str, config_text: str) -> Path:
    d = Path(repo) / name
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "config.pbtxt").write_text(config_text)
    (d / "1" / "model.py").write_text(textwrap.dedent(model_py))
    return d


ECHO_MODEL_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", (x * 2).astype(np.int32))]))
        return out
"""


def write_echo_model(repo: Path, name: str = "echo") -> Path:
    """A trivial non-decoupled model: OUT = 2 * IN (INT32[-1])."""
    cfg = model_config_text(name, [("IN", "INT32", [-1])], [("OUT", "INT32", [-1])])
    return write_python_model(repo, name, ECHO_MODEL_PY, cfg)


FAKE_LLM_MODEL_PY = '''
"""Deterministic decoupled fake LLM for rtk's tests (see tests/triton_helpers.py)."""
import json
import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _opt(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy().reshape(-1)[0]


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        self.ttft_s = float(params.get("ttft_ms", "0")) / 1e3
        self.itl_s = float(params.get("itl_ms", "0")) / 1e3
        self.interface = params.get("interface", "ensemble")
        self.serial = params.get("serial", "0") == "1"
        self.stall_at = int(params.get("stall_at_request", "-1"))
        self.stall_s = float(params.get("stall_ms", "0")) / 1e3
        self.stall_every = int(params.get("stall_every", "0"))
        self.fail_every = int(params.get("fail_every", "0"))
        self.count = 0
        self.lock = threading.Lock()
        self.work = queue.Queue()
        if self.serial:
            threading.Thread(target=self._worker, daemon=True).start()

    def _worker(self):
        while True:
            item = self.work.get()
            if item is None:
                return
            self._generate(*item)

    def execute(self, requests):
        now = time.time_ns()
        for r in requests:
            with self.lock:
                index, self.count = self.count, self.count + 1
            if self.serial:
                self.work.put((r, now, index))
            else:
                threading.Thread(target=self._generate, args=(r, now, index), daemon=True).start()
        return None

    def _generate(self, request, arrival_ns, index):
        sender = request.get_response_sender()
        try:
            if self.interface == "ensemble":
                n = int(_opt(request, "max_tokens", 16))
                stream = bool(_opt(request, "stream", False))
                raw = _opt(request, "text_input", b"")
                prompt_len = len((raw.decode() if isinstance(raw, bytes) else str(raw)).split())
            else:
                n = int(_opt(request, "request_output_len", 16))
                stream = bool(_opt(request, "streaming", False))
                prompt_len = int(_opt(request, "input_lengths", 0))
            perf = bool(_opt(request, "return_perf_metrics", False))
            # Only requested outputs: tritonserver 2.51's python backend frees the others without the GIL
            # (toolkit/triton/models/rtk_text.py, requested_outputs), which breaks the stub when threads run.
            want = set(request.requested_output_names())
            if self.fail_every and index % self.fail_every == self.fail_every - 1:
                raise RuntimeError(f"request {index} fails on purpose (fail_every={self.fail_every})")
            if index == self.stall_at or (self.stall_every and index % self.stall_every == self.stall_every - 1):
                time.sleep(self.stall_s)
            start = time.perf_counter()
            scheduled_ns = time.time_ns()
            stamps = {
                "arrival_time_ns": arrival_ns,
                "first_scheduled_time_ns": scheduled_ns,
                "first_token_time_ns": 0,
                "last_token_time_ns": 0,
            }
            tokens = []
            for i in range(n):
                delay = start + self.ttft_s + i * self.itl_s - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                if sender.is_cancelled():
                    sender.send(flags=FINAL)
                    return
                now_ns = time.time_ns()
                stamps["first_token_time_ns"] = stamps["first_token_time_ns"] or now_ns
                stamps["last_token_time_ns"] = now_ns
                tokens.append(1000 + (prompt_len + i) % 1000)
                if stream:
                    sender.send(self._response(want, [tokens[-1]], stamps if perf else None))
            if stream:
                sender.send(flags=FINAL)
            else:
                sender.send(self._response(want, tokens, stamps if perf else None), flags=FINAL)
        except Exception as exc:  # report instead of leaving the client waiting
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"fake_llm: {exc}")), flags=FINAL)

    def _response(self, want, tokens, stamps):
        if self.interface == "ensemble":
            text = "".join(f" tok{t}" for t in tokens)
            outs = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
        else:
            outs = [
                pb_utils.Tensor("output_ids", np.array([tokens], dtype=np.int32)),
                pb_utils.Tensor("sequence_length", np.array([len(tokens)], dtype=np.int32)),
            ]
        for k, v in (stamps or {}).items():
            outs.append(pb_utils.Tensor(k, np.array([v], dtype=np.int64)))
        return pb_utils.InferenceResponse([t for t in outs if t.name() in want])

    def finalize(self):
        self.work.put(None)
'''

_STAMPS = [
    (n, "INT64", [1])
    for n in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
]


def write_fake_llm(
    repo: Path,
    name: str,
    *,
    interface: str = "ensemble",
    ttft_ms: float = 0.0,
    itl_ms: float = 0.0,
    serial: bool = False,
    stall_at_request: int = -1,
    stall_ms: float = 0.0,
    stall_every: int = 0,
    fail_every: int = 0,
    max_batch_size: int = 8,
) -> Path:
    """A decoupled fake LLM with the ensemble or tensorrt_llm tensor interface.

    Token i of a request is sent at ``start + ttft_ms + i * itl_ms`` (absolute deadlines, so delays
    do not accumulate).  ``serial``: one request at a time, in arrival order; request number
    ``stall_at_request`` (0-based, counting every request the model sees) first sleeps ``stall_ms``, and so does
    every ``stall_every``-th request.
    ``fail_every``: every n-th request gets an error response instead of tokens.
    """
    if interface == "ensemble":
        inputs = [
            ("text_input", "STRING", [1]),
            ("max_tokens", "INT32", [1]),
            ("stream", "BOOL", [1], True),
            ("min_tokens", "INT32", [1], True),
            ("return_perf_metrics", "BOOL", [1], True),
        ]
        outputs = [("text_output", "STRING", [-1])] + _STAMPS
    elif interface == "tensorrt_llm":
        inputs = [
            ("input_ids", "INT32", [-1]),
            ("input_lengths", "INT32", [1]),
            ("request_output_len", "INT32", [1]),
            ("streaming", "BOOL", [1], True),
            ("end_id", "INT32", [1], True),
            ("pad_id", "INT32", [1], True),
            ("return_perf_metrics", "BOOL", [1], True),
        ]
        outputs = [("output_ids", "INT32", [-1, -1]), ("sequence_length", "INT32", [-1])] + _STAMPS
    else:
        raise ValueError(interface)
    params = dict(
        interface=interface,
        ttft_ms=ttft_ms,
        itl_ms=itl_ms,
        serial="1" if serial else "0",
        stall_at_request=stall_at_request,
        stall_ms=stall_ms,
        stall_every=stall_every,
        fail_every=fail_every,
    )
    cfg = model_config_text(name, inputs, outputs, max_batch_size=max_batch_size, decoupled=True, parameters=params)
    return write_python_model(repo, name, FAKE_LLM_MODEL_PY, cfg)


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists (signal 0 reaches it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def running_server(repo: Path, *, ready_timeout_s: float = 60.0, attempts: int = 3, **kwargs) -> Iterator[TritonServer]:
    """A tritonserver on ``repo`` bound to 127.0.0.1 on free ports; retried when a port race is lost."""
    for attempt in range(attempts):
        server = TritonServer(repo, exit_timeout_s=2, ready_timeout_s=ready_timeout_s, **kwargs)
        try:
            server.__enter__()
        except ServerError as exc:
            if attempt + 1 < attempts and ("already in use" in str(exc) or "Address already in use" in str(exc)):
                continue
            raise
        break
    try:
        yield server
    finally:
        server.stop()


def model_successes(http_url: str, model: str) -> int:
    """Requests ``model`` answered, from Triton's statistics extension (``/v2/models/NAME/stats``).  Its
    ``nv_inference_request_success`` metric is not used: it read 0 here for requests sent straight to the cpu
    ``tensorrt_llm`` model (a decoupled python model) over gRPC, while the statistics counted them."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"{http_url}/v2/models/{model}/stats", timeout=10) as r:
        stats = json.loads(r.read())
    return sum(int(m["inference_stats"]["success"]["count"]) for m in stats["model_stats"])


def processes_naming(path: Path) -> list[int]:
    """The processes on this host whose command line names ``path`` (a repository's tritonserver and its
    python stubs)."""
    needle = str(Path(path).resolve()).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return found
