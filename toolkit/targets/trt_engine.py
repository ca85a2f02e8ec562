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

It also renders the Triton ``tensorrt_llm`` model (C++ ``tensorrtllm`` backend) for the engine:
:func:`triton_model_config` and :func:`warmup_files`.

Written against TensorRT-LLM's own sources (NVIDIA/TensorRT-LLM): ``tensorrt_llm/commands/build.py``
(65f1d15), ``tensorrt_llm/plugin/plugin.py`` (c20322f), ``tensorrt_llm/_common.py``
(``check_max_num_tokens``), ``tensorrt_llm/builder.py`` (``Engine.save``), and
``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt`` (0c8de69) with
``triton_backend/inflight_batcher_llm/src/model_instance_state.cc`` (c8c6df0).  The flag set is
kept as data in tests/data/trtllm_1_2_1_trtllm_build.json.  ``tensorrt_llm`` is never imported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
from pathlib import Path

from ..artifacts import atomic_stage, is_complete, read_manifest, sha256_file, sha256_json, stage_key
from ..console import step
from ..errors import HostMismatchError, SpecError, StageError, UsageError
from ..hostinfo import HostInfo, probe_host
from ..spec import Spec
from ..stages import StageResult, default_output
from .gpu_memory import ModelShape, check_fits, estimate_memory

log = logging.getLogger(__name__)

TRTLLM_BUILD = "trtllm-build"
TRTLLM_VERSION = "1.2.1"
BUILD_LOG = "build.log"

