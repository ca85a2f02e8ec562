"""Pre-flight GPU memory estimate for the GPU targets: weights, KV pool, activations.

Pure functions over the model's shape (a TensorRT-LLM checkpoint ``config.json`` or a Hugging
Face ``config.json``) and the spec, so a build that cannot fit is refused in milliseconds, before
``trtllm-build`` or the LLM API spends minutes finding out.

Weights are counted the way the ModelOpt/TensorRT-LLM checkpoint stores them (rtk's own
measurement of ModelOpt 0.47's SmolLM2-135M exports' rank0.safetensors: FP8 219.5 MB,
INT4-AWQ g64 173.3 MB): quantized linears at their packed size plus their scales, embedding,
``lm_head`` (written separately; quantized only with ``quantization.quantize_lm_head``) and norms in the
model dtype.  The KV cache holds ``2 x layers x kv_heads x head_dim`` values per token.  Activations are an upper-bound
rule of thumb sized by ``max_num_tokens`` (TensorRT-LLM sizes its activation buffers for that
many tokens per step) plus float32 logits for a full batch, and a fixed runtime allowance
covers the CUDA context, cuBLAS/TensorRT workspaces and NCCL.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import SpecError

GiB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
RUNTIME_OVERHEAD_BYTES = 1 * GiB


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """From a TensorRT-LLM checkpoint config (``head_size``) or an HF config (``head_dim``)."""
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = config.get("head_size") or config.get("head_dim") or hidden // heads
        dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab_size=int(config["vocab_size"]),
            dtype=str(dtype),
        )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 2)

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(out, in) of the quantizable linears of one decoder layer (Llama/Qwen2/Mistral layout)."""
        h, i, q = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim
        return [(self.qkv_width, h), (h, q), (i, h), (i, h), (h, i)]


def linear_bytes(out_f: int, in_f: int, fmt: str, dtype_bytes: int, group_size: int | None) -> float:
    """Bytes of one linear layer's weight and scales as ModelOpt 0.47 exports them (measured on SmolLM2-135M)."""
    n = out_f * in_f
    if fmt == "none":
        return n * dtype_bytes
    if fmt == "fp8":
        return n + 8  # weight and activation scaling factors
    if fmt == "int8_sq":
        return n + 4 * out_f + dtype_bytes * in_f  # per-channel scales, smoothing (pre-quant) scale
    if fmt in ("int4_awq", "w4a8_awq"):
        g = group_size or 128
        return n / 2 + 4 * n / g + dtype_bytes * in_f + 8  # packed int4, f32 group scales, pre-quant scale
    if fmt == "nvfp4":
        return n / 2 + n / 16 + 8  # packed e2m1, fp8 block scale per 16, global scales
    raise ValueError(f"unknown quantization format {fmt!r}")


@dataclass
class MemoryEstimate:
    """Bytes per GPU (the busiest rank) unless named ``total``."""

    weights_total: int
    weights_per_gpu: int
    kv_bytes_per_token: int  # per GPU
    kv_bytes_per_sequence: int  # one max_seq_len sequence, whole blocks, per GPU
    kv_pool_full_batch: int  # max_batch_size full sequences, per GPU
    activations: int
    runtime_overhead: int

    @property
    def fixed(self) -> int:
        """What the GPU holds before any KV block: weights, activations, runtime."""
        return self.weights_per_gpu + self.activations + self.runtime_overhead

    def to_dict(self) -> dict:
        return {**asdict(self), "fixed": self.fixed}


