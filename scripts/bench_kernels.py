#!/usr/bin/env python
"""rtk's GEMV over a model's layer projections against oneDNN's bf16 GEMM, per row count, in one process.

Loads one or more built engines (directories with ``engine_config.json`` and ``hf/``, as ``rtk build`` writes them)
or engines over checkpoints / quantized exports (``…/quantized/hf``) with default settings, and times each one's
decoder-layer projections (SmolLM2-135M: 30 layers x q/k/v, o, gate/up, down = 120 calls), or its LM head alone
(``--head``), on the same random input rows, every engine and way alternated within each repeat so that the
host's phase falls on all alike (a bf16 engine beside an FP8 one: what the codes save at each row count):

* ``tiles``: rtk's GEMV as the engine calls it (``Projection._gemv``), in AMX's bf16 tiles (``kernels.gemv_tiles``);
  ``gemv`` where the CPU has no AMX;
* ``avx512``: the same calls with the tiles switched off (``set_gemv_tiles(False)``: the AVX512 GEMV), AMX hosts only;
* ``onednn``: the library's GEMM over a packed bf16 copy of the same weights (the engine's, or made here where the
  engine keeps none: ``Projection.library_free``), one call whatever the rows, the peer.

Prints ms for all of an engine's calls (median of ``--repeats``, min-max) and, per engine, oneDNN's time over
rtk's GEMV's.  Usage::

    python scripts/bench_kernels.py ~/.cache/rtk/peers/rtk/engines/peer-bench-{none,fp8}/engine \\
        [--rows 1 4 16 64] [--repeats 9] [--threads 2] [--head]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from toolkit.runtime import kernels  # noqa: E402
from toolkit.runtime.engine import Engine, EngineConfig  # noqa: E402
from toolkit.targets.cpu import ENGINE_CONFIG  # noqa: E402
from toolkit.targets.cpu import load_engine as load_built_engine  # noqa: E402


def load() -> str:
    """The load average, for the table's header and footer."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def load_engine(path: Path) -> Engine | None:
    """A built engine as built (``targets.cpu.load_engine``), or an engine over a checkpoint / export with default
    settings; None if neither."""
    if (path / ENGINE_CONFIG).is_file():
        return load_built_engine(path)
    if (path / "config.json").is_file():
        return Engine(path, EngineConfig(max_num_tokens=1, max_batch_size=1, max_input_len=512, max_seq_len=1024))
    return None


def projections_of(engine: Engine, head: bool) -> list:
    """The projections whose calls are timed: every layer's, or the LM head's; those rtk's GEMV takes."""
    model = engine.model
    if head:
        found = list(getattr(model.lm_head, "parts", [model.lm_head]))
    else:
        found = [p for layer in model.layers for g in (layer.qkv, layer.o, layer.gate_up, layer.down) for p in g.parts]
    return [p for p in found if p.gemv is not None or p.quant is not None]


def library_copy(p) -> torch.Tensor:
    """oneDNN's packed bf16 copy of ``p``'s weights: the engine's, or made here where the engine dropped its own
    (``Projection.library_free``: AMX's tiles take every call) from the weights rtk's GEMV computes with."""
    if p.packed is not None:
        return p.packed
    if p.quant is not None:
        weight = p.quant.weight()
    else:  # rtk's GEMV layout [blocks, K/2, 64, 2] back to [N, K]
        weight = p.gemv.permute(0, 2, 1, 3).reshape(-1, p.in_features)[: p.out_features]
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", type=Path, nargs="+", help="built engine directories, or checkpoints / exports (hf)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64], help="rows a call")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", action="store_true", help="the LM head's calls instead of the layers'")
    args = ap.parse_args()
    if any(r < 1 for r in args.rows) or args.repeats < 1:
        ap.error("--rows and --repeats take counts of at least 1")
    torch.set_num_threads(args.threads)
    if not kernels.available():
        print("rtk's kernels are unavailable on this CPU (kernels.available() is False): nothing to measure")
        return 1
    engines = {}
    for path in args.paths:
        engine = load_engine(path)
        if engine is None:
            ap.error(f"paths: {path} holds neither engine_config.json (a built engine) nor config.json (a checkpoint)")
        projections = projections_of(engine, args.head)
        if not projections:
            ap.error(f"paths: no projection of the engine at {path} takes rtk's GEMV here")
        name = path.name if path.name not in ("hf", "engine") else path.parent.name
        engines[name] = [(p, library_copy(p)) for p in projections]
    tiles = kernels.gemv_tiles()
    set_tiles = torch.ops.rtk_kernels.set_gemv_tiles
    ways = ["tiles", "avx512", "onednn"] if tiles else ["gemv", "onednn"]
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# {stamp}, {os.cpu_count()} CPUs, threads {args.threads}, load average {load()} at start; AMX tiles: "
        f"{tiles}; ms for all of an engine's calls, median (min-max) of {args.repeats} repeats, everything alternated"
    )
    for name, projections in engines.items():
        kinds = ", ".join(sorted({p.kernel for p, _ in projections}))
        print(f"# {name}: {len(projections)} calls ({kinds})")
    print()
    columns = [(name, way) for name in engines for way in ways]
    print("| rows a call | " + " | ".join(f"{n}: {w}" for n, w in columns) + " | oneDNN / rtk's GEMV |")
    print("|---" * (len(columns) + 2) + "|")
    try:
        for rows in args.rows:
            xs = {
                p.in_features: torch.randn(rows, p.in_features).to(torch.bfloat16)
                for projections in engines.values()
                for p, _ in projections
            }
            times: dict[tuple[str, str], list[float]] = {c: [] for c in columns}
            for _ in range(args.repeats):
                for name, way in columns:
                    if tiles:
                        set_tiles(way != "avx512")
                    start = time.perf_counter()
                    for p, library in engines[name]:
                        x = xs[p.in_features]
                        if way == "onednn":
                            torch.ops.mkldnn._linear_pointwise(x, library, p.bias, "none", [], "")
                        else:
                            p._gemv(x)
                    times[(name, way)].append((time.perf_counter() - start) * 1e3)
            med = {c: statistics.median(v) for c, v in times.items()}
            cells = [f"{med[c]:.2f} ({min(times[c]):.2f}-{max(times[c]):.2f})" for c in columns]
            ratios = ", ".join(f"{med[(n, 'onednn')] / med[(n, ways[0])]:.2f}x" for n in engines)
            print(f"| {rows} | " + " | ".join(cells) + f" | {ratios} |")
    finally:
        if tiles:
            set_tiles(True)
    print()
    print(f"load average {load()} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
