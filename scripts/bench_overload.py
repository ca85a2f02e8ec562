"""Overload through the front door: capacity, then 1.5x capacity with and without deadline-aware admission.

    .venv/bin/python scripts/bench_overload.py SPEC|REPOSITORY [--duration 60] [--load 1.5 | --rate R] [--deadline-ms D]

Starts tritonserver on the repository (free ports, ``serving.server_niceness`` or ``--server-niceness``) and the
front door as its own process in its own session (``python -m toolkit.frontdoor``, as ``rtk serve --detach`` does;
one at a time: a plain one, then one with a cache tier, then one with a rule tier), then, with this process as the
client (aiohttp on the front door's kind of event
loop, uvloop's where it is installed; streamed chat requests, every latency measured from the request's
*scheduled* send time, so this client's own lag counts against the server):

1. capacity.  A closed loop at ``build.max_batch_size`` concurrency first; the deadline D defaults to 2x the
   TTFT p50 measured there.  Then (``--capacity search``, the default) capacity is what ``rtk slo --search
   rate`` finds through the front door without a deadline: the highest Poisson rate whose TTFT p99 stays
   within D (``toolkit.slo.runner.search_slo``, the same prompts as the phases below, ``--search-requests``
   at each rate); ``--capacity closed-loop`` takes the closed loop's answers per second instead.
2. the same Poisson schedule at ``load`` x capacity (or ``--rate`` requests/s: capacity varies between runs
   on a shared host, so runs compared take one rate) for ``duration`` seconds, twice: without a deadline
   (the peer: every request queues) and with D as each request's deadline (``x-rtk-ttft-deadline-ms``).
   Goodput counts answers whose first token came within D.
3. refusals under saturation: a closed loop of 2x ``build.max_batch_size`` streams, and beside it a request with a
   1 ms deadline every ``--probe-period`` s for ``--probe-seconds`` (hundreds of refusals: a p99 that is not just
   the slowest of a few dozen).
4. cache: a deterministic request repeated; TTFT of the cache hits against the same request's first answer.
5. fallback: the primary held busy by long requests; requests with deadline D answered by a rule tier.

The overload phases also print this client's send lag (scheduled → sent), the refusal latency and served
TTFT from the send, and both as the front door timed them (its ``Server-Timing`` header: from its handler's
start to the response's head): on a 2-core host the client shares the cores with the engine and the front
door, and a refusal the front door made in 4 ms can reach the table at 120 ms when the client sent it late.
``--client-nice -10`` (where permitted) raises this client's CPU priority once the server and the front door run.

Each phase also compares the admission's predicted TTFT (the ``x-rtk-predicted-ttft-ms`` header of every
primary answer) with the TTFT measured here.  Prints one table with the host's load average; a benchmark,
not a test: run it under the shared CPU lock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.slo.outcome import TIMING_HEADER, server_timing_ms  # noqa: E402
from toolkit.triton import launch  # noqa: E402
from toolkit.triton.server import free_ports  # noqa: E402

TOPICS = [
    "the sea",
    "a lighthouse",
    "autumn",
    "a small robot",
    "the moon",
    "a bakery",
    "trains",
    "a garden",
    "winter",
    "a library",
    "mountains",
    "a violin",
    "rain",
    "a fox",
    "the desert",
    "a market",
]


@dataclass
class Result:
    scheduled: float
    status: int = 0
    ttft: float | None = None  # seconds from the scheduled send to the first content (or to the refusal)
    sent: float | None = None  # seconds from the scheduled send to the moment this client sent it (its own lag)
    end: float | None = None
    tier: str = ""
    tokens: int = 0
    predicted: float | None = None  # seconds: the admission's TTFT prediction (x-rtk-predicted-ttft-ms)
    frontdoor: float | None = None  # seconds: the front door's own time to the response's head (Server-Timing)


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def prediction_row(label: str, served: list[Result]) -> tuple[str, str]:
    """How the admission's predictions compared with the TTFT the client measured (primary answers)."""
    pairs = [(r.ttft, r.predicted) for r in served if r.ttft is not None and r.predicted]
    if not pairs:
        return (f"… {label}: measured / predicted TTFT", "no predictions (an older front door?)")
    ratio = [m / p for m, p in pairs]
    late = sum(m > p for m, p in pairs) / len(pairs)
    return (
        f"… {label}: measured / predicted TTFT p10 / p50 / p90 ({len(pairs)} answers)",
        f"{pct(ratio, 10):.2f} / {pct(ratio, 50):.2f} / {pct(ratio, 90):.2f}; {late:.0%} later than predicted",
    )


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]} (number {i})."}]


