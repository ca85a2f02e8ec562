"""The quantize stage's exports and its quality numbers equal what ModelOpt itself computes.

* KV-cache quantization without weight quantization is calibrated and exported, not dropped.
* NVFP4 (no fake-quant forward without CUDA): rtk's dequantized weights equal ModelOpt's own.
* Each format's export, read back by rtk's loader, stays close to ModelOpt's fake-quant perplexity.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import spec_for
from safetensors import safe_open

from toolkit.quantize import calibrate, export_hf, load_model, quantize
from toolkit.runtime.checkpoint import load_checkpoint

FAST_CALIB = {"calibration": {"num_samples": 8, "max_length": 64, "batch_size": 4}, "eval_samples": 4}


def tensors(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def test_kv_cache_alone_is_calibrated_when_weights_stay_unquantized(tmp_path, tiny_llama_dir):
    spec = spec_for("tiny-kv", tiny_llama_dir, quantization={"format": "none", "kv_cache": "fp8", **FAST_CALIB})
    result = quantize(spec, checkpoint=tiny_llama_dir, output=tmp_path / "q")
    hq = json.loads((result.path / "hf" / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] is None and hq["kv_cache_quant_algo"] == "FP8"
    hf = tensors(result.path / "hf")
    assert hf["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16  # weights untouched
    for i in range(2):
        assert hf[f"model.layers.{i}.self_attn.k_proj.k_scale"].item() > 0
        assert hf[f"model.layers.{i}.self_attn.v_proj.v_scale"].item() > 0
    trt = json.loads((result.path / "trtllm" / "config.json").read_text())["quantization"]
    assert trt["quant_algo"] is None and trt["kv_cache_quant_algo"] == "FP8"
    q = json.loads((result.path / "quality.json").read_text())
    assert q["quantized_ppl"] != q["baseline_ppl"], "the gated number must include the KV quantization"
    # ModelOpt quantizes K/V after RoPE (k/v_bmm_quantizer); the export, read back, computes the same
    assert q["quantized_ppl"] == pytest.approx(q["fake_quant_ppl"], rel=2e-3)


def test_nvfp4_weights_dequantize_as_modelopt_does(tmp_path, tiny_llama_dir):
    """rtk's loader against ModelOpt's NVFP4QTensor: the exported bytes dequantize to the same weights,
    and those are ModelOpt's own NVFP4 quantization of the calibrated weights, with one global scale
    per fused group (q|k|v, as TensorRT-LLM fuses them)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from transformers import AutoTokenizer

    spec = spec_for(
        "tiny-nvfp4", tiny_llama_dir, quantization={"format": "nvfp4", **FAST_CALIB}, build={"target": "trt-engine"}
    )
    model = calibrate(load_model(tiny_llama_dir, spec), spec, AutoTokenizer.from_pretrained(tiny_llama_dir), None)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[1].mlp
    cases = {
        "q_proj": (0, "self_attn", attn.q_proj, [attn.q_proj, attn.k_proj, attn.v_proj]),
        "down_proj": (1, "mlp", mlp.down_proj, [mlp.down_proj]),
    }
    own = {}
    for name, (_, _, module, group) in cases.items():
        global_scale = max(NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(m.weight_quantizer) for m in group)
        qt, scale, global_scale = NVFP4QTensor.quantize(
            module.weight.detach().to(torch.bfloat16), 16, None, global_scale
        )
        own[name] = qt.dequantize(dtype=torch.float32, scale=scale, double_scale=global_scale, block_sizes={-1: 16})
    export_hf(model, tmp_path / "hf", tiny_llama_dir)
    hf = tensors(tmp_path / "hf")
    ckpt = load_checkpoint(tmp_path / "hf")
    for name, (li, mod, _, _) in cases.items():
        prefix = f"model.layers.{li}.{mod}.{name}"
        packed = hf[f"{prefix}.weight"]
        shape = torch.Size([packed.shape[0], packed.shape[1] * 2])
        theirs = NVFP4QTensor(shape, torch.float32, packed).dequantize(
            dtype=torch.float32,
            scale=hf[f"{prefix}.weight_scale"],
            double_scale=hf[f"{prefix}.weight_scale_2"],
            block_sizes={-1: 16},
        )
        ours = ckpt.layers[li][name].weight
        tol = dict(rtol=1e-6, atol=1e-6 * ours.abs().max().item())  # the two multiply the scales in another order
        torch.testing.assert_close(ours, theirs, **tol)
        torch.testing.assert_close(ours, own[name], **tol)


