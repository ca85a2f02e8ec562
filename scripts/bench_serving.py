#!/usr/bin/env python
"""What Triton adds to rtk's CPU engine: TTFT and ITL through Triton vs calling the engine directly.

    python scripts/bench_serving.py triton_repo/smollm2-cpu [--requests 24] [--concurrency 1 8]
        [--paths engine tensorrt_llm tensorrt_llm-aio ensemble frontdoor frontdoor-ensemble]
        [--compare-frontdoor DIR]

For each concurrency level the same closed-loop workload (every stream sends its next request when
the previous one ends; the same chat prompt, greedy, no end token so every answer has exactly
``--output-tokens`` tokens) runs three ways:

* ``engine``       — the repository's engine in this process (BackgroundEngine, callback per token),
  with the served thread policy (``load_engine(served=True)``); each stream's next request is submitted from the
  last token's callback, on the engine's thread, so it always joins the very next step;
* ``engine-client`` — the same engine driven as a client drives a server: each stream is a thread that sends its
  next request once its last token has arrived, so (as through Triton) a request can arrive while a step runs and
  wait for it.  Against ``engine`` this is the cost of the arrival's phase, not of any transport;
* ``tensorrt_llm`` — Triton's ``tensorrt_llm`` model over streaming gRPC (token ids in and out), through
  tritonclient (its stream thread, an ``InferResult`` and numpy arrays per message);
* ``tensorrt_llm-aio`` — the same prompts to the same model as the front door sends them: through ``grpc.aio``
  (toolkit/frontdoor/triton.py: kept-open calls, tensors packed with ``struct``, responses read as bytes) on an
  event loop in a thread of its own (the front door's kind: uvloop's where it is installed; ``--client-loop``), asking
  for ``output_ids`` and ``sequence_length`` only (the gRPC paths above ask for no output by name, so each response
  carries every output the model has: ~15 tensors made per token, the perf metrics among them for the TTFT split);
  Triton's hops with a client whose CPU per token is a lean client's (on a shared host the client's CPU is taken
  from the engine as the server's is), no TTFT split;
* ``ensemble``     — Triton's ``ensemble`` over streaming gRPC (text in, text out: + pre/postprocessing);
* ``frontdoor``    — rtk's OpenAI-compatible front door (its own process, ``python -m toolkit.frontdoor``)
  as served by default: ``/v1/chat/completions`` SSE, ``ignore_eos``, sent as token ids straight to
  ``tensorrt_llm`` (the front door tokenises and detokenises);
* ``frontdoor-ensemble`` — the same front door through the ensemble (``serving.frontend.primary_model:
  ensemble``).  Both front doors' TTFT and ITL are also given as added ms against the gRPC paths
  (``tensorrt_llm`` and ``tensorrt_llm-aio``: token ids, no text at all; ``ensemble``: text in and out), with the
  front door process's CPU time per request and per token (from /proc: on a shared host that CPU is taken from the
  engine), and this process's own CPU per token on every path (the client's: tritonclient's gRPC stream, or the
  lean ``grpc.aio`` client that the front door itself is towards Triton).
  The client is a minimal HTTP/1.1 reader on a kept-alive socket (TCP_NODELAY), so that the client's
  own parsing costs about what tritonclient's does on the gRPC paths;
* ``frontdoor@NAME`` — with ``--compare-frontdoor DIR``: the same front door started from another
  checkout of rtk (``git archive COMMIT toolkit | tar -x -C DIR``), for before/after in one run.

Both engines are loaded (the server's by tritonserver from toolkit/triton/server.py, on free ports) but
only one path runs at a time: the paths take turns, ``--rounds`` times per level, so drift of a
shared host falls on each path alike.  On the ``tensorrt_llm`` path the model's own time stamps
also split TTFT into engine time and Triton's share (send → execute, first token → client; same
host clock).  TTFT is measured from the request's send to its first token
(response); ITL is every gap between consecutive tokens (responses).  Printed: medians and p90 in
ms, and the ratios / added ms against ``engine`` from the same run.  The first ``--warmup``
requests of each path and level are not measured.  Each path's CPU per streamed token is split by where it ran:
this process (the client), tritonserver, and the ``tensorrt_llm`` stub's engine threads, response senders and other
threads (told apart by the thread names the served model gives them, toolkit/runtime/os_threads.py), so what a
served token costs the engine's cores besides the engine's own work is read, not inferred.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import queue
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "toolkit/triton/models"))

from toolkit.runtime.os_threads import cpu_seconds

QUESTION = "Explain in a few sentences why the sky is blue."
PATHS = ("engine", "engine-client", "tensorrt_llm", "tensorrt_llm-aio", "ensemble", "frontdoor", "frontdoor-ensemble")
FRONTDOOR_SETTINGS = {"frontdoor": [], "frontdoor-ensemble": ["serving.frontend.primary_model=ensemble"]}


def percentile(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


class Recorder:
    def __init__(self):
        self.ttft, self.itl = [], []
        # TTFT split from the model's time stamps (same host clock), ms: send -> arrival in the model,
        # arrival -> first scheduled (waiting for the running step to end), scheduled -> first token
        # (the step that prefills it), first token -> client
        self.split = []
        self.lock = threading.Lock()

    def add(self, sent: float, times: list[float]):
        with self.lock:
            self.ttft.append(times[0] - sent)
            self.itl.extend(b - a for a, b in itertools.pairwise(times))


def closed_loop(concurrency: int, requests: int, warmup: int, one, rec: Recorder) -> Recorder:
    """``concurrency`` client threads; each runs ``one()`` until ``requests`` (+ ``warmup``) are done."""
    counter = iter(range(requests + warmup))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            sent, times, overhead = one()
            if i >= warmup:
                rec.add(sent, times)
                if overhead is not None:
                    rec.split.append(overhead)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rec


# -- the three paths ----------------------------------------------------------------------------


def engine_split(bg, request_id):
    """A request's TTFT split from the engine's own stamps (no hops in process): waiting for the running step, its
    first step; on the engine's thread, where they are consistent."""
    t = bg.engine.times(request_id)
    return (0.0, (t.first_scheduled_ns - t.arrival_ns) / 1e6, (t.first_token_ns - t.first_scheduled_ns) / 1e6, 0.0)


