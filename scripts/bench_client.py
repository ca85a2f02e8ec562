#!/usr/bin/env python
"""What the rtk slo client itself costs, and how fast one client process can keep a schedule.

Against a tritonserver (started here, on 127.0.0.1) serving a trivial decoupled python model that
streams tokens with no delay (tests/triton_helpers.py ``write_fake_llm``, ttft = itl = 0):

1. **Client CPU per request and per streamed token.**  The client process's CPU time
   (``time.process_time``: every thread, gRPC's own included) over closed-loop runs with 1 and
   with 64 output tokens, fitted as ``cpu = a·requests + b·tokens``.  The peer, measured in the
   same run on the same requests (same inputs and requested outputs, server timestamps included),
   is tritonclient's own stream API (``start_stream`` + ``async_stream_infer`` with a callback)
   doing nothing but counting — about the least a Python client of this protocol can do.  rtk's
   figure includes everything ``run_slo`` does: prompts, timestamps, decoding, metrics.
2. **Highest sustained request rate** with the client's send lag p99 (sent − due) under 1 ms:
   open-loop constant arrivals at increasing rates, 8 tokens per request.

Each number is the median of ``--repeats`` runs.  The server shares the machine's cores with
the client, so the rates are those of *this* host with its server, not the client alone.

    python scripts/bench_client.py [--repeats 3] [--requests 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the fake model lives with the tests

import numpy as np  # noqa: E402

from triton_helpers import running_server, write_fake_llm  # noqa: E402

from toolkit.slo.records import SERVER_STAMPS  # noqa: E402
from toolkit.slo.runner import run_slo  # noqa: E402
from toolkit.spec import SLOSpec  # noqa: E402


def rtk_run(url: str, *, tokens: int, requests: int, concurrency: int | None = None, rate: float | None = None):
    slo = SLOSpec(concurrency=concurrency, request_rate=rate, arrival="constant", num_requests=requests, warmup_requests=0,
                  input_tokens=16, output_tokens=tokens, max_schedule_lag_ms=1000)
    t = time.process_time()
    rep = run_slo(slo, url, keep_output=False)
    cpu = time.process_time() - t
    assert rep.summary.failed == 0, rep.summary.errors
    return cpu, rep


def tritonclient_run(url: str, *, tokens: int, requests: int, concurrency: int) -> float:
    """The peer: tritonclient's stream API, ``concurrency`` in flight, counting final responses."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    slots = threading.Semaphore(concurrency)
    finished = threading.Event()
    state = {"done": 0, "errors": 0}

    def callback(result, error):  # tritonclient calls it with these keyword names
        if error is not None:
            state["errors"] += 1
        elif not result.get_response().parameters["triton_final_response"].bool_param:
            return
        state["done"] += 1
        slots.release()
        if state["done"] == requests:
            finished.set()

    def inp(name, arr, dtype):
        x = grpcclient.InferInput(name, list(arr.shape), dtype)
        x.set_data_from_numpy(arr)
        return x

    t = time.process_time()
    client.start_stream(callback=callback)
    # The same protocol work as rtk's requests: text plus the four server timestamps.
    outputs = [grpcclient.InferRequestedOutput(n) for n in ("text_output", *SERVER_STAMPS)]
    for i in range(requests):
        slots.acquire()
        text = " ".join(["word"] * 16)
        inputs = [inp("text_input", np.array([[text.encode()]], dtype=np.object_), "BYTES"),
                  inp("max_tokens", np.array([[tokens]], dtype=np.int32), "INT32"),
                  inp("stream", np.array([[True]]), "BOOL"),
                  inp("min_tokens", np.array([[tokens]], dtype=np.int32), "INT32"),
                  inp("return_perf_metrics", np.array([[True]]), "BOOL")]
        client.async_stream_infer("ensemble", inputs, request_id=str(i), outputs=outputs, enable_empty_final_response=True)
    finished.wait(300)
    client.stop_stream()
    client.close()
    cpu = time.process_time() - t
    assert state["errors"] == 0 and state["done"] == requests, state
    return cpu


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """cpu = a·requests + b·tokens from (requests, tokens, cpu) points; returns (a, b) in µs."""
    A = np.array([[r, k] for r, k, _ in points], dtype=float)
    y = np.array([c for _, _, c in points])
    a, b = np.linalg.lstsq(A, y, rcond=None)[0]
    return a * 1e6, b * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=400, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=16, help="closed loop for the cost runs")
    ap.add_argument("--rates", default="100,200,400,800,1200,1600,2400", help="open-loop rates to try (req/s)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        write_fake_llm(repo, "ensemble", interface="ensemble", ttft_ms=0, itl_ms=0, max_batch_size=64)
        with running_server(repo) as srv:
            url = srv.grpc_url
            rtk_run(url, tokens=8, requests=100, concurrency=8)  # warm the server and this process
            tritonclient_run(url, tokens=8, requests=100, concurrency=8)

            # 1. cost per request and per token
            rows = {"rtk slo (gRPC)": [], "tritonclient stream": []}
            for _ in range(args.repeats):
                pts_rtk, pts_tc = [], []
                for tokens in (1, 64):
                    cpu, _ = rtk_run(url, tokens=tokens, requests=args.requests, concurrency=args.concurrency)
                    pts_rtk.append((args.requests, args.requests * tokens, cpu))
                    cpu = tritonclient_run(url, tokens=tokens, requests=args.requests, concurrency=args.concurrency)
                    pts_tc.append((args.requests, args.requests * tokens, cpu))
                rows["rtk slo (gRPC)"].append(fit(pts_rtk))
                rows["tritonclient stream"].append(fit(pts_tc))
            med = {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in rows.items()}

            # 2. highest rate with send lag p99 < 1 ms
            rate_rows = []
            for rate in [float(r) for r in args.rates.split(",")]:
                lags, achieved = [], []
                for _ in range(args.repeats):
                    n = max(args.requests, int(rate))  # at least ~1 s of load
                    _, rep = rtk_run(url, tokens=8, requests=n, rate=rate)
                    lags.append(rep.dist("client_lag").p99)
                    achieved.append(rep.summary.aggregates["request_throughput"])
                rate_rows.append((rate, statistics.median(lags), statistics.median(achieved)))
                if statistics.median(lags) > 5:  # far past the limit; higher rates only get worse
                    break

    print(f"\nhost: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; server and client share them; "
          f"median of {args.repeats} runs, {args.requests} requests each, closed loop {args.concurrency} for costs\n")
    print("| client | CPU per request (µs) | CPU per streamed token (µs) | ratio to tritonclient (req / token) |")
    print("|---|---:|---:|---:|")
    base = med["tritonclient stream"]
    for name, (a, b) in med.items():
        print(f"| {name} | {a:.0f} | {b:.1f} | {a / base[0]:.2f} / {b / base[1]:.2f} |")
    print("\n| offered rate (req/s) | achieved (req/s) | send lag p99 (ms) | < 1 ms |")
    print("|---:|---:|---:|---|")
    best = None
    for rate, lag, got in rate_rows:
        ok = lag < 1.0
        best = rate if ok else best
        print(f"| {rate:g} | {got:.0f} | {lag:.3f} | {'yes' if ok else 'no'} |")
    print(f"\nhighest rate tried with send lag p99 < 1 ms: {best if best is not None else 'none'} req/s (8 tokens per request)")


if __name__ == "__main__":
    main()
