#!/usr/bin/env python
"""Does a hot model update drop or slow requests?  ``rtk slo`` at a steady rate through the front door while
``rtk serve --reload`` swaps the server under it.

    flock /tmp/rtk/cpu.lock python scripts/bench_reload.py [--spec examples/smollm2-cpu.yaml] [--rate 1.0]

The script runs ``rtk build SPEC`` (cached stages are skipped), starts ``rtk serve SPEC --detach`` on free ports
(its state file and logs in a temporary run directory, so it never meets another server of the same repository),
then runs ``rtk slo SPEC --transport openai`` against the front door at ``--rate`` requests per second (constant
arrivals) and, during that run, reloads the server ``--reloads`` times: the first ``--reload-after`` seconds
after the start, the next ones ``--gap`` seconds after the previous one ended.  The reloads alternate
``load_niceness`` 10 (the default: the new server loads at a lower CPU priority) and 0 (equal priority), so
both are measured against the same steady state.

Printed: failed requests (anything but a whole answer from the primary tier; target 0), and TTFT (from the
request's scheduled send to its first token, rtk slo's definition) p50 / p99 / max of the requests scheduled
in steady state (before the first reload, and from ``--settle`` seconds after each reload ended), and, pooled
per ``load_niceness``, of those scheduled during a reload (its start to its end), split into the new server
loading (the old one serving alone), the swap to the old server's exit, and the ``--settle`` seconds after.
Ratio: p99 / steady-state p99 (target ≤ 1.2).  The run's report.json (every request) stays in the printed
run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RTK = [sys.executable, "-m", "toolkit.cli"]  # the `rtk` of this interpreter


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def rtk(*args: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([*RTK, *args], env=env, cwd=ROOT, capture_output=True, text=True)
    if check and r.returncode != 0:
        sys.exit(f"rtk {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def stats(ttfts: list[float]) -> tuple[int, float, float, float]:
    if not ttfts:
        return 0, float("nan"), float("nan"), float("nan")
    a = np.array(ttfts)
    return len(a), float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(a.max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "examples" / "smollm2-cpu.yaml"))
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (constant arrivals)")
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--reloads", type=int, default=4)
    ap.add_argument("--reload-after", type=float, default=60.0, help="seconds of steady state before the first")
    ap.add_argument("--gap", type=float, default=40.0, help="seconds from the end of one reload to the next")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds after a reload not counted as steady")
    ap.add_argument("--tail", type=float, default=45.0, help="seconds of load after the last reload")
    args = ap.parse_args()

    from toolkit.spec import load_spec
    from toolkit.triton import launch

    spec = load_spec(args.spec)
    http, grpc, metrics, front = free_ports(4)
    sets = [
        f"serving.http_port={http}",
        f"serving.grpc_port={grpc}",
        f"serving.metrics_port={metrics}",
        f"serving.frontend.port={front}",
    ]
    overrides = [x for s in sets for x in ("--set", s)]
    run_dir = Path(tempfile.mkdtemp(prefix="rtk-bench-reload-"))
    env = {**os.environ, "RTK_RUN_DIR": str(run_dir)}
    os.environ["RTK_RUN_DIR"] = str(run_dir)  # the in-process reloads find the same state file
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; loadavg {Path('/proc/loadavg').read_text().strip()}"
    )
    print(rtk("build", args.spec, env=env).stdout.strip())
    rtk("serve", args.spec, *overrides, "--detach", "--timeout", "600", env=env)
    fd = f"http://127.0.0.1:{front}/v1"
    duration = args.reload_after + args.reloads * (40.0 + args.gap) + args.tail  # 40 s: a reload, roughly
    n = int(duration * args.rate)
    out = run_dir / "slo"
    slo = subprocess.Popen(
        [
            *RTK,
            "slo",
            args.spec,
            *overrides,
            "--transport",
            "openai",
            "--endpoint",
            "chat",
            "--url",
            fd,
            "--model",
            spec.serving.frontend.model_name or spec.name,
            "--request-rate",
            str(args.rate),
            "--arrival",
            "constant",
            "--num-requests",
            str(n),
            "--warmup-requests",
            "4",
            "--input-tokens",
            str(args.input_tokens),
            "--output-tokens",
            str(args.output_tokens),
            "--objective",
            "error_rate<=0",
            "--max-schedule-lag-ms",
            "1000",
            "--no-plots",
            "-o",
            str(out),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    slo_output: list[str] = []
    reader = threading.Thread(target=lambda: slo_output.extend(slo.stdout), daemon=True)
    reader.start()
    windows = []
    try:
        time.sleep(args.reload_after)
        for i in range(args.reloads):
            niceness = 10 if i % 2 == 0 else 0
            start = time.time()
            r = launch.reload(args.spec, overrides=sets, load_niceness=niceness)
            end = time.time()
            windows.append(dict(niceness=niceness, start=start, end=end, in_flight=r.in_flight, seconds=r.seconds))
            print(f"reload {i + 1} (load_niceness {niceness}): {r.seconds}, {r.in_flight} in flight at the swap")
            if i + 1 < args.reloads:
                time.sleep(args.gap)
        slo.wait(timeout=duration * 3)
        reader.join(10)
    finally:
        if slo.poll() is None:
            slo.terminate()
        rtk("serve", args.spec, *overrides, "--stop", env=env, check=False)
    report = out / "report.json"
    if not report.is_file():
        print("".join(slo_output))
        sys.exit("rtk slo wrote no report")
    data = json.loads(report.read_text())
    t0_unix, t0_ns = data["client"]["t0_unix"], data["client"]["t0_ns"]
    records = [r for r in data["records"] if r["phase"] == "measure"]

    def unix(ns: int) -> float:
        return t0_unix + (ns - t0_ns) / 1e9

    failed = [r for r in records if r["outcome"] != "served"]
    # Rows: steady state, then per load_niceness the requests scheduled while the new server loaded (the old
    # one serving), from the swap to the old server's exit, and in the first --settle seconds after.
    rows: dict[str, list[float]] = {"steady state": []}
    for n in sorted({w["niceness"] for w in windows}, reverse=True):
        for phase in ("whole reload", "new server loading", "swap, drain, old server stopping", "settle"):
            rows[f"load_niceness {n}: {phase}"] = []
    for r in records:
        if r["outcome"] != "served":
            continue
        at = unix(r["scheduled_ns"])
        ttft = (r["chunk_ns"][0] - r["scheduled_ns"]) / 1e6
        where = ["steady state"]
        for w in windows:
            swap = w["start"] + w["seconds"]["start"]
            tag = f"load_niceness {w['niceness']}: "
            if w["start"] <= at <= w["end"]:
                where = [
                    tag + "whole reload",
                    tag + ("new server loading" if at < swap else "swap, drain, old server stopping"),
                ]
            elif w["end"] < at <= w["end"] + args.settle:
                where = [tag + "settle"]
        for name in where:
            rows[name].append(ttft)
    base = stats(rows["steady state"])
    print(f"\n{len(records)} requests at {args.rate}/s, {args.input_tokens} in / {args.output_tokens} out tokens")
    print(f"failed requests: {len(failed)}" + (f" ({sorted({r['outcome'] for r in failed})})" if failed else ""))
    print(f"{len(windows)} reloads: " + "; ".join(f"load_niceness {w['niceness']} {w['seconds']}" for w in windows))
    print("\n| requests scheduled during | requests | TTFT p50 ms | TTFT p99 ms | TTFT max ms | p99 / steady p99 |")
    print("|---|---|---|---|---|---|")
    for name, ttfts in rows.items():
        n, p50, p99, top = stats(ttfts)
        print(f"| {name} | {n} | {p50:.0f} | {p99:.0f} | {top:.0f} | {p99 / base[2]:.2f} |")
    (run_dir / "reloads.json").write_text(json.dumps(windows, indent=1))
    print(f"\nrequests: {report}; reloads: {run_dir / 'reloads.json'}")
    print(f"loadavg after: {Path('/proc/loadavg').read_text().strip()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
