"""Make a transformers-5 checkpoint directory read correctly by transformers 4.57 (TensorRT-LLM 1.2.1).

transformers 5 writes rope settings only under ``rope_parameters`` and names the tokenizer class
``TokenizersBackend``.  transformers 4.57 then silently uses ``rope_theta = 10000`` and refuses the
tokenizer ("Tokenizer class TokenizersBackend does not exist").  We add the 4.57 spellings next to the v5 ones;
transformers 5 still loads the directory identically.
"""

from __future__ import annotations

import json
from pathlib import Path

from .artifacts import write_json_atomic

# The files of a Hugging Face tokenizer, with the chat template and generation defaults served with it
# (one list: fetch downloads them, quantize copies them next to its export, emit puts them in the repository).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def rope_theta(config: dict) -> float | None:
    """rope theta from either the v4 (``rope_theta``) or v5 (``rope_parameters``) spelling."""
    if config.get("rope_theta") is not None:
        return float(config["rope_theta"])
    params = config.get("rope_parameters") or {}
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return None


def rope_scaling(config: dict) -> dict | None:
    """The rope-scaling dict (v4 ``rope_scaling`` or v5 ``rope_parameters`` minus the theta), or None."""
    if isinstance(config.get("rope_scaling"), dict):
        return config["rope_scaling"]
    params = dict(config.get("rope_parameters") or {})
    params.pop("rope_theta", None)
    if params.get("rope_type", "default") == "default":
        return None
    return params


def trtllm_rope(config: dict) -> tuple[float, dict | None]:
    """``(rotary_base, rotary_scaling)`` of a TensorRT-LLM checkpoint converted from this HF config.

    TensorRT-LLM's converter (NVIDIA/TensorRT-LLM tensorrt_llm/models/llama/config.py,
    ``LLaMAConfig.from_hugging_face``) copies transformers 4.x's ``config.rope_theta`` and
    ``config.rope_scaling`` verbatim; transformers 4.x's LlamaConfig copies a legacy ``type`` key
    to ``rope_type``.  Unscaled rope is ``None``: TensorRT-LLM 1.2's ``RotaryScalingType``
    has no ``default`` member.
    """
    scaling = rope_scaling(config)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        if "type" in scaling:
            scaling["rope_type"] = scaling["type"]
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return rope_theta(config) or 10000.0, scaling


def make_compatible(directory: Path) -> list[str]:
    """Patch ``config.json`` and ``tokenizer_config.json`` in place (new files, atomically).

    Returns what was changed, for the manifest.  Files are replaced, never edited through, so a
    hard-linked source file is left untouched.
    """
    directory = Path(directory)
    changed = []
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    theta = rope_theta(cfg)
    if theta is not None and cfg.get("rope_theta") != theta:
        cfg["rope_theta"] = theta
        changed.append(f"config.json: rope_theta={theta}")
    scaling = rope_scaling(cfg)
    if scaling is not None and "rope_scaling" not in cfg:
        cfg["rope_scaling"] = scaling
        changed.append("config.json: rope_scaling")
    if changed:
        write_json_atomic(cfg_path, cfg)
    tok_path = directory / "tokenizer_config.json"
    if tok_path.is_file():
        tok = json.loads(tok_path.read_text())
        if tok.get("tokenizer_class") == "TokenizersBackend":
            tok["tokenizer_class"] = "PreTrainedTokenizerFast"
            write_json_atomic(tok_path, tok)
            changed.append("tokenizer_config.json: tokenizer_class=PreTrainedTokenizerFast")
    return changed
