#!/usr/bin/env python
"""What the rtk slo client itself costs, and how fast it keeps a schedule with 1 and with N processes.

Against a tritonserver (started here, on 127.0.0.1) serving a trivial decoupled python model that
streams tokens with no delay (tests/triton_helpers.py ``write_fake_llm``, ttft = itl = 0):

0. **The fake server's own ceiling**: closed loop at concurrency 64, 8 tokens per request, driven
   by tritonclient's stream API (the cheapest client) and by rtk with N workers; the higher
   completed-request rate is what this host's server can do while a client runs beside it.
1. **Client CPU per request and per streamed token.**  The client process's CPU time
   (``time.process_time``: every thread, gRPC's own included) over closed-loop runs with 1 and
   with 64 output tokens, fitted as ``cpu = a·requests + b·tokens``.  The peer, measured in the
   same run on the same requests (same inputs and requested outputs, server timestamps included),
   is tritonclient's own stream API (``start_stream`` + ``async_stream_infer`` with a callback)
   doing nothing but counting — about the least a Python client of this protocol can do.  rtk's
   figure includes everything ``run_slo`` does: prompts, timestamps, decoding, metrics.
2. **Highest on-schedule request rate**, for 1 and for N worker processes (``--workers``): open-loop
   constant arrivals at increasing rates, 8 tokens per request; a rate is kept when the client's
   send lag p99 (sent − due) is under 1 ms and at least 95 % of the offered rate completed.

Each number is the median of ``--repeats`` runs.  The server shares the machine's cores with
the client, so the rates are those of *this* host with its server, not the client alone.

    python scripts/bench_client.py [--repeats 3] [--requests 400] [--workers 2]
    python scripts/bench_client.py --server-cpus 0-7 --client-cpus 8-15   # server and client apart

``--server-cpus`` / ``--client-cpus`` pin tritonserver (and its python stubs) and the client processes
to disjoint CPU sets, which makes a many-core host behave as a client host beside a server host.
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

INTERFACE = "ensemble"  # --interface: the fake model's tensor interface and its name on the server


def rtk_run(
    url: str, *, tokens: int, requests: int, concurrency: int | None = None, rate: float | None = None, workers: int = 1
):
    """(client CPU seconds, report); with workers the CPU is every worker's plus this process's."""
    slo = SLOSpec(
        concurrency=concurrency,
        request_rate=rate,
        arrival="constant",
        num_requests=requests,
        warmup_requests=2 * workers,
        endpoint=INTERFACE,
        input_tokens=16,
        output_tokens=tokens,
        max_schedule_lag_ms=1000,
    )
    t = time.process_time()
    rep = run_slo(slo, url, keep_output=False, workers=workers)
    cpu = time.process_time() - t + (rep.client["cpu_s"] if workers > 1 else 0.0)
    assert rep.summary.failed == 0, rep.summary.errors
    return cpu, rep


def tritonclient_run(url: str, *, tokens: int, requests: int, concurrency: int) -> tuple[float, float]:
    """The peer: tritonclient's stream API, ``concurrency`` in flight, counting final responses.
    Returns (CPU seconds, completed requests per second)."""
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

    t, wall = time.process_time(), time.perf_counter()
    client.start_stream(callback=callback)
    # The same protocol work as rtk's requests: text plus the four server timestamps.
    output = "text_output" if INTERFACE == "ensemble" else "output_ids"
    outputs = [grpcclient.InferRequestedOutput(n) for n in (output, *SERVER_STAMPS)]
    for i in range(requests):
        slots.acquire()
        if INTERFACE == "ensemble":
            text = " ".join(["word"] * 16)
            inputs = [
                inp("text_input", np.array([[text.encode()]], dtype=np.object_), "BYTES"),
                inp("max_tokens", np.array([[tokens]], dtype=np.int32), "INT32"),
                inp("stream", np.array([[True]]), "BOOL"),
                inp("min_tokens", np.array([[tokens]], dtype=np.int32), "INT32"),
            ]
        else:
            inputs = [
                inp("input_ids", np.arange(1, 17, dtype=np.int32)[None], "INT32"),
                inp("input_lengths", np.array([[16]], dtype=np.int32), "INT32"),
                inp("request_output_len", np.array([[tokens]], dtype=np.int32), "INT32"),
                inp("streaming", np.array([[True]]), "BOOL"),
            ]
        inputs.append(inp("return_perf_metrics", np.array([[True]]), "BOOL"))
        client.async_stream_infer(
            INTERFACE, inputs, request_id=str(i), outputs=outputs, enable_empty_final_response=True
        )
    finished.wait(300)
    wall = time.perf_counter() - wall
    client.stop_stream()
    client.close()
    cpu = time.process_time() - t
    assert state["errors"] == 0 and state["done"] == requests, state
    return cpu, requests / wall


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """cpu = c + a·requests + b·tokens from (requests, tokens, cpu) points; returns (a, b) in µs and c in ms.

    The constant c is each run's fixed cost (connecting, building the workload, the report): without
    it, a fit over runs of equal length would charge it to every request.
    """
    A = np.array([[1.0, r, k] for r, k, _ in points], dtype=float)
    y = np.array([c for _, _, c in points])
    c, a, b = np.linalg.lstsq(A, y, rcond=None)[0]
    return a * 1e6, b * 1e6, c * 1e3


def on_schedule(url: str, rate: float, *, workers: int, requests: int, repeats: int) -> tuple[float, float, float]:
    """Median (send lag p99 ms, achieved req/s, client CPU µs per request) at ``rate``."""
    lags, achieved, cpus = [], [], []
    for _ in range(repeats):
        n = max(requests, int(2 * rate))  # at least ~2 s of load
        cpu, rep = rtk_run(url, tokens=8, requests=n, rate=rate, workers=workers)
        lags.append(rep.dist("client_lag").p99)
        achieved.append(rep.summary.aggregates["request_throughput"])
        cpus.append(cpu / n * 1e6)
    return statistics.median(lags), statistics.median(achieved), statistics.median(cpus)


def cpu_set(text: str | None) -> set[int] | None:
    """``0-3,6`` -> {0, 1, 2, 3, 6}; None stays None (no pinning)."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    missing = cpus - os.sched_getaffinity(0)
    if missing:
        raise SystemExit(
            f"CPUs {sorted(missing)} are not available to this process (it may use {sorted(os.sched_getaffinity(0))})"
        )
    return cpus


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=400, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=16, help="closed loop for the cost runs")
    ap.add_argument("--workers", type=int, default=2, help="client processes to compare with one")
    ap.add_argument("--rates", default="100,200,300,400,600,800,1200,1600", help="open-loop rates to try (req/s)")
    ap.add_argument(
        "--interface",
        choices=("ensemble", "tensorrt_llm"),
        default="ensemble",
        help="the fake model's interface: text (ensemble) or token ids (tensorrt_llm)",
    )
    ap.add_argument("--server-cpus", help="pin tritonserver and its stubs to these CPUs, e.g. 0-7")
    ap.add_argument("--client-cpus", help="pin the client processes to these CPUs, e.g. 8-15")
    args = ap.parse_args()
    global INTERFACE
    INTERFACE = args.interface
    server_cpus, client_cpus = cpu_set(args.server_cpus), cpu_set(args.client_cpus)
    everything = os.sched_getaffinity(0)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loads = [os.getloadavg()[0]]

    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        write_fake_llm(repo, INTERFACE, interface=INTERFACE, ttft_ms=0, itl_ms=0, max_batch_size=64)
        if server_cpus:
            os.sched_setaffinity(0, server_cpus)  # the server and its stubs inherit this set
        with running_server(repo) as srv:
            os.sched_setaffinity(0, client_cpus or everything)  # spawned workers inherit this one
            url = srv.grpc_url
            rtk_run(url, tokens=8, requests=100, concurrency=8)  # warm the server and this process
            tritonclient_run(url, tokens=8, requests=100, concurrency=8)

            # 0. the fake server's ceiling
            tc_ceiling = statistics.median(
                tritonclient_run(url, tokens=8, requests=2000, concurrency=64)[1] for _ in range(args.repeats)
            )
            rtk_ceiling = statistics.median(
                rtk_run(url, tokens=8, requests=2000, concurrency=64, workers=args.workers)[1].summary.aggregates[
                    "request_throughput"
                ]
                for _ in range(args.repeats)
            )
            ceiling = max(tc_ceiling, rtk_ceiling)
            progress(
                f"ceiling: tritonclient {tc_ceiling:.0f} req/s, rtk {args.workers} workers {rtk_ceiling:.0f} req/s"
            )
            loads.append(os.getloadavg()[0])

            # 1. cost per request and per token
            rows = {"rtk slo (gRPC, 1 process)": [], "tritonclient stream": []}
            for _ in range(args.repeats):
                pts_rtk, pts_tc = [], []
                for n, tokens in ((args.requests, 1), (2 * args.requests, 1), (args.requests, 64)):
                    cpu, _ = rtk_run(url, tokens=tokens, requests=n, concurrency=args.concurrency)
                    pts_rtk.append((n, n * tokens, cpu))
                    cpu, _ = tritonclient_run(url, tokens=tokens, requests=n, concurrency=args.concurrency)
                    pts_tc.append((n, n * tokens, cpu))
                rows["rtk slo (gRPC, 1 process)"].append(fit(pts_rtk))
                rows["tritonclient stream"].append(fit(pts_tc))
                progress(
                    f"cost fit (µs/request, µs/token, ms fixed): rtk {rows['rtk slo (gRPC, 1 process)'][-1]}, "
                    f"tritonclient {rows['tritonclient stream'][-1]}"
                )
            med = {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in rows.items()}
            loads.append(os.getloadavg()[0])

            # 2. highest on-schedule rate, 1 vs N processes
            rate_rows: dict[int, list] = {}
            for workers in (1, args.workers):
                rate_rows[workers] = []
                for rate in [float(r) for r in args.rates.split(",")]:
                    lag, got, cpu = on_schedule(
                        url, rate, workers=workers, requests=args.requests, repeats=args.repeats
                    )
                    rate_rows[workers].append((rate, lag, got, cpu))
                    progress(f"{workers} workers at {rate:g} req/s: achieved {got:.0f}, lag p99 {lag:.3f} ms")
                    if lag > 5 or got < 0.8 * rate:  # far past the limit; higher rates only get worse
                        break
            loads.append(os.getloadavg()[0])

    print(
        f"\n{started}; host: {os.cpu_count()} CPUs, load average (1 min) {min(loads):.1f}–{max(loads):.1f} "
        "during the run; "
        + (
            f"server pinned to CPUs {args.server_cpus}, client to {args.client_cpus or 'the rest'}; "
            if server_cpus
            else "server and client share the CPUs; "
        )
        + f"median of {args.repeats} runs"
    )
    print(
        f"\nfake server ceiling (closed loop 64, 8 tokens): {tc_ceiling:.0f} req/s driven by tritonclient, "
        f"{rtk_ceiling:.0f} req/s by rtk slo with {args.workers} workers\n"
    )
    print(
        "| client | CPU per request (µs) | CPU per streamed token (µs) | fixed cost per run (ms) "
        "| ratio to tritonclient (req / token) |"
    )
    print("|---|---:|---:|---:|---:|")
    base = med["tritonclient stream"]
    for name, (a, b, c) in med.items():
        print(f"| {name} | {a:.0f} | {b:.1f} | {c:.0f} | {a / base[0]:.2f} / {b / base[1]:.2f} |")
    best = {}
    print(
        "\n| workers | offered rate (req/s) | achieved (req/s) | send lag p99 (ms) "
        "| client CPU per request, whole run (µs) | on schedule |"
    )
    print("|---:|---:|---:|---:|---:|---|")
    for workers, rows_w in rate_rows.items():
        for rate, lag, got, cpu in rows_w:
            ok = lag < 1.0 and got >= 0.95 * rate
            if ok:
                best[workers] = rate
            print(f"| {workers} | {rate:g} | {got:.0f} | {lag:.3f} | {cpu:.0f} | {'yes' if ok else 'no'} |")
    one, many = best.get(1), best.get(args.workers)
    print(
        f"\nhighest on-schedule rate: 1 process {one or 'none'} req/s, {args.workers} processes {many or 'none'} req/s "
        f"(fake server ceiling {ceiling:.0f} req/s)"
    )
    if one and many:
        target = min(1.6 * one, ceiling)
        print(
            f"{args.workers} processes / 1 process: {many / one:.2f}× "
            f"(target: ≥ 1.6× or the ceiling, i.e. ≥ {target:.0f} req/s: "
            f"{'met' if many >= 0.95 * target else 'not met'})"
        )


if __name__ == "__main__":
    main()
