"""Stage 2, quantize: ModelOpt post-training quantization, both exports, and a quality report.

Output directory (default ``engines/<name>/quantized/``)::

    hf/             unified HF checkpoint (hf_quant_config.json, model.safetensors, tokenizer) + manifest
    trtllm/         TensorRT-LLM checkpoint (config.json, rank<N>.safetensors) + manifest
    quality.json    perplexity of the *exported* checkpoint (read by rtk's loader) vs the unquantized one,
                    and how far its next-token distributions moved (``kl_divergence``)
    rtk-manifest.json

The quality gate (``quantization.max_perplexity_increase``) fails the stage with exit code 3 and
leaves no artifact behind; the rejected report is kept at ``<output>.rejected-quality.json``.

ModelOpt 0.47 on CPU: FP8, INT8-SQ, INT4-AWQ and W4A8-AWQ calibrate, fake-quantize and export.
NVFP4 calibrates and exports, but its fake-quant forward needs CUDA, so the report evaluates the
export only (emulated by the loader); ModelOpt raises "amax must be a CUDA tensor for dynamic block
quantization" (modelopt/torch/quantization/tensor_quant.py) otherwise.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .artifacts import (
    StageResult,
    default_output,
    hash_tree,
    link_or_copy,
    read_manifest,
    run_stage,
    tool_versions,
    write_json_atomic,
)
from .console import err, progress, quiet_libraries, step
from .errors import QualityGateError, SourceError, StageError, UsageError
from .hfcompat import TOKENIZER_FILES, make_compatible, trtllm_rope
from .spec import Spec, check_against_model, resolve_group_size

log = logging.getLogger(__name__)

# Formats whose fake-quantized forward ModelOpt can run without CUDA (dynamic-block formats cannot);
# "none" with a quantized KV cache fake-quantizes keys and values only.
CPU_FAKE_QUANT = {"none", "fp8", "int8_sq", "int4_awq", "w4a8_awq"}


def modelopt_config(
    fmt: str,
    kv_cache: str,
    group_size: int | None,
    quantize_lm_head: bool = False,
    weight_only_modules: Sequence[str] = (),
) -> dict:
    """The ModelOpt quant config for a format (0.47: ``quant_cfg`` is a list of entries).

    ``quantize_lm_head``: re-enable the LM head's weight quantizer, which ModelOpt's configs disable
    (``*lm_head*``), as TensorRT-LLM's ``examples/quantization/quantize.py --quantize_lm_head`` does.  Entries
    apply in order and one of ``enable`` alone keeps the format's settings, so the head's weights get the
    layers' format: W4A16 AWQ under int4_awq, W8A16 under int8_sq (ModelOpt then exports MIXED_PRECISION).
    Its input stays unquantized: on SmolLM2-135M an INT8-SQ head with its static per-tensor input scale
    raised the export's perplexity increase from 6.8 % to 10.3 % (FP8: 2.0 % to 4.6 %), the weight-only
    INT8 head by nothing measurable (docs/engine-measurements.md).  A blanket ``*lm_head*`` entry would also enable
    the output quantizer, and the export would then claim an INT8 KV cache.

    ``weight_only_modules``: int8_sq layers whose input quantizer is turned off (``*<name>*input_quantizer``), so
    ModelOpt neither smooths nor quantizes their inputs and exports them as W8A16 (MIXED_PRECISION).
    """
    import modelopt.torch.quantization as mtq

    base = {
        "none": {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"},  # KV cache alone
        "fp8": mtq.FP8_DEFAULT_CFG,
        "int8_sq": mtq.INT8_SMOOTHQUANT_CFG,
        "int4_awq": mtq.INT4_AWQ_CFG,
        "w4a8_awq": mtq.W4A8_AWQ_BETA_CFG,
        "nvfp4": mtq.NVFP4_DEFAULT_CFG,
    }[fmt]
    cfg = copy.deepcopy(base)
    if group_size is not None:
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer":
                stages = entry["cfg"] if isinstance(entry["cfg"], list) else [entry["cfg"]]
                for c in stages:  # W4A8: a two-stage SequentialQuantizer; only the int4 stage has blocks
                    if c.get("block_sizes"):
                        c["block_sizes"][-1] = group_size
    for name in weight_only_modules:
        cfg["quant_cfg"].append({"quantizer_name": f"*{name}*input_quantizer", "enable": False})
    if quantize_lm_head:
        cfg["quant_cfg"].append({"quantizer_name": "*lm_head*weight_quantizer", "enable": True})
    if kv_cache != "none":
        kv_bits = (4, 3) if kv_cache == "fp8" else 8
        kv_entry = [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": kv_bits, "axis": None}}]
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, kv_entry)
    return cfg


def calibration_batches(spec: Spec, tokenizer) -> list:
    """Token batches for calibration: the shipped corpus's calib split, or an HF dataset."""
    import torch

    c = spec.quantization.calibration
    if c.dataset == "builtin:rtk-calib":
        from .quality import builtin_texts

        texts = builtin_texts("calib")
    elif c.dataset.startswith("hf:"):
        texts = _hf_dataset_texts(c.dataset, c.num_samples)
    else:
        raise UsageError(
            f"quantization.calibration.dataset '{c.dataset}' is not 'builtin:rtk-calib' "
            "or 'hf:DATASET[:SPLIT][#COLUMN]'"
        )
    # Concatenate texts and cut into num_samples windows of max_length tokens (no padding waste).
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if len(ids) >= c.num_samples * c.max_length:
            break
    windows = [ids[i : i + c.max_length] for i in range(0, len(ids) - c.max_length + 1, c.max_length)][: c.num_samples]
    if not windows:
        raise UsageError(
            "quantization.calibration: the dataset yielded no text; check quantization.calibration.dataset"
        )
    return [torch.tensor(windows[i : i + c.batch_size]) for i in range(0, len(windows), c.batch_size)]


