#!/usr/bin/env python
"""Wall time and peak memory of fetching the embedded model and of each quantization format.

Each step runs as its own `rtk` process (so its peak RSS is its own, read with wait4), with
`--force` so nothing is served from the cache.  Prints a table; numbers depend on the host and on
what else runs on it, so compare rows of one run, not runs of different days.

    .venv/bin/python scripts/bench_quantize.py [--formats fp8,int4_awq] [--calib 64] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ["none", "fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4"]


def run(args: list[str], cwd: Path) -> tuple[float, float, int]:
    """Run ``rtk ARGS``; return (wall seconds, peak RSS MiB, exit code)."""
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit.cli", *args],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        print(f"  ! rtk {' '.join(args)} exited {code}: {proc.stderr.read().decode()[-400:]}", file=sys.stderr)
    return wall, usage.ru_maxrss / 1024, code


def print_row(name: str, runs: list, q: dict | None) -> None:
    ok = [r for r in runs if r[2] == 0]
    if not ok:
        print(f"{name:44} {'failed':>8}", flush=True)
        return
    wall = statistics.median(r[0] for r in ok)
    rss = statistics.median(r[1] for r in ok)
    if q:
        fq = f"{q['fake_quant_ppl']:.2f}" if q.get("fake_quant_ppl") else "n/a"
        print(
            f"{name:44} {wall:8.1f} {rss:13.0f} {q['baseline_ppl']:9.2f} {fq:>10} {q['quantized_ppl']:10.2f} "
            f"{q['increase'] * 100:+7.1f}%",
            flush=True,
        )
    else:
        print(f"{name:44} {wall:8.1f} {rss:13.0f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--calib", type=int, default=64, help="calibration samples (AWQ formats: see --awq-calib)")
    ap.add_argument(
        "--awq-calib",
        type=int,
        default=16,
        help="calibration samples for int4_awq / w4a8_awq, whose search runs many forwards per layer",
    )
    ap.add_argument("--eval", type=int, default=32, help="held-out evaluation texts")
    ap.add_argument("--repeat", type=int, default=1, help="runs per row (median reported)")
    a = ap.parse_args()
    print(
        f"rtk quantize benchmark — SmolLM2-135M-Instruct, {os.cpu_count()} CPUs, calib {a.calib} (AWQ {a.awq_calib}) "
        f"× 256 tokens, eval {a.eval} held-out texts, median of {a.repeat}; "
        f"load average before: {os.getloadavg()[0]:.1f}"
    )
    head = (
        f"{'step':44} {'wall s':>8} {'peak RSS MiB':>13} {'ppl base':>9} {'ppl fake-q':>10} {'ppl export':>10} "
        f"{'Δ ppl':>8}"
    )
    print(head)
    print("-" * len(head), flush=True)
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        spec = work / "spec.yaml"
        spec.write_text(f"name: bench\nquantization:\n  max_perplexity_increase: 100\n  eval_samples: {a.eval}\n")
        ckpt = work / "checkpoint"
        runs = [run(["fetch", str(spec), "--output", str(ckpt), "--force"], work) for _ in range(a.repeat)]
        print_row("fetch builtin:smollm2-135m-instruct → bf16", runs, None)
        for fmt in a.formats.split(","):
            out = work / f"q-{fmt}"
            target = "trt-engine" if fmt == "nvfp4" else "cpu"  # the cpu target cannot run nvfp4
            n = a.awq_calib if fmt in ("int4_awq", "w4a8_awq") else a.calib
            args = [
                "quantize",
                str(spec),
                "--checkpoint",
                str(ckpt),
                "--output",
                str(out),
                "--force",
                "--set",
                f"quantization.format={fmt}",
                "--set",
                f"build.target={target}",
                "--set",
                f"quantization.calibration.num_samples={n}",
            ]
            runs = [run(args, work) for _ in range(a.repeat)]
            q = json.loads((out / "quality.json").read_text()) if (out / "quality.json").is_file() else None
            print_row(f"quantize {fmt} (calib {n})", runs, q)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