def engine_runner(bg, prompt_ids, out_tokens):
    """The in-process peer: ``run(concurrency, count, warmup, rec)``.  The closed loop is driven from the
    engine's own callbacks (the next request is submitted when one finishes), so no client thread
    competes with the engine for the GIL."""
    from toolkit.runtime.engine import GenerationRequest

    def run(c, count, warmup, rec):
        total = count + warmup
        state = {"next": 0, "running": 0}
        lock = threading.Lock()
        all_done = threading.Event()

        def submit(index):
            times = []
            sent = time.perf_counter()

            def on_event(ev):
                if ev.token_id is not None:
                    if not times and index >= warmup:  # engine thread: its own stamps are consistent here
                        rec.split.append(engine_split(bg, ev.request_id))
                    times.append(time.perf_counter())
                if ev.finished:
                    if index >= warmup:
                        rec.add(sent, times)
                    start_next()

            bg.submit(GenerationRequest(prompt_ids=list(prompt_ids), max_new_tokens=out_tokens, end_id=-1), on_event)

        def start_next():
            with lock:
                state["running"] -= 1
                if state["next"] == total:
                    if state["running"] == 0:
                        all_done.set()
                    return
                index = state["next"]
                state["next"] += 1
                state["running"] += 1
            submit(index)

        with lock:
            first = min(c, total)
            state["next"] = state["running"] = first
        for i in range(first):
            submit(i)
        all_done.wait()

    return run


def engine_client_one(bg, prompt_ids, out_tokens):
    """``one()`` for ``engine-client``: submit to the in-process engine, wait on this (client) thread for the last
    token; token times and the engine's split are taken on the engine's thread as for ``engine``."""
    from toolkit.runtime.engine import GenerationRequest

    def one():
        times, split, done = [], [], threading.Event()
        sent = time.perf_counter()

        def on_event(ev):
            if ev.token_id is not None:
                if not times:
                    split.append(engine_split(bg, ev.request_id))
                times.append(time.perf_counter())
            if ev.finished:
                done.set()

        bg.submit(GenerationRequest(prompt_ids=list(prompt_ids), max_new_tokens=out_tokens, end_id=-1), on_event)
        done.wait()
        return sent, times, split[0] if split else None

    return one


def client_runner(one):
    def run(c, count, warmup, rec):
        closed_loop(c, count, warmup, one, rec)

    return run