@pytest.mark.parametrize("fmt", ["fp8", "none"])
def test_model_dtype_is_the_dtype_of_every_checkpoint_and_of_the_engines_tensors(tmp_path, tiny_llama_dir, fmt):
    """One rule: ``model.dtype`` types the fetched checkpoint, both exports (tensors and config) and
    the trt-engine's Triton tensors.  The tiny source is bfloat16; the spec asks for float16."""
    from toolkit.fetch import fetch
    from toolkit.triton.config import TORCH_TO_TRITON

    spec = spec_for(
        "tiny-fp16",
        tiny_llama_dir,
        model={"dtype": "float16"},
        quantization={"format": fmt, **FAST_CALIB},
        build={"target": "trt-engine"},
    )
    ckpt = fetch(spec, output=tmp_path / "checkpoint").path
    assert tensors(ckpt)["model.embed_tokens.weight"].dtype == torch.float16
    assert tensors(tiny_llama_dir)["model.embed_tokens.weight"].dtype == torch.bfloat16  # links not written through
    out = quantize(spec, checkpoint=ckpt, output=tmp_path / "q").path
    for directory, names in [
        (ckpt, ["model.norm.weight"]),
        (out / "hf", ["model.embed_tokens.weight", "model.norm.weight"]),
        (out / "trtllm", ["transformer.vocab_embedding.weight", "lm_head.weight", "transformer.ln_f.weight"]),
    ]:
        t = tensors(directory)
        assert [t[n].dtype for n in names] == [torch.float16] * len(names), directory.name
    hf_cfg = json.loads((out / "hf" / "config.json").read_text())
    assert hf_cfg["dtype"] == hf_cfg["torch_dtype"] == "float16"
    trt_cfg = json.loads((out / "trtllm" / "config.json").read_text())
    assert trt_cfg["dtype"] == "float16"
    # the trt-engine types its MODEL-dtype tensors from model.dtype: the same type as the checkpoint it builds
    assert TORCH_TO_TRITON[spec.model.dtype] == TORCH_TO_TRITON[trt_cfg["dtype"]] == "FP16"


def _effective(layer: dict, name: str) -> torch.Tensor:
    """A projection's weight as applied to the normalized hidden state: W · diag(pre_quant_scale · norm).

    The exports place AWQ/SmoothQuant input scales differently (hf/ folds the ones of q|k|v and
    gate|up into the RMSNorm weights; trtllm/ keeps them as prequant_scaling_factor), not their product.
    """
    norm = {
        "q_proj": "input_layernorm",
        "k_proj": "input_layernorm",
        "v_proj": "input_layernorm",
        "gate_proj": "post_attention_layernorm",
        "up_proj": "post_attention_layernorm",
    }.get(name)
    lin = layer[name]
    cols = torch.ones(lin.weight.shape[1])
    if lin.pre_quant_scale is not None:
        cols = cols * lin.pre_quant_scale
    if norm:
        cols = cols * layer[norm]
    return lin.weight * cols


@pytest.mark.parametrize(
    "fmt, kv, tol",
    [
        pytest.param("fp8", "fp8", 0.06, id="fp8+kv"),
        pytest.param("int8_sq", "none", 0.06, id="int8_sq", marks=pytest.mark.slow),
        # AWQ: hf/ re-smooths q|k|v and gate|up with one averaged scale and re-quantizes them (test_quantize.py's
        # int4 test); trtllm/ keeps each projection's own AWQ scale: two quantizations, measured 8 % apart
        pytest.param("int4_awq", "none", 0.12, id="int4_awq", marks=pytest.mark.slow),
        pytest.param("nvfp4", "none", 0.06, id="nvfp4", marks=pytest.mark.slow),
    ],
)
def test_trtllm_export_holds_the_same_quantized_model_as_the_hf_export(tmp_path, tiny_llama_dir, fmt, kv, tol):
    """hf/ and trtllm/ come from two restores of one calibration.  They agree except where TensorRT-LLM
    asks otherwise: one weight scale per fused q|k|v and gate|up group (re-rounding each weight by
    less than one code step: measured ≤ 4 % relative; AWQ see below), and FP8 KV-cache scales of at least 1.0
    (modelopt/torch/export/quant_utils.py, get_kv_cache_scaling_factor).  Activation scales are equal."""
    from toolkit.runtime.checkpoint import load_trtllm_checkpoint

    spec = spec_for(
        f"tiny-{fmt}",
        tiny_llama_dir,
        build={"target": "trt-engine" if fmt == "nvfp4" else "cpu"},
        quantization={"format": fmt, "kv_cache": kv, "group_size": 64, **FAST_CALIB, "max_perplexity_increase": 100.0},
    )
    out = quantize(spec, checkpoint=tiny_llama_dir, output=tmp_path / "q").path
    hf, trt = load_checkpoint(out / "hf"), load_trtllm_checkpoint(out / "trtllm", out / "hf")
    assert (hf.quant_algo, hf.kv_cache_quant_algo) == (trt.quant_algo, trt.kv_cache_quant_algo)
    for i, (a, b) in enumerate(zip(hf.layers, trt.layers, strict=True)):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            wa, wb = _effective(a, name), _effective(b, name)
            rel = ((wa - wb).norm() / wa.norm()).item()
            assert rel < tol, f"layer {i} {name}: the exports' weights differ by {rel:.1%}"
            qa, qb = a[name].act_quant, b[name].act_quant
            assert (qa is None) == (qb is None) and (
                qa is None or (qa.kind, qa.scale.item()) == (qb.kind, qb.scale.item())
            )
        if kv == "fp8":
            assert b["k_scale"].item() == b["v_scale"].item() == max(a["k_scale"].item(), a["v_scale"].item(), 1.0)
    torch.testing.assert_close(hf.embed_tokens, trt.embed_tokens, rtol=0, atol=0)
    q = json.loads((out / "quality.json").read_text())
    assert q["trtllm_ppl"] is not None and q["trtllm_increase"] == pytest.approx(
        q["trtllm_ppl"] / q["baseline_ppl"] - 1
    )


