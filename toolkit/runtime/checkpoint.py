"""Load a checkpoint — plain or ModelOpt unified-HF export — into dense float tensors.

transformers ignores ModelOpt quantization when it loads an export (it casts FP8 weights to bf16
without their scales and warns "Unknown quantization type, got modelopt"), so rtk reads the exported tensors
itself and dequantizes them exactly as TensorRT-LLM interprets them:

===========  ==========================================  ==========================================
quant_algo   weight tensor                               dequantized weight / activation emulation
===========  ==========================================  ==========================================
FP8          F8_E4M3 [out,in], weight_scale []           w·s;  x → fp8(x/input_scale)·input_scale
W8A8_SQ_*    I8 [out,in], weight_scale [out]             w·s[:,None];  x·pre_quant_scale → int8 QDQ
W8A16        I8 [out,in], weight_scale [out]             w·s[:,None];  x as it is (weight-only)
W4A16_AWQ    U8 [out/2,in] int4 pairs along *out*,        int4·weight_scale (per group of `group_size`
             low nibble = even row, two's complement      inputs);  x·pre_quant_scale where present
W4A8_AWQ     as W4A16 + weight_scale_2, input_scale       as W4A16, then x → fp8 QDQ (input_scale)
NVFP4        U8 [out,in/2] e2m1 codes along *in*, low     lut[code]·fp8 block scale·weight_scale_2;
             nibble first; weight_scale F8 [out,in/16]    x → NVFP4 QDQ in blocks of 16
===========  ==========================================  ==========================================

``MIXED_PRECISION`` names each quantized module's algorithm (``quantized_layers``; a TensorRT-LLM
checkpoint's in ``quant_cfg.json``), e.g. a W8A16 ``lm_head`` under W8A8 layers
(``quantization.quantize_lm_head``).

KV-cache scales (``k_proj.k_scale`` / ``v_proj.v_scale``) are returned per layer.  This module is
the single reader of checkpoints: the quantize stage's quality report and the CPU engine both use
it, so the engine's perplexity equals the report by construction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SourceError
from ..hfcompat import rope_scaling, rope_theta

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_LUT = torch.cat([E2M1_VALUES, -E2M1_VALUES])  # code 8..15 = negative


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        cfg = json.loads((path / "config.json").read_text())
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED), None)
        if arch is None:
            raise SourceError(
                f"{path / 'config.json'}: architecture {archs or '(none)'} is not supported by rtk's loader; "
                f"supported: {', '.join(SUPPORTED)}"
            )
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        gen = path / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta(cfg) or 10000.0,
            rope_scaling=rope_scaling(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass
class ActQuant:
    """Activation quantization emulated on a linear's input (per-tensor scale)."""

    kind: str  # "fp8" | "int8" | "nvfp4"
    scale: torch.Tensor  # 0-d float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant(x, self.kind, self.scale)


