"""Perplexity of a checkpoint on held-out text, read through rtk's own loader.

The forward is transformers' reference implementation of the architecture, with every projection
replaced by the loader's dequantized :class:`~toolkit.runtime.checkpoint.Linear` (which emulates
pre-quant scales and activation quantization) and, where the checkpoint quantizes the KV cache,
keys and values fake-quantized with their scales *after* RoPE, inside the attention function, where
ModelOpt's ``k_bmm_quantizer`` / ``v_bmm_quantizer``, TensorRT-LLM's KV cache and rtk's engine all
quantize them.  Used for the quantize stage's report and as the reference the CPU engine is tested
against.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .runtime.checkpoint import Checkpoint, Linear, fake_quant, load_checkpoint, load_trtllm_checkpoint

DATA = Path(__file__).parent / "data" / "text.jsonl"


def builtin_texts(split: str) -> list[str]:
    """Texts of the shipped corpus (``calib`` or ``eval``); see toolkit/data/README.md."""
    return [r["text"] for r in map(json.loads, DATA.read_text().splitlines()) if r["split"] == split]


class _EmulatedLinear(torch.nn.Module):
    def __init__(self, linear: Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


KV_QUANT_ATTENTION = "rtk_sdpa_quantized_kv"


def _sdpa_quantized_kv(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention on keys and values quantize-dequantized after RoPE.

    ``module.kv_quant`` is ``(kind, k_scale, v_scale)`` or None (no KV quantization in that layer).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kv = getattr(module, "kv_quant", None)
    if kv is not None:
        kind, k_scale, v_scale = kv
        key, value = fake_quant(key, kind, k_scale), fake_quant(value, kind, v_scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(KV_QUANT_ATTENTION, _sdpa_quantized_kv)


def reference_model(
    ckpt: Checkpoint, dtype: torch.dtype = torch.float32, config_dir: Path | None = None
) -> torch.nn.Module:
    """A transformers model carrying the checkpoint's dequantized weights and quantization emulation.

    ``config_dir`` holds the HF config.json (default: the checkpoint's own; a TensorRT-LLM
    checkpoint's config is not one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = json.loads((Path(config_dir or ckpt.path) / "config.json").read_text())
    hf_cfg.pop("quantization_config", None)
    model_type = hf_cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **hf_cfg)
    config.tie_word_embeddings = ckpt.config.tie_word_embeddings
    _register_attention()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=KV_QUANT_ATTENTION)
    sd = {k: v.to(dtype) for k, v in ckpt.state_dict().items()}
    model.load_state_dict(sd, strict=False, assign=True)
    if ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    elif ckpt.lm_head.pre_quant_scale is not None or ckpt.lm_head.act_quant is not None:
        model.lm_head = _EmulatedLinear(ckpt.lm_head)  # a quantized head (quantization.quantize_lm_head)
    kv_kind = {"FP8": "fp8", "INT8": "int8"}.get(ckpt.kv_cache_quant_algo or "")
    for i, layer in enumerate(ckpt.layers):
        block = model.model.layers[i]
        # TensorRT-LLM uses 1.0 where a layer has no calibrated KV scale; so does rtk's engine
        scales = [torch.tensor(1.0) if layer[f"{kv}_scale"] is None else layer[f"{kv}_scale"] for kv in "kv"]
        block.self_attn.kv_quant = (kv_kind, *scales) if kv_kind else None
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(block.self_attn, name, _EmulatedLinear(layer[name]))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(block.mlp, name, _EmulatedLinear(layer[name]))
    # Rotary buffers were created on the meta device; rebuild them on the CPU.
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config)
    return model.eval()


@dataclass
class Evaluation:
    """A model over the eval texts: its perplexity; with ``keep``, each text's next-token log-probabilities
    (float16 ``[T-1, V]``); with a ``reference`` (the baseline's kept log-probabilities), how far its
    next-token distributions moved from the baseline's, as llama.cpp's ``llama-perplexity --kl-divergence``
    reports it (ggml-org/llama.cpp tools/perplexity/perplexity.cpp): the mean and 99th percentile of
    KL(baseline || model) per position, and the share of positions where both rank the same token first."""

    ppl: float
    logprobs: list[torch.Tensor] | None = None
    mean_kld: float | None = None
    kld_p99: float | None = None
    same_top: float | None = None


@torch.inference_mode()
def evaluate(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    token_lists: Iterable[list[int]],
    on_text: Callable[[], None] | None = None,
    *,
    keep: bool = False,
    reference: list[torch.Tensor] | None = None,
) -> Evaluation:
    """``logits_fn(ids[1,T]) -> [1,T,V]`` over ``token_lists``: see :class:`Evaluation`."""
    nll, count = 0.0, 0
    kept: list[torch.Tensor] = []
    klds: list[torch.Tensor] = []
    same = 0
    for i, ids in enumerate(token_lists):
        x = torch.tensor([ids])
        lp = torch.log_softmax(logits_fn(x).float()[0, :-1], dim=-1)
        tgt = x[0, 1:]
        nll -= lp.gather(1, tgt[:, None]).sum().item()
        count += len(ids) - 1
        if keep:
            kept.append(lp.to(torch.float16))
        if reference is not None:
            base = reference[i].float()
            klds.append((base.exp() * (base - lp)).sum(-1))
            same += int((base.argmax(-1) == lp.argmax(-1)).sum())
        if on_text:
            on_text()
    out = Evaluation(math.exp(nll / max(count, 1)), kept if keep else None)
    if reference is not None and klds:
        kld = torch.cat(klds).double()
        out.mean_kld, out.kld_p99 = float(kld.mean()), float(torch.quantile(kld, 0.99))
        out.same_top = same / len(kld)
    return out


def perplexity(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    token_lists: Iterable[list[int]],
    on_text: Callable[[], None] | None = None,
) -> float:
    """exp(mean NLL) over all predicted tokens of all texts; ``logits_fn(ids[1,T]) -> [1,T,V]``."""
    return evaluate(logits_fn, token_lists, on_text).ppl


def eval_token_lists(tokenizer, num_samples: int, max_length: int = 256) -> list[list[int]]:
    """Held-out texts tokenized with a leading BOS when the tokenizer has one."""
    out = []
    for text in builtin_texts("eval")[:num_samples]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_length - 1]
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
        out.append(ids)
    return out


def evaluate_checkpoint(
    path: Path | str,
    token_lists: list[list[int]],
    on_text=None,
    dtype=torch.float32,
    hf_config_dir: Path | None = None,
    *,
    keep: bool = False,
    reference: list[torch.Tensor] | None = None,
) -> Evaluation:
    """:func:`evaluate` of an HF checkpoint, or of a TensorRT-LLM one when ``hf_config_dir`` gives its HF config."""
    ckpt = load_checkpoint(path) if hf_config_dir is None else load_trtllm_checkpoint(path, hf_config_dir)
    model = reference_model(ckpt, dtype=dtype, config_dir=hf_config_dir)
    return evaluate(lambda x: model(input_ids=x).logits, token_lists, on_text, keep=keep, reference=reference)


def checkpoint_perplexity(
    path: Path | str, token_lists: list[list[int]], on_text=None, dtype=torch.float32, hf_config_dir: Path | None = None
) -> float:
    """Perplexity of an HF checkpoint, or of a TensorRT-LLM one when ``hf_config_dir`` gives its HF config."""
    return evaluate_checkpoint(path, token_lists, on_text, dtype, hf_config_dir).ppl