class SharedStream:
    """One gRPC client and one bidirectional stream for every request of a path (no connection per
    request): requests are multiplexed by id and each response is routed to its request's queue."""

    def __init__(self, url):
        import tritonclient.grpc as g

        self.client = g.InferenceServerClient(url)
        self.queues: dict[str, queue.Queue] = {}
        self.lock = threading.Lock()
        self.ids = iter(range(1 << 62))
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error):
        at, at_ns = time.perf_counter(), time.time_ns()
        rid = result.get_response().id if result is not None else None
        with self.lock:
            targets = [self.queues[rid]] if rid in self.queues else list(self.queues.values())
        for q in targets:  # an error without a request id reaches every request in flight
            q.put((result, error, at, at_ns))

    def send(self, model, inputs) -> tuple[str, queue.Queue]:
        q: queue.Queue = queue.Queue()
        with self.lock:
            rid = f"bench-{next(self.ids)}"
            self.queues[rid] = q
        self.client.async_stream_infer(model, inputs, request_id=rid, enable_empty_final_response=True)
        return rid, q

    def done(self, rid):
        with self.lock:
            self.queues.pop(rid, None)

    def close(self):
        self.client.stop_stream()
        self.client.close()


def grpc_one(stream: SharedStream, model, inputs_fn):
    def one():
        times, overhead = [], None
        inputs = inputs_fn()
        sent, sent_ns = time.perf_counter(), time.time_ns()
        rid, q = stream.send(model, inputs)
        try:
            while True:
                result, error, at, at_ns = q.get(timeout=300)
                if error is not None:
                    raise RuntimeError(error)
                r = result.get_response()
                names = {o.name for o in r.outputs}
                token = ("output_ids" in names and result.as_numpy("output_ids").size) or (
                    "text_output" in names and any(result.as_numpy("text_output").reshape(-1))
                )
                if token:
                    if not times and "first_token_time_ns" in names:
                        stamp = {
                            k: int(result.as_numpy(k).reshape(-1)[0])
                            for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns")
                        }
                        arrival, sched, first = (stamp[k] for k in stamp)
                        overhead = (
                            (arrival - sent_ns) / 1e6,
                            (sched - arrival) / 1e6,
                            (first - sched) / 1e6,
                            (at_ns - first) / 1e6,
                        )
                    times.append(at)
                if r.parameters["triton_final_response"].bool_param:
                    return sent, times, overhead
        finally:
            stream.done(rid)

    return one


