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
    """The served engine's torch threads when the spec sets none: every core this process may use but one.

    tritonserver, the python stubs (pre/postprocessing) and the front door work on every token; with
    all cores in the engine's OpenMP team, each of their wake-ups can stall a parallel region.
    Measured on the 2-core development host (FP8 SmolLM2, ``rtk slo``, 2026-11-30): one engine thread
    served ITL p50 18.3 ms and 46.8 tok/s at concurrency 1 (two threads: 23.3 ms, 37.1 tok/s), 24.8 ms
    and 127.9 tok/s at concurrency 4 (30.7 ms, 105.4 tok/s).
    """
    return max(1, len(os.sched_getaffinity(0)) - 1)


def load_engine(engine_dir: str | os.PathLike, served: bool = False, **overrides):
    """The :class:`toolkit.runtime.engine.Engine` of a cpu engine directory (``overrides``: EngineConfig fields).

    ``served``: the engine runs inside tritonserver, so without a ``num_threads`` it takes
    :func:`served_threads` for decode steps, and all cores for steps that prefill prompts (unless
    ``prefill_threads`` says otherwise): while a prompt is prefilled the server's processes mostly wait.
    An engine whose decode step is one of rtk's fused ones (``kernels_avx2.DecodeLayers``, ``kernels.DecodeLayers``)
    also takes all cores for a lone sequence's decode steps (unless ``lone_decode_threads`` says otherwise): one
    row streams every weight, one core reads ~13 GB/s where two read ~19 on the AVX2 host, and the server's
    processes have one response a step to handle (:func:`lone_decode_on_every_core`); where the float32 AVX2
    kernels read float weights, for every decode step (:func:`decode_on_every_core`).
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
    every_core = len(os.sched_getaffinity(0))
    auto_threads = served and config.num_threads is None
    auto_lone = auto_threads and config.lone_decode_threads is None
    if auto_threads:
        config.num_threads = served_threads()
        if config.prefill_threads is None:
            config.prefill_threads = every_core
    engine = Engine(engine_dir / CHECKPOINT_DIR, config)
    if auto_lone and lone_decode_on_every_core(engine):
        config.lone_decode_threads = every_core
    if auto_threads and decode_on_every_core(engine):
        import torch

        config.num_threads = every_core
        torch.set_num_threads(every_core)  # what Engine does with num_threads
    return engine


def lone_decode_on_every_core(engine) -> bool:
    """Whether a served engine's lone decode steps take every core by default: where its decode step is one of
    rtk's fused ones, the float32 AVX2 step or the bf16 AVX512 one.  Measured served at one stream (bench_peer,
    bf16 SmolLM2, 2 cores): ITL p50 15.9 -> 12.8 ms with the AVX2 step (2026-12-02), 24.4-25.6 -> 15.5-16.9 ms
    with the bf16 step on an AMX host (2026-12-04, two alternated pairs); oneDNN's own one-row GEMM did not
    read faster on two cores there, so an engine without a fused step keeps ``num_threads``.  Not where the
    float32 step's projections are all integer products on a CPU with native bf16 (INT8 / INT4 exports, which
    ``dtype: auto`` computes in float32 there): on the AMX host a lone stream's ITL p50 was 16.2 -> 9.0 ms
    (INT4-AWQ) and 19.3 -> 14.0 ms (INT8-SQ) on one core against two (2026-12-04, docs/engine.md, "The engine's
    dtype on AVX512-VNNI hosts"), where the AVX2 host's INT8-SQ gained from the second core (15.9 -> 12.8 ms)."""
    from ..runtime import kernels_avx2, model

    fused = engine.model.fused
    if isinstance(fused, kernels_avx2.DecodeLayers) and model.bf16_is_fast():
        return not all(p.int_products is not None for p in engine.model.projections)
    return fused is not None


def decode_on_every_core(engine) -> bool:
    """Whether a served engine's decode steps of several sequences take every core by default too: where its
    decode step is rtk's float32 AVX2 one over float weights (bf16, FP8 codes), whose GEMV of several rows is
    bound by arithmetic, not by the weights' bytes.  Measured on the Ice Lake host (bench_peer, bf16 against
    BF16, 2026-12-03 22:28-22:37): served tok/s 49 / 55 at 4 / 8 streams on all cores but one, 64 / 79 on
    both.  Integer products (INT8-SQ, W8A16, INT4-AWQ) keep all cores but one: the demo's INT8-SQ build on both
    cores gave the same tok/s at 4 and 8 streams and a longer ITL p99 at 4 (91.7 against 58.1 ms)."""
    from ..runtime import kernels_avx2

    if not isinstance(engine.model.fused, kernels_avx2.DecodeLayers):
        return False
    return all(p.fp32_gemv is not None for p in engine.model.projections)


def _fingerprint(d: Path) -> dict:
    """A manifest-less checkpoint's identity: small files (configs, tokenizer) by content, weight files
    by size and nanosecond mtime (two checkpoints written in the same second must not share a key)."""

    def ident(p: Path) -> str | list[int]:
        st = p.stat()
        if st.st_size <= 16 << 20:
            return hashlib.sha256(p.read_bytes()).hexdigest()
        return [st.st_size, st.st_mtime_ns]

    return {p.name: ident(p) for p in sorted(d.iterdir()) if p.is_file()}