def fake_quant(x: torch.Tensor, kind: str, scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize ``x`` as the GPU kernels would, returning ``x``'s dtype."""
    dt = x.dtype
    s = scale.to(torch.float32)
    xf = x.to(torch.float32)
    if kind == "fp8":
        q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        return (q * s).to(dt)
    if kind == "int8":
        return ((xf / s).round().clamp(-128, 127) * s).to(dt)
    if kind == "nvfp4":
        return _nvfp4_qdq(xf, s).to(dt)
    raise ValueError(f"unknown activation quantization '{kind}'")


E2M1_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2


def _e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP4 (e2m1) value, ties to the even code, keeping the sign; |x| ≤ 6.

    Ties to even as ModelOpt's GPU kernel and export cast do (0.75→1, 1.75→2, 3.5→4, 2.5→2; seen
    on an H200, docs/gpu-checks.md).  ``bucketize`` alone would put every tie in the lower bucket.
    """
    a = x.abs().clamp(max=6.0)
    idx = torch.bucketize(a, E2M1_MIDPOINTS)
    tie = (a == E2M1_MIDPOINTS[idx.clamp(max=len(E2M1_MIDPOINTS) - 1)]) & (idx % 2 == 1)
    return torch.sign(x) * E2M1_VALUES[idx + tie.long()]


def _nvfp4_qdq(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 activation QDQ: blocks of 16 along the last dim, fp8 block scales relative to ``global_scale``."""
    shape = x.shape
    xb = x.reshape(-1, shape[-1] // 16, 16)
    amax = xb.abs().amax(-1, keepdim=True)
    block = (amax / (6.0 * global_scale)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    denom = block * global_scale
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    q = _e2m1_round(xb / safe) * denom
    return q.reshape(shape)


@dataclass
class WeightCodes:
    """A quantized weight's codes as stored, for kernels that read them directly.

    ``weight == codes.float() * scale`` exactly (scale per output row, or per row and group of
    ``group_size`` inputs).
    """

    bits: int  # 8 (W8A8 SmoothQuant, FP8) or 4 (AWQ)
    codes: torch.Tensor  # int8 [out, in] (int4 values in -8..7), or float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [out] (bits 8) or [out, in / group_size] (bits 4)
    group_size: int | None = None

    @property
    def kind(self) -> str:
        """``int8``, ``int4`` or ``fp8``."""
        return "fp8" if self.codes.dtype == torch.float8_e4m3fn else f"int{self.bits}"


@dataclass
class Linear:
    """One projection with its weight dequantized to dense float32 ``[out, in]``."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    pre_quant_scale: torch.Tensor | None = None
    act_quant: ActQuant | None = None
    codes: WeightCodes | None = None  # the quantized codes behind ``weight`` (FP8, INT8, INT4 formats)

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        if self.act_quant is not None:
            x = self.act_quant(x)
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(
            self.prepare_input(x), self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )


@dataclass
class Checkpoint:
    config: ModelConfig
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    embed_tokens: torch.Tensor
    lm_head: Linear  # the embedding (dense) where tied; quantized where the export quantized the head
    final_norm: torch.Tensor
    layers: list[dict]
    group_size: int | None = None
    path: Path | None = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Dense weights under transformers' names (for building a reference model)."""
        sd = {
            "model.embed_tokens.weight": self.embed_tokens,
            "model.norm.weight": self.final_norm,
            "lm_head.weight": self.lm_head.weight,
        }
        for i, layer in enumerate(self.layers):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                sd[f"model.layers.{i}.{norm}.weight"] = layer[norm]
            for p in PROJECTIONS:
                mod = "self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                sd[f"model.layers.{i}.{mod}.{p}.weight"] = layer[p].weight
                if layer[p].bias is not None:
                    sd[f"model.layers.{i}.{mod}.{p}.bias"] = layer[p].bias
        return sd


class _Tensors:
    """All tensors of a (possibly sharded) safetensors checkpoint, read lazily."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise SourceError(
                f"{path}: no *.safetensors files; point at a checkpoint directory written by `rtk fetch` or "
                "`rtk quantize`"
            )
        self._where: dict[str, object] = {}
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        for h in self._handles:
            for k in h.keys():
                self._where[k] = h

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor | None:
        h = self._where.get(name)
        return None if h is None else h.get_tensor(name)

    def require(self, name: str, path: Path) -> torch.Tensor:
        t = self.get(name)
        if t is None:
            raise SourceError(
                f"{path}: tensor '{name}' is missing; the checkpoint is incomplete or not a supported layout"
            )
        return t


def read_quant_config(path: Path) -> dict:
    """The ``quantization`` section of hf_quant_config.json (or of config.json's quantization_config)."""
    hq = path / "hf_quant_config.json"
    if hq.is_file():
        return json.loads(hq.read_text()).get("quantization", {}) or {}
    cfg = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    if cfg.get("quant_method") == "modelopt":
        return {k: cfg.get(k) for k in ("quant_algo", "kv_cache_quant_algo", "group_size", "quantized_layers")}
    if cfg:
        raise SourceError(
            f"{path / 'config.json'}: quantization method '{cfg.get('quant_method')}' is not supported; "
            "rtk reads ModelOpt exports and unquantized checkpoints"
        )
    return {}


MIXED_PRECISION = "MIXED_PRECISION"


def layer_algos(q: dict, path: Path):
    """``prefix -> (quant_algo, group_size)`` of a ModelOpt quantization section.

    ``MIXED_PRECISION`` (ModelOpt's export where modules differ, e.g. a weight-only ``lm_head`` under
    INT8-SQ layers) lists each quantized module in ``quantized_layers``; a module not listed is unquantized.
    Otherwise every module has the section's algorithm (an excluded one has no scales: read dense).
    """
    algo, group = q.get("quant_algo"), q.get("group_size")
    if algo != MIXED_PRECISION:
        return lambda prefix: (algo, group)
    layers = q.get("quantized_layers")
    if not isinstance(layers, dict):
        raise SourceError(f"{path}: quant_algo MIXED_PRECISION without quantized_layers; re-export the checkpoint")

    def of(prefix: str) -> tuple[str | None, int | None]:
        entry = layers.get(prefix) or {}
        return entry.get("quant_algo"), entry.get("group_size", group)

    return of


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """U8 ``[out/2, in]`` → int8 ``[out, in]``: low nibble is the even row, signed two's complement."""
    p = packed.to(torch.int16)
    low = p & 0x0F
    high = (p >> 4) & 0x0F
    rows = torch.stack([low, high], dim=1).reshape(packed.shape[0] * 2, packed.shape[1])
    return torch.where(rows >= 8, rows - 16, rows).to(torch.int8)


def unpack_fp4_cols(packed: torch.Tensor) -> torch.Tensor:
    """U8 ``[out, in/2]`` → float ``[out, in]`` e2m1 values (low nibble first)."""
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0x0F, (p >> 4) & 0x0F], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)
    return E2M1_LUT[codes]


def int8_rows(linear: Linear) -> Linear:
    """A weight-only INT8 (W8A16) copy of a float projection: per output row, scale ``max |w| / 127`` and codes
    ``round(w / scale)`` (ModelOpt's per-channel INT8 weight quantizer, the ``W8A16`` head of
    ``quantization.quantize_lm_head``).  The CPU engine's ``lm_head: int8`` (a bf16 head read at half the bytes)."""
    w = linear.weight.to(torch.float32)
    scale = w.abs().amax(dim=1) / 127.0  # a row of zeros: codes 0, scale 0
    codes = torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-127, 127).to(torch.int8)
    return Linear(
        weight=codes.to(torch.float32) * scale[:, None],
        bias=linear.bias,
        pre_quant_scale=linear.pre_quant_scale,
        act_quant=linear.act_quant,
        codes=WeightCodes(8, codes, scale),
    )