async def one(client, url, model, i, at, t0, *, max_tokens, deadline_ms=None, body_extra=None, msgs=None) -> Result:
    delay = t0 + at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    res = Result(scheduled=at)
    headers = {"x-rtk-ttft-deadline-ms": f"{deadline_ms:g}"} if deadline_ms else {}
    body = {
        "model": model,
        "messages": msgs or messages(i),
        "max_tokens": max_tokens,
        "stream": True,
        **(body_extra or {}),
    }
    start = t0 + at
    res.sent = time.perf_counter() - start
    try:
        async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            res.status, res.tier = r.status, r.headers.get("x-rtk-tier", "")
            if "x-rtk-predicted-ttft-ms" in r.headers:
                res.predicted = float(r.headers["x-rtk-predicted-ttft-ms"]) / 1e3
            ms = server_timing_ms(r.headers.get(TIMING_HEADER))
            res.frontdoor = None if ms is None else ms / 1e3
            if r.status != 200:
                await r.read()
                res.ttft = res.end = time.perf_counter() - start
                return res
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                obj = json.loads(line[6:])
                if obj.get("choices") and obj["choices"][0].get("delta", {}).get("content"):
                    if res.ttft is None:
                        res.ttft = time.perf_counter() - start
                    res.tokens += 1
            res.end = time.perf_counter() - start
    except aiohttp.ClientError:
        res.status = -1
    return res


