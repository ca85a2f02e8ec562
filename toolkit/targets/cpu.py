"""Build for the ``cpu`` target: an engine directory rtk's CPU engine loads.

``engines/<name>/engine/`` holds

* ``engine_config.json`` — the :class:`toolkit.runtime.engine.EngineConfig` derived from
  ``spec.build`` (batch, token and sequence limits, KV block size and pool, reuse, chunking,
  threads);
* ``hf/`` — the quantize stage's unified HF checkpoint (hard links, or copies across file
  systems), the same files the GPU targets start from;
* ``rtk-manifest.json`` — written last; the directory is renamed into place only then.

The build loads the checkpoint once through the engine's own reader, so a format the engine
cannot run fails here, not when Triton loads the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from ..artifacts import StageResult, default_output, link_or_copy, read_manifest, run_stage, tool_versions
from ..console import step
from ..errors import SourceError
from ..spec import Spec

ENGINE_CONFIG = "engine_config.json"
CHECKPOINT_DIR = "hf"


def engine_config(spec: Spec):
    from ..runtime.engine import EngineConfig

    return EngineConfig.from_build(spec.build)


def build(spec: Spec, quantized_dir: Path, output: Path | None = None, *, force: bool = False) -> StageResult:
    """Write the cpu engine directory for ``spec`` from the quantize stage's ``quantized_dir``."""
    quantized_dir = Path(quantized_dir)
    output = Path(output) if output else default_output(spec, "build")
    hf = quantized_dir / CHECKPOINT_DIR
    if not (hf / "config.json").is_file():
        raise SourceError(
            f"'{quantized_dir}' has no {CHECKPOINT_DIR}/config.json; run `rtk quantize SPEC` first "
            "(or pass the quantize stage's output directory)"
        )
    src = read_manifest(quantized_dir)
    # The engine config as this rtk writes it (field names included), so an rtk whose EngineConfig
    # changed rebuilds instead of reusing an engine_config.json it may not read.
    inputs = {
        "quantized": (src or {}).get("key") or _fingerprint(hf),
        "engine_config": asdict(engine_config(spec)),
    }

    def write(out) -> None:
        config = engine_config(spec)
        with out.timed("link_checkpoint"):
            link_or_copy(hf, out.tmp / CHECKPOINT_DIR)
        (out.tmp / ENGINE_CONFIG).write_text(json.dumps(asdict(config), indent=2, sort_keys=True) + "\n")
        with out.timed("verify"), step("Checking the CPU engine can read the checkpoint"):
            from ..runtime.checkpoint import load_checkpoint

            ckpt = load_checkpoint(out.tmp / CHECKPOINT_DIR)
        out.manifest.update(
            target="cpu",
            engine_config=asdict(config),
            model={
                "architecture": ckpt.config.architecture,
                "num_layers": ckpt.config.num_layers,
                "quant_algo": ckpt.quant_algo,
                "kv_cache_quant_algo": ckpt.kv_cache_quant_algo,
            },
        )

    return run_stage(
        "build",
        output,
        section=spec.build.model_dump(),
        inputs=inputs,
        tools=tool_versions("torch", "safetensors"),
        write=write,
        force=force,
    )


def served_threads() -> int:
    """The served engine's torch threads when the spec sets none: every core this process may use, for every step.

    Until 2026-12-05 a served engine kept one core for tritonserver, its python stubs and the front door in
    decode steps of several streams, with exceptions by kernel. Those measurements were taken while the served
    engine had two OpenMP pools, one for the thread that loaded it and one for the thread that stepped it, so a
    two-thread step waited for sleeping workers in each parallel region (docs/engine-measurements.md, "One OpenMP
    pool"). With one pool, every step on both cores of a 2-core AMD Zen 4 host (bench_peer, SmolLM2, two alternated
    pairs, 2026-12-05) served INT8-SQ 12-36 % more tokens a second at 1, 4 and 8 streams, and INT4-AWQ 16-21 %
    more at one stream; bf16 and FP8 stayed within the host's drift. On the AMX host, INT4-AWQ gained
    15-37 %.

    Under a CPU quota (a container's CPU limit: :func:`cpu_quota_cores`) the cores of the affinity mask may be
    many more than the quota lets run at once; then the whole cores of the quota, at least one.
    """
    cores = len(os.sched_getaffinity(0))
    quota = cpu_quota_cores()
    return cores if quota is None else max(1, min(cores, int(quota)))