def _dequant_weight(
    t: _Tensors, prefix: str, algo: str | None, group_size: int | None, path: Path
) -> tuple[torch.Tensor, WeightCodes | None]:
    """The dense float32 weight, and the codes behind it for the FP8 and integer formats."""
    w = t.require(prefix + ".weight", path)
    scale = t.get(prefix + ".weight_scale")
    if algo is None or scale is None:  # unquantized (or an excluded module)
        return w.to(torch.float32), None
    scale = scale.to(torch.float32)
    if algo == "FP8":
        rows = scale.reshape(-1).expand(w.shape[0]).contiguous() if scale.numel() == 1 else scale.reshape(-1)
        return w.to(torch.float32) * scale, WeightCodes(8, w.to(torch.float8_e4m3fn), rows)
    if algo.startswith("W8A8_SQ") or algo == "W8A16":  # W8A16: per-channel int8 weights, float activations
        rows = scale.reshape(-1).expand(w.shape[0]).contiguous() if scale.numel() == 1 else scale.reshape(-1)
        return w.to(torch.float32) * rows[:, None], WeightCodes(8, w.to(torch.int8), rows)
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        codes = unpack_int4_rows(w)
        g = codes.shape[1] // scale.shape[1]
        return codes.to(torch.float32) * scale.repeat_interleave(g, dim=1), WeightCodes(4, codes, scale, g)
    if algo == "NVFP4":
        vals = unpack_fp4_cols(w)
        block = scale.repeat_interleave(16, dim=1)  # fp8 block scales, already cast to float
        s2 = t.require(prefix + ".weight_scale_2", path).to(torch.float32)
        return vals * block * s2, None
    raise SourceError(
        f"{path}: quant_algo '{algo}' is not supported; rtk reads FP8, W8A8_SQ_PER_CHANNEL, W8A16, W4A16_AWQ, "
        "W4A8_AWQ, NVFP4 (and MIXED_PRECISION of these)"
    )