def estimate_memory(shape: ModelShape, spec) -> MemoryEstimate:
    """Estimate from a :class:`ModelShape` and a ``toolkit.spec.Spec`` (quantization + build)."""
    q, b = spec.quantization, spec.build
    tp, pp = b.tp_size, b.pp_size
    group = q.group_size
    if q.format in ("int4_awq", "w4a8_awq") and group is None:
        from ..spec import resolve_group_size

        group = resolve_group_size(spec, shape.hidden_size, shape.intermediate_size)
    db = shape.dtype_bytes
    per_layer = sum(linear_bytes(o, i, q.format, db, group) for o, i in shape.linear_shapes())
    norms = (2 * shape.num_layers + 1) * shape.hidden_size * db
    embed = shape.vocab_size * shape.hidden_size * db  # vocab embedding
    # lm_head: the embedding's size, or the layers' format with quantization.quantize_lm_head
    head = embed
    if q.quantize_lm_head:  # weight-only: W8A16 (codes and per-channel scales) or W4A16 AWQ
        v, h = shape.vocab_size, shape.hidden_size
        head = v * h + 4 * v if q.format == "int8_sq" else linear_bytes(v, h, q.format, db, group)
    weights_total = per_layer * shape.num_layers + norms + embed + head
    # The busiest rank: its share of the layers, plus the embedding (first stage) and lm_head (last).
    edge = embed + head if pp == 1 else max(embed, head)
    weights_per_gpu = per_layer * math.ceil(shape.num_layers / pp) / tp + edge / tp + norms

    kv_value_bytes = 1 if q.kv_cache in ("fp8", "int8") else db
    kv_heads_per_gpu = math.ceil(shape.num_kv_heads / tp)
    layers_per_gpu = math.ceil(shape.num_layers / pp)
    kv_token = 2 * layers_per_gpu * kv_heads_per_gpu * shape.head_dim * kv_value_bytes
    seq_tokens = math.ceil(b.max_seq_len / b.tokens_per_block) * b.tokens_per_block
    act_width = 3 * shape.hidden_size + (2 * shape.intermediate_size + shape.qkv_width) / tp
    activations = b.max_num_tokens * act_width * db + b.max_batch_size * (shape.vocab_size / tp) * 4
    return MemoryEstimate(
        weights_total=int(weights_total),
        weights_per_gpu=int(weights_per_gpu),
        kv_bytes_per_token=int(kv_token),
        kv_bytes_per_sequence=int(kv_token * seq_tokens),
        kv_pool_full_batch=int(kv_token * seq_tokens * b.max_batch_size),
        activations=int(activations),
        runtime_overhead=RUNTIME_OVERHEAD_BYTES,
    )


@dataclass
class FitReport:
    gpu_memory: int
    kv_available: int  # what kv_cache_free_gpu_mem_fraction of the free memory gives the KV pool
    full_sequences: int  # how many max_seq_len sequences that pool holds at once
    max_batch_size: int

    @property
    def full_batch_fits(self) -> bool:
        return self.full_sequences >= self.max_batch_size

    def note(self) -> str | None:
        if self.full_batch_fits:
            return None
        return (
            f"the KV pool ({_gib(self.kv_available)}) holds {self.full_sequences} of build.max_batch_size "
            f"{self.max_batch_size} sequences at build.max_seq_len; the scheduler admits fewer requests at once "
            "when prompts are long"
        )


def check_fits(estimate: MemoryEstimate, spec, gpu_memory_bytes: int, gpu_name: str = "GPU") -> FitReport:
    """Refuse (SpecError) a configuration whose engine cannot serve one full-length request on this GPU."""
    b = spec.build
    free_after_load = gpu_memory_bytes - estimate.fixed
    kv_available = int(max(0, free_after_load) * b.kv_cache_free_gpu_mem_fraction)
    report = FitReport(
        gpu_memory=gpu_memory_bytes,
        kv_available=kv_available,
        full_sequences=kv_available // max(1, estimate.kv_bytes_per_sequence),
        max_batch_size=b.max_batch_size,
    )
    if report.full_sequences >= 1:
        return report
    per_gpu = f" per GPU (tp {b.tp_size} x pp {b.pp_size})" if b.world_size > 1 else ""
    raise SpecError(
        f"this build cannot fit on the {gpu_name} ({_gib(gpu_memory_bytes)}): it needs about "
        f"{_gib(estimate.weights_per_gpu)} of {spec.quantization.format} weights + {_gib(estimate.activations)} of "
        f"activations + {_gib(estimate.runtime_overhead)} of runtime{per_gpu}, and "
        f"{_gib(estimate.kv_bytes_per_sequence)} of KV cache for one {b.max_seq_len}-token sequence, but only "
        f"{_gib(kv_available)} is left for the KV pool at kv_cache_free_gpu_mem_fraction "
        f"{b.kv_cache_free_gpu_mem_fraction}. Choose a smaller quantization.format (e.g. int4_awq), lower "
        "build.max_seq_len / build.max_num_tokens / build.max_batch_size, or raise build.tp_size",
        field="build",
    )


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"