def cpu_quota_cores(
    root: str | os.PathLike = "/sys/fs/cgroup", proc_cgroup: str | os.PathLike = "/proc/self/cgroup"
) -> float | None:
    """The cores a CFS quota lets this process's cgroup (or an ancestor's) use at once, or None without one.

    A Kubernetes CPU limit is such a quota: cgroup v2's ``cpu.max`` ("QUOTA PERIOD", or "max PERIOD" for none),
    cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1 for none); see the kernel's
    Documentation/admin-guide/cgroup-v2.rst ("cpu.max") and Documentation/scheduler/sched-bwc.rst.
    """
    root = Path(root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        names = controllers.split(",") if controllers else []
        if not names:  # cgroup v2's unified hierarchy
            mounts = [root]
        elif "cpu" in names:
            mounts = [root / controllers, root / "cpu"]
        else:
            continue
        for mount in (m for m in mounts if m.is_dir()):
            d = mount / path.lstrip("/")
            while True:  # the cgroup, then its ancestors up to the mount: each one's limit applies
                limits.append(_quota(d, v2=not names))
                if d == mount:
                    break
                d = d.parent
            break
    found = [q for q in limits if q is not None]
    return min(found) if found else None


def _quota(d: Path, v2: bool) -> float | None:
    try:
        if v2:
            quota, period = (d / "cpu.max").read_text().split()[:2]
        else:
            quota, period = ((d / f).read_text().strip() for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        if quota in ("max", "-1") or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


# libgomp's rounds of spinning before an idle OpenMP worker sleeps, for a served engine whose spec sets none
# (build.openmp_spin_count; GOMP_SPINCOUNT; libgomp's own default is 300,000, several milliseconds): about 1 ms,
# longer than the gaps between a step's parallel regions, shorter than an idle engine's wait
SERVED_GOMP_SPINCOUNT = 100_000


def bound_openmp_spin(engine_dir: str | os.PathLike | None = None) -> bool:
    """Let a served engine's idle OpenMP workers sleep after the spin rounds its engine config sets
    (``openmp_spin_count``, from ``build.openmp_spin_count``; else :data:`SERVED_GOMP_SPINCOUNT`) as
    ``GOMP_SPINCOUNT``, unless the environment sets ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` itself.  Returns
    whether it set it (not when torch, and so libgomp, is already loaded).

    libgomp reads the variable once, when it loads (gcc-mirror/gcc ``libgomp/env.c``, ``initialize_env``):
    call this before torch is imported.  With libgomp's default (300,000 rounds), the engine's worker kept a
    core spinning for milliseconds after each parallel region while tritonserver, the python stubs and the front
    door waited for one; beside other busy processes requests then reached the model's ``execute`` only after
    the running ones had ended (docs/engine-measurements.md, "Served engines beside other load").  With 10,000 a decode
    step's worker slept through the gaps between its parallel regions, which cost a quiet host 8-34 % of its tok/s
    ("The served OpenMP spin as a spec setting").
    """
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False  # the user's choice, or too late: libgomp is loaded
    spin = None
    if engine_dir is not None:  # the engine config as JSON: EngineConfig's module would load torch
        try:
            spin = json.loads((Path(engine_dir) / ENGINE_CONFIG).read_text()).get("openmp_spin_count")
            spin = None if spin is None else int(spin)
        except (OSError, ValueError, TypeError, AttributeError):
            spin = None  # load_engine reports a missing or damaged config
    os.environ["GOMP_SPINCOUNT"] = str(SERVED_GOMP_SPINCOUNT if spin is None else spin)
    return True


def load_engine(engine_dir: str | os.PathLike, served: bool = False, **overrides):
    """The :class:`toolkit.runtime.engine.Engine` of a cpu engine directory (``overrides``: EngineConfig fields).

    ``served``: the engine runs inside tritonserver, so without a ``num_threads`` it takes
    :func:`served_threads` (every core) for every step, or as many as other processes leave free
    (``follow_free_cores``); ``prefill_threads`` and ``lone_decode_threads`` still override it for their steps.
    Load a served engine on the thread that steps it
    (``BackgroundEngine(lambda: load_engine(...))``).
    """
    from ..runtime.engine import Engine, EngineConfig

    engine_dir = Path(engine_dir)
    cfg_path = engine_dir / ENGINE_CONFIG
    if not cfg_path.is_file():
        raise SourceError(f"'{engine_dir}' is not a cpu engine directory (no {ENGINE_CONFIG}); run `rtk build SPEC`")
    try:
        config = EngineConfig(**{**json.loads(cfg_path.read_text()), **overrides})
    except (TypeError, ValueError) as exc:  # a field this rtk does not know, or a broken file
        raise SourceError(
            f"'{cfg_path}' was written by another rtk version or is damaged ({exc}); "
            "rebuild it with `rtk build SPEC --force build`"
        ) from None
    if served and config.num_threads is None:
        config.num_threads = served_threads()
        config.follow_free_cores = True
    return Engine(engine_dir / CHECKPOINT_DIR, config)


def _fingerprint(d: Path) -> dict:
    """A manifest-less checkpoint's identity: small files (configs, tokenizer) by content, weight files
    by size and nanosecond mtime (two checkpoints written in the same second must not share a key)."""

    def ident(p: Path) -> str | list[int]:
        st = p.stat()
        if st.st_size <= 16 << 20:
            return hashlib.sha256(p.read_bytes()).hexdigest()
        return [st.st_size, st.st_mtime_ns]

    return {p.name: ident(p) for p in sorted(d.iterdir()) if p.is_file()}
