#!/usr/bin/env python
"""Which autoscaling signal moves under load: Triton's queue:compute ratio or the engine's waiting requests.

    python scripts/bench_autoscaling_signal.py SPEC|REPOSITORY [--concurrency 1 16] [--seconds 20]

Serves the repository with a real tritonserver (free ports, as ``rtk serve`` launches it), then for
each concurrency level runs a closed loop of streaming ``generate_stream`` requests on the ensemble
for ``--seconds`` while sampling ``/metrics`` every 200 ms. Printed per level:

* ``waiting`` — ``nv_trt_llm_request_metrics{request_type="waiting"}``: mean and max over the samples
  (the signal ``rtk deploy k8s`` scales on by default);
* ``queue:compute`` — Triton's ratio from the Kubernetes autoscaling tutorial over the level's window,
  ``Δnv_inference_queue_duration_us / Δnv_inference_compute_infer_duration_us``, for the
  ``tensorrt_llm`` model and for the ``ensemble``;
* completed requests per second, so the levels can be compared.

A level with concurrency ≤ ``build.max_batch_size`` should show no waiting requests; above it, the
requests beyond the batch wait in the engine.  The load average is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolkit.triton import launch

SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} ([0-9.eE+-]+)$")


def scrape(url: str) -> list[tuple[str, dict, float]]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def value(samples, name: str, **labels) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def stream_once(http_url: str, max_tokens: int) -> None:
    body = json.dumps(
        {
            "text_input": "Write a long story about a lighthouse keeper.",
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0.0,
        }
    ).encode()
    req = urllib.request.Request(
        f"{http_url}/v2/models/ensemble/generate_stream", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        for _ in resp:
            pass


def run_level(server, concurrency: int, seconds: float, max_tokens: int) -> dict:
    stop = threading.Event()
    done = [0]
    lock = threading.Lock()

    def client():
        while not stop.is_set():
            stream_once(server.http_url, max_tokens)
            with lock:
                done[0] += 1

    before = scrape(server.metrics_url)
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    waiting = []
    while time.perf_counter() - t0 < seconds:
        time.sleep(0.2)
        waiting.append(value(scrape(server.metrics_url), "nv_trt_llm_request_metrics", request_type="waiting"))
    after = scrape(server.metrics_url)
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()

    def ratio(model):
        q = value(after, "nv_inference_queue_duration_us", model=model) - value(
            before, "nv_inference_queue_duration_us", model=model
        )
        c = value(after, "nv_inference_compute_infer_duration_us", model=model) - value(
            before, "nv_inference_compute_infer_duration_us", model=model
        )
        return q / c if c else float("nan")

    return {
        "concurrency": concurrency,
        "waiting_mean": sum(waiting) / len(waiting),
        "waiting_max": max(waiting),
        "ratio_llm": ratio("tensorrt_llm"),
        "ratio_ensemble": ratio("ensemble"),
        "rps": done[0] / elapsed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="spec or emitted repository")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    target = launch.resolve(args.source)
    server = launch.make_server(target, free_ports=True)
    server.start()
    try:
        server.wait_ready(models=target.models)
        stream_once(server.http_url, 4)  # warm the HTTP path
        rows = [run_level(server, c, args.seconds, args.max_tokens) for c in args.concurrency]
    finally:
        server.stop()
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(
        f"max_batch_size {target.build.max_batch_size}; {args.seconds:.0f} s per level; load average {load}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print("| concurrency | waiting mean | waiting max | queue:compute tensorrt_llm | queue:compute ensemble | req/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['waiting_mean']:.2f} | {r['waiting_max']:.0f} | {r['ratio_llm']:.4f} | "
            f"{r['ratio_ensemble']:.4f} | {r['rps']:.2f} |"
        )


if __name__ == "__main__":
    main()