def _hf_dataset_texts(source: str, n: int) -> list[str]:
    name, _, column = source[3:].partition("#")
    name, _, split = name.partition(":")
    try:
        import datasets
    except ImportError:
        raise UsageError(
            "an hf: calibration dataset needs the 'datasets' package (pip install datasets), or use builtin:rtk-calib"
        ) from None
    try:
        ds = datasets.load_dataset(name, split=split or "train", streaming=True)
        col = column or "text"
        return [row[col] for _, row in zip(range(n * 4), ds, strict=False) if row.get(col)]
    except Exception as exc:  # datasets raises many types for an unreachable hub
        raise UsageError(
            f"cannot read calibration dataset hf:{name} ({type(exc).__name__}: {exc}); "
            "the hub may be unreachable — use builtin:rtk-calib"
        ) from None


def quantize(
    spec: Spec, checkpoint: Path | None = None, output: Path | None = None, *, force: bool = False
) -> StageResult:
    """Run the quantize stage on ``checkpoint`` (default: the fetch stage's output)."""
    checkpoint = Path(checkpoint) if checkpoint else default_output(spec, "fetch")
    output = Path(output) if output else default_output(spec, "quantize")
    if not (checkpoint / "config.json").is_file():
        raise SourceError(
            f"checkpoint directory '{checkpoint}' has no config.json; run `rtk fetch SPEC` first or pass --checkpoint"
        )
    config = json.loads((checkpoint / "config.json").read_text())
    check_against_model(spec, config)
    group_size = resolve_group_size(spec, int(config["hidden_size"]), int(config["intermediate_size"]))
    src_manifest = read_manifest(checkpoint) or {"files": hash_tree(checkpoint)}
    section = {
        **spec.quantization.model_dump(),
        "resolved_group_size": group_size,
        "model_dtype": spec.model.dtype,
        "tp_size": spec.build.tp_size,
        "pp_size": spec.build.pp_size,
    }
    inputs = {"checkpoint": src_manifest.get("key") or src_manifest["files"]}
    tools = tool_versions("nvidia-modelopt", "torch", "transformers", "safetensors")
    rejected = output.parent / f"{output.name}.rejected-quality.json"

    def write(out) -> None:
        report = _run(spec, checkpoint, out, group_size)
        out.manifest["quality"] = report
        write_json_atomic(out.tmp / "quality.json", report)
        print_report(report)
        if not report["passed"]:
            write_json_atomic(rejected, report)
            if _worst_increase(report) > report["max_increase"]:
                raise QualityGateError(
                    f"perplexity rose {_worst_increase(report) * 100:.1f} % ({report['baseline_ppl']:.2f} → "
                    f"{report['quantized_ppl']:.2f} hf/, {report.get('trtllm_ppl') or float('nan'):.2f} trtllm/), "
                    f"above quantization.max_perplexity_increase = {report['max_increase'] * 100:.1f} %. "
                    f"Choose a gentler format (fp8), more calibration samples, or raise the gate. Report: {rejected}"
                )
            raise QualityGateError(
                f"the export's next-token distributions moved by a mean KL divergence of "
                f"{report['kl_divergence']['mean']:.4f} from the unquantized model's, above "
                f"quantization.max_kl_divergence = {report['max_kl_divergence']}. Choose a gentler format (fp8), keep "
                f"sensitive layers W8A16 (quantization.weight_only_modules), or raise the gate. Report: {rejected}"
            )

    result = run_stage("quantize", output, section=section, inputs=inputs, tools=tools, write=write, force=force)
    rejected.unlink(missing_ok=True)
    return result


