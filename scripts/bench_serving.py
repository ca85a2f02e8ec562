#!/usr/bin/env python
"""What Triton adds to rtk's CPU engine: TTFT and ITL through Triton vs calling the engine directly.

    python scripts/bench_serving.py triton_repo/smollm2-cpu [--requests 24] [--concurrency 1 8]

For each concurrency level the same closed-loop workload (every stream sends its next request when
the previous one ends; the same chat prompt, greedy, no end token so every answer has exactly
``--output-tokens`` tokens) runs three ways:

* ``engine``       — the repository's engine in this process (BackgroundEngine, callback per token);
* ``tensorrt_llm`` — Triton's ``tensorrt_llm`` model over streaming gRPC (token ids in and out);
* ``ensemble``     — Triton's ``ensemble`` over streaming gRPC (text in, text out: + pre/postprocessing);
* ``frontdoor``    — rtk's OpenAI-compatible front door (its own process, ``python -m toolkit.frontdoor``)
  over that ensemble: ``/v1/chat/completions`` SSE, ``ignore_eos``; its TTFT and ITL are also given
  as added ms against ``ensemble`` (what the front door costs).

Both engines are loaded (the server's by tritonserver from toolkit/triton/server.py, on free ports) but
only one path runs at a time: the paths take turns, ``--rounds`` times per level, so drift of a
shared host falls on each path alike.  On the ``tensorrt_llm`` path the model's own time stamps
also split TTFT into engine time and Triton's share (send → execute, first token → client; same
host clock).  TTFT is measured from the request's send to its first token
(response); ITL is every gap between consecutive tokens (responses).  Printed: medians and p90 in
ms, and the ratios / added ms against ``engine`` from the same run.  The first ``--warmup``
requests of each path and level are not measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "toolkit/triton/models"))

QUESTION = "Explain in a few sentences why the sky is blue."


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
                        t = bg.engine.times(ev.request_id)
                        rec.split.append(
                            (
                                0.0,
                                (t.first_scheduled_ns - t.arrival_ns) / 1e6,
                                (t.first_token_ns - t.first_scheduled_ns) / 1e6,
                                0.0,
                            )
                        )
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


def frontdoor_one(url, model, n):
    """One streamed chat request through the front door; one httpx client (keep-alive) per thread."""
    import httpx

    local = threading.local()
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": n,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }

    def one():
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=url, timeout=300)
        times = []
        sent = time.perf_counter()
        with local.client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"front door: HTTP {r.status_code} {r.read()[:300]!r}")
            for line in r.iter_lines():
                if line.startswith('data: {"id"') and '"content"' in line:
                    times.append(time.perf_counter())
        return sent, times, None

    return one


def start_frontdoor(repo, server):
    """``python -m toolkit.frontdoor`` on a free port; returns (process, url)."""
    import subprocess

    from toolkit.triton.server import free_ports

    (port,) = free_ports(1)
    cmd = [
        sys.executable,
        "-m",
        "toolkit.frontdoor",
        str(repo),
        "--triton-grpc",
        server.grpc_url,
        "--metrics-url",
        server.metrics_url,
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
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
    args = ap.parse_args(argv)

    import rtk_text

    from toolkit.artifacts import read_manifest
    from toolkit.triton import launch
    from toolkit.triton.server import free_ports

    repo = args.repository
    manifest = read_manifest(repo) or {}
    if manifest.get("target") != "cpu":
        ap.error(f"{repo} is not an emitted cpu repository")
    engine_dir = manifest["inputs"]["engine_dir"]
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
    from toolkit.runtime.engine import BackgroundEngine
    from toolkit.targets.cpu import load_engine

    http, grpc, metrics = free_ports(3)
    t = launch.resolve(repo)
    server = launch.make_server(t, http_port=http, grpc_port=grpc, metrics_port=metrics)
    server.start()
    bg, streams, fd_proc = None, [], None
    try:
        server.wait_ready(models=t.models)
        bg = BackgroundEngine(load_engine(engine_dir))

        def llm_inputs():
            return [
                tensor("input_ids", np.array([prompt_ids], dtype=np.int32), "INT32"),
                tensor("input_lengths", np.array([[len(prompt_ids)]], dtype=np.int32), "INT32"),
                tensor("request_output_len", np.array([[n]], dtype=np.int32), "INT32"),
                tensor("end_id", np.array([[-1]], dtype=np.int32), "INT32"),
                tensor("streaming", np.array([[True]]), "BOOL"),
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
        fd_proc, fd_url = start_frontdoor(repo, server)
        with urllib.request.urlopen(fd_url + "/v1/models") as resp:
            fd_model = json.loads(resp.read())["data"][0]["id"]
        paths = {
            "engine": engine_runner(bg, prompt_ids, n),
            "tensorrt_llm": client_runner(grpc_one(streams[0], "tensorrt_llm", llm_inputs)),
            "ensemble": client_runner(grpc_one(streams[1], "ensemble", ens_inputs)),
            "frontdoor": client_runner(frontdoor_one(fd_url, fd_model, n)),
        }
        results = {p: {c: Recorder() for c in args.concurrency} for p in paths}
        for c in args.concurrency:
            per_round = max(c, args.requests // args.rounds)
            for r in range(args.rounds):  # interleaved, so drift of a shared host hits every path alike
                for name, run in paths.items():
                    run(c, per_round, args.warmup if r == 0 else 0, results[name][c])
            print(f"# {c} stream(s) done", flush=True)
    finally:
        for st in streams:
            st.close()
        if fd_proc is not None:
            fd_proc.terminate()
            fd_proc.wait(10)
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
        base = results["engine"][c]
        b_ttft, b_itl = statistics.median(base.ttft), statistics.median(base.itl)
        for path in ("engine", "tensorrt_llm", "ensemble", "frontdoor"):
            r = results[path][c]
            ttft, itl = statistics.median(r.ttft), statistics.median(r.itl)
            print(
                f"| {c} | {path} | {ttft * ms:.1f} | {percentile(r.ttft, 90) * ms:.1f} | {itl * ms:.1f} | "
                f"{percentile(r.itl, 90) * ms:.1f} | {ttft / b_ttft:.2f} | {(ttft - b_ttft) * ms:+.1f} | "
                f"{itl / b_itl:.2f} |"
            )
    print("\nThe front door against the ensemble it fronts (medians; added ms per request and per token)")
    print("| streams | TTFT added ms | ITL added ms |")
    print("|---|---|---|")
    for c in args.concurrency:
        e, f = results["ensemble"][c], results["frontdoor"][c]
        print(
            f"| {c} | {(statistics.median(f.ttft) - statistics.median(e.ttft)) * ms:+.2f} | "
            f"{(statistics.median(f.itl) - statistics.median(e.itl)) * ms:+.3f} |"
        )
    print("\nTTFT split from the engine's time stamps, medians in ms (tensorrt_llm path: + Triton's hops)")
    print("| streams | path | send -> model | waiting for the running step | prefill step | first token -> client |")
    print("|---|---|---|---|---|---|")
    for c in args.concurrency:
        for path in ("engine", "tensorrt_llm"):
            split = results[path][c].split
            if split:
                cols = " | ".join(f"{statistics.median(x[i] for x in split):.1f}" for i in range(4))
                print(f"| {c} | {path} | {cols} |")
    print(f"\n# load average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