# rtk's quantization.format -> the checkpoint's quantization.quant_algo (ModelOpt export names,
# shared/reference/modelopt-on-cpu.md §6.1).
QUANT_ALGO = {
    "none": None, "fp8": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL",
    "int4_awq": "W4A16_AWQ", "w4a8_awq": "W4A8_AWQ", "nvfp4": "NVFP4",
}
KV_CACHE_QUANT_ALGO = {"none": None, "fp8": "FP8", "int8": "INT8"}
# Lowest compute capability (sm) that runs each format (ModelOpt support matrix: FP8 and W4A8 on
# Ada and later, FP4 on Blackwell, INT8/INT4 on Ampere; TensorRT-LLM 1.x supports Ampere and later).
MIN_SM = {"none": 80, "fp8": 89, "int8_sq": 80, "int4_awq": 80, "w4a8_awq": 89, "nvfp4": 100}
MIN_SM_KV = {"none": 80, "fp8": 89, "int8": 80}
# trtllm-build switches use_fused_mlp off unless quant_algo is one of these (commands/build.py).
FUSED_MLP_ALGOS = (None, "FP8", "MIXED_PRECISION")
DTYPE_TO_TRITON = {"bfloat16": "TYPE_BF16", "float16": "TYPE_FP16", "float32": "TYPE_FP32"}


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
    have = quant.get("quant_algo")
    if have != QUANT_ALGO[q.format]:
        raise UsageError(
            f"the TensorRT-LLM checkpoint at '{checkpoint_dir}' is quantized as {have or 'unquantized'} but "
            f"quantization.format is '{q.format}' ({QUANT_ALGO[q.format] or 'unquantized'}); {redo}"
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
    missing = [f"rank{r}.safetensors" for r in range(tp * pp) if not (Path(checkpoint_dir) / f"rank{r}.safetensors").is_file()]
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
        log.warning("build.max_num_tokens %d > 16384: TensorRT-LLM warns of no gain and possible tensor-volume errors", b.max_num_tokens)
    max_pos = int(config.get("max_position_embeddings") or 0)
    if max_pos and b.max_seq_len > max_pos:
        raise SpecError(f"{b.max_seq_len} exceeds the checkpoint's max_position_embeddings ({max_pos})", field="build.max_seq_len")
    g, dtype = b.gemm_plugin, config.get("dtype", spec.model.dtype)
    if g == "fp8" and spec.quantization.format != "fp8":
        raise SpecError("'fp8' needs an FP8-calibrated checkpoint (quantization.format: fp8); use 'auto'", field="build.gemm_plugin")
    if g == "nvfp4" and spec.quantization.format != "nvfp4":
        raise SpecError("'nvfp4' needs quantization.format: nvfp4; use 'auto'", field="build.gemm_plugin")
    if g in ("float16", "bfloat16") and g != dtype:
        raise SpecError(f"'{g}' differs from the checkpoint dtype {dtype}; use 'auto' (the model dtype)", field="build.gemm_plugin")


def fused_mlp_effective(spec: Spec, config: dict) -> bool:
    algo = (config.get("quantization") or {}).get("quant_algo")
    return spec.build.use_fused_mlp and algo in FUSED_MLP_ALGOS


# -- the command line ---------------------------------------------------------------------------

def trtllm_build_command(spec: Spec, checkpoint_dir: Path | str, output_dir: Path | str, config: dict,
                         *, exe: str = TRTLLM_BUILD) -> list[str]:
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
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(output_dir),
        "--max_batch_size", str(b.max_batch_size),
        "--max_input_len", str(b.max_input_len),
        "--max_seq_len", str(b.max_seq_len),
        "--max_num_tokens", str(b.max_num_tokens),
        "--max_beam_width", str(b.max_beam_width),
        "--kv_cache_type", "paged",
        "--tokens_per_block", str(b.tokens_per_block),
        "--gpt_attention_plugin", "auto",
        "--remove_input_padding", "enable",
        "--context_fmha", "enable",
        "--use_paged_context_fmha", _switch(b.use_paged_context_fmha),
        "--use_fused_mlp", _switch(fused_mlp_effective(spec, config)),
        "--gemm_plugin", b.gemm_plugin,
        "--multiple_profiles", _switch(b.multiple_profiles),
        "--workers", str(b.world_size),
        "--output_timing_cache", str(output_dir / "model.cache"),
        "--log_level", "info",
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
        raise StageError(f"trtllm-build left no readable config.json in '{engine_dir}' ({exc}); see {BUILD_LOG}") from None
    missing = [f"rank{r}.engine" for r in range(spec.build.world_size) if not (engine_dir / f"rank{r}.engine").is_file()]
    if missing:
        raise StageError(f"trtllm-build did not write {', '.join(missing)} in '{engine_dir}'; see {BUILD_LOG}")
    built = engine_config.get("build_config") or {}
    wrong = []
    for key, want in expected_build_config(spec).items():
        if key == "plugin_config":
            plugins = built.get("plugin_config") or {}
            wrong += [f"plugin_config.{k}={plugins.get(k)!r} (spec: {v!r})" for k, v in want.items() if plugins.get(k) != v]
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

def check_build_host(spec: Spec, host: HostInfo, *, exe: str = TRTLLM_BUILD) -> None:
    """A trt-engine build needs the GPUs it will run on, TensorRT-LLM and trtllm-build (doctor says more)."""
    q, b = spec.quantization, spec.build
    where = "run it inside nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3 (26.04-26.07); `rtk doctor --target trt-engine` lists what is missing"
    if not host.has_gpu:
        raise HostMismatchError(f"building TensorRT engines needs an NVIDIA GPU and this host has none; {where}")
    if shutil.which(exe) is None and not Path(exe).is_file():
        raise HostMismatchError(f"'{exe}' is not on PATH (TensorRT-LLM {TRTLLM_VERSION} provides it); {where}")
    if len(host.gpus) < b.world_size:
        raise HostMismatchError(
            f"build.tp_size x build.pp_size = {b.world_size} GPUs, but this host has {len(host.gpus)}; "
            "build and serve on a host with that many GPUs, or lower build.tp_size / build.pp_size"
        )
    need = max(MIN_SM[q.format], MIN_SM_KV[q.kv_cache])
    if host.gpu.sm < need:
        raise HostMismatchError(
            f"quantization.format '{q.format}' (KV cache '{q.kv_cache}') needs compute capability sm{need} or newer; "
            f"this host has {host.describe_gpu()}. Choose a format the GPU runs (e.g. int4_awq or none) or another GPU"
        )
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
        "gpu": {"name": g.name, "sm": g.sm, "compute_capability": f"{g.compute_capability[0]}.{g.compute_capability[1]}",
                "memory_total_bytes": g.memory_total_bytes},
        "gpu_count": spec.build.world_size,
        "tp_size": spec.build.tp_size,
        "pp_size": spec.build.pp_size,
        "quantization": {"format": spec.quantization.format, "kv_cache": spec.quantization.kv_cache,
                         "quant_algo": (config.get("quantization") or {}).get("quant_algo")},
    }


