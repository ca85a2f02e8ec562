#!/usr/bin/env python
"""What the rtk slo client itself costs, and how fast it keeps a schedule with 1 and with N processes.

Against a tritonserver (started here, on 127.0.0.1) serving a trivial decoupled python model that
streams tokens with no delay (tests/triton_helpers.py ``write_fake_llm``, ttft = itl = 0):

0. **The fake server's own ceiling**: closed loop at concurrency 64, 8 tokens per request, driven
   by tritonclient's stream API (the cheapest client), by rtk with 1 and with N workers; the highest
   median completed-request rate is what this host's server can do while a client runs beside it.
1. **Client CPU per request and per streamed token**, tritonclient and rtk run alternately (the
   order flips each repeat).  Each client's process CPU time (``time.process_time``: every thread,
   gRPC's own included; the server is another process) is read over the *measured window*: from
   the moment the stream is open and warm to the last final response (tritonclient) or to the
   summary and verdict computed (rtk), so connecting, spawning and building the workload are out
   and nothing has to be fitted away.  Closed loop, ``--requests`` N: per 1-token request from a
   run of 2N one-token requests (a run of N gives the same figure when the window has no fixed
   cost), per further token from a run of N 64-token requests.  The peer is tritonclient's own
   stream API (``start_stream`` + ``async_stream_infer`` with a callback) doing nothing but
   counting — about the least a Python client of this protocol can do — on the same requests
   (same inputs and requested outputs, server timestamps included).  rtk's window holds
   everything ``run_slo`` does per request: prompts, wire requests, timestamps, decoding, metrics.
   The same runs' whole-process CPU, fitted as ``cpu = c + a·requests + b·tokens``, is printed
   beside it to show how noisy that older measure is.
2. **Highest on-schedule request rate**, for 1 and for N worker processes (``--workers``): open-loop
   constant arrivals at increasing rates, 8 tokens per request; a rate is kept when the client's
   send lag p99 (sent − due) is under 1 ms and at least 95 % of the offered rate completed.

Each number is the median of ``--repeats`` runs, with the spread (min–max) beside it.  Unless
the server and the client are pinned apart, they share the machine's cores, and the rates are
those of *this* host with its server, not the client alone.

    python scripts/bench_client.py [--repeats 3] [--requests 1000] [--workers 2] [--sections cost]
    python scripts/bench_client.py --server-cpus 0 --client-cpus 1        # a 2-core host
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

from toolkit.slo.client import Client, ClientJob  # noqa: E402
from toolkit.slo.records import SERVER_STAMPS  # noqa: E402
from toolkit.slo.runner import judge, run_slo  # noqa: E402
from toolkit.spec import SLOSpec  # noqa: E402

INTERFACE = "ensemble"  # --interface: the fake model's tensor interface and its name on the server


def slo_of(*, tokens: int, requests: int, concurrency: int | None = None, rate: float | None = None, workers=1):
    return SLOSpec(
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


def rtk_run(
    url: str, *, tokens: int, requests: int, concurrency: int | None = None, rate: float | None = None, workers: int = 1
):
    """(client CPU seconds, report); with workers the CPU is every worker's plus this process's."""
    slo = slo_of(tokens=tokens, requests=requests, concurrency=concurrency, rate=rate, workers=workers)
    t = time.process_time()
    rep = run_slo(slo, url, keep_output=False, workers=workers)
    cpu = time.process_time() - t + (rep.client["cpu_s"] if workers > 1 else 0.0)
    assert rep.summary.failed == 0, rep.summary.errors
    return cpu, rep


def rtk_cost(url: str, *, tokens: int, requests: int, concurrency: int) -> tuple[float, float]:
    """One client process's CPU seconds for a closed-loop run: (whole run, measured window).

    The steps are those of ``run_slo`` in one process (Client, open_and_warm, measure, finish,
    judge).  The whole run starts before the workload and the connection are built; the window
    starts after the stream is open and warm and ends when the summary and verdict are computed,
    so it holds only per-request work: prompts, wire requests, sends, reading, decoding, metrics.
    """
    slo = slo_of(tokens=tokens, requests=requests, concurrency=concurrency)
    job = ClientJob(
        slo=slo.model_dump(), urls=[url], transport="grpc", model=INTERFACE, endpoint=INTERFACE, keep_output=False
    )
    whole = time.process_time()
    client = Client(job)
    try:
        client.open_and_warm()
        window = time.process_time()
        client.measure(None)
    finally:
        result = client.finish()
    summary, _, _ = judge(result.records, slo, [])
    end = time.process_time()
    assert summary.failed == 0, summary.errors
    return end - whole, end - window


def tritonclient_run(url: str, *, tokens: int, requests: int, concurrency: int) -> tuple[float, float, float]:
    """The peer: tritonclient's stream API, ``concurrency`` in flight, counting final responses.
    Returns (CPU seconds of the whole run, CPU seconds of the window, completed requests per second);
    the window starts once the stream is open and ends at the last final response."""
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
    window = time.process_time()
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
    window = time.process_time() - window
    client.stop_stream()
    client.close()
    cpu = time.process_time() - t
    assert state["errors"] == 0 and state["done"] == requests, state
    return cpu, window, requests / wall


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """cpu = c + a·requests + b·tokens from (requests, tokens, cpu) points; returns (a, b) in µs and c in ms.

    The constant c is each run's fixed cost (connecting, building the workload, the report): without
    it, a fit over runs of equal length would charge it to every request.
    """
    A = np.array([[1.0, r, k] for r, k, _ in points], dtype=float)
    y = np.array([c for _, _, c in points])
    c, a, b = np.linalg.lstsq(A, y, rcond=None)[0]
    return a * 1e6, b * 1e6, c * 1e3


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


def spread(xs: list[float], fmt: str = ".0f") -> str:
    """'median (min–max)' of xs."""
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}–{max(xs):{fmt}})"


def cost_section(url: str, args) -> list[str]:
    """Client CPU per request and per token, tritonclient and rtk alternately; the table's lines."""
    n = args.requests
    runs = ((n, 1), (2 * n, 1), (n, 64))
    clients = {
        "rtk slo (gRPC, 1 process)": lambda req, tok: rtk_cost(
            url, tokens=tok, requests=req, concurrency=args.concurrency
        ),
        "tritonclient stream": lambda req, tok: tritonclient_run(
            url, tokens=tok, requests=req, concurrency=args.concurrency
        )[:2],
    }
    # per client: lists over repeats of the window's µs per request / per token, and the fit's (a, b, c)
    direct: dict[str, list[tuple[float, float, float]]] = {k: [] for k in clients}
    fits: dict[str, list[tuple[float, float, float]]] = {k: [] for k in clients}
    for rep in range(args.repeats):
        order = list(clients) if rep % 2 else list(reversed(clients))  # tritonclient first, then rtk first, ...
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in clients}
        for req, tok in runs:
            for name in order:
                got[name].append(clients[name](req, tok))
        for name, ((_, c1), (_, c2), (_, c3)) in got.items():
            fits[name].append(fit([(req, req * tok, w) for (req, tok), (w, _) in zip(runs, got[name], strict=True)]))
            per_req_n, per_req_2n = c1 / n * 1e6, c2 / (2 * n) * 1e6
            per_token = (c3 / n - c2 / (2 * n)) / 63 * 1e6
            direct[name].append((per_req_n, per_req_2n, per_token))
        progress(
            f"cost repeat {rep + 1}: "
            + "; ".join(
                f"{k}: window {d[-1][0]:.0f}/{d[-1][1]:.0f} µs per request (N/2N), {d[-1][2]:.1f} µs per token, "
                f"fit {fits[k][-1][0]:.0f} µs/req {fits[k][-1][1]:.1f} µs/tok {fits[k][-1][2]:.0f} ms"
                for k, d in direct.items()
            )
        )
    rtk, tc = list(clients)
    lines = [
        f"Client CPU in the measured window (closed loop {args.concurrency}, {2 * n} one-token requests and "
        f"{n} 64-token requests per repeat; median (min–max) of {args.repeats} repeats, ratios taken within a repeat):",
        "",
        "| client | CPU per 1-token request (µs) | CPU per further streamed token (µs) "
        "| CPU per 8-token request (µs; 1-token + 7 further) | ratio to tritonclient (1-token / token / 8-token) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in clients:
        d = direct[name]
        eight = [x[1] + 7 * x[2] for x in d]
        r_req = [x[1] / y[1] for x, y in zip(d, direct[tc], strict=True)]
        r_tok = [x[2] / y[2] for x, y in zip(d, direct[tc], strict=True)]
        r_eight = [(x[1] + 7 * x[2]) / (y[1] + 7 * y[2]) for x, y in zip(d, direct[tc], strict=True)]
        lines.append(
            f"| {name} | {spread([x[1] for x in d])} | {spread([x[2] for x in d], '.1f')} | {spread(eight)} "
            f"| {spread(r_req, '.2f')} / {spread(r_tok, '.2f')} / {spread(r_eight, '.2f')} |"
        )
    lines += [
        "",
        "The same runs' whole-process CPU (connecting, warm-up and the report included), fitted as "
        "cpu = c + a·requests + b·tokens per repeat:",
        "",
        "| client | a: per request (µs) | b: per token (µs) | c: fixed per run (ms) | ratio a / a(tritonclient) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in clients:
        f = fits[name]
        ratio = [x[0] / y[0] for x, y in zip(f, fits[tc], strict=True)]
        lines.append(
            f"| {name} | {spread([x[0] for x in f])} | {spread([x[1] for x in f], '.1f')} "
            f"| {spread([x[2] for x in f])} | {spread(ratio, '.2f')} |"
        )
    return lines


def rate_section(url: str, args, ceiling: float) -> list[str]:
    """The highest on-schedule rate for 1 and for N processes; the table's lines."""
    rate_rows: dict[int, list] = {}
    for workers in (1, args.workers):
        rate_rows[workers] = []
        for rate in [float(r) for r in args.rates.split(",")]:
            lags, achieved, cpus = [], [], []
            for _ in range(args.repeats):
                n = max(args.rate_requests, int(2 * rate))  # at least ~2 s of load
                cpu, rep = rtk_run(url, tokens=8, requests=n, rate=rate, workers=workers)
                lags.append(rep.dist("client_lag").p99)
                achieved.append(rep.summary.aggregates["request_throughput"])
                cpus.append(cpu / n * 1e6)
            lag, got = statistics.median(lags), statistics.median(achieved)
            rate_rows[workers].append((rate, lags, achieved, cpus))
            progress(f"{workers} workers at {rate:g} req/s: achieved {got:.0f}, lag p99 {spread(lags, '.3f')} ms")
            if lag > 5 or got < 0.8 * rate:  # far past the limit; higher rates only get worse
                break
    best: dict[int, float] = {}
    lines = [
        "| workers | offered rate (req/s) | achieved (req/s) | send lag p99 (ms), median (min–max) "
        "| client CPU per request, whole run (µs) | on schedule |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for workers, rows_w in rate_rows.items():
        for rate, lags, achieved, cpus in rows_w:
            lag, got = statistics.median(lags), statistics.median(achieved)
            ok = lag < 1.0 and got >= 0.95 * rate
            if ok:
                best[workers] = rate
            lines.append(
                f"| {workers} | {rate:g} | {got:.0f} | {spread(lags, '.3f')} | {statistics.median(cpus):.0f} "
                f"| {'yes' if ok else 'no'} |"
            )
    one, many = best.get(1), best.get(args.workers)
    lines.append(
        f"\nhighest on-schedule rate: 1 process {one or 'none'} req/s, {args.workers} processes {many or 'none'} "
        f"req/s (fake server ceiling {ceiling:.0f} req/s)"
    )
    if one:
        target = min(1.6 * one, ceiling)
        if one >= 0.95 * ceiling:
            lines.append(
                f"1 process already keeps its schedule at {one / ceiling:.0%} of the fake server's ceiling: "
                f"the target (≥ 1.6× or the ceiling, whichever is lower, i.e. ≥ {target:.0f} req/s) is the "
                f"ceiling, and {args.workers} processes {'reach' if many and many >= 0.95 * target else 'miss'} it"
            )
        elif many:
            lines.append(
                f"{args.workers} processes / 1 process: {many / one:.2f}× (target: ≥ 1.6× or the ceiling, i.e. "
                f"≥ {target:.0f} req/s: {'met' if many >= 0.95 * target else 'not met'})"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1000, help="requests per run (the cost runs use N and 2N)")
    ap.add_argument("--concurrency", type=int, default=16, help="closed loop for the cost runs")
    ap.add_argument("--workers", type=int, default=2, help="client processes to compare with one")
    ap.add_argument("--rates", default="100,200,300,400,600,800,1200,1600", help="open-loop rates to try (req/s)")
    ap.add_argument("--rate-requests", type=int, default=400, help="least requests per open-loop run")
    ap.add_argument(
        "--sections",
        default="ceiling,cost,rates",
        help="what to measure, comma-separated: ceiling, cost, rates (rates needs ceiling)",
    )
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
    sections = set(args.sections.split(","))
    if "rates" in sections:
        sections.add("ceiling")
    server_cpus, client_cpus = cpu_set(args.server_cpus), cpu_set(args.client_cpus)
    everything = os.sched_getaffinity(0)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out: list[str] = []

    def load(when: str) -> None:
        out.append(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({when}, {time.strftime('%H:%M')})")

    load("before")
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

            ceiling = 0.0
            if "ceiling" in sections:
                rates = {"tritonclient": [], "rtk 1 process": [], f"rtk {args.workers} processes": []}
                for _ in range(args.repeats):
                    rates["tritonclient"].append(tritonclient_run(url, tokens=8, requests=2000, concurrency=64)[2])
                    for name, w in (("rtk 1 process", 1), (f"rtk {args.workers} processes", args.workers)):
                        rep = rtk_run(url, tokens=8, requests=2000, concurrency=64, workers=w)[1]
                        rates[name].append(rep.summary.aggregates["request_throughput"])
                ceiling = max(statistics.median(v) for v in rates.values())
                out.append(
                    "fake server ceiling (closed loop 64, 8 tokens, req/s, median (min–max)): "
                    + ", ".join(f"{k} {spread(v)}" for k, v in rates.items())
                )
                progress(out[-1])
                load("after the ceiling")
            if "cost" in sections:
                out += ["", *cost_section(url, args)]
                load("after the cost runs")
            if "rates" in sections:
                out += ["", *rate_section(url, args, ceiling)]
                load("after the rate runs")

    print(
        f"\n{started}; host: {os.cpu_count()} CPUs; "
        + (
            f"server pinned to CPUs {args.server_cpus}, client to {args.client_cpus or 'the rest'}; "
            if server_cpus
            else "server and client share the CPUs; "
        )
        + f"{args.repeats} repeats; interface {INTERFACE}\n"
    )
    print("\n".join(out))


if __name__ == "__main__":
    main()
