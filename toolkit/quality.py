"""Perplexity of a checkpoint on held-out text, read through rtk's own loader.

The forward is transformers' reference implementation of the architecture, with every projection
replaced by the loader's dequantized :class:`~toolkit.runtime.checkpoint.Linear` (which emulates
pre-quant scales and activation quantization) and, where the checkpoint quantizes the KV cache,
k/v projections' outputs fake-quantized with their scales.  Used for the quantize stage's report
and as the reference the CPU engine is tested against.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterable

import torch

from .runtime.checkpoint import Checkpoint, Linear, fake_quant, load_checkpoint

DATA = Path(__file__).parent / "data" / "text.jsonl"


def builtin_texts(split: str) -> list[str]:
    """Texts of the shipped corpus (``calib`` or ``eval``); see toolkit/data/README.md."""
    return [r["text"] for r in map(json.loads, DATA.read_text().splitlines()) if r["split"] == split]


class _EmulatedLinear(torch.nn.Module):
    def __init__(self, linear: Linear, out_kind: str | None = None, out_scale: torch.Tensor | None = None):
        super().__init__()
        self.linear = linear
        self.out_kind, self.out_scale = out_kind, out_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.out_kind is not None:
            y = fake_quant(y, self.out_kind, self.out_scale)
        return y


def reference_model(ckpt: Checkpoint, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A transformers model carrying the checkpoint's dequantized weights and quantization emulation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = json.loads((ckpt.path / "config.json").read_text())
    hf_cfg.pop("quantization_config", None)
    model_type = hf_cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **hf_cfg)
    config.tie_word_embeddings = ckpt.config.tie_word_embeddings
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    sd = {k: v.to(dtype) for k, v in ckpt.state_dict().items()}
    model.load_state_dict(sd, strict=False, assign=True)
    if ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    kv_kind = {"FP8": "fp8", "INT8": "int8"}.get(ckpt.kv_cache_quant_algo or "")
    for i, layer in enumerate(ckpt.layers):
        block = model.model.layers[i]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            kind = scale = None
            if kv_kind and name in ("k_proj", "v_proj") and layer[f"{name[0]}_scale"] is not None:
                kind, scale = kv_kind, layer[f"{name[0]}_scale"]
            setattr(block.self_attn, name, _EmulatedLinear(layer[name], kind, scale))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(block.mlp, name, _EmulatedLinear(layer[name]))
    # Rotary buffers were created on the meta device; rebuild them on the CPU.
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config)
    return model.eval()


@torch.inference_mode()
def perplexity(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    token_lists: Iterable[list[int]],
    on_text: Callable[[], None] | None = None,
) -> float:
    """exp(mean NLL) over all predicted tokens of all texts; ``logits_fn(ids[1,T]) -> [1,T,V]``."""
    nll, count = 0.0, 0
    for ids in token_lists:
        x = torch.tensor([ids])
        logits = logits_fn(x).float()
        lp = torch.log_softmax(logits[0, :-1], dim=-1)
        tgt = x[0, 1:]
        nll -= lp.gather(1, tgt[:, None]).sum().item()
        count += len(ids) - 1
        if on_text:
            on_text()
    return math.exp(nll / max(count, 1))


def eval_token_lists(tokenizer, num_samples: int, max_length: int = 256) -> list[list[int]]:
    """Held-out texts tokenized with a leading BOS when the tokenizer has one."""
    out = []
    for text in builtin_texts("eval")[:num_samples]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_length - 1]
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
        out.append(ids)
    return out


def checkpoint_perplexity(path: Path | str, token_lists: list[list[int]], on_text=None, dtype=torch.float32) -> float:
    model = reference_model(load_checkpoint(path), dtype=dtype)
    return perplexity(lambda x: model(input_ids=x).logits, token_lists, on_text)