def load_model(checkpoint: Path, spec: Spec):
    """The source model in float32 (calibration and fake-quant evaluation run in fp32 on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, trust_remote_code=spec.model.trust_remote_code
    )
    # ModelOpt 0.47 reads config.rope_theta; transformers 5 keeps it only in rope_parameters.
    rp = getattr(m.config, "rope_parameters", None) or {}
    if getattr(m.config, "rope_theta", None) is None and "rope_theta" in rp:
        m.config.rope_theta = rp["rope_theta"]
    if spec.quantization.quantize_lm_head:
        untie_lm_head(m)
    return m.eval()


def untie_lm_head(model) -> None:
    """Give the LM head its own copy of a tied embedding, so quantizing the head leaves the embedding alone.

    Tied, SmoothQuant / AWQ would fold their scales into the shared weight, and the export would write that
    folded weight as the embedding.  Untied, the export carries the quantized head besides the embedding and
    says ``tie_word_embeddings: false``.
    """
    import torch

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not embed.weight:
        return
    head.weight = torch.nn.Parameter(embed.weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.config.get_text_config(decoder=True).tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):  # transformers >= 5: the export dedups by this map
        model.all_tied_weights_keys = {}


def calibrate(model, spec: Spec, tokenizer, group_size: int | None, on_batch=None):
    """Insert ModelOpt quantizers for ``spec.quantization`` and calibrate them; returns the model."""
    import modelopt.torch.quantization as mtq
    import torch

    batches = calibration_batches(spec, tokenizer)
    q = spec.quantization
    cfg = modelopt_config(q.format, q.kv_cache, group_size, q.quantize_lm_head, q.weight_only_modules)

    def forward_loop(m):
        with torch.no_grad():
            for b in batches:
                m(input_ids=b)
                if on_batch:
                    on_batch(len(batches))

    return mtq.quantize(model, cfg, forward_loop)


def fake_quant_perplexity(model, eval_ids, on_text=None) -> float:
    """Perplexity of ModelOpt's in-memory fake-quantized model, evaluated on a copy whose weight
    quantizers are folded into the weights (ModelOpt re-quantizes every weight on every forward
    otherwise — minutes per text on CPU for INT8).  ``model`` itself is left exportable."""
    import copy

    import modelopt.torch.quantization as mtq

    from .quality import perplexity

    folded = copy.deepcopy(model)
    mtq.fold_weight(folded)
    return perplexity(lambda x: folded(input_ids=x).logits, eval_ids, on_text)


def _run(spec: Spec, checkpoint: Path, out, group_size: int | None) -> dict:
    import torch
    from transformers import AutoTokenizer

    from .quality import checkpoint_perplexity, eval_token_lists, evaluate_checkpoint

    quiet_libraries()
    q = spec.quantization
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=spec.model.trust_remote_code)
    eval_ids = eval_token_lists(tokenizer, q.eval_samples)
    report: dict = {
        "format": q.format,
        "kv_cache": q.kv_cache,
        "group_size": group_size,
        "eval_texts": len(eval_ids),
        "eval_tokens": sum(len(x) - 1 for x in eval_ids),
        "eval_set": "builtin:rtk-calib split=eval (held out from calibration)",
        "compute_dtype": "float32",
    }
    # format none with a quantized KV cache: calibrate and export the KV-cache scales alone
    unquantized = q.format == "none" and q.kv_cache == "none"
    with progress() as bar, out.timed("baseline_eval"):
        task = bar.add_task("Perplexity of the unquantized checkpoint", total=len(eval_ids))
        baseline = evaluate_checkpoint(checkpoint, eval_ids, lambda: bar.advance(task), keep=not unquantized)
        report["baseline_ppl"] = baseline.ppl

    hf_dir, trt_dir = out.tmp / "hf", out.tmp / "trtllm"
    source_config = json.loads((checkpoint / "config.json").read_text())
    if unquantized:
        link_or_copy(checkpoint, hf_dir)
        set_checkpoint_dtype(hf_dir, spec.model.dtype)  # replaces files: the source's links stay untouched
        with out.timed("export_trtllm"), step("Exporting the TensorRT-LLM checkpoint"):
            _export_trtllm(
                load_model(checkpoint, spec),
                trt_dir,
                source_config,
                spec.build.tp_size,
                spec.build.pp_size,
                spec.model.dtype,
            )
        report["fake_quant_ppl"] = None
    else:
        import modelopt.torch.opt as mto

        with progress() as bar, out.timed("calibrate"):
            task = bar.add_task(f"Calibrating {q.format} ({q.calibration.num_samples} samples)", total=None)
            model = calibrate(
                load_model(checkpoint, spec),
                spec,
                tokenizer,
                group_size,
                lambda n: bar.update(task, total=n, advance=1),
            )
        report["calibration"] = {
            "samples": q.calibration.num_samples,
            "max_length": q.calibration.max_length,
            "dataset": q.calibration.dataset,
        }
        if q.format in CPU_FAKE_QUANT:
            with progress() as bar, out.timed("fake_quant_eval"):
                task = bar.add_task("Perplexity of the fake-quantized model", total=len(eval_ids))
                report["fake_quant_ppl"] = fake_quant_perplexity(model, eval_ids, lambda: bar.advance(task))
        else:
            report["fake_quant_ppl"] = None
            report["note"] = (
                f"{q.format}: ModelOpt's fake-quant forward needs CUDA; the export is evaluated by rtk's emulation only"
            )
        # Export mutates the model in place: export HF from this one, TensorRT-LLM from a fresh restore.
        with tempfile.TemporaryDirectory(dir=out.tmp.parent) as scratch:
            state = Path(scratch) / "modelopt_state.pth"
            mto.save(model, str(state))
            with out.timed("export_hf"), step("Exporting the unified HF checkpoint"):
                export_hf(model, hf_dir, checkpoint, spec.model.dtype)
            del model
            with out.timed("export_trtllm"), step("Exporting the TensorRT-LLM checkpoint"):
                fresh = load_model(checkpoint, spec)
                mto.restore(fresh, str(state))
                _export_trtllm(fresh, trt_dir, source_config, spec.build.tp_size, spec.build.pp_size, spec.model.dtype)
                del fresh
    make_compatible(hf_dir)
    for sub in (hf_dir, trt_dir):
        (sub / "rtk-manifest.json").write_text(json.dumps({"files": hash_tree(sub), "complete": True}, indent=2) + "\n")

    # The gate reads both exports: trt-engine builds from trtllm/, which comes from a separate restore
    # with TensorRT-LLM's own scales (one weight scale per fused q|k|v and gate|up group; FP8 KV-cache
    # scales clamped to at least 1.0), so its numbers are not hf/'s.
    report["trtllm_ppl"] = report["trtllm_increase"] = None
    if unquantized:
        report["quantized_ppl"] = report["baseline_ppl"]
    else:
        with progress() as bar, out.timed("export_eval"):
            task = bar.add_task("Perplexity of the exported HF checkpoint (rtk loader)", total=len(eval_ids))
            exported = evaluate_checkpoint(hf_dir, eval_ids, lambda: bar.advance(task), reference=baseline.logprobs)
            report["quantized_ppl"] = exported.ppl
            report["kl_divergence"] = {
                "mean": exported.mean_kld,
                "p99": exported.kld_p99,
                "same_top_token": exported.same_top,
            }
        del baseline
        if spec.build.world_size == 1:
            with progress() as bar, out.timed("export_eval_trtllm"):
                task = bar.add_task("Perplexity of the TensorRT-LLM checkpoint (rtk loader)", total=len(eval_ids))
                report["trtllm_ppl"] = checkpoint_perplexity(
                    trt_dir, eval_ids, lambda: bar.advance(task), hf_config_dir=hf_dir
                )
            report["trtllm_increase"] = report["trtllm_ppl"] / report["baseline_ppl"] - 1.0
        else:
            report["note"] = (report.get("note", "") + "; " if report.get("note") else "") + (
                "trtllm/ has several ranks; rtk's loader reads single-rank checkpoints, so only hf/ is gated"
            )
    report["increase"] = report["quantized_ppl"] / report["baseline_ppl"] - 1.0
    report["max_increase"] = q.max_perplexity_increase
    report["max_kl_divergence"] = q.max_kl_divergence
    kld = (report.get("kl_divergence") or {}).get("mean") or 0.0  # none: an unquantized export moved nothing
    report["passed"] = _worst_increase(report) <= q.max_perplexity_increase and (
        q.max_kl_divergence is None or kld <= q.max_kl_divergence
    )
    return report


def _worst_increase(report: dict) -> float:
    """The larger perplexity increase of the two exports (hf/ and, where evaluated, trtllm/)."""
    return max(x for x in (report["increase"], report.get("trtllm_increase")) if x is not None)


def export_hf(model, dest: Path, checkpoint: Path, dtype: str = "bfloat16") -> None:
    """ModelOpt's unified HF export in ``dtype`` plus the tokenizer files it does not write."""
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    dest.mkdir(parents=True)
    with torch.inference_mode(False), torch.no_grad():
        export_hf_checkpoint(model, dtype=getattr(torch, dtype), export_dir=str(dest))
    set_checkpoint_dtype(dest, dtype)
    for name in TOKENIZER_FILES:  # the export writes weights and config only
        if (checkpoint / name).is_file() and not (dest / name).exists():
            shutil.copy2(checkpoint / name, dest / name)