class AioStream:
    """``tensorrt_llm`` over Triton's gRPC stream through ``grpc.aio``, as the front door sends and reads it: the
    front door's pool of kept-open ``ModelStreamInfer`` calls (toolkit/frontdoor/triton.py ``StreamPool``), tensors
    packed with ``struct`` (``raw_tensor``), the outputs asked for by name, a response's ids read from its raw bytes.
    Its requests run on an event loop in a thread of their own; :meth:`runner` drives a closed loop of ``c``
    coroutines there."""

    def __init__(self, url, inputs, outputs=(), *, loop_factory=asyncio.new_event_loop):
        self.template = self._template(inputs, outputs)  # every request's message but its id
        self.ids = iter(range(1 << 62))
        self.loop = loop_factory()
        threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True).start()
        self._wait(self._open(url))

    def _wait(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _open(self, url):
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        from toolkit.frontdoor.triton import StreamPool

        self.channel = grpc.aio.insecure_channel(url.removeprefix("grpc://"))
        self.pool = StreamPool(service_pb2_grpc.GRPCInferenceServiceStub(self.channel))

    @staticmethod
    def _template(inputs, outputs):
        """``inputs``: (name, datatype, values, shape) of every request; ``outputs``: the ones asked for by name (none:
        every output the model has)."""
        from tritonclient.grpc import service_pb2 as pb

        from toolkit.frontdoor.triton import raw_tensor

        msg = pb.ModelInferRequest(model_name="tensorrt_llm")
        for name, datatype, values, shape in inputs:
            msg.inputs.add(name=name, datatype=datatype, shape=shape)
            msg.raw_input_contents.append(raw_tensor(datatype, values))
        for name in outputs:
            msg.outputs.add(name=name)
        msg.parameters["triton_enable_empty_final_response"].bool_param = True
        return msg

    async def one(self):
        import grpc
        from tritonclient.grpc import service_pb2 as pb

        msg = pb.ModelInferRequest()
        msg.CopyFrom(self.template)
        msg.id = f"aio-{next(self.ids)}"
        call, _ = self.pool.take()
        times, ended = [], False
        sent = time.perf_counter()
        try:
            await call.write(msg)
            while True:
                resp = await call.read()
                at = time.perf_counter()
                if resp is grpc.aio.EOF or resp.error_message:
                    raise RuntimeError(f"tensorrt_llm: {resp.error_message if resp is not grpc.aio.EOF else 'EOF'}")
                r = resp.infer_response
                raws = dict(zip((o.name for o in r.outputs), r.raw_output_contents, strict=True))
                if raws.get("output_ids"):
                    times.append(at)
                final = r.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    ended = True
                    return sent, times
        finally:
            if ended:
                self.pool.give_back(call)
            else:
                call.cancel()

    async def _closed_loop(self, c, count, warmup, rec):
        counter = iter(range(count + warmup))  # shared by the coroutines of one loop: no lock

        async def stream():
            for i in counter:
                sent, times = await self.one()
                if i >= warmup:
                    rec.add(sent, times)

        await asyncio.gather(*(stream() for _ in range(c)))

    def runner(self):
        def run(c, count, warmup, rec):
            self._wait(self._closed_loop(c, count, warmup, rec))

        return run

    def close(self):
        async def shut():
            self.pool.close()
            await self.channel.close()

        self._wait(shut())
        self.loop.call_soon_threadsafe(self.loop.stop)


def frontdoor_one(url, model, n):
    """One streamed chat request through the front door on this thread's kept-alive connection: HTTP/1.1
    with a chunked SSE body, read with the least work per token (a token is a chunk whose event has
    ``"content"``)."""
    import socket
    from urllib.parse import urlsplit

    local = threading.local()
    u = urlsplit(url)
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": n,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()

    def one():
        if not hasattr(local, "sock"):
            local.sock = socket.create_connection((u.hostname, u.port))
            local.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            local.file = local.sock.makefile("rb")
        f, times = local.file, []
        sent = time.perf_counter()
        local.sock.sendall(head + body)
        status = f.readline()
        while f.readline() not in (b"\r\n", b""):
            pass
        if b" 200 " not in status:
            raise RuntimeError(f"front door: {status!r}")
        while True:  # chunked transfer encoding: size line, data, CRLF; a 0 size ends the body
            size = int(f.readline().strip(), 16)
            if size == 0:
                f.readline()
                break
            data = f.read(size)
            f.readline()
            if b'"content"' in data:
                times.append(time.perf_counter())
        return sent, times, None

    return one


def server_cpu(pid: int) -> Counter:
    """CPU seconds so far of tritonserver (``pid``) and the python-backend stubs it started, by where they ran:
    tritonserver itself, the ``tensorrt_llm`` stub's engine threads (the thread stepping the engine and its OpenMP
    workers), its response senders, its other threads (the stub's own), and the other models' stubs.  The engine's
    threads are told apart by the names the served model gives them (toolkit/runtime/os_threads.py)."""
    from toolkit.runtime.os_threads import ENGINE_THREAD, SENDER_THREAD, cpu_by_thread_name
    from toolkit.triton.server import group_members

    parts = {ENGINE_THREAD: "engine threads", SENDER_THREAD: "response senders"}
    out = Counter(tritonserver=sum(cpu_by_thread_name(pid).values()))
    for kid in (p for p in group_members(pid) if p != pid):  # the python stubs tritonserver started
        try:
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
        except OSError:
            continue
        threads = cpu_by_thread_name(kid)
        if b"/tensorrt_llm/1/" in cmdline:
            for name, seconds in threads.items():
                out[parts.get(name, "stub's other threads")] += seconds
        else:
            out["other stubs"] += sum(threads.values())
    return out


SERVER_CPU_COLUMNS = ("tritonserver", "engine threads", "response senders", "stub's other threads", "other stubs")


def start_frontdoor(repo, server, root=ROOT, settings=()):
    """``python -m toolkit.frontdoor`` (from the rtk checkout ``root``, with ``--set`` of each of ``settings``)
    on a free port; returns (process, url)."""
    import subprocess

    from toolkit.triton.server import free_ports

    (port,) = free_ports(1)
    cmd = [
        sys.executable,
        "-m",
        "toolkit.frontdoor",
        str(Path(repo).resolve()),
        "--triton-grpc",
        server.grpc_url,
        "--metrics-url",
        server.metrics_url,
        "--port",
        str(port),
        *(x for s in settings for x in ("--set", s)),
    ]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=root, env=env)
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise SystemExit(f"the front door did not start: {line!r}")
    return proc, line.split()[1]