# -- the stage ----------------------------------------------------------------------------------

def _checkpoint_fingerprint(quantized_dir: Path, checkpoint_dir: Path) -> dict:
    m = read_manifest(quantized_dir)
    if m and m.get("key"):
        return {"quantized_key": m["key"]}
    return {"config_sha256": sha256_file(checkpoint_dir / "config.json"),
            "weights": {p.name: p.stat().st_size for p in sorted(checkpoint_dir.glob("rank*.safetensors"))}}


def build(spec: Spec, quantized_dir: Path | str, output: Path | str | None = None, *, force: bool = False,
          host: HostInfo | None = None, exe: str = TRTLLM_BUILD) -> StageResult:
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
    tools = {"tensorrt_llm": host.packages.get("tensorrt_llm"), "tensorrt": host.packages.get("tensorrt"),
             "cuda": host.cuda_version, "gpu_sm": host.gpu.sm, "gpu": host.gpu.name}
    key = stage_key("build", section, inputs, tools)
    if not force and is_complete(output, key):
        return StageResult("build", output, True, read_manifest(output))

    failed_log = output.parent / f"{output.name}.{BUILD_LOG.replace('.log', '-failed.log')}"
    with atomic_stage("build", output, key, inputs=inputs, spec_section=section, tools=tools) as out:
        argv = trtllm_build_command(spec, checkpoint_dir.resolve(), out.tmp.resolve(), config, exe=exe)
        with out.timed("trtllm_build"), step(f"Building TensorRT engines with {Path(exe).name} (log: {output / BUILD_LOG})"):
            run_logged(argv, out.tmp / BUILD_LOG, cwd=out.tmp, keep_on_failure=failed_log)
        (out.tmp / "model.cache").unlink(missing_ok=True)  # timing cache: a build input, not part of the engine
        engine_config = verify_engine(out.tmp, spec)
        out.manifest.update({
            "target": "trt-engine",
            "build_command": trtllm_build_command(spec, checkpoint_dir.resolve(), output.resolve(), config, exe=exe),
            "engine_version": engine_config.get("version"),
            "use_fused_mlp_effective": fused_mlp_effective(spec, config),
            "memory_estimate": {**estimate.to_dict(), "kv_available": fit.kv_available, "full_sequences": fit.full_sequences},
            "runs_on": runs_on_record(spec, host, config),
        })
    failed_log.unlink(missing_ok=True)
    return StageResult("build", output, False, read_manifest(output))


build_trt_engine = build


def run_logged(argv: list[str], log_path: Path, *, cwd: Path, keep_on_failure: Path | None = None,
               env: dict | None = None) -> None:
    """Run a tool in its own process group with stdout+stderr in ``log_path``; raise StageError on failure.

    On failure the log is copied to ``keep_on_failure`` first, because the stage's temporary
    directory (where the log lives) is removed when the stage fails.
    """
    log_path = Path(log_path)
    with open(log_path, "w") as logf:
        logf.write("$ " + " ".join(argv) + "\n")
        logf.flush()
        try:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
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
        raise StageError(f"{Path(argv[0]).name} failed with exit code {rc}; its log is kept at {kept}. Last lines:\n{tail}")


# -- the Triton model (C++ tensorrtllm backend) ---------------------------------------------------