def test_gate_fails_when_only_the_trtllm_export_is_bad(tmp_path, tiny_llama_dir, monkeypatch):
    """trt-engine deploys trtllm/; a fault in that export alone must fail the gate (exit 3), not pass on hf/."""
    from safetensors.torch import load_file, save_file

    import toolkit.quantize as qmod
    from toolkit.errors import QualityGateError

    real = qmod._export_trtllm

    def export_then_damage(model, dest, *args, **kwargs):
        real(model, dest, *args, **kwargs)
        f = dest / "rank0.safetensors"
        t = load_file(f)
        t["transformer.ln_f.weight"] *= 20  # a final norm 20x too large: far sharper, wrong logits
        save_file(t, f, metadata={"format": "pt"})

    monkeypatch.setattr(qmod, "_export_trtllm", export_then_damage)
    spec = spec_for(
        "tiny-gate",
        tiny_llama_dir,
        build={"target": "trt-engine"},
        quantization={"format": "fp8", **FAST_CALIB, "max_perplexity_increase": 0.5},
    )
    with pytest.raises(QualityGateError, match="trtllm/"):
        quantize(spec, checkpoint=tiny_llama_dir, output=tmp_path / "quantized")
    report = json.loads((tmp_path / "quantized.rejected-quality.json").read_text())
    assert report["increase"] <= 0.5 < report["trtllm_increase"]  # hf/ alone would have passed
    assert not (tmp_path / "quantized").exists()


@pytest.mark.parametrize("fmt", ["fp8", "int8_sq", "w4a8_awq"])
def test_export_is_as_close_to_the_model_as_modelopts_fake_quant(tmp_path, tiny_llama_dir, fmt):
    """The export read back by rtk's loader vs ModelOpt's in-memory fake-quant model, on logits (the tiny
    random model's perplexity hardly reacts to its weights; its logits do).  A dequantization bug
    (wrong scale axis, nibble order, lost pre-quant scale) gives garbage, far outside this bound."""
    import copy

    import modelopt.torch.quantization as mtq
    from transformers import AutoTokenizer

    from toolkit.quality import reference_model

    spec = spec_for(f"tiny-{fmt}", tiny_llama_dir, quantization={"format": fmt, "group_size": 64, **FAST_CALIB})
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = torch.tensor(
        [tok("The assignment statement binds names to objects. A function is defined with def.")["input_ids"]]
    )
    with torch.no_grad():
        base = load_model(tiny_llama_dir, spec)(input_ids=ids).logits
        model = calibrate(load_model(tiny_llama_dir, spec), spec, tok, 64 if "awq" in fmt else None)
        folded = copy.deepcopy(model)
        mtq.fold_weight(folded)
        fake = folded(input_ids=ids).logits
    export_hf(model, tmp_path / "hf", tiny_llama_dir)
    with torch.no_grad():
        exported = reference_model(load_checkpoint(tmp_path / "hf"))(input_ids=ids).logits

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    # measured: export/fake-quant distance ratio 0.97 (fp8), 1.01 (int8_sq), 1.07 (w4a8_awq; hf/ re-smooths q|k|v)
    assert rel(exported, base) <= 1.2 * rel(fake, base), (
        f"{fmt}: the export is much further from the model than ModelOpt's"
    )


def test_int8_kv_cache_is_refused_at_validation_not_by_a_crash_in_the_export():
    """ModelOpt 0.47's HF export asserts on INT8 KV-cache scales ("Invalid KV cache quantization format")."""
    from toolkit.errors import SpecError
    from toolkit.spec import spec_from_dict

    for fmt in ("none", "fp8"):
        with pytest.raises(SpecError, match=r"quantization\.kv_cache.*'int8' cannot be exported.*'fp8' or 'none'"):
            spec_from_dict({"name": "kv8", "quantization": {"format": fmt, "kv_cache": "int8"}})