def _export_trtllm(
    model, dest: Path, source_config: dict, tp_size: int = 1, pp_size: int = 1, dtype: str = "bfloat16"
) -> None:
    """ModelOpt's TensorRT-LLM checkpoint export, sharded for the spec's tensor/pipeline parallelism.

    ``source_config`` is the checkpoint's config.json, the HF config TensorRT-LLM would convert.
    """
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    decoder = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen"}[
        model.config.architectures[0]
    ]
    dest.mkdir(parents=True)
    # ModelOpt warns "Cannot export tensorrt_llm checkpoint config … No module named 'tensorrt_llm'"
    # and writes config.json itself; that is expected on a host without TensorRT-LLM.
    logging.getLogger("modelopt").setLevel(logging.ERROR)
    with torch.no_grad():
        export_tensorrt_llm_checkpoint(
            model,
            decoder_type=decoder,
            dtype=getattr(torch, dtype),
            export_dir=str(dest),
            inference_tensor_parallel=tp_size,
            inference_pipeline_parallel=pp_size,
        )
    cast_unquantized_tensors(dest, dtype)
    cfg_path = dest / "config.json"
    if not cfg_path.is_file() or not list(dest.glob("rank*.safetensors")):
        raise StageError(f"ModelOpt's TensorRT-LLM export wrote no config.json/rank*.safetensors into {dest}")
    # ModelOpt 0.47 reads rope_theta / rope_scaling from the model config, which transformers 5
    # keeps only in rope_parameters: the export would lose Llama-3.1's scaling (and 4.x-style
    # readers default the base to 10000).  Write what TensorRT-LLM's own converter derives.
    cfg = json.loads(cfg_path.read_text())
    cfg["rotary_base"], cfg["rotary_scaling"] = trtllm_rope(source_config)
    write_json_atomic(cfg_path, cfg)