def act_kind(algo: str | None) -> str | None:
    """How a module of ``algo`` quantizes its input (``ActQuant.kind``); None: it does not."""
    if algo is None:
        return None
    return {"FP8": "fp8", "W4A8_AWQ": "fp8", "NVFP4": "nvfp4"}.get(algo, "int8" if algo.startswith("W8A8") else None)


def _act_quant(t: _Tensors, prefix: str, algo: str | None) -> ActQuant | None:
    s, kind = t.get(prefix + ".input_scale"), act_kind(algo)
    return None if s is None or kind is None else ActQuant(kind, s.to(torch.float32).reshape(()))


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read config, quantization info and every tensor of ``path``; weights come back dense float32."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SourceError(f"{path}: no config.json; pass a checkpoint directory (e.g. engines/<name>/quantized/hf)")
    config = ModelConfig.from_dir(path)
    q = read_quant_config(path)
    algo = q.get("quant_algo")
    kv_algo = q.get("kv_cache_quant_algo")
    algo_of = layer_algos(q, path)
    t = _Tensors(path)
    embed = t.require("model.embed_tokens.weight", path).to(torch.float32)

    def linear(prefix: str) -> Linear:
        bias = t.get(prefix + ".bias")
        pqs = t.get(prefix + ".pre_quant_scale")
        module_algo, group_size = algo_of(prefix)
        weight, codes = _dequant_weight(t, prefix, module_algo, group_size, path)
        return Linear(
            weight=weight,
            codes=codes,
            bias=None if bias is None else bias.to(torch.float32),
            pre_quant_scale=None if pqs is None else pqs.to(torch.float32),
            act_quant=_act_quant(t, prefix, module_algo),
        )

    # a quantized head (quantization.quantize_lm_head) comes untied, with its codes and scales
    tied = "lm_head.weight" not in t or config.tie_word_embeddings
    lm_head = Linear(weight=embed) if tied else linear("lm_head")
    layers = []
    for i in range(config.num_layers):
        layer: dict = {}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            layer[norm] = t.require(f"model.layers.{i}.{norm}.weight", path).to(torch.float32)
        for p in PROJECTIONS:
            mod = "self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            layer[p] = linear(f"model.layers.{i}.{mod}.{p}")
        for kv in ("k", "v"):
            s = t.get(f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale")
            layer[f"{kv}_scale"] = None if s is None else s.to(torch.float32).reshape(())
        layers.append(layer)
    return Checkpoint(
        config=config,
        quant_algo=algo,
        kv_cache_quant_algo=kv_algo,
        embed_tokens=embed,
        lm_head=lm_head,
        final_norm=t.require("model.norm.weight", path).to(torch.float32),
        layers=layers,
        group_size=q.get("group_size"),
        path=path,
    )


TRTLLM_PROJECTIONS = {
    "attention.dense": "o_proj",
    "mlp.gate": "up_proj",
    "mlp.fc": "gate_proj",
    "mlp.proj": "down_proj",
}


def _trtllm_weight(t: _Tensors, prefix: str, algo: str | None, path: Path) -> torch.Tensor:
    """A TensorRT-LLM checkpoint's (possibly fused) weight, dequantized to float32 ``[out, in]``.

    ModelOpt writes the same codes as in its HF export, under TensorRT-LLM's scale names:
    ``weights_scaling_factor`` (FP8 ``[1]``, SmoothQuant ``[out]``, AWQ ``[out, in/group]``,
    NVFP4 fp8 ``[out, in/16]`` with ``weights_scaling_factor_2``).
    """
    w = t.require(prefix + ".weight", path)
    s = t.get(prefix + ".weights_scaling_factor")
    if algo is None or s is None:
        return w.to(torch.float32)
    s = s.to(torch.float32)
    if algo == "FP8":
        return w.to(torch.float32) * s.reshape(())
    if algo.startswith("W8A8_SQ") or algo == "W8A16":
        return w.to(torch.float32) * s.reshape(-1, 1)
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        q = unpack_int4_rows(w.view(torch.uint8)).to(torch.float32)
        return q * s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)
    if algo == "NVFP4":
        s2 = t.require(prefix + ".weights_scaling_factor_2", path).to(torch.float32).reshape(())
        return unpack_fp4_cols(w.view(torch.uint8)) * s.repeat_interleave(16, dim=1) * s2
    raise SourceError(
        f"{path}: quant_algo '{algo}' is not supported; rtk reads FP8, W8A8_SQ_PER_CHANNEL, W8A16, W4A16_AWQ, "
        "W4A8_AWQ, NVFP4 (and MIXED_PRECISION of these)"
    )