def client_session() -> aiohttp.ClientSession:
    """aiohttp (rtk slo's OpenAI client too), connections unlimited: at 1.5x capacity without admission hundreds of
    requests are in flight."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600), auto_decompress=False
    )


async def run_schedule(url, model, times, *, max_tokens, deadline_ms=None):
    async with client_session() as client:
        t0 = time.perf_counter() + 0.2
        return await asyncio.gather(
            *(
                one(client, url, model, i, at, t0, max_tokens=max_tokens, deadline_ms=deadline_ms)
                for i, at in enumerate(times)
            )
        )


async def closed_loop(url, model, concurrency, n, *, max_tokens):
    results = []
    async with client_session() as client:
        counter = iter(range(n))

        async def worker():
            for i in counter:
                t0 = time.perf_counter()
                results.append(await one(client, url, model, i, 0.0, t0, max_tokens=max_tokens))

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t


def start_frontdoor(repo: Path, server, port: int, *sets: str) -> subprocess.Popen:
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
        *(a for s in sets for a in ("--set", s)),
    ]
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        start_new_session=True,  # as rtk serve --detach starts it: its own session (and autogroup), not the client's
    )
    line = p.stdout.readline()
    if not line.startswith("ready"):
        raise SystemExit(f"the front door did not start: {line}{p.stderr.read()}")
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--load", type=float, default=1.5, help="offered rate as a multiple of the measured capacity")
    ap.add_argument(
        "--rate",
        type=float,
        default=None,
        help="offered rate in requests/s instead of --load x capacity (the same load for runs compared)",
    )
    ap.add_argument("--deadline-ms", type=float, default=None, help="default: 2x the TTFT p50 in the closed loop")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--capacity-requests", type=int, default=48, help="requests of the closed loop")
    ap.add_argument(
        "--capacity",
        choices=("search", "closed-loop"),
        default="search",
        help="search: the highest Poisson rate whose TTFT p99 is within D without admission (rtk slo --search rate); "
        "closed-loop: the closed loop's answers per second",
    )
    ap.add_argument(
        "--search-requests", type=int, default=150, help="requests the search sends at each rate (p99 needs ≥ 100)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--probe-seconds",
        type=float,
        default=30.0,
        help="refusals under saturation: how long a must-refuse request is sent beside a saturating closed loop "
        "(0: skip)",
    )
    ap.add_argument("--probe-period", type=float, default=0.05, help="seconds between the must-refuse requests")
    ap.add_argument(
        "--client-nice",
        type=int,
        default=None,
        help="this client's niceness once the server and the front door run (e.g. -10: needs CAP_SYS_NICE); "
        "default: unchanged",
    )
    ap.add_argument(
        "--server-niceness",
        type=int,
        default=None,
        help="serving.server_niceness for the server started (default: the spec's)",
    )
    ap.add_argument(
        "--frontdoor-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a spec setting for every front door started, e.g. serving.guard.prediction_quantile=null (repeatable)",
    )
    args = ap.parse_args()

    t = launch.resolve(args.source)
    if args.server_niceness is not None:
        t.serving.server_niceness = args.server_niceness
    server = launch.make_server(t, free_ports=True)
    server.start()
    procs = []
    try:
        server.wait_ready(models=t.models)
        sets = args.frontdoor_set

        def frontdoor(*more: str) -> str:
            """Another front door on the server (one at a time: an idle one still polls Triton's gauges)."""
            for p in procs:
                p.terminate()
                p.wait(10)
            procs.clear()
            (port,) = free_ports(1)
            procs.append(start_frontdoor(t.repository, server, port, *sets, *more))
            return f"http://127.0.0.1:{port}"

        rows = [client_priority(args.client_nice)]
        rows += run_all(args, t, frontdoor)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        server.stop()
    print(
        f"\nload average (1/5/15 min) after the run: {' '.join(open('/proc/loadavg').read().split()[:3])}; "
        f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print("\n| measurement | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    return 0


def run(coro):
    """``coro`` on the event loop the front door runs on (uvloop's where it is installed), as bench_filter.py's
    client does: the client's own lag counts in every latency here, so it runs on the faster loop."""
    from toolkit.frontdoor.runner import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory("auto")[0]) as runner:
        return runner.run(coro)


def ms3(xs) -> str:
    """p50 / p99 / max of seconds, in ms."""
    return f"{pct(xs, 50) * 1e3:.1f} / {pct(xs, 99) * 1e3:.1f} / {max(xs) * 1e3:.1f} ms"


def search_capacity(args, t, url, model, deadline_ms, hint) -> tuple[float, list[tuple[str, str]]]:
    """The highest Poisson rate at which the front door without a deadline keeps TTFT p99 within D: ``rtk slo
    --search rate`` (doubling from half the closed loop's rate, then bisecting to 10 %), with the phases' prompts."""
    from toolkit.slo.runner import search_slo
    from toolkit.slo.verdict import PASS
    from toolkit.spec import Objective, SLOSpec

    def point(rep) -> None:
        d = rep.dist("ttft")
        print(
            f"  search: {rep.plan.value:.2f} req/s, TTFT p99 {d.p99:.0f} ms over {rep.summary.measured} requests: "
            f"{rep.verdict.status}",
            flush=True,
        )

    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text(
            "".join(
                json.dumps({"text": messages(i)[0]["content"], "output_tokens": args.output_tokens}) + "\n"
                for i in range(args.search_requests + t.build.max_batch_size)  # each rate's requests and warm-up
            )
        )
        slo = SLOSpec(
            transport="openai",
            endpoint="chat",
            model=model,
            request_rate=hint,
            arrival="poisson",
            num_requests=args.search_requests,
            warmup_requests=t.build.max_batch_size,
            dataset=str(prompts),
            seed=args.seed,
            objectives=[Objective(metric="ttft", stat="p99", max=deadline_ms)],
            # This client shares the host's cores with the server it saturates; its lag is measured and counts
            # against the server (latencies run from the schedule), so a lagging point is a miss, not unknown.
            max_schedule_lag_ms=1e6,
        )
        rep = search_slo(
            slo,
            url,
            kind="rate",
            start=hint / 2,
            limit=hint * 8,
            precision=0.1,
            max_steps=8,
            repository=t.repository,
            on_point=point,
        )
    if rep.best is None:
        raise SystemExit(f"the capacity search found no rate with TTFT p99 within {deadline_ms:.0f} ms: {rep.notes}")
    tried = ", ".join(
        f"{p.plan.value:.2f} ({p.dist('ttft').p99:.0f} ms, {'pass' if p.verdict.status == PASS else 'miss'})"
        for p in rep.points
    )
    return rep.best, [
        (
            f"capacity: rtk slo --search rate, TTFT p99 ≤ D without a deadline, {args.search_requests} requests a rate",
            f"**{rep.best:.2f} req/s**",
        ),
        ("… rates tried, req/s (TTFT p99)", tried),
    ]


def client_priority(nice: int | None) -> tuple[str, str]:
    """This client's niceness, set once the server and the front door run (each in a session of its own): a client
    starved of CPU by the engine it saturates adds its own lag to every latency it measures.  Linux's niceness is a
    thread's, so every thread's; with autogroups (``/proc/sys/kernel/sched_autogroup_enabled``) the scheduler shares
    the CPU between sessions first, so also this session's autogroup's.  A negative value needs CAP_SYS_NICE;
    without it the client stays as it was."""
    row = "this client's niceness (the server and the front door: the caller's, each in its own session)"
    if nice is None:
        return row, f"{os.getpriority(os.PRIO_PROCESS, 0)} (unchanged)"
    try:
        for task in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(task), nice)
        group = Path("/proc/self/autogroup")
        if group.exists() and Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
            group.write_text(str(nice))
            return row, f"{nice} (and its session's autogroup)"
    except OSError as exc:
        print(f"--client-nice {nice}: not applied ({exc.strerror}); the client keeps its niceness", flush=True)
        return row, f"{os.getpriority(os.PRIO_PROCESS, 0)} (--client-nice {nice} not permitted)"
    return row, f"{nice}"


def refusal_rows(prefix: str, shed: list[Result]) -> list[tuple[str, str]]:
    """The refusals' latency from this client's send, and the front door's own (``Server-Timing``) where it sent it."""
    rows = [(f"{prefix} refusal latency from the send p50 / p99 / max", ms3([r.ttft - r.sent for r in shed]))]
    inside = [r.frontdoor for r in shed if r.frontdoor is not None]
    if inside:
        rows.append((f"{prefix} refusal in the front door (Server-Timing) p50 / p99 / max", ms3(inside)))
    return rows


def refusal_probe(args, url: str, model: str, conc: int) -> list[tuple[str, str]]:
    """Refusals under saturation, enough of them for a p99: a closed loop of 2x max_batch_size streams without a
    deadline keeps the engine busy and a queue waiting, and beside it a request that no prediction can meet (a 1 ms
    deadline) every ``--probe-period`` seconds.  The overload phases refuse a few dozen requests, so their p99 is
    about their slowest one."""
    period, seconds = args.probe_period, args.probe_seconds

    async def go():
        async with client_session() as client:
            stop = asyncio.Event()

            async def stream(i: int) -> None:
                k = 0
                while not stop.is_set():
                    await one(
                        client, url, model, 5000 + 100 * i + k, 0.0, time.perf_counter(), max_tokens=args.output_tokens
                    )
                    k += 1

            loops = [asyncio.create_task(stream(i)) for i in range(2 * conc)]
            await asyncio.sleep(2.0)  # the queue builds
            t0 = time.perf_counter()
            probes = await asyncio.gather(
                *(
                    one(client, url, model, 9000 + j, j * period, t0, max_tokens=args.output_tokens, deadline_ms=1)
                    for j in range(int(seconds / period))
                )
            )
            stop.set()
            await asyncio.gather(*loops)
            return probes

    probes = run(go())
    label = (
        f"refusals under saturation ({2 * conc} streams in a closed loop, a request with a 1 ms deadline every "
        f"{period * 1e3:.0f} ms for {seconds:.0f} s)"
    )
    statuses = Counter(r.status for r in probes)
    shed = [r for r in probes if r.status in (429, 503)]
    rows = [(f"{label}: statuses", ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items())))]
    if shed:
        rows += refusal_rows("…", shed)
        rows += [
            ("… refusals over 50 ms from the send", f"{sum(r.ttft - r.sent > 0.05 for r in shed)} of {len(shed)}"),
            ("… this client's send lag p50 / p99 / max", ms3([r.sent for r in probes])),
        ]
    print(rows[1] if shed else rows[0], flush=True)
    return rows