def set_checkpoint_dtype(directory: Path, dtype: str) -> None:
    """Make ``model.dtype`` the dtype of a written HF checkpoint: its unquantized tensors and config.json.

    The one rule for dtype: ``model.dtype`` is the dtype of every checkpoint rtk writes (fetch, both
    exports) and of the engines' tensors (the trt-engine's Triton types follow it).  ModelOpt 0.47
    writes the in-memory model's dtype (float32 here: rtk calibrates in float32) into config.json
    whatever ``dtype=`` it exported in.  ``torch_dtype`` is the spelling transformers 4.x reads.
    """
    cast_unquantized_tensors(directory, dtype)
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("dtype") != dtype or cfg.get("torch_dtype") != dtype:
        cfg["dtype"] = cfg["torch_dtype"] = dtype
        write_json_atomic(cfg_path, cfg)


def cast_unquantized_tensors(directory: Path, dtype: str = "bfloat16") -> None:
    """Cast floating tensors that are not scales (embeddings, norms, lm_head) to ``dtype``.

    ModelOpt 0.47's exports keep the model's own dtype for unquantized tensors even when given
    ``dtype=``; rtk calibrates in float32, so without this the embedding would ship in fp32.
    Scales (``*scale*``, ``*scaling_factor*``) stay as written (float32 where TensorRT-LLM expects it);
    quantized codes (fp8, integers) are not floating tensors of these dtypes.  Files are replaced,
    never written through, so a hard-linked source stays untouched.
    """
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    floats = (torch.float32, torch.float16, torch.bfloat16)

    def recast(k: str, t) -> bool:
        return t.dtype in floats and t.dtype != target and "scal" not in k

    for f in directory.glob("*.safetensors"):
        tensors = load_file(str(f))
        if not any(recast(k, t) for k, t in tensors.items()):
            continue
        cast = {k: (t.to(target) if recast(k, t) else t) for k, t in tensors.items()}
        tmp = f.with_name(f".{f.name}.tmp")
        save_file(cast, str(tmp), metadata={"format": "pt"})
        tmp.replace(f)