def tensor(name, arr, dtype):
    import tritonclient.grpc as g

    t = g.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repository", type=Path, help="an emitted cpu repository (rtk build SPEC)")
    ap.add_argument("--requests", type=int, default=24, help="measured requests per level and path")
    ap.add_argument("--warmup", type=int, default=2, help="requests per level and path not measured")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="the paths take turns this many times per level")
    ap.add_argument(
        "--paths",
        nargs="+",
        default=list(PATHS),
        choices=PATHS,
        help="which paths to run; ratios are against the first",
    )
    ap.add_argument(
        "--compare-frontdoor",
        type=Path,
        metavar="DIR",
        help="also run the front door from this other rtk checkout (path frontdoor@DIR's name)",
    )
    ap.add_argument(
        "--client-loop",
        choices=["auto", "asyncio"],
        default="auto",
        help="the tensorrt_llm-aio path's event loop: auto, the loop uvicorn gives the front door (uvloop's where it "
        "is installed), or asyncio's",
    )
    args = ap.parse_args(argv)
    from toolkit.frontdoor.runner import event_loop_factory

    aio_loop, aio_loop_name = event_loop_factory(args.client_loop)

    from toolkit.artifacts import read_manifest
    from toolkit.targets.cpu import bound_openmp_spin

    repo = args.repository
    manifest = read_manifest(repo) or {}
    if manifest.get("target") != "cpu":
        ap.error(f"{repo} is not an emitted cpu repository")
    engine_dir = manifest["inputs"]["engine_dir"]
    # the in-process engine's OpenMP workers spin as the served one's do (GOMP_SPINCOUNT, read when torch loads
    # libgomp): the comparison is of Triton's hops, not of spin policies
    spin_bounded = bound_openmp_spin(engine_dir)

    import rtk_text

    from toolkit.triton import launch
    from toolkit.triton.server import free_ports

    tok = rtk_text.load_tokenizer(str(repo / "preprocessing/tokenizer"))
    chat = json.dumps([{"role": "user", "content": QUESTION}])
    prompt_ids, _ = rtk_text.encode_prompt(tok, chat, window=10_000, policy="reject")
    n = args.output_tokens

    print(f"# rtk serving overhead — {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    print(
        f"# engine {engine_dir}; prompt {len(prompt_ids)} tokens (chat template), {n} output tokens, greedy;"
        f" ~{args.requests} measured + {args.warmup} warm-up requests per level and path in {args.rounds}"
        " interleaved rounds; closed loop",
        flush=True,
    )
    print(
        f"# in-process engine: GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}"
        f" ({'as served' if spin_bounded else 'from the environment'}), OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}; the tensorrt_llm-aio client on "
        f"{aio_loop_name}'s loop",
        flush=True,
    )
    from toolkit.runtime.engine import BackgroundEngine
    from toolkit.targets.cpu import load_engine

    http, grpc, metrics = free_ports(3)
    t = launch.resolve(repo)
    server = launch.make_server(t, http_port=http, grpc_port=grpc, metrics_port=metrics)
    server.start()
    server_pid = server.process.pid
    bg, streams, doors, aio = None, [], {}, None
    try:
        server.wait_ready(models=t.models)
        if "engine" in args.paths or "engine-client" in args.paths:
            # the server's thread policy (targets.cpu.served_threads), so that the comparison is of
            # Triton's hops, not of thread counts
            bg = BackgroundEngine(lambda: load_engine(engine_dir, served=True))  # loaded on its own thread

        # tensorrt_llm's inputs, (name, datatype, values, shape): both tensorrt_llm paths send these
        llm_request = [
            ("input_ids", "INT32", list(prompt_ids), [1, len(prompt_ids)]),
            ("input_lengths", "INT32", [len(prompt_ids)], [1, 1]),
            ("request_output_len", "INT32", [n], [1, 1]),
            ("end_id", "INT32", [-1], [1, 1]),
            ("streaming", "BOOL", [True], [1, 1]),
        ]

        def llm_inputs():  # tritonclient's, with the perf metrics for the TTFT split
            numpy_type = {"INT32": np.int32, "BOOL": np.bool_}
            return [
                *(tensor(k, np.array(v, dtype=numpy_type[t]).reshape(shape), t) for k, t, v, shape in llm_request),
                tensor("return_perf_metrics", np.array([[True]]), "BOOL"),
            ]

        def ens_inputs():
            return [
                tensor("text_input", np.array([[chat.encode()]], dtype=np.object_), "BYTES"),
                tensor("max_tokens", np.array([[n]], dtype=np.int32), "INT32"),
                tensor("end_id", np.array([[-1]], dtype=np.int32), "INT32"),
                tensor("stream", np.array([[True]]), "BOOL"),
            ]

        streams = [SharedStream(server.grpc_url) for _ in range(2)]  # one per path, reused by every request
        if "tensorrt_llm-aio" in args.paths:
            aio = AioStream(server.grpc_url, llm_request, ("output_ids", "sequence_length"), loop_factory=aio_loop)
        roots = {name: (ROOT, FRONTDOOR_SETTINGS[name]) for name in FRONTDOOR_SETTINGS if name in args.paths}
        if args.compare_frontdoor:
            roots[f"frontdoor@{args.compare_frontdoor.name}"] = (args.compare_frontdoor.resolve(), [])
        for name, (root, settings) in roots.items():
            doors[name] = start_frontdoor(repo, server, root, settings)
        fd_model = None
        for _, fd_url in doors.values():
            with urllib.request.urlopen(fd_url + "/v1/models") as resp:
                fd_model = json.loads(resp.read())["data"][0]["id"]
        paths = {
            "engine": engine_runner(bg, prompt_ids, n) if bg is not None else None,
            "engine-client": client_runner(engine_client_one(bg, prompt_ids, n)) if bg is not None else None,
            "tensorrt_llm": client_runner(grpc_one(streams[0], "tensorrt_llm", llm_inputs)),
            "tensorrt_llm-aio": aio.runner() if aio is not None else None,
            "ensemble": client_runner(grpc_one(streams[1], "ensemble", ens_inputs)),
            **{name: client_runner(frontdoor_one(url, fd_model, n)) for name, (_, url) in doors.items()},
        }
        paths = {k: v for k, v in paths.items() if k in args.paths or k in doors}
        results = {p: {c: Recorder() for c in args.concurrency} for p in paths}
        # The front door processes' CPU: while their path runs (busy), and while the others run (idle polling).
        cpu = {name: {c: [0.0, 0.0, 0.0, 0.0] for c in args.concurrency} for name in doors}  # busy s, t, idle s, t
        # This process's CPU while each path ran: the client's (tritonclient's gRPC stream, or the HTTP reader).
        client_cpu = {name: dict.fromkeys(args.concurrency, 0.0) for name in paths}
        # tritonserver's and its stubs' CPU while each path ran, by where it ran (server_cpu)
        served_cpu = {name: {c: Counter() for c in args.concurrency} for name in paths}
        for c in args.concurrency:
            per_round = max(c, args.requests // args.rounds)
            for r in range(args.rounds):  # interleaved, so drift of a shared host hits every path alike
                for name, run in paths.items():
                    before = {d: cpu_seconds(p.pid) for d, (p, _) in doors.items()}
                    t0, own0, server0 = time.perf_counter(), cpu_seconds(os.getpid()), server_cpu(server_pid)
                    run(c, per_round, args.warmup if r == 0 else 0, results[name][c])
                    dt = time.perf_counter() - t0
                    client_cpu[name][c] += cpu_seconds(os.getpid()) - own0
                    served_cpu[name][c].update(server_cpu(server_pid))
                    served_cpu[name][c].subtract(server0)
                    for d, (p, _) in doors.items():
                        used = cpu_seconds(p.pid) - before[d]
                        acc = cpu[d][c]
                        if d == name:
                            acc[0], acc[1] = acc[0] + used, acc[1] + dt
                        else:
                            acc[2], acc[3] = acc[2] + used, acc[3] + dt
            print(f"# {c} stream(s) done", flush=True)
    finally:
        for st in streams:
            st.close()
        if aio is not None:
            aio.close()
        for p, _ in doors.values():
            p.terminate()
            p.wait(10)
        if bg is not None:
            bg.close()
        server.stop()

    ms = 1e3
    print()
    print(
        "| streams | path | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | TTFT ratio | TTFT added ms"
        " | ITL ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        base = results[next(iter(paths))][c]
        b_ttft, b_itl = statistics.median(base.ttft), statistics.median(base.itl)
        for path in paths:
            r = results[path][c]
            ttft, itl = statistics.median(r.ttft), statistics.median(r.itl)
            print(
                f"| {c} | {path} | {ttft * ms:.1f} | {percentile(r.ttft, 90) * ms:.1f} | {itl * ms:.1f} | "
                f"{percentile(r.itl, 90) * ms:.1f} | {ttft / b_ttft:.2f} | {(ttft - b_ttft) * ms:+.1f} | "
                f"{itl / b_itl:.2f} |"
            )
    for grpc_path in ("tensorrt_llm", "tensorrt_llm-aio", "ensemble"):
        if not doors or grpc_path not in paths:
            continue
        print(
            f"\nThe front doors against Triton's gRPC path to {grpc_path} (medians; added ms per request and per"
            " token; their CPU: busy minus the idle polling rate)"
        )
        print("| streams | front door | TTFT added ms | ITL added ms | CPU ms per request | CPU us per token |")
        print("|---|---|---|---|---|---|")
        for c in args.concurrency:
            e = results[grpc_path][c]
            for name in doors:
                f = results[name][c]
                busy, busy_t, idle, idle_t = cpu[name][c]
                own = busy - (idle / idle_t if idle_t else 0.0) * busy_t
                n_req, n_tok = len(f.ttft), len(f.itl) + len(f.ttft)
                print(
                    f"| {c} | {name} | {(statistics.median(f.ttft) - statistics.median(e.ttft)) * ms:+.2f} | "
                    f"{(statistics.median(f.itl) - statistics.median(e.itl)) * ms:+.3f} | "
                    f"{own / n_req * 1e3:.2f} | {own / n_tok * 1e6:.0f} |"
                )
    print(
        "\nThis process's CPU per streamed token while each path ran (its client: tritonclient's gRPC stream, or"
        " its grpc.aio loop, or the HTTP reader of a front door), us; the first round's warm-up requests are in the"
        " CPU, not in the tokens"
    )
    in_process = ("engine", "engine-client")  # this process's CPU there is the engine's too
    print("| streams | " + " | ".join(p for p in paths if p not in in_process) + " |")
    print("|---|" + "---|" * sum(p not in in_process for p in paths))
    for c in args.concurrency:
        cells = []
        for path in paths:
            if path not in in_process:
                r = results[path][c]
                cells.append(f"{client_cpu[path][c] / max(1, len(r.itl) + len(r.ttft)) * 1e6:.0f}")
        print(f"| {c} | " + " | ".join(cells) + " |")
    print(
        "\nThe server's CPU per streamed token while each path ran, us, by where it ran: tritonserver, the tensorrt_llm"
        " stub's engine threads (its stepping thread and OpenMP workers), response senders and other threads, and the"
        " other models' stubs (on the in-process paths: the server idling); with the client's above, what a served"
        " token costs the host's cores"
    )
    print("| streams | path | " + " | ".join(SERVER_CPU_COLUMNS) + " | all but the engine's |")
    print("|---|---|" + "---|" * (len(SERVER_CPU_COLUMNS) + 1))
    for c in args.concurrency:
        for path in paths:
            r, used = results[path][c], served_cpu[path][c]
            per_token = 1e6 / max(1, len(r.itl) + len(r.ttft))
            rest = sum(v for k, v in used.items() if k != "engine threads")
            cells = " | ".join(f"{used[k] * per_token:.0f}" for k in SERVER_CPU_COLUMNS)
            print(f"| {c} | {path} | {cells} | {rest * per_token:.0f} |")
    print("\nTTFT split from the engine's time stamps, medians in ms (tensorrt_llm path: + Triton's hops)")
    print("| streams | path | send -> model | waiting for the running step | prefill step | first token -> client |")
    print("|---|---|---|---|---|---|")
    for c in args.concurrency:
        for path in ("engine", "engine-client", "tensorrt_llm"):
            split = results[path][c].split if path in results else None
            if split:
                cols = " | ".join(f"{statistics.median(x[i] for x in split):.1f}" for i in range(4))
                print(f"| {c} | {path} | {cols} |")
    print(f"\n# load average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