def load_trtllm_checkpoint(path: str | Path, hf_config_dir: str | Path) -> Checkpoint:
    """Read a single-rank TensorRT-LLM checkpoint written by ModelOpt into the same dense form.

    Fused projections are split back (``attention.qkv`` rows are q|k|v; ``mlp.fc`` is the gated
    projection, ``mlp.gate`` the up projection); the KV cache uses ``kv_cache_scaling_factor`` for
    keys and values, as TensorRT-LLM does.  ``hf_config_dir`` gives the model's HF config.json.
    """
    path = Path(path)
    trt_cfg = json.loads((path / "config.json").read_text())
    mapping = trt_cfg.get("mapping") or {}
    if int(mapping.get("world_size", 1)) != 1:
        raise SourceError(
            f"{path}: rtk reads single-rank TensorRT-LLM checkpoints; this one has world_size {mapping['world_size']}"
        )
    config = ModelConfig.from_dir(Path(hf_config_dir))
    q = trt_cfg.get("quantization") or {}
    algo, kv_algo = q.get("quant_algo"), q.get("kv_cache_quant_algo")
    if algo == MIXED_PRECISION and (path / "quant_cfg.json").is_file():  # TensorRT-LLM's per-module layout
        q = {**q, **json.loads((path / "quant_cfg.json").read_text())}
    algo_of = layer_algos(q, path)
    t = _Tensors(path)
    embed = t.require("transformer.vocab_embedding.weight", path).to(torch.float32)
    H, KVH, D = config.num_heads, config.num_kv_heads, config.head_dim

    def weight_of(prefix: str) -> torch.Tensor:
        return _trtllm_weight(t, prefix, algo_of(prefix)[0], path)

    def linear(prefix: str, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        pqs = t.get(prefix + ".prequant_scaling_factor")
        act, kind = t.get(prefix + ".activation_scaling_factor"), act_kind(algo_of(prefix)[0])
        return Linear(
            weight=weight,
            bias=bias,
            pre_quant_scale=None if pqs is None else pqs.to(torch.float32).reshape(-1),
            act_quant=None if act is None or kind is None else ActQuant(kind, act.float().reshape(())),
        )

    lm_head = Linear(weight=embed)
    if "lm_head.weight" in t:  # quantized where the export quantized the head (quantization.quantize_lm_head)
        lm_head = linear("lm_head", weight_of("lm_head"), None)
    layers = []
    for i in range(config.num_layers):
        pre = f"transformer.layers.{i}."
        layer: dict = {
            "input_layernorm": t.require(pre + "input_layernorm.weight", path).to(torch.float32),
            "post_attention_layernorm": t.require(pre + "post_layernorm.weight", path).to(torch.float32),
        }
        qkv_w = weight_of(pre + "attention.qkv")
        qkv_b = t.get(pre + "attention.qkv.bias")
        bounds = {"q_proj": (0, H * D), "k_proj": (H * D, (H + KVH) * D), "v_proj": ((H + KVH) * D, (H + 2 * KVH) * D)}
        for name, (a, b) in bounds.items():
            bias = None if qkv_b is None else qkv_b[a:b].to(torch.float32)
            layer[name] = linear(pre + "attention.qkv", qkv_w[a:b], bias)
        for trt_name, name in TRTLLM_PROJECTIONS.items():
            bias = t.get(pre + trt_name + ".bias")
            layer[name] = linear(
                pre + trt_name,
                weight_of(pre + trt_name),
                None if bias is None else bias.to(torch.float32),
            )
        kv = t.get(pre + "attention.kv_cache_scaling_factor")
        layer["k_scale"] = layer["v_scale"] = None if kv is None else kv.to(torch.float32).reshape(())
        layers.append(layer)
    return Checkpoint(
        config=config,
        quant_algo=algo,
        kv_cache_quant_algo=kv_algo,
        embed_tokens=embed,
        lm_head=lm_head,
        final_norm=t.require("transformer.ln_f.weight", path).to(torch.float32),
        layers=layers,
        group_size=q.get("group_size"),
        path=path,
    )