def print_report(report: dict) -> None:
    from rich.table import Table

    t = Table(
        title=f"Quality report: {report['format']}"
        + (f" + {report['kv_cache']} KV" if report["kv_cache"] != "none" else "")
    )
    t.add_column("checkpoint")
    t.add_column("perplexity", justify="right")
    t.add_row("unquantized (baseline)", f"{report['baseline_ppl']:.3f}")
    if report.get("fake_quant_ppl") is not None:
        t.add_row("fake-quantized (ModelOpt, in memory)", f"{report['fake_quant_ppl']:.3f}")
    t.add_row("exported hf/ (rtk loader)", f"{report['quantized_ppl']:.3f}")
    if report.get("trtllm_ppl") is not None:
        t.add_row("exported trtllm/ (rtk loader)", f"{report['trtllm_ppl']:.3f}")
    err.print(t)
    verdict = "[green]PASS[/]" if report["passed"] else "[red]FAIL[/]"
    lines = [
        f"increase {_worst_increase(report) * 100:+.2f} % (gate {report['max_increase'] * 100:.1f} %) on "
        f"{report['eval_tokens']} held-out tokens"
    ]
    kld = report.get("kl_divergence")
    if kld:
        gate = report.get("max_kl_divergence")
        lines.append(
            f"hf/ against the baseline, per position: mean KL divergence {kld['mean']:.4f}"
            + (f" (gate {gate})" if gate is not None else "")
            + f", p99 {kld['p99']:.3f}; same most likely token {kld['same_top_token'] * 100:.1f} %"
        )
    lines[-1] += f": {verdict}"
    for line in lines:
        err.print(line)
    if report.get("note"):
        err.print(f"[dim]{report['note']}[/]")
