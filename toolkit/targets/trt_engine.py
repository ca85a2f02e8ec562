"""The ``trt-engine`` target: TensorRT engines from ``trtllm-build`` (TensorRT-LLM 1.2.x).

From the quantize stage's TensorRT-LLM checkpoint (``<quantized>/trtllm/``: ``config.json`` +
``rank<N>.safetensors``) this module

* checks the checkpoint against the spec (quantization, tensor/pipeline parallel mapping, limits)
  and the host (GPU, compute capability for the format, ``trtllm-build``, GPU memory),
* renders the ``trtllm-build`` command line from ``spec.build`` (:func:`trtllm_build_command`),
* runs it in a child process (its memory goes back to the system when it exits) with its log kept
  as ``build.log`` beside the engine, inside :func:`toolkit.artifacts.atomic_stage`,
* reads the engine's ``config.json`` back to prove it carries the spec's limits, and
* records in the manifest where the engine can run (``runs_on``: TensorRT-LLM, TensorRT and CUDA
  versions, GPU and compute capability, tp/pp, quantization, spec hash) for
  :func:`toolkit.hostinfo.check_host_compatible`.

and says how tritonserver is launched for the engine (:func:`triton_launch`: MPI ranks, orchestrator
mode).  The Triton model itself is rendered by toolkit/triton/gpu_models.py.

Written against TensorRT-LLM's own sources (NVIDIA/TensorRT-LLM): ``tensorrt_llm/commands/build.py``
(65f1d15), ``tensorrt_llm/plugin/plugin.py`` (c20322f), ``tensorrt_llm/_common.py``
(``check_max_num_tokens``), ``tensorrt_llm/builder.py`` (``Engine.save``) and
``triton_backend/scripts/launch_triton_server.py`` (0a2e2c1).  The flag set is kept as data in
tests/data/trtllm_1_2_1_trtllm_build.json.  ``tensorrt_llm`` is never imported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

from ..artifacts import StageResult, default_output, read_manifest, run_stage, sha256_file, sha256_json
from ..console import step
from ..errors import HostMismatchError, SpecError, StageError, UsageError
from ..hostinfo import HostInfo, probe_host
from ..spec import Spec
from . import MIN_SM, MIN_SM_KV, NGC_CONTAINER, TRTLLM_VERSION
from .gpu_memory import ModelShape, check_fits, estimate_memory

log = logging.getLogger(__name__)

TRTLLM_BUILD = "trtllm-build"
BUILD_LOG = "build.log"

# rtk's quantization.format -> the checkpoint's quantization.quant_algo (the names ModelOpt's
# TensorRT-LLM export writes: modelopt/torch/export/model_config.py QUANTIZATION_* constants).
QUANT_ALGO = {
    "none": None,
    "fp8": "FP8",
    "int8_sq": "W8A8_SQ_PER_CHANNEL",
    "int4_awq": "W4A16_AWQ",
    "w4a8_awq": "W4A8_AWQ",
    "nvfp4": "NVFP4",
}
KV_CACHE_QUANT_ALGO = {"none": None, "fp8": "FP8", "int8": "INT8"}


def checkpoint_quant_algo(q) -> str | None:
    """The ``quant_algo`` ModelOpt writes for a ``quantization`` section: a W8A16 ``lm_head``
    (``quantize_lm_head``) or W8A16 layers (``weight_only_modules``) among INT8-SQ ones make the checkpoint
    MIXED_PRECISION, which TensorRT-LLM quantizes linear by linear (NVIDIA/TensorRT-LLM
    tensorrt_llm/quantization/quantize.py ``quantize`` at 0614867: an INT8-SQ linear as
    ``Int8SmoothQuantLinear``, a W8A16 one as ``WeightOnlyQuantRowLinear`` / ``ColumnLinear``); an int4_awq head
    is W4A16_AWQ too."""
    if q.format == "int8_sq" and (q.quantize_lm_head or q.weight_only_modules):
        return "MIXED_PRECISION"
    return QUANT_ALGO[q.format]


# trtllm-build switches use_fused_mlp off unless quant_algo is one of these (commands/build.py).
FUSED_MLP_ALGOS = (None, "FP8", "MIXED_PRECISION")


def _switch(on: bool) -> str:
    return "enable" if on else "disable"


# -- the checkpoint -----------------------------------------------------------------------------


def load_checkpoint_config(checkpoint_dir: Path) -> dict:
    path = Path(checkpoint_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(
            f"'{checkpoint_dir}' holds no TensorRT-LLM checkpoint (no config.json); run `rtk quantize SPEC` "
            "first: it writes <quantized>/trtllm/ for the trt-engine target"
        ) from None
    except ValueError as exc:
        raise UsageError(f"'{path}' is not valid JSON ({exc}); re-run `rtk quantize SPEC --force`") from None


def check_checkpoint(spec: Spec, config: dict, checkpoint_dir: Path) -> None:
    """The checkpoint must be the one this spec asks for: format, KV quantization, tp/pp mapping."""
    q, b = spec.quantization, spec.build
    redo = "re-run `rtk quantize SPEC --force` so the checkpoint matches the spec"
    quant = config.get("quantization") or {}
    have, want = quant.get("quant_algo"), checkpoint_quant_algo(q)
    if have != want:
        options = []
        if q.quantize_lm_head:
            options.append("quantize_lm_head")
        if q.weight_only_modules:
            options.append(f"weight_only_modules {list(q.weight_only_modules)}")
        head = f" with {' and '.join(options)}" if options else ""
        raise UsageError(
            f"the TensorRT-LLM checkpoint at '{checkpoint_dir}' is quantized as {have or 'unquantized'} but "
            f"quantization.format is '{q.format}'{head} ({want or 'unquantized'}); {redo}"
        )
    have_kv = quant.get("kv_cache_quant_algo")
    if have_kv != KV_CACHE_QUANT_ALGO[q.kv_cache]:
        raise UsageError(
            f"the checkpoint at '{checkpoint_dir}' has KV-cache quantization {have_kv or 'none'} but "
            f"quantization.kv_cache is '{q.kv_cache}'; {redo}"
        )
    mapping = config.get("mapping") or {}
    tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
    if (tp, pp) != (b.tp_size, b.pp_size):
        raise UsageError(
            f"the checkpoint at '{checkpoint_dir}' was exported for tp_size {tp}, pp_size {pp} but the spec asks for "
            f"build.tp_size {b.tp_size}, build.pp_size {b.pp_size}: trtllm-build takes tensor/pipeline parallelism "
            f"from the checkpoint's mapping; {redo}"
        )
    missing = [
        f"rank{r}.safetensors" for r in range(tp * pp) if not (Path(checkpoint_dir) / f"rank{r}.safetensors").is_file()
    ]
    if missing:
        raise UsageError(f"the checkpoint at '{checkpoint_dir}' lacks {', '.join(missing)}; {redo}")
    heads = int(config.get("num_attention_heads", 0))
    if heads and heads % b.tp_size:
        raise SpecError(f"{b.tp_size} does not divide the model's {heads} attention heads", field="build.tp_size")


def check_limits(spec: Spec, config: dict) -> None:
    """Refuse limits that trtllm-build would silently rewrite (tensorrt_llm/_common.py check_max_num_tokens)."""
    b = spec.build
    cap = b.max_batch_size * b.max_seq_len
    if b.max_num_tokens > cap:
        raise SpecError(
            f"{b.max_num_tokens} exceeds build.max_batch_size x build.max_seq_len ({cap}); trtllm-build would "
            f"silently lower it to {cap}. Set it to at most {cap}",
            field="build.max_num_tokens",
        )
    if b.max_num_tokens < b.tokens_per_block:
        raise SpecError(
            f"{b.max_num_tokens} is below build.tokens_per_block ({b.tokens_per_block}); trtllm-build would raise it",
            field="build.max_num_tokens",
        )
    if b.max_num_tokens > 16384:
        log.warning(
            "build.max_num_tokens %d > 16384: TensorRT-LLM warns of no gain and possible tensor-volume errors",
            b.max_num_tokens,
        )
    max_pos = int(config.get("max_position_embeddings") or 0)
    if max_pos and b.max_seq_len > max_pos:
        raise SpecError(
            f"{b.max_seq_len} exceeds the checkpoint's max_position_embeddings ({max_pos})", field="build.max_seq_len"
        )
    g, dtype = b.gemm_plugin, config.get("dtype", spec.model.dtype)
    if g == "fp8" and spec.quantization.format != "fp8":
        raise SpecError(
            "'fp8' needs an FP8-calibrated checkpoint (quantization.format: fp8); use 'auto'", field="build.gemm_plugin"
        )
    if g == "nvfp4" and spec.quantization.format != "nvfp4":
        raise SpecError("'nvfp4' needs quantization.format: nvfp4; use 'auto'", field="build.gemm_plugin")
    if g in ("float16", "bfloat16") and g != dtype:
        raise SpecError(
            f"'{g}' differs from the checkpoint dtype {dtype}; use 'auto' (the model dtype)", field="build.gemm_plugin"
        )


def fused_mlp_effective(spec: Spec, config: dict) -> bool:
    """trtllm-build's rule, by the layers' algorithm: a MIXED_PRECISION checkpoint whose only odd module is a
    W8A16 head still has INT8-SQ MLPs, which the fused MLP does not take."""
    algo = (config.get("quantization") or {}).get("quant_algo")
    layers = QUANT_ALGO[spec.quantization.format]
    return spec.build.use_fused_mlp and algo in FUSED_MLP_ALGOS and layers in FUSED_MLP_ALGOS


# -- the command line ---------------------------------------------------------------------------


def trtllm_build_command(
    spec: Spec, checkpoint_dir: Path | str, output_dir: Path | str, config: dict, *, exe: str = TRTLLM_BUILD
) -> list[str]:
    """``trtllm-build`` argv for the spec: limits, paged KV cache and kernels; tp/pp come from the checkpoint.

    In-flight batching needs the GPT attention plugin, packed inputs (remove_input_padding) and a
    paged KV cache; KV reuse and chunked context need paged context FMHA.  They are spelled out even
    where they are TensorRT-LLM's defaults so the command says what the engine is.  No
    ``--build_config`` JSON: with it trtllm-build ignores the shape flags.
    """
    b = spec.build
    output_dir = Path(output_dir)
    return [
        exe,
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--output_dir",
        str(output_dir),
        "--max_batch_size",
        str(b.max_batch_size),
        "--max_input_len",
        str(b.max_input_len),
        "--max_seq_len",
        str(b.max_seq_len),
        "--max_num_tokens",
        str(b.max_num_tokens),
        "--max_beam_width",
        str(b.max_beam_width),
        "--kv_cache_type",
        "paged",
        "--tokens_per_block",
        str(b.tokens_per_block),
        "--gpt_attention_plugin",
        "auto",
        "--remove_input_padding",
        "enable",
        "--context_fmha",
        "enable",
        "--use_paged_context_fmha",
        _switch(b.use_paged_context_fmha),
        "--use_fused_mlp",
        _switch(fused_mlp_effective(spec, config)),
        "--gemm_plugin",
        b.gemm_plugin,
        "--multiple_profiles",
        _switch(b.multiple_profiles),
        "--workers",
        str(b.world_size),
        "--output_timing_cache",
        str(output_dir / "model.cache"),
        "--log_level",
        "info",
    ]


def expected_build_config(spec: Spec) -> dict:
    """The engine config.json ``build_config`` values rtk checks after a build (builder.py Engine.save)."""
    b = spec.build
    return {
        "max_batch_size": b.max_batch_size,
        "max_input_len": b.max_input_len,
        "max_seq_len": b.max_seq_len,
        "max_num_tokens": b.max_num_tokens,
        "max_beam_width": b.max_beam_width,
        "kv_cache_type": "paged",
        "plugin_config": {
            "tokens_per_block": b.tokens_per_block,
            "use_paged_context_fmha": b.use_paged_context_fmha,
            "multiple_profiles": b.multiple_profiles,
            "remove_input_padding": True,
            "context_fmha": True,
        },
    }


def verify_engine(engine_dir: Path, spec: Spec) -> dict:
    """The built engine carries the spec's limits, one rank<N>.engine per rank. Returns its config.json."""
    engine_dir = Path(engine_dir)
    try:
        engine_config = json.loads((engine_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise StageError(
            f"trtllm-build left no readable config.json in '{engine_dir}' ({exc}); see {BUILD_LOG}"
        ) from None
    missing = [
        f"rank{r}.engine" for r in range(spec.build.world_size) if not (engine_dir / f"rank{r}.engine").is_file()
    ]
    if missing:
        raise StageError(f"trtllm-build did not write {', '.join(missing)} in '{engine_dir}'; see {BUILD_LOG}")
    built = engine_config.get("build_config") or {}
    wrong = []
    for key, want in expected_build_config(spec).items():
        if key == "plugin_config":
            plugins = built.get("plugin_config") or {}
            wrong += [
                f"plugin_config.{k}={plugins.get(k)!r} (spec: {v!r})" for k, v in want.items() if plugins.get(k) != v
            ]
        elif key == "kv_cache_type":
            if str(built.get(key, "")).lower().split(".")[-1] != want:
                wrong.append(f"kv_cache_type={built.get(key)!r} (spec: {want!r})")
        elif built.get(key) != want:
            wrong.append(f"{key}={built.get(key)!r} (spec: {want!r})")
    if wrong:
        raise StageError(
            f"the engine in '{engine_dir}' does not carry the spec's build settings: {'; '.join(wrong)}. "
            f"trtllm-build changed them (see {BUILD_LOG} for its warnings)"
        )
    return engine_config


# -- the host -----------------------------------------------------------------------------------


def build_host_problems(spec: Spec, host: HostInfo, *, exe: str = TRTLLM_BUILD) -> list[str]:
    """Why this host cannot build ``spec``'s engines ([] when it can): GPUs, trtllm-build, compute capability."""
    q, b = spec.quantization, spec.build
    if not host.has_gpu:
        return ["building TensorRT engines needs an NVIDIA GPU and this host has none"]
    problems = []
    if shutil.which(exe) is None and not Path(exe).is_file():
        problems.append(f"'{exe}' is not on PATH (TensorRT-LLM {TRTLLM_VERSION} provides it)")
    if len(host.gpus) < b.world_size:
        problems.append(
            f"build.tp_size x build.pp_size = {b.world_size} GPUs, but this host has {len(host.gpus)}; "
            "build and serve on a host with that many GPUs, or lower build.tp_size / build.pp_size"
        )
    need = max(MIN_SM[q.format], MIN_SM_KV[q.kv_cache])
    if host.gpu.sm < need:
        problems.append(
            f"quantization.format '{q.format}' (KV cache '{q.kv_cache}') needs compute capability sm{need} or newer; "
            f"this host has {host.describe_gpu()}. Choose a format the GPU runs (e.g. int4_awq or none) or another GPU"
        )
    return problems


def check_build_host(spec: Spec, host: HostInfo, *, exe: str = TRTLLM_BUILD) -> None:
    """Raise HostMismatchError naming every reason this host cannot build the engines (doctor says more)."""
    problems = build_host_problems(spec, host, exe=exe)
    if problems:
        where = f"run it inside {NGC_CONTAINER} (26.04-26.07); `rtk doctor --target trt-engine` lists what is missing"
        raise HostMismatchError(f"{'; '.join(problems)}; {where}")
    have = host.packages.get("tensorrt_llm")
    if have != TRTLLM_VERSION:
        log.warning("TensorRT-LLM %s is installed; rtk's trt-engine target is written for %s", have, TRTLLM_VERSION)


def runs_on_record(spec: Spec, host: HostInfo, config: dict) -> dict:
    """Where this engine can run: the stack and GPU it was built with (checked by check_host_compatible)."""
    g = host.gpu
    return {
        "target": "trt-engine",
        "spec_name": spec.name,
        "spec_hash": sha256_json(spec.model_dump(mode="json")),
        "tensorrt_llm": host.packages.get("tensorrt_llm"),
        "tensorrt": host.packages.get("tensorrt"),
        "cuda": host.cuda_version,
        "driver": host.driver_version,
        "gpu": {
            "name": g.name,
            "sm": g.sm,
            "compute_capability": f"{g.compute_capability[0]}.{g.compute_capability[1]}",
            "memory_total_bytes": g.memory_total_bytes,
        },
        "gpu_count": spec.build.world_size,
        "tp_size": spec.build.tp_size,
        "pp_size": spec.build.pp_size,
        "quantization": {
            "format": spec.quantization.format,
            "kv_cache": spec.quantization.kv_cache,
            "quant_algo": (config.get("quantization") or {}).get("quant_algo"),
        },
    }


# -- the stage ----------------------------------------------------------------------------------


def _checkpoint_fingerprint(quantized_dir: Path, checkpoint_dir: Path) -> dict:
    m = read_manifest(quantized_dir)
    if m and m.get("key"):
        return {"quantized_key": m["key"]}
    return {
        "config_sha256": sha256_file(checkpoint_dir / "config.json"),
        "weights": {p.name: p.stat().st_size for p in sorted(checkpoint_dir.glob("rank*.safetensors"))},
    }


def build(
    spec: Spec,
    quantized_dir: Path | str,
    output: Path | str | None = None,
    *,
    force: bool = False,
    host: HostInfo | None = None,
    exe: str = TRTLLM_BUILD,
) -> StageResult:
    """Build TensorRT engines into ``output`` (default engines/<name>/engine) from ``<quantized_dir>/trtllm``."""
    if spec.build.target != "trt-engine":
        raise SpecError(f"this builds the trt-engine target, not '{spec.build.target}'", field="build.target")
    quantized_dir = Path(quantized_dir)
    checkpoint_dir = quantized_dir / "trtllm"
    config = load_checkpoint_config(checkpoint_dir)
    check_checkpoint(spec, config, checkpoint_dir)
    check_limits(spec, config)
    host = host or probe_host(triton_version=False)
    check_build_host(spec, host, exe=exe)
    estimate = estimate_memory(ModelShape.from_config(config), spec)
    fit = check_fits(estimate, spec, host.gpu.memory_total_bytes, host.describe_gpu())
    if fit.note():
        log.warning("%s", fit.note())

    output = Path(output) if output else default_output(spec, "build")
    section = {"build": spec.build.model_dump(mode="json"), "quantization": spec.quantization.model_dump(mode="json")}
    inputs = {"checkpoint": _checkpoint_fingerprint(quantized_dir, checkpoint_dir)}
    tools = {
        "tensorrt_llm": host.packages.get("tensorrt_llm"),
        "tensorrt": host.packages.get("tensorrt"),
        "cuda": host.cuda_version,
        "gpu_sm": host.gpu.sm,
        "gpu": host.gpu.name,
    }
    failed_log = output.parent / f"{output.name}.{BUILD_LOG.replace('.log', '-failed.log')}"

    def write(out) -> None:
        argv = trtllm_build_command(spec, checkpoint_dir.resolve(), out.tmp.resolve(), config, exe=exe)
        with (
            out.timed("trtllm_build"),
            step(f"Building TensorRT engines with {Path(exe).name} (log: {output / BUILD_LOG})"),
        ):
            run_logged(argv, out.tmp / BUILD_LOG, cwd=out.tmp, keep_on_failure=failed_log)
        (out.tmp / "model.cache").unlink(missing_ok=True)  # timing cache: a build input, not part of the engine
        engine_config = verify_engine(out.tmp, spec)
        out.manifest.update(
            {
                "target": "trt-engine",
                "build_command": trtllm_build_command(
                    spec, checkpoint_dir.resolve(), output.resolve(), config, exe=exe
                ),
                "engine_version": engine_config.get("version"),
                "use_fused_mlp_effective": fused_mlp_effective(spec, config),
                "memory_estimate": {
                    **estimate.to_dict(),
                    "kv_available": fit.kv_available,
                    "full_sequences": fit.full_sequences,
                },
                "runs_on": runs_on_record(spec, host, config),
            }
        )

    result = run_stage("build", output, section=section, inputs=inputs, tools=tools, write=write, force=force)
    failed_log.unlink(missing_ok=True)
    return result


def run_logged(
    argv: list[str], log_path: Path, *, cwd: Path, keep_on_failure: Path | None = None, env: dict | None = None
) -> None:
    """Run a tool in its own process group with stdout+stderr in ``log_path``; raise StageError on failure.

    On failure the log is copied to ``keep_on_failure`` first, because the stage's temporary
    directory (where the log lives) is removed when the stage fails.
    """
    log_path = Path(log_path)
    with open(log_path, "w") as logf:
        logf.write("$ " + " ".join(argv) + "\n")
        logf.flush()
        try:
            proc = subprocess.Popen(
                argv, stdout=logf, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True
            )
        except OSError as exc:
            raise StageError(f"cannot run '{argv[0]}': {exc}") from None
        try:
            rc = proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    if rc != 0:
        kept = log_path
        if keep_on_failure:
            shutil.copyfile(log_path, keep_on_failure)
            kept = keep_on_failure
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise StageError(
            f"{Path(argv[0]).name} failed with exit code {rc}; its log is kept at {kept}. Last lines:\n{tail}"
        )


# -- how tritonserver runs the engine -------------------------------------------------------------


def triton_launch(build, serving):
    """The launch for an engine built with ``build`` (BuildSpec) served with ``serving`` (ServingSpec).

    As TensorRT-LLM's ``triton_backend/scripts/launch_triton_server.py`` (0a2e2c1): one tritonserver
    rank per GPU under ``mpirun`` when the engine spans several GPUs; several one-engine instances
    (``serving.instance_count > 1``, each on the GPUs ``gpu_device_ids`` gives it) run in orchestrator
    mode instead (its ``--multi-model``): ``TRTLLM_ORCHESTRATOR=1`` spawns the executor processes, and
    the server gives up its pinned and CUDA memory pools and peer access so they have the GPUs.
    """
    from ..triton.server import Launch

    world = build.tp_size * build.pp_size
    if serving.instance_count > 1:
        gpus = world * serving.instance_count
        args = (
            "--pinned-memory-pool-byte-size=0",
            "--enable-peer-access=false",
            *(f"--cuda-memory-pool-byte-size={g}:0" for g in range(gpus)),
        )
        return Launch(env={"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}, server_args=args)
    return Launch(ranks=world)
