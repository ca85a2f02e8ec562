"""The quality gate's reference forward (toolkit/quality.py) computes what the deployed engines compute."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from toolkit.quality import reference_model
from toolkit.runtime.checkpoint import load_checkpoint


def _with_kv_scales(src, dest, kind: str, k_scale: float, v_scale: float):
    """A copy of ``src`` whose hf_quant_config quantizes the KV cache with the given per-layer scales."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(k_scale * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(v_scale * (i + 1))
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    quant = {"quantization": {"quant_algo": None, "kv_cache_quant_algo": kind}}
    (dest / "hf_quant_config.json").write_text(json.dumps(quant))
    return dest


@pytest.mark.parametrize("kind,scales", [("FP8", (0.02, 0.01)), ("INT8", (0.05, 0.03))])
def test_kv_cache_is_quantized_after_rope_as_the_engine_does(tmp_path, tiny_llama_dir, kind, scales):
    """rtk's engine stores K/V codes after RoPE, as TensorRT-LLM's KV cache and ModelOpt's
    k/v_bmm_quantizer do; the reference must give the same logits (quantizing the k_proj output,
    before RoPE, puts different values on the quantization grid)."""
    from toolkit.runtime.engine import Engine, EngineConfig

    path = _with_kv_scales(tiny_llama_dir, tmp_path / kind, kind, *scales)
    ids = torch.randint(3, 49152, (96,), generator=torch.Generator().manual_seed(7)).tolist()
    eng = Engine(
        path,
        EngineConfig(
            max_batch_size=1,
            max_num_tokens=128,
            max_input_len=128,
            max_seq_len=160,
            tokens_per_block=16,
            dtype="float32",
        ),
    )
    assert eng.pool.quant.kind == kind.lower()
    with torch.inference_mode():
        want = eng.prompt_logits(ids)
        got = reference_model(load_checkpoint(path))(input_ids=torch.tensor([ids])).logits[0]
        unquantized = reference_model(load_checkpoint(tiny_llama_dir))(input_ids=torch.tensor([ids])).logits[0]
    err = (got - want).abs().max().item()
    assert (unquantized - want).abs().max().item() > 50 * max(err, 1e-5), "the KV quantization must matter here"
    assert err < 1e-4, f"{kind}: reference vs engine max |Δlogit| {err:.2e}"