def run_all(args, t, frontdoor):
    """The phases.  ``frontdoor(*settings)`` starts the front door a phase uses (and stops the one before)."""
    plain = frontdoor()
    model = httpx.get(plain + "/v1/models").json()["data"][0]["id"]
    rows = [("serving.server_niceness (tritonserver and its models)", str(t.serving.server_niceness))]
    conc = t.build.max_batch_size
    run(closed_loop(plain, model, conc, conc, max_tokens=args.output_tokens))  # warm the path
    res, wall = run(closed_loop(plain, model, conc, args.capacity_requests, max_tokens=args.output_tokens))
    ok = [r for r in res if r.status == 200]
    capacity = closed = len(ok) / wall
    ttft50 = pct([r.ttft for r in ok if r.ttft], 50)
    deadline_ms = args.deadline_ms or round(2 * ttft50 * 1000, -1)
    rows += [
        (f"closed loop (concurrency = max_batch_size {conc}): answers per second", f"{closed:.2f} req/s"),
        (
            "TTFT p50 / p99 in the closed loop",
            f"{ttft50 * 1e3:.0f} / {pct([r.ttft for r in ok if r.ttft], 99) * 1e3:.0f} ms",
        ),
        (
            f"answer length in the closed loop, content chunks p10 / p50 / p90 (max_tokens {args.output_tokens})",
            " / ".join(f"{pct([r.tokens for r in ok], q):.0f}" for q in (10, 50, 90)),
        ),
        prediction_row("closed loop", ok),
        ("deadline D", f"{deadline_ms:.0f} ms"),
    ]
    print(f"closed loop {closed:.2f} req/s, TTFT p50 {ttft50 * 1e3:.0f} ms, deadline {deadline_ms:.0f} ms", flush=True)
    if args.capacity == "search":
        capacity, search_rows = search_capacity(args, t, plain, model, deadline_ms, hint=closed)
        rows += search_rows
    else:
        rows.append(("capacity", "the closed loop's answers per second"))

    rate = args.rate or args.load * capacity
    rng = random.Random(args.seed)
    times, at = [], 0.0
    while at < args.duration:
        times.append(at)
        at += rng.expovariate(rate)
    for label, d in (("no deadline (peer)", None), ("deadline D (front door admission)", deadline_ms)):
        res = run(run_schedule(plain, model, times, max_tokens=args.output_tokens, deadline_ms=d))
        served = [r for r in res if r.status == 200]
        shed = [r for r in res if r.status in (429, 503)]
        other = [r for r in res if r.status not in (200, 429, 503)]
        ttfts = [r.ttft for r in served if r.ttft is not None]
        good = [x for x in ttfts if x * 1e3 <= deadline_ms]
        rows += [
            (
                f"{rate / capacity:.2g}x capacity, {label}: offered",
                f"{len(res)} requests in {args.duration:.0f} s ({rate:.2f}/s)",
            ),
            (f"… {label}: served / shed / failed", f"{len(served)} / {len(shed)} / {len(other)}"),
            (f"… {label}: served TTFT p50 / p99", f"{pct(ttfts, 50) * 1e3:.0f} / {pct(ttfts, 99) * 1e3:.0f} ms"),
            (
                f"… {label}: goodput (first token within D)",
                f"{len(good) / args.duration:.2f} req/s = {len(good) / args.duration / capacity:.0%} of capacity",
            ),
            prediction_row(label, served),
        ]
        rows.append(
            (f"… {label}: this client's send lag (scheduled → sent) p50 / p99 / max", ms3([r.sent for r in res]))
        )
        if ttfts:
            rows.append(
                (
                    f"… {label}: served TTFT from the send p50 / p99 / max",
                    ms3([r.ttft - r.sent for r in served if r.ttft]),
                )
            )
            heads = [r.frontdoor for r in served if r.frontdoor is not None]
            if heads:
                rows.append((f"… {label}: served TTFT in the front door (Server-Timing) p50 / p99 / max", ms3(heads)))
        if shed:
            rows.append((f"… {label}: refusal latency p50 / p99 / max", ms3([r.ttft for r in shed])))
            rows += refusal_rows(f"… {label}:", shed)
        print(rows[-1], flush=True)

    if args.probe_seconds > 0:
        rows += refusal_probe(args, plain, model, conc)

    # Cache: the first answer from the engine, then hits.
    cached = frontdoor("serving.guard.fallbacks=[{kind: cache}]")

    async def cache_run():
        async with client_session() as client:
            firsts, hits = [], []
            for i in range(5):
                msgs = messages(1000 + i)
                r = await one(
                    client,
                    cached,
                    model,
                    i,
                    0.0,
                    time.perf_counter(),
                    max_tokens=args.output_tokens,
                    body_extra={"temperature": 0},
                    msgs=msgs,
                )
                firsts.append(r)
                for _ in range(8):
                    hits.append(
                        await one(
                            client,
                            cached,
                            model,
                            i,
                            0.0,
                            time.perf_counter(),
                            max_tokens=args.output_tokens,
                            body_extra={"temperature": 0},
                            msgs=msgs,
                        )
                    )
            return firsts, hits

    firsts, hits = run(cache_run())
    assert all(r.tier == "primary" for r in firsts) and all(r.tier == "cache" for r in hits), "cache tiers"
    rows += [
        ("cache: TTFT of the first (engine) answer p50", f"{pct([r.ttft for r in firsts], 50) * 1e3:.1f} ms"),
        (
            "cache: TTFT of a repeated deterministic request p50 / p99 (40 hits)",
            f"{pct([r.ttft for r in hits], 50) * 1e3:.2f} / {pct([r.ttft for r in hits], 99) * 1e3:.2f} ms",
        ),
    ]

    # Fallback: hold the primary busy with long requests, then ask with deadline D.
    ruled = frontdoor("serving.guard.fallbacks=[{kind: rule, template: 'Busy right now.'}]")

    async def fallback_run():
        async with client_session() as client:
            now = time.perf_counter()
            hold = [
                asyncio.create_task(one(client, ruled, model, 2000 + i, 0.0, now, max_tokens=4 * args.output_tokens))
                for i in range(2 * conc)
            ]
            await asyncio.sleep(1.0)
            asks = []
            for i in range(10):
                asks.append(
                    await one(
                        client,
                        ruled,
                        model,
                        3000 + i,
                        0.0,
                        time.perf_counter(),
                        max_tokens=args.output_tokens,
                        deadline_ms=deadline_ms,
                    )
                )
            await asyncio.gather(*hold)
            return asks

    asks = run(fallback_run())
    tiers = {}
    for r in asks:
        tiers[r.tier] = tiers.get(r.tier, 0) + 1
    lat = [r.ttft for r in asks if r.ttft is not None]
    rows += [
        (
            f"fallback (primary held busy by {2 * conc} long requests): tiers of 10 requests",
            ", ".join(f"{k} {v}" for k, v in sorted(tiers.items())),
        ),
        (
            "fallback: TTFT p50 / max",
            f"{pct(lat, 50) * 1e3:.1f} / {max(lat) * 1e3:.1f} ms (deadline {deadline_ms:.0f} ms)",
        ),
    ]
    return rows


if __name__ == "__main__":
    sys.exit(main())