# The tensorrt_llm model's tensors, as in triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/
# config.pbtxt (0c8de69): (name, data type, dims, optional, allow_ragged_batch, reshape to []).
# Placeholder dtypes: encoder_input_features/prompt_embedding_table -> the model dtype, logits -> FP32.
_S = ([1], True, False, True)  # optional scalar with reshape: { shape: [ ] }
CPP_INPUTS = [
    ("input_ids", "TYPE_INT32", [-1], True, True, False),
    ("encoder_input_features", "$dtype", [-1, -1], True, True, False),
    ("encoder_output_lengths", "TYPE_INT32", *_S),
    ("input_lengths", "TYPE_INT32", [1], False, False, True),
    ("request_output_len", "TYPE_INT32", [1], False, False, True),
    ("num_return_sequences", "TYPE_INT32", *_S),
    ("draft_input_ids", "TYPE_INT32", [-1], True, True, False),
    ("decoder_input_ids", "TYPE_INT32", [-1], True, True, False),
    ("decoder_input_lengths", "TYPE_INT32", *_S),
    ("draft_logits", "TYPE_FP32", [-1, -1], True, True, False),
    ("draft_acceptance_threshold", "TYPE_FP32", *_S),
    ("end_id", "TYPE_INT32", *_S),
    ("pad_id", "TYPE_INT32", *_S),
    ("stop_words_list", "TYPE_INT32", [2, -1], True, True, False),
    ("bad_words_list", "TYPE_INT32", [2, -1], True, True, False),
    ("embedding_bias", "TYPE_FP32", [-1], True, True, False),
    ("beam_width", "TYPE_INT32", *_S),
    ("temperature", "TYPE_FP32", *_S),
    ("runtime_top_k", "TYPE_INT32", *_S),
    ("runtime_top_p", "TYPE_FP32", *_S),
    ("runtime_top_p_min", "TYPE_FP32", *_S),
    ("runtime_top_p_decay", "TYPE_FP32", *_S),
    ("runtime_top_p_reset_ids", "TYPE_INT32", *_S),
    ("len_penalty", "TYPE_FP32", *_S),
    ("early_stopping", "TYPE_BOOL", *_S),
    ("repetition_penalty", "TYPE_FP32", *_S),
    ("min_tokens", "TYPE_INT32", *_S),
    ("beam_search_diversity_rate", "TYPE_FP32", *_S),
    ("presence_penalty", "TYPE_FP32", *_S),
    ("frequency_penalty", "TYPE_FP32", *_S),
    ("seed", "TYPE_UINT64", *_S),
    ("return_log_probs", "TYPE_BOOL", *_S),
    ("return_context_logits", "TYPE_BOOL", *_S),
    ("return_generation_logits", "TYPE_BOOL", *_S),
    ("return_perf_metrics", "TYPE_BOOL", *_S),
    ("return_num_input_tokens", "TYPE_BOOL", *_S),
    ("return_num_output_tokens", "TYPE_BOOL", *_S),
    ("exclude_input_in_output", "TYPE_BOOL", *_S),
    ("stop", "TYPE_BOOL", *_S),
    ("streaming", "TYPE_BOOL", *_S),
    ("prompt_embedding_table", "$dtype", [-1, -1], True, True, False),
    ("prompt_table_extra_ids", "TYPE_UINT64", [-1], True, True, False),
    ("prompt_vocab_size", "TYPE_INT32", *_S),
    ("cross_attention_mask", "TYPE_BOOL", [-1, -1], True, True, False),
    ("mrope_rotary_cos_sin", "TYPE_FP32", [-1], True, False, False),
    ("mrope_position_deltas", "TYPE_INT64", [1], True, False, False),
    ("lora_task_id", "TYPE_UINT64", *_S),
    ("lora_weights", "TYPE_FP16", [-1, -1], True, True, False),
    ("lora_config", "TYPE_INT32", [-1, 3], True, True, False),
    ("context_phase_params", "TYPE_UINT8", [-1], True, True, False),
    ("skip_cross_attn_blocks", "TYPE_BOOL", [1], True, True, False),
    ("retention_token_range_starts", "TYPE_INT32", [-1], True, True, False),
    ("retention_token_range_ends", "TYPE_INT32", [-1], True, True, False),
    ("retention_token_range_priorities", "TYPE_INT32", [-1], True, True, False),
    ("retention_token_range_durations_ms", "TYPE_INT32", [-1], True, True, False),
    ("retention_decode_priority", "TYPE_INT32", [1], True, True, False),
    ("retention_decode_duration_ms", "TYPE_INT32", [1], True, True, False),
    ("guided_decoding_guide_type", "TYPE_STRING", [1], True, True, False),
    ("guided_decoding_guide", "TYPE_STRING", [1], True, True, False),
    ("lookahead_window_size", "TYPE_INT32", [1], True, True, False),
    ("lookahead_ngram_size", "TYPE_INT32", [1], True, True, False),
    ("lookahead_verification_set_size", "TYPE_INT32", [1], True, True, False),
]
CPP_OUTPUTS = [
    ("output_ids", "TYPE_INT32", [-1, -1]),
    ("sequence_length", "TYPE_INT32", [-1]),
    ("cum_log_probs", "TYPE_FP32", [-1]),
    ("output_log_probs", "TYPE_FP32", [-1, -1]),
    ("context_logits", "TYPE_FP32", [-1, -1]),
    ("generation_logits", "TYPE_FP32", [-1, -1, -1]),
    ("batch_index", "TYPE_INT32", [1]),
    ("sequence_index", "TYPE_INT32", [1]),
    ("context_phase_params", "TYPE_UINT8", [-1]),
    ("kv_cache_alloc_new_blocks", "TYPE_INT32", [1]),
    ("kv_cache_reused_blocks", "TYPE_INT32", [1]),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32", [1]),
    ("arrival_time_ns", "TYPE_INT64", [1]),
    ("first_scheduled_time_ns", "TYPE_INT64", [1]),
    ("first_token_time_ns", "TYPE_INT64", [1]),
    ("last_token_time_ns", "TYPE_INT64", [1]),
    ("acceptance_rate", "TYPE_FP32", [1]),
    ("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    ("total_draft_tokens", "TYPE_INT32", [1]),
    ("num_input_tokens", "TYPE_INT32", [1]),
    ("num_output_tokens", "TYPE_INT32", [1]),
]
EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"
WARMUP_PROMPT_TOKENS = 16
WARMUP_OUTPUT_TOKENS = 4


def add_tensors(config, inputs=(), outputs=(), dtype: str = "TYPE_BF16") -> None:
    """Append ModelInput/ModelOutput entries to a ModelConfig (``$dtype`` -> ``dtype``)."""
    from tritonclient.grpc import model_config_pb2 as mc

    for name, data_type, dims, optional, ragged, reshape in inputs:
        t = config.input.add(name=name, data_type=mc.DataType.Value(dtype if data_type == "$dtype" else data_type),
                             dims=dims, optional=optional, allow_ragged_batch=ragged)
        if reshape:
            t.reshape.SetInParent()  # reshape: { shape: [ ] }
    for name, data_type, dims in outputs:
        config.output.add(name=name, data_type=mc.DataType.Value(data_type), dims=dims)


def set_queue_policy(config, spec: Spec) -> None:
    """dynamic_batching.default_queue_policy from serving.max_queue_size / queue_timeout_ms."""
    from tritonclient.grpc import model_config_pb2 as mc

    policy = config.dynamic_batching.default_queue_policy
    policy.max_queue_size = spec.serving.max_queue_size
    if spec.serving.queue_timeout_ms:
        policy.timeout_action = mc.ModelQueuePolicy.REJECT
        policy.default_timeout_microseconds = spec.serving.queue_timeout_ms * 1000


def triton_model_config(spec: Spec, engine_dir: Path | str, *, name: str = "tensorrt_llm"):
    """The ``tensorrt_llm`` model for the C++ ``tensorrtllm`` backend, built through Triton's ModelConfig schema.

    ``engine_dir`` is the engine directory as the server will see it.  Every parameter the
    backend reads is set from the spec, including the three it reads without a default
    (``tokenizer_dir``, ``xgrammar_tokenizer_info_path``, ``guided_decoding_backend``:
    model_instance_state.cc getGuidedDecodingConfigFromParams throws when they are absent).
    With ``serving.warmup`` the config names warm-up files that must exist in
    ``<model>/warmup/`` (:func:`warmup_files`); :func:`write_triton_model` writes both.
    """
    from tritonclient.grpc import model_config_pb2 as mc

    b, s = spec.build, spec.serving
    config = mc.ModelConfig(name=name, backend="tensorrtllm", max_batch_size=b.max_batch_size)
    config.model_transaction_policy.decoupled = s.decoupled
    config.dynamic_batching.preferred_batch_size.append(b.max_batch_size)
    config.dynamic_batching.max_queue_delay_microseconds = 0
    set_queue_policy(config, spec)  # the backend hands max_queue_size to the executor too
    add_tensors(config, CPP_INPUTS, CPP_OUTPUTS, dtype=DTYPE_TO_TRITON[spec.model.dtype])
    # KIND_CPU: the backend places the engine on the GPUs itself (upstream template).
    config.instance_group.add(count=s.instance_count, kind=mc.ModelInstanceGroup.KIND_CPU)
    params = {
        "gpt_model_type": s.batching_strategy,
        "gpt_model_path": str(engine_dir),
        "max_beam_width": str(b.max_beam_width),
        "batch_scheduler_policy": s.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": str(b.kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": _bool(b.enable_kv_cache_reuse),
        "enable_chunked_context": _bool(b.enable_chunked_context),
        "exclude_input_in_output": "true",  # text_output carries the answer only; a request may override
        "normalize_log_probs": "true",
        "decoding_mode": "top_k_top_p",
        "cancellation_check_period_ms": "100",
        "stats_check_period_ms": "100",
        "multi_block_mode": "true",
        "enable_context_fmha_fp32_acc": "false",
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "executor_worker_path": EXECUTOR_WORKER,
        "tokenizer_dir": "",
        "xgrammar_tokenizer_info_path": "",
        "guided_decoding_backend": "",
    }
    if s.instance_count > 1:
        # One engine copy per instance on its own GPUs ("0,1;2,3"); served in orchestrator mode (mpi.py).
        ws = b.world_size
        params["gpu_device_ids"] = ";".join(",".join(str(i * ws + r) for r in range(ws)) for i in range(s.instance_count))
    for k, v in params.items():
        config.parameters[k].string_value = v
    if s.warmup:
        add_warmup(config, spec, _cpp_warmup_inputs(spec))
    return config


def write_triton_model(spec: Spec, model_dir: Path | str, engine_dir: Path | str) -> Path:
    """Write the ``tensorrt_llm`` model directory: config.pbtxt, warmup/ files and the version dir ``1/``."""
    model_dir = Path(model_dir)
    write_model_dir(model_dir, triton_model_config(spec, engine_dir, name=model_dir.name),
                    warmup_files(spec) if spec.serving.warmup else {})
    return model_dir


def write_model_dir(model_dir: Path, config, warmup: dict[str, bytes], version_files: dict[str, str] | None = None) -> None:
    """config.pbtxt (text_format, parsed back through the schema as a check), warmup/, 1/."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    text = text_format.MessageToString(config)
    if text_format.Parse(text, mc.ModelConfig()) != config:
        raise StageError(f"the config of model '{config.name}' does not survive a text round trip")
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text)
    for name, data in warmup.items():
        (model_dir / "warmup").mkdir(exist_ok=True)
        (model_dir / "warmup" / name).write_bytes(data)
    for name, data in (version_files or {}).items():
        (model_dir / "1" / name).write_text(data)


def _bool(v: bool) -> str:
    return "true" if v else "false"


def _warmup_lengths(spec: Spec) -> tuple[int, int]:
    prompt = min(WARMUP_PROMPT_TOKENS, spec.build.max_input_len)
    return prompt, max(1, min(WARMUP_OUTPUT_TOKENS, spec.build.max_seq_len - prompt))


def _cpp_warmup_inputs(spec: Spec) -> dict:
    prompt, out = _warmup_lengths(spec)
    return {
        "input_ids": ("TYPE_INT32", [prompt], "input_ids"),
        "input_lengths": ("TYPE_INT32", [1], "input_lengths"),
        "request_output_len": ("TYPE_INT32", [1], "request_output_len"),
    }


def add_warmup(config, spec: Spec, inputs: dict, *, batch_size: int = 1) -> None:
    """One warm-up request per instance at load, its tensors read from <model>/warmup/<file>."""
    from tritonclient.grpc import model_config_pb2 as mc

    w = config.model_warmup.add(name="rtk_warmup", batch_size=batch_size, count=1)
    for name, (data_type, dims, filename) in inputs.items():
        w.inputs[name].data_type = mc.DataType.Value(data_type)
        w.inputs[name].dims.extend(dims)
        w.inputs[name].input_data_file = filename


def warmup_files(spec: Spec, prompt_ids: list[int] | None = None) -> dict[str, bytes]:
    """Files for ``<repo>/tensorrt_llm/warmup/`` (raw little-endian tensors, as Triton reads them).

    ``prompt_ids`` defaults to arbitrary small token ids: warm-up exercises the kernels, not the text.
    """
    prompt, out = _warmup_lengths(spec)
    ids = list(prompt_ids or range(100, 100 + prompt))[:prompt]
    ids += [ids[-1]] * (prompt - len(ids))
    return {
        "input_ids": struct.pack(f"<{prompt}i", *ids),
        "input_lengths": struct.pack("<i", prompt),
        "request_output_len": struct.pack("<i", out),
    }

