"""The decoder-only transformer forward over a paged KV cache (Llama / Mistral / Qwen2 family).

Weights come from :func:`toolkit.runtime.checkpoint.load_checkpoint` (dense float32, quantized
formats already dequantized) and are prepared once for speed:

* converted to the compute dtype (bf16 where the CPU has native bf16 dot products, else fp32);
* q/k/v and gate/up fused into single matmuls when their activation emulation is identical;
* bf16 weights pre-packed into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
  what Inductor's CPU freezing does), which doubles GEMV bandwidth here with bit-identical results;
* decode rows' matmuls and float32 K/V reads through rtk's own CPU kernels
  (:mod:`toolkit.runtime.kernels`) where they give the same bits (checked at load); for FP8,
  INT8 and INT4 exports the decode GEMV reads the codes (a half / a quarter of bf16's bytes) and
  rebuilds the dense bf16 weights in registers, so quantized and dense paths give the same bits;
* decode rows' whole layers in one C++ call (``kernels.DecodeLayers``, ``fused_decode``): the small
  operators between the projections without Python, with the operators' bits.

Activation quantization (FP8 / INT8 ``input_scale``) and AWQ / SmoothQuant ``pre_quant_scale``
are emulated exactly as :class:`~toolkit.runtime.checkpoint.Linear` does, in the compute dtype
(in one pass by ``kernels.quantize_input``, or ``kernels_avx2.quantize_input`` on a float32 engine, where
rtk's kernels run and give torch's bits).

One forward runs a *flat* batch of tokens from many sequences (TensorRT-LLM's packed,
"remove input padding" layout): generation rows first, then prompt chunks.  Linear layers see all
rows at once; attention reads each sequence's keys and values from the pool through its block
table, one SDPA call per generating row and per aligned unit of prompt rows.  Numerics follow
transformers' Llama operation by operation (RMSNorm in fp32, RoPE tables in fp32 rounded to the
compute dtype, SDPA) and are batch-invariant (see :class:`Projection`), so greedy tokens match
``generate`` whatever else is running.  Attention runs on float32 q/k/v by default
(``attention_dtype``): torch's bf16 CPU SDPA is several times slower at decode shapes.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .. import hostinfo
from ..errors import SourceError
from . import hugepages, kernels, kernels_avx2
from .checkpoint import Checkpoint, Linear, ModelConfig, fake_quant
from .kv_cache import KVPool, KVQuant

log = logging.getLogger(__name__)


BF16_CPU_FLAGS = set(hostinfo.NATIVE_BF16_FLAGS)


def onednn_bf16() -> bool:
    """True when oneDNN computes bf16 GEMMs here: on every AVX512 CPU, natively with AVX512-BF16 / AMX, by
    converting to float32 without (Skylake-SP to Ice Lake)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def bf16_is_fast() -> bool:
    """True when this CPU has native bf16 dot products (AVX512-BF16 / AMX, /proc/cpuinfo) and oneDNN uses them:
    what ``dtype: auto`` asks.  Where oneDNN converts (:func:`onednn_bf16` without the flags) a bf16 engine
    decoded SmolLM2's INT8-SQ export 5x slower than the float32 one (docs/engine-measurements.md, "AVX512 without
    bf16")."""
    return bool(BF16_CPU_FLAGS & hostinfo.cpu_flags()) and onednn_bf16()


def _any_projection(ckpt: Checkpoint, takes: Callable[[Linear], bool]) -> bool:
    """Whether ``takes`` holds for one of the checkpoint's decoder projections."""
    return any(isinstance(lin, Linear) and takes(lin) for layer in ckpt.layers for lin in layer.values())


def integer_products_apply(ckpt: Checkpoint, int4_gemv: str = "dot") -> bool:
    """Whether a float32 engine runs decoder projections of the checkpoint as rtk's integer products: int8 codes,
    or int4 codes with ``int4_gemv: dot``, whose inputs are unquantized or int8 (INT8-SQ, W8A16, INT4-AWQ; not
    W4A8-AWQ's FP8 inputs)."""

    def takes(lin: Linear) -> bool:
        kind = lin.codes.kind if lin.codes is not None else None
        inputs_ok = lin.act_quant is None or lin.act_quant.kind == "int8"
        return inputs_ok and (kind == "int8" or (kind == "int4" and int4_gemv == "dot"))

    return _any_projection(ckpt, takes)


def resolve_dtype(
    name: str, ckpt: Checkpoint | None = None, cpu_kernels: bool = True, int4_gemv: str = "dot"
) -> torch.dtype:
    """The engine's compute dtype for ``name`` (``EngineConfig.dtype``).  ``auto``: float32 where the CPU has no
    native bf16, and for an export whose projections take rtk's integer products (:func:`integer_products_apply`)
    where they run with AVX512-VNNI (``kernels_avx2.library() == "rtk_vnni"``), which only a float32 engine calls:
    on an Intel AMX host SmolLM2's INT8-SQ export decoded 99 against 44 tok/s at one stream, 245 against 146 at 8
    (docs/engine-measurements.md, "The engine's dtype on AVX512-VNNI hosts"); else bfloat16.  INT4 codes take float32
    there too: their rows run the tiles' arithmetic in AMX's int8 tiles or AVX512-VNNI's lanes
    (``W4A8Weight.add_tiles``), and on an AMD Zen 4 host SmolLM2's INT4-AWQ export prefilled in 0.75-0.88x and took its
    steps with prompt rows at 4 and 8 streams in 0.57-0.69x the bf16 engine's time (docs/engine-measurements.md,
    "INT4-AWQ rows in AVX512-VNNI's lanes"), where until then a bf16 engine had served it ("INT4-AWQ on a bf16 engine
    where AMX is absent")."""
    if name == "auto":
        if not bf16_is_fast():
            return torch.float32
        if cpu_kernels and ckpt is not None and integer_products_apply(ckpt, int4_gemv) and kernels_avx2.wants_vnni():
            return torch.float32 if kernels_avx2.library() == "rtk_vnni" else torch.bfloat16
        return torch.bfloat16
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
    if name not in table:
        from ..errors import UsageError

        raise UsageError(f"engine dtype '{name}' is not supported; use 'auto', 'bfloat16' or 'float32'")
    return table[name]


def int4_tiles_apply(ckpt: Checkpoint, dtype: torch.dtype, cpu_kernels: bool = True, int4_gemv: str = "dot") -> bool:
    """Whether the checkpoint's INT4 projections take AMX's int8 tiles on this engine (``W4A8Weight.add_tiles``):
    a float32 engine with rtk's kernels, INT4 codes with unquantized inputs and ``int4_gemv: dot`` (rtk's integer
    products), and :func:`kernels_avx2.prompt_tiles`."""
    if dtype != torch.float32 or not cpu_kernels or int4_gemv != "dot":
        return False

    def int4_unquantized_inputs(lin: Linear) -> bool:
        return lin.codes is not None and lin.codes.kind == "int4" and lin.act_quant is None

    return _any_projection(ckpt, int4_unquantized_inputs) and kernels_avx2.prompt_tiles()


def resolve_decode_batching(
    name: str, ckpt: Checkpoint, dtype: torch.dtype, cpu_kernels: bool = True, int4_gemv: str = "dot"
) -> str:
    """The engine's ``EngineConfig.decode_batching`` for ``name``.  ``auto``: ``full`` where the INT4 projections
    take AMX's int8 tiles (:func:`int4_tiles_apply`), since there a step of ``TILE_DECODE_ROWS`` rows or more
    through the tiles, decode rows too, is what makes decoding several streams faster (SmolLM2's INT4-AWQ export
    served 1.14-1.26x against 0.94-0.99x Q4_0's tok/s at 4 streams; docs/engine-measurements.md, "INT4-AWQ prompt rows
    in AMX's int8 tiles"); a row's float sums then take an order that depends on its step, a stated tolerance.  Else
    ``attention``: a request's numbers never depend on its step's other rows."""
    if name != "auto":
        return name
    return "full" if int4_tiles_apply(ckpt, dtype, cpu_kernels, int4_gemv) else "attention"


def resolve_float32_prompt_rows(name: str) -> str:
    """The engine's ``EngineConfig.float32_prompt_rows`` for ``name``.  ``auto``: ``gemv`` where rtk's 256-bit AVX2
    build runs (no AVX512-VNNI), ``mkl`` elsewhere.  On an AMD Zen 2 host (AVX2, 2 threads) the GEMV over SmolLM2's
    bf16 weights took 0.22x / 0.42x / 0.89x / 0.84x / 1.03x MKL's time over its float32 copies at 8 / 16 / 32 / 64 /
    448 rows (MKL's calls are 32 rows, so fewer cost as many); on an Intel Ice Lake host (the 512-bit build) MKL took
    0.57x the GEMV's time at 32 rows (docs/engine-measurements.md, "Prompt rows through the GEMV on AVX2 hosts")."""
    if name != "auto":
        return name
    return "gemv" if kernels_avx2.library() == "rtk_avx2" else "mkl"


# -- projections --------------------------------------------------------------------------------


def _stored_codes(linears: list[Linear]) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """``(kind, codes, scale)`` of the linears' quantized weights, concatenated by output, where all have codes
    of one kind and group size; else None."""
    codes = [lin.codes for lin in linears]
    if any(c is None for c in codes) or len({(c.kind, c.group_size) for c in codes}) != 1:
        return None
    return codes[0].kind, torch.cat([c.codes for c in codes]), torch.cat([c.scale for c in codes])


def _same_emulation(a: Linear, b: Linear) -> bool:
    def same(x, y):
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))

    if not same(a.pre_quant_scale, b.pre_quant_scale):
        return False
    if (a.act_quant is None) != (b.act_quant is None):
        return False
    return a.act_quant is None or (
        a.act_quant.kind == b.act_quant.kind and torch.equal(a.act_quant.scale, b.act_quant.scale)
    )


ROWWISE_MAX_BYTES = 4 << 20  # a weight this small stays cache-resident across one-row calls


MAX_PAD_ROWS = 16  # beyond this, padding small calls would cost more than it is worth

# oneDNN's bf16 GEMM with AMX (Intel Sapphire Rapids and later) gives a row other bits in calls of other sizes,
# beyond any row count (SmolLM2's down projection, 2 threads: a 64-row call's rows differ from the same rows in
# a 256-row one), but calls whose row counts lie in one of its kernels' ranges give a row the same bits whatever
# its place or neighbours (there, every SmolLM2 shape, 1 and 2 threads: 1 to 32 rows; 37 to 192 rows for the
# down projection, 33 to 256 for the others).  Where the probe finds that, every call of the projection has
# between ``pad_rows`` and ``tile_rows`` rows: a longer one is cut into tiles, a shorter one (or last tile)
# padded with zero rows.  Ranges tried, in order: up to 32 rows (the range of transformers' one-row decode calls
# and short prompts, so a prompt of up to 32 tokens gets their bits); else exactly 32 (the last tile padded).
LIBRARY_TILE_ROWS = 32

# torch's W8A16 / W4A16 CPU kernels read a half / a quarter of bf16's bytes, but their cost grows
# fast with rows (at 8 rows a SmolLM2 INT8 decode step took 45 ms against 30 ms in bf16; a 60-token
# INT8 prefill twice bf16's).  So prompt rows always use the bf16 weights, kept besides the codes,
# and with decode_batching "full" (one GEMM over all rows) a call of more rows than this does too.
INT_MAX_ROWS = {8: 4, 4: 8}

# rtk's GEMV (kernels.py) computes every row as a one-row call, reading the weights once per call; on
# SmolLM2's layer shapes (2 threads, weights from DRAM) it took 0.63-0.79x oneDNN's time up to 16 rows
GEMV_MAX_ROWS = 16
# Where a shape's one-row bits are every call's (Projection.whole_gemv_rows), a call of up to this many rows goes
# through the GEMV whole, prompt rows and decode rows alike: with the weights in DRAM it beat oneDNN's GEMM there
# (AMD Zen 4, 2 threads, 2026-12-05: a bf16 prompt of 17-96 tokens prefilled in 0.88-0.97x the time, level from 128
# on) ...
WHOLE_GEMV_MAX_ROWS = 96
# ... and over codes it reads for every call (FP8's table, which has no bf16 copy), rebuilding the weights per row
# group: 0.91-0.96x up to 48 tokens, 1.02x at 64.  (INT4's group sums round their own way and never go whole.)
WHOLE_CODES_MAX_ROWS = 48
# With the GEMVs in AMX's bf16 tiles (kernels.tiles_take) their time hardly grows with the rows: SmolLM2's layers
# took 0.37-0.6x oneDNN's time (in its 32-row tiles) at 96-512 rows over bf16 weights, 0.38-0.54x at 24-256 over FP8
# codes converted once a call (Intel AMX host, 2 threads, 2026-12-06), so there a call of any size goes through them
WHOLE_TILES_MAX_ROWS = 4096
# decode_batching "full": from this many rows on, an INT4 call takes AMX's tiles (W4A8Weight.prompt) for all its rows,
# decode rows too, where they pay: SmolLM2's INT4-AWQ decode steps on one thread on the AMX host (2026-12-05), w4a8
# against the tiles from 4 rows on, 13.8-15.7 / 17.3-18.0 ms at 4 rows, 26.7-27.6 / 24.0-24.9 at 8
TILE_DECODE_ROWS = 8
# Over FP8 / INT8 / INT4 codes it is compute-bound (rebuilding each weight costs ~9 instructions per
# 32): SmolLM2's layers took 0.5-0.7x the bf16 GEMV's time up to 4 rows and 1.0-1.3x from 5 rows
# (2026-11-30, 2 threads), so more rows read the bf16 copy, which gives the same bits.
QUANT_MAX_ROWS = 4
# Per-tensor FP8 looked up in a table (kernels.cpp, Fp8TableWeights) is not: 0.89-0.95x the bf16 GEMV's
# time from 5 to 16 rows (SmolLM2's FP8 layers, one thread, 2026-12-01), so it reads its codes for
# every GEMV call and needs no bf16 copy.
# INT4 group sums (Int4DotWeights) read their codes for every decode row too: their rows must not
# switch to the bf16 copy, whose rounding differs, or a sequence's numbers would depend on the batch.
CODES_MAX_ROWS = {"fp8-table": GEMV_MAX_ROWS, "int4-dot": GEMV_MAX_ROWS}


class Projection:
    """One or more linears sharing an input, run as a single matmul: ``y = [x W1^T + b1, x W2^T + b2, ...]``.

    Batch invariance: a GEMM library may compute a row with different kernels depending on how
    many rows the call has.  On this CPU oneDNN's bf16 one-row kernel rounds long dot products
    (``in_features`` > 1024) differently from its multi-row kernel, which gives every row the same
    bits for any row count >= 2; MKL's fp32 GEMM differs below 4-8 rows.  A probe at load measures,
    per weight shape, the smallest row count ``min_rows`` from which every call agrees with any
    larger one.  Where ``min_rows`` > 1:

    * ``rowwise`` (weight <= 4 MiB): rows of single-token (decode) sequences go through the
      one-row kernel one at a time, exactly as a lone decode — and transformers' decode — computes
      them; the other rows run together, padded to ``min_rows``;
    * ``pad`` (larger weights, where re-reading them per row would cost too much): every call
      with fewer than ``min_rows`` rows is padded to ``min_rows``.

    Either way a sequence's numbers do not depend on what else is in the batch.  Where no row count
    gives every larger call's bits (oneDNN's AMX GEMM), every call has ``pad_rows`` to ``tile_rows`` rows
    (:data:`LIBRARY_TILE_ROWS`): longer ones are cut into tiles, shorter ones padded.

    rtk's GEMV (``kernels.py``) sums in the order of oneDNN's AVX512-BF16 one-row kernel, and where oneDNN runs
    its AMX kernel (Intel Sapphire Rapids and later) it runs in AMX's tiles with that kernel's order
    (``kernels.gemv_tiles``).  Where the bits still part (a reduction that is not a multiple of 32 inputs there,
    or ``RTK_AMX=0``) the GEMV runs with its own rounding (``own_rounding``), checked at load to be the float
    product within ``kernels.GEMV_TOLERANCE`` and batch-invariant: decode rows always take it, prompt rows
    never do.
    """

    def __init__(
        self,
        linears: list[Linear],
        dtype: torch.dtype,
        pack: bool,
        probe_cache: dict | None = None,
        int_kernels: bool = False,
        full_batching: bool = False,
        gemv_kernel: bool = False,
        int4_gemv: str = "dot",
        blockwise_inputs: bool = False,
        float32_prompt_rows: str = "mkl",
        prompt_tiles: bool = True,
    ):
        """``prompt_tiles``: INT4 integer products take prompt rows in the tiles' layout where the VNNI kernels run
        (AMX's tiles or AVX512-VNNI's lanes, ``W4A8Weight.add_tiles``; the LM head, whose rows are logit rows, one a
        sequence, only where the lanes take every row).

        ``blockwise_inputs``: on a float32 engine, weight-only INT8 weights (the LM head of
        ``quantization.quantize_lm_head``, the layers of ``quantization.weight_only_modules``) and, with
        ``int4_gemv: "dot"``, INT4-AWQ weights take integer products (``kernels_avx2.W8A8Weight`` blockwise,
        ``kernels_avx2.W4A8Weight``), which quantize the input themselves per block of 32 (a stated rounding
        difference, not the export's arithmetic).

        ``float32_prompt_rows``: on a float32 engine, where rtk's AVX2 GEMV takes the decode rows (``fp32_gemv``),
        ``"mkl"`` sends prompt rows through MKL over float32 copies packed at load (:class:`kernels_avx2.MklTiles`),
        ``"gemv"`` through the GEMV too (:func:`resolve_float32_prompt_rows`)."""
        first = linears[0]
        self.int4_gemv = int4_gemv
        self.prompt_tiles = prompt_tiles
        self.dtype = dtype
        self.out_features = sum(lin.weight.shape[0] for lin in linears)
        self.in_features = first.weight.shape[1]
        weight = torch.cat([lin.weight for lin in linears]).to(dtype).contiguous()
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat(
                [lin.bias if lin.bias is not None else torch.zeros(lin.weight.shape[0]) for lin in linears]
            ).to(dtype)
        self.bias = bias
        self.pre_quant_scale = None if first.pre_quant_scale is None else first.pre_quant_scale.to(dtype)
        self.act_kind = first.act_quant.kind if first.act_quant is not None else None
        self.act_scale = first.act_quant.scale if first.act_quant is not None else None
        self.act_scale_value = 0.0 if self.act_scale is None else float(self.act_scale)
        self.packed = None
        self.library_free = False  # the library's copy dropped: rtk's GEMV takes every call (set at the end)
        self.mkl_tiles: kernels_avx2.MklTiles | None = None  # a float32 GEMV's prompt rows (set below)
        self.gemv = None  # rtk's one-row kernel's packed weight (set below where it applies)
        self.quant: kernels.QuantizedWeight | None = None  # rtk's GEMV over the codes (quantized exports)
        self.weight = weight
        self.tile_rows: int | None = None  # set by the row probe where calls must lie in a range of sizes
        self.pad_rows = 1  # ... and the range's smallest size (shorter calls are padded to it)
        self.int8 = self.int4 = self.int_max_rows = None
        if pack:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                self.weight = None
            except (AttributeError, RuntimeError) as exc:  # pragma: no cover - depends on the CPU / build
                log.debug("oneDNN weight packing unavailable (%s); using plain linear", exc)
        shape = (
            self.out_features,
            self.in_features,
            bias is not None,
            "packed" if self.packed is not None else "dense",
        )
        cache = probe_cache if probe_cache is not None else {}
        # a float32 engine with rtk's kernels probes below, once the GEMM of its prompt rows is known
        fp32_kernels = gemv_kernel and dtype == torch.float32 and kernels_avx2.available()
        if not fp32_kernels:
            self.min_rows = self._probed(cache, shape)
        # decode rows through rtk's GEMV (kernels.py) where it gives oneDNN's one-row bits, or on AMX hosts its
        # own (class docstring): over the codes of a quantized export (checked per projection: its weights and
        # products), else over bf16 (per shape)
        usable = gemv_kernel and self.packed is not None and self.in_features % 2 == 0 and kernels.available()
        # rtk's GEMV runs in AMX's tiles for this shape (kernels.tiles_take): calls of any size go through it whole
        self.in_tiles = usable and kernels.tiles_take(self.in_features)
        gemv_rounding = None  # "library": oneDNN's one-row bits; "own": its own (see the class docstring)
        if usable:
            # the bf16 weight packed for rtk's GEMV: for the probe (once per shape), the codes kernel's reference
            # where the GEMV rounds its own way, and decode calls the codes kernel does not take (below)
            key = (*shape[:3], "gemv")
            packed = None
            if key not in cache:
                packed = kernels.pack(weight)
                cache[key] = self._gemv_rounding(packed, weight, bias)
            gemv_rounding = cache[key]
            if gemv_rounding == "own" and packed is None:
                packed = kernels.pack(weight)
            # the codes kernel must give the bits its decode rows would get from the bf16 GEMV
            reference = (
                functools.partial(kernels.gemv, packed=packed, out_features=self.out_features, bias=bias)
                if gemv_rounding == "own"
                else self._library_gemm
            )
            self.quant = self._pack_codes(linears, weight, bias, reference)
            if gemv_rounding and self.codes_max_rows < GEMV_MAX_ROWS:
                # the bf16 copy too: decode calls of more rows than the codes kernel takes read it
                self.gemv = packed if packed is not None else kernels.pack(weight)
        if self.quant is None and int_kernels and dtype == torch.bfloat16:
            # torch's integer kernels where rtk's GEMV does not read the codes: decode rows through the
            # integer kernel (one call: its rows are batch-invariant), prompt rows through the bf16
            # weights; with full_batching, by the call's row count instead
            self._pack_int(linears)
            if full_batching and self.int8 is not None:
                self.int_max_rows = INT_MAX_ROWS[8]
            elif full_batching and self.int4 is not None:
                self.int_max_rows = INT_MAX_ROWS[4]
        # float32 engines (CPUs without native bf16): rtk's AVX2 GEMV reads the weights as stored (bf16 or
        # the export's codes) instead of their float32 copies, summing in its own order
        self.fp32_gemv = self.int_products = None
        self.gemv_prompt_rows = False  # a float32 engine's prompt rows through rtk's AVX2 GEMV too (set below)
        if fp32_kernels:
            if self.act_kind == "int8" or (self.act_kind is None and blockwise_inputs):
                self.int_products = self._pack_int_products(linears, weight, bias)
            if self.int_products is None:
                self.fp32_gemv = self._pack_fp32(linears, weight, bias)
            # prompt rows through the GEMV too: one batch-invariant kernel for every row, over the weights as stored
            self.gemv_prompt_rows = self.fp32_gemv is not None and float32_prompt_rows == "gemv"
            # else the prompt rows beside the AVX2 GEMV's: MKL over weights packed once, in place of the float32 ones
            if self.fp32_gemv is not None and not self.gemv_prompt_rows:
                self.mkl_tiles = kernels_avx2.MklTiles.pack(weight)
            if self.mkl_tiles is not None and self._probed(cache, (*shape[:3], "mkl")) > 1:
                log.info("MKL's packed GEMM gives rows of %s other bits in other calls; F.linear takes them", shape[:2])
                self.mkl_tiles = None
            if self.int_products is None and not self.gemv_prompt_rows:
                self.min_rows = self._probed(cache, (*shape[:3], "dense" if self.mkl_tiles is None else "mkl"))
            else:  # every row through the integer products or the GEMV: no library GEMM to probe (nor to warn about)
                self.min_rows, self.tile_rows, self.pad_rows = 1, None, 1
            if self.mkl_tiles is not None or self.gemv_prompt_rows or self.int_products is not None:
                self.weight = None  # no row reads the float32 copy
        # rtk's one-pass input quantization, where it gives torch's bits (checked here, once); the integer-product
        # kernels quantize their own input and never call it
        self.fused_input = (
            gemv_kernel
            and self.act_kind in (None, "fp8", "int8")
            and self.int_products is None
            and self._fused_input_agrees()
        )
        # int4-dot and the AVX2 GEMV round their own way (not the dense path's bits): decode rows always go
        # through them and prompt rows never do, so neither kind of row changes numbers with what shares its
        # call.  False lets one-row prompt calls through them too (to measure their numerics over a prompt,
        # one token a step).
        self.own_rounding = (
            (self.quant is not None and self.quant.kind == "int4-dot")
            or self.fp32_gemv is not None
            or (gemv_rounding == "own" and (self.quant is not None or self.gemv is not None))
        )
        self.single_rows = None
        if self.min_rows > 1:
            self.single_rows = "rowwise" if self.nbytes <= ROWWISE_MAX_BYTES else "pad"
        # Where AMX's tiles take every call whole with the library's bits (whole_gemv_rows, checked above against
        # oneDNN over the packed copy), that copy is never read again: dropped, and _library_gemm goes through the
        # GEMV (the bf16 engine's layers: 212 MB of SmolLM2's, the same again in rtk's GEMV layout).
        int_kernels = self.int8 is not None or self.int4 is not None  # their prompt rows read the library's copy
        self.library_free = bool(self.in_tiles and self.whole_gemv_rows and self.packed is not None and not int_kernels)
        if self.library_free:
            self.packed = None

    @property
    def whole_gemv_rows(self) -> int:
        """Most rows a batch-invariant call sends through rtk's GEMV whole, decode and prompt rows alike
        (:data:`WHOLE_GEMV_MAX_ROWS`, :data:`WHOLE_CODES_MAX_ROWS` over codes alone, :data:`WHOLE_TILES_MAX_ROWS`
        in AMX's tiles): where the GEMV's one-row bits are every call's bits (``min_rows`` 1, the library's
        rounding); else 0."""
        whole = (self.gemv is not None or self.quant is not None) and not self.own_rounding and self.min_rows == 1
        if not whole:
            return 0
        if self.in_tiles:
            return WHOLE_TILES_MAX_ROWS
        return WHOLE_CODES_MAX_ROWS if self.quant is not None and self.gemv is None else WHOLE_GEMV_MAX_ROWS

    @property
    def full_gemv_rows(self) -> int:
        """Without ``singles`` (``decode_batching: full``): most rows a call sends through rtk's GEMV whole; a call of
        more goes through the library's GEMM whole, decode rows too (no batch invariance; where the GEMV rounds its
        own way, AMX hosts, a step with prompt rows then reads the weights once, not twice).  0 without the GEMV."""
        if self.gemv is None and self.quant is None:
            return 0
        return max(self.whole_gemv_rows, GEMV_MAX_ROWS)

    @property
    def codes_max_rows(self) -> int:
        """Most rows a GEMV call reads the codes for (more read the bf16 copy, or, without one, go in calls of this
        many); 0 without codes.  In AMX's tiles a call over codes (int4-dot's group sums excepted: not tiled) converts
        each block once for all its rows, so there it takes any count and no bf16 copy is kept."""
        if self.quant is None:
            return 0
        if self.in_tiles and self.quant.kind != "int4-dot":
            return WHOLE_TILES_MAX_ROWS
        return CODES_MAX_ROWS.get(self.quant.kind, QUANT_MAX_ROWS)

    @property
    def kernel(self) -> str:
        """What computes the decode rows' matmul: ``rtk-int8`` / ``rtk-fp8`` / ``rtk-fp8-table`` / ``rtk-int4``
        (rtk's GEMV over the codes), ``rtk-avx2-<kind>`` / ``rtk-avx2-w8a8`` / ``rtk-avx2-w8a8-blockwise`` /
        ``rtk-avx2-w4a8`` (a float32 engine's AVX2 kernels),
        ``int8`` / ``int4`` (torch's integer kernels), ``packed`` (bf16 weights packed for oneDNN, or only for rtk's
        GEMV where AMX's tiles take every call: ``library_free``) or ``dense``."""
        if self.quant is not None:
            return f"rtk-{self.quant.kind}"
        if self.fp32_gemv is not None:
            return f"rtk-avx2-{self.fp32_gemv.kind}"
        if self.int_products is not None:
            if isinstance(self.int_products, kernels_avx2.W4A8Weight):
                return "rtk-avx2-w4a8"
            return "rtk-avx2-w8a8-blockwise" if self.int_products.blockwise else "rtk-avx2-w8a8"
        packed = self.packed is not None or self.library_free
        return "int8" if self.int8 else "int4" if self.int4 else "packed" if packed else "dense"

    def _gemv_rounding(self, packed: torch.Tensor, weight: torch.Tensor, bias) -> str | None:
        """How rtk's bf16 GEMV over ``packed`` rounds here: ``"library"`` (oneDNN's one-row bits), ``"own"``
        (apart from them, but the float product within ``kernels.GEMV_TOLERANCE`` and batch-invariant), or
        None (neither: oneDNN computes the projection)."""
        if kernels.agrees(self._library_gemm, packed, self.out_features, bias):
            return "library"
        shape = (self.out_features, self.in_features)
        gemv = functools.partial(kernels.gemv, packed=packed, out_features=self.out_features)
        if kernels.within_and_invariant(
            lambda x, b: gemv(x, bias=b), weight.float(), bias, kernels.GEMV_TOLERANCE, torch.bfloat16
        ):
            log.info("rtk's GEMV rounds apart from oneDNN's one-row kernel for %s; decode rows take it", shape)
            return "own"
        log.info("rtk's GEMV differs from oneDNN for %s; oneDNN computes it", shape)
        return None

    def _pack_codes(
        self, linears: list[Linear], weight: torch.Tensor, bias, reference
    ) -> kernels.QuantizedWeight | None:
        """The codes packed for rtk's GEMV, where its weights are exactly ``weight`` and its products those of
        ``reference`` (a one-row call: oneDNN's, or rtk's bf16 GEMV where that rounds its own way)."""
        stored = _stored_codes(linears)
        if stored is None:
            return None
        kind = "int4-dot" if stored[0] == "int4" and self.int4_gemv == "dot" else stored[0]
        try:
            quant = kernels.QuantizedWeight.pack(kind, stored[1], stored[2])
        except RuntimeError as exc:  # e.g. a group size the layout cannot take
            log.info("rtk's GEMV cannot read the %s codes of %s (%s)", kind, tuple(weight.shape), exc)
            return None
        if kind == "int4-dot":
            exact = torch.cat([lin.weight for lin in linears])  # codes * scale in float32
            if quant.within(exact, bias):
                return quant
            log.info("rtk's int4-dot GEMV is off the float32 product for %s; oneDNN computes it", tuple(weight.shape))
            return None
        if not quant.agrees(weight, reference, bias):
            log.info("rtk's %s GEMV differs from the dense weights of %s; oneDNN computes it", quant.kind, weight.shape)
            return None
        return quant

    def _pack_fp32(self, linears: list[Linear], weight: torch.Tensor, bias) -> kernels_avx2.Fp32Weight | None:
        """The float32 weights as rtk's AVX2 GEMV reads them (their codes, else bf16), where its products are
        the float32 ones within its tolerance; None keeps MKL's."""
        packed = kernels_avx2.Fp32Weight.pack(weight, _stored_codes(linears))
        if packed is None:
            return None
        if not packed.within(weight, bias):
            log.info("rtk's AVX2 GEMV is off the float32 product for %s; MKL computes it", tuple(weight.shape))
            return None
        return packed

    def _pack_int_products(
        self, linears: list[Linear], weight: torch.Tensor, bias
    ) -> kernels_avx2.W8A8Weight | kernels_avx2.W4A8Weight | None:
        """An INT8 or INT4 projection as integer products (every row), where they are the float32 product of the
        same quantized values within the kernel's tolerance; None leaves it to the float32 paths.  Without an
        input scale (weight-only INT8 and INT4, the latter only with ``int4_gemv: "dot"``), the input is
        quantized per block of 32 by the kernel."""
        stored = _stored_codes(linears)
        if stored is not None and stored[0] == "int4":
            packed = kernels_avx2.W4A8Weight.pack(stored) if self.int4_gemv == "dot" else None
        else:
            packed = kernels_avx2.W8A8Weight.pack(stored, self.act_scale)
        if packed is None:
            return None
        if not packed.within(weight, bias):  # the float32 weights (codes * scale) of every linear
            log.info("rtk's integer products are off the float32 product for %s; float32 runs it", self.out_features)
            return None
        if isinstance(packed, kernels_avx2.W4A8Weight) and self.prompt_tiles:
            packed.add_tiles(stored[1], weight, bias)  # prompt rows in the tiles' layout, where the VNNI build runs
        return packed

    def _quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """rtk's one-pass input quantization (bf16: ``kernels``; float32: ``kernels_avx2``)."""
        fn = kernels.quantize_input if self.dtype == torch.bfloat16 else kernels_avx2.quantize_input
        return fn(x, self.pre_quant_scale, self.act_kind, self.act_scale_value)

    def _fused_input_agrees(self) -> bool:
        """True when rtk's input quantization kernel runs here and gives torch's bits for this projection's."""
        if self.dtype == torch.bfloat16:
            if not kernels.available():
                return False
        elif self.dtype != torch.float32 or self.in_features % 8 or not kernels_avx2.available():
            return False
        if self.pre_quant_scale is None and self.act_kind is None:
            return True
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, self.in_features, generator=g) * torch.exp2(torch.randint(-12, 12, (8, 1), generator=g))
        x = x.to(self.dtype)
        want = x if self.pre_quant_scale is None else x * self.pre_quant_scale
        if self.act_kind is not None:
            want = fake_quant(want, self.act_kind, self.act_scale)
        got = self._quantize_input(x)
        bits = torch.int16 if self.dtype == torch.bfloat16 else torch.int32
        if not torch.equal(got.view(bits), want.view(bits)):
            log.info("rtk's input quantization differs from torch's for %s; torch computes it", self.act_kind)
            return False
        return True

    def _pack_int(self, linears: list[Linear]) -> None:
        """Keep the integer codes for torch's W8A16 / W4A16 CPU kernels (a quarter / half of bf16's bytes).

        ``_weight_int8pack_mm(x, codes, scale)`` computes ``(x @ codes^T) * scale`` per output row;
        ``_weight_int4pack_mm_for_cpu`` dequantizes ``(code + 8 - 8) * scale`` per group inside the
        kernel.  The scales are rounded to bf16 (the kernels' scale dtype), so results differ from
        the dense path (bf16 of ``code * scale``) in rounding, not in the weights' values.
        """
        iws = [lin.codes for lin in linears]
        if any(w is None or w.kind == "fp8" for w in iws) or len({(w.bits, w.group_size) for w in iws}) != 1:
            return
        codes = torch.cat([w.codes for w in iws]).contiguous()
        scale = torch.cat([w.scale for w in iws])
        try:
            if iws[0].bits == 8:
                self.int8 = (codes, scale.to(torch.bfloat16).contiguous())
            else:
                g = iws[0].group_size
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32) + 8, 2)
                scales_zeros = torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1)
                self.int4 = (packed, g, scales_zeros.to(torch.bfloat16).contiguous())
        except (AttributeError, RuntimeError) as exc:  # pragma: no cover - depends on the torch build
            log.debug("integer weight kernel unavailable for %s (%s); using dense bf16", tuple(codes.shape), exc)
            self.int8 = self.int4 = None

    def _probed(self, cache: dict, key: tuple) -> int:
        """``min_rows`` by :meth:`_probe_rows`, once per weight shape and GEMM (``key``) in ``cache``; sets
        ``tile_rows`` and ``pad_rows`` to the probe's."""
        if key not in cache:
            cache[key] = self._probe_rows()
        min_rows, self.tile_rows, self.pad_rows = cache[key]
        return min_rows

    def _probe_rows(self) -> tuple[int, int | None, int]:
        """``(min_rows, tile_rows, pad_rows)``: the smallest row count from which a call gives each row the bits
        a larger call gives it; where no count does but calls in a range of sizes agree (oneDNN's AMX GEMM), the
        range's largest and smallest size (``min_rows`` then 1).  The tile settings are set while probed."""
        self.tile_rows, self.pad_rows = None, 1
        # a kernel difference shows in a few outputs per row: wide weights need fewer rows to see it.  Over more than
        # 1,024 inputs oneDNN's one-row bf16 kernel parts from its multi-row one in only ~1.5 of 10,000 outputs (random
        # weights of 120 x 1,160 and 120 x 1,536: 34-42 of 245,760), which 64 rows of 120 outputs missed for some
        # weights: there at least 2^18 outputs are compared
        long = self.in_features > 1024
        cover = min(512 if long else 64, max(4, (1 << (18 if long else 16)) // self.out_features))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(max(128, cover), self.in_features, generator=g).to(self.dtype)
        counts = list(range(1, MAX_PAD_ROWS + 1)) + [24, 32, 64]
        with torch.inference_mode():
            ref = self._matmul(x)

            def agrees(m: int) -> bool:  # calls of m rows over (at least) the first ``cover`` rows
                n = -(-cover // m) * m
                return all(torch.equal(self._matmul(x[i : i + m]), ref[i : i + m]) for i in range(0, n, m))

            agree = [agrees(m) for m in counts]
            if (not agree[-1] or not all(agree[MAX_PAD_ROWS:])) and self.packed is not None:
                # calls in a range of sizes: row counts stop mattering if rows agree whatever the call's size,
                # place and neighbours
                for lo, hi in [(1, LIBRARY_TILE_ROWS), (LIBRARY_TILE_ROWS, LIBRARY_TILE_ROWS)]:
                    self.pad_rows, self.tile_rows = lo, hi
                    ref = self._matmul(x)
                    sizes = [*range(1, hi + 1), hi + 1, 2 * hi - 1]  # every call, and tiles with a short last one
                    ok = all(agrees(m) for m in sizes) and torch.equal(self._matmul(x.flip(0)), ref.flip(0))
                    self.tile_rows, self.pad_rows = None, 1
                    if ok:
                        log.info(
                            "oneDNN's GEMM of shape %s gives rows other bits in calls of other sizes; its calls "
                            "take %d to %d rows",
                            (self.out_features, self.in_features),
                            lo,
                            hi,
                        )
                        return 1, hi, lo
        if not agree[-1] or not all(agree[MAX_PAD_ROWS:]):
            log.warning(
                "GEMM of shape %s is not row-invariant for large batches here; batching may change results "
                "in the last bit",
                (self.out_features, self.in_features),
            )
            return 1, None, 1
        first_bad_from_end = max((i for i, ok in enumerate(agree) if not ok), default=-1)
        return (counts[first_bad_from_end + 1] if first_bad_from_end >= 0 else 1), None, 1

    @property
    def nbytes(self) -> int:
        """Bytes of weights a decode forward reads (codes and scales where a kernel reads the codes)."""
        if self.quant is not None:
            return self.quant.nbytes
        if self.fp32_gemv is not None:
            return self.fp32_gemv.nbytes
        if self.int_products is not None:
            return self.int_products.nbytes
        if self.int8:
            return self.int8[0].numel() + self.int8[1].numel() * 2
        if self.int4:
            return self.int4[0].numel() + self.int4[2].numel() * 2
        return self.out_features * self.in_features * torch.finfo(self.dtype).bits // 8

    def __call__(self, x: torch.Tensor, singles: int | None = 0) -> torch.Tensor:
        """``x``: ``[T, in]``; its first ``singles`` rows belong to single-token (decode) sequences.

        ``singles=None``: one call over all rows, whatever their count (not batch-invariant).
        """
        # Same order of operations as checkpoint.Linear.__call__ (the reference semantics).
        if self.int_products is not None:  # integer products: a row's result is its own, so every row goes through
            w = self.int_products
            if not w.amx:  # w4a8 or, with VNNI lanes, w4a8_lanes for every row
                return w(x, self.bias, self.pre_quant_scale)
            # INT4 with AMX tiles: decode rows through w4a8, prompt rows through the tiles (W4A8Weight.prompt);
            # with decode_batching "full" (singles=None), by the call's row count (TILE_DECODE_ROWS)
            rows = x.shape[0]
            if singles is None:
                singles = rows if rows < TILE_DECODE_ROWS else 0
            if singles >= rows:
                return w(x, self.bias, self.pre_quant_scale)
            prompt = w.prompt(x[singles:], self.bias, self.pre_quant_scale)
            return prompt if not singles else torch.cat([w(x[:singles], self.bias, self.pre_quant_scale), prompt])
        if self.fused_input and (self.pre_quant_scale is not None or self.act_kind is not None):
            x = self._quantize_input(x)
        else:
            if self.pre_quant_scale is not None:
                x = x * self.pre_quant_scale
            if self.act_kind is not None:
                x = fake_quant(x, self.act_kind, self.act_scale)
        if self.gemv_prompt_rows:  # every row, decode and prompt, through the GEMV: a row's result is its own
            return self._gemv(x)
        # Kernels that round their own way (torch's integer kernels, rtk's INT4 group sums, the AVX2 GEMV, rtk's
        # GEMV on AMX hosts): decode rows through the kernel, prompt rows through the library's GEMM; with
        # decode_batching "full" (singles=None), by the call's row count.
        if self.int8 is not None or self.int4 is not None or self.own_rounding:
            own, limit = (self._gemv, GEMV_MAX_ROWS) if self.own_rounding else (self._int_matmul, self.int_max_rows)
            if singles is None:
                return own(x) if x.shape[0] <= limit else self._matmul(x)
            if not singles:
                return self._padded(x) if self.single_rows else self._matmul(x)
            parts = [own(x[:singles])]
            if x.shape[0] > singles:
                parts.append(self._padded(x[singles:]) if self.single_rows else self._matmul(x[singles:]))
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.gemv is not None or self.quant is not None:
            rows, whole = x.shape[0], self.whole_gemv_rows
            if rows <= whole or (singles is None and rows <= self.full_gemv_rows):
                # a row-invariant shape (its one-row bits are every call's bits), or decode_batching "full"
                return self._gemv(x)
            if whole:  # the same shape in a bigger call: decode rows too through the library's GEMM, whose bits are
                return self._matmul(x)  # the GEMV's there, so the weights are read once, not twice
            if singles:
                # decode rows with the one-row bits, as a lone decode (and transformers') computes them
                parts = [self._gemv(x[:singles])]
                if rows > singles:
                    parts.append(self._padded(x[singles:]) if self.single_rows else self._matmul(x[singles:]))
                return parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.single_rows is None or singles is None:
            return self._matmul(x)
        if self.single_rows == "pad" or singles == 0:
            return self._padded(x)
        parts = [self._matmul(x[i : i + 1]) for i in range(singles)]
        if x.shape[0] > singles:
            parts.append(self._padded(x[singles:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows >= self.min_rows:
            return self._matmul(x)
        pad = x.new_zeros(self.min_rows - rows, x.shape[1])
        return self._matmul(torch.cat([x, pad]))[:rows]

    def _int_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            y = torch.ops.aten._weight_int8pack_mm(x, *self.int8)
        else:
            packed, g, scales_zeros = self.int4
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, scales_zeros)
        return y if self.bias is None else y + self.bias

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        """Rows with the one-row bits: over the codes for a few rows, else over the bf16 weights (same bits);
        on a float32 engine, rtk's AVX2 GEMV where it applies."""
        if self.fp32_gemv is not None:
            return self.fp32_gemv(x, self.bias)
        limit = self.codes_max_rows
        if self.quant is not None and (x.shape[0] <= limit or self.gemv is None):
            if x.shape[0] <= limit:
                return self.quant(x, self.bias)
            return torch.cat([self.quant(x[i : i + limit], self.bias) for i in range(0, x.shape[0], limit)])
        return kernels.gemv(x, self.gemv, self.out_features, self.bias)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if (self.gemv is not None or self.quant is not None) and x.shape[0] == 1 and not self.own_rounding:
            return self._gemv(x)
        return self._library_gemm(x)

    def _library_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMM of a library: MKL over packed weights (float32 engines), oneDNN's bf16 one, else F.linear; rtk's
        GEMV where it gives the library's bits for every call and the library's copy was dropped (``library_free``)."""
        if self.library_free:
            return self._gemv(x)
        if self.mkl_tiles is not None:
            return self.mkl_tiles(x, self.bias)
        if self.packed is not None:
            rows, tile, least = x.shape[0], self.tile_rows, self.pad_rows
            if tile is None or rows == 0 or least <= rows <= tile:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            if 0 < rows % tile < least:  # the last tile (or a short call) padded with zero rows
                x = torch.cat([x, x.new_zeros(least - rows % tile, x.shape[1])])
            tiles = [
                torch.ops.mkldnn._linear_pointwise(x[i : i + tile], self.packed, self.bias, "none", [], "")
                for i in range(0, x.shape[0], tile)
            ]
            return torch.cat(tiles)[:rows]
        return F.linear(x, self.weight, self.bias)


class FusedGroup:
    """q/k/v (or gate/up) as one Projection when their emulation agrees, else one per linear."""

    def __init__(
        self,
        linears: list[Linear],
        dtype: torch.dtype,
        pack: bool,
        probe_cache: dict | None = None,
        int_kernels: bool = False,
        full_batching: bool = False,
        gemv_kernel: bool = False,
        int4_gemv: str = "dot",
        blockwise_inputs: bool = False,
        float32_prompt_rows: str = "mkl",
    ):
        args = (dtype, pack, probe_cache, int_kernels, full_batching, gemv_kernel, int4_gemv, blockwise_inputs)
        args += (float32_prompt_rows,)  # Projection's arguments in its order
        if all(_same_emulation(linears[0], lin) for lin in linears[1:]):
            self.parts = [Projection(linears, *args)]
        else:
            self.parts = [Projection([lin], *args) for lin in linears]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor, singles: int | None = 0) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0](x, singles)
        return torch.cat([p(x, singles) for p in self.parts], dim=-1)


# -- rope -----------------------------------------------------------------------------------------


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies as transformers computes them (default, linear, Llama-3 and YaRN rope types)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        # transformers/modeling_rope_utils.py::_compute_llama3_parameters
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        inv_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, inv_llama)
    if kind == "yarn":
        # transformers/modeling_rope_utils.py::_compute_yarn_parameters (cos/sin scaling: rope_attention_scaling)
        base, old_len = config.rope_theta, float(scaling["original_max_position_embeddings"])
        factor = float(scaling.get("factor") or config.max_position_embeddings / old_len)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        extrapolate = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    raise SourceError(
        f"rope scaling type '{kind}' is not supported by the CPU engine (config.json rope_scaling / rope_parameters); "
        "supported: default, linear, llama3, yarn"
    )


def rope_attention_scaling(config: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (YaRN's attention factor; 1 otherwise)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or config.max_position_embeddings / old_len)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def rope_tables(config: ModelConfig, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and *signed* sin tables ``[length, head_dim]`` in ``dtype``, as transformers rounds them.

    transformers rotates with ``x * cos + rotate_half(x) * sin`` where ``rotate_half(x) =
    cat(-x2, x1)``; that equals ``x[..., swap] * (sign * sin)`` exactly (negation is exact), which
    takes one gather instead of two slices, a negation and a concatenation.
    """
    inv_freq = rope_inv_freq(config)
    pos = torch.arange(length, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    attention_scaling = rope_attention_scaling(config)
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    half = config.head_dim // 2
    sign = torch.cat([-torch.ones(half), torch.ones(half)])
    return cos.to(dtype), sin.to(dtype) * sign.to(dtype)


# -- one step's attention metadata --------------------------------------------------------------


@dataclass
class PrefillChunk:
    """Prompt rows ``[start, start + length)`` of the flat batch, at positions ``cached ...``."""

    start: int
    length: int
    cached: int
    slots: torch.Tensor | None  # [cached + length] slots to read K/V from; None = this chunk's own K/V
    units: list[tuple[int, int, torch.Tensor]]  # query rows [a, b) of the chunk and their mask [b - a, cached + b]


@dataclass
class StepPlan:
    """Per-step inputs shared by every layer: where to write K/V and what each row attends to."""

    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T]
    num_decode: int = 0  # rows [0, num_decode) are one-row (generation) attention calls
    decode_slots: torch.Tensor | None = None  # contexts of the one-row calls' sequences, concatenated
    decode_bounds: list[tuple[int, int]] = field(default_factory=list)  # each one-row call's keys in decode_slots
    # batched decode attention (build_plan(batched=True)): every decode row's context padded to the longest
    decode_padded: torch.Tensor | None = None  # [B, Lmax] slots (padding repeats a valid slot)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] True where a row attends
    prefills: list[PrefillChunk] = field(default_factory=list)
    logit_rows: torch.Tensor | None = None  # rows whose logits are needed; None = all

    def prompt_rows(self) -> StepPlan:
        """The plan of the prompt rows alone (rows ``[num_decode, T)``, renumbered from 0)."""
        b = self.num_decode
        chunks = [PrefillChunk(c.start - b, c.length, c.cached, c.slots, c.units) for c in self.prefills]
        return StepPlan(positions=self.positions[b:], write_slots=self.write_slots[b:], prefills=chunks)

    def prompt_tensors(self) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        """The prompt chunks as rtk's fused layers take them (``DecodeLayers.forward_rows``): chunks ``[C, 3]``
        (first row, rows, positions cached), each chunk's slots (empty: it reads its own rows), units ``[U, 3]``
        (chunk, first query row, end) and each unit's mask."""
        empty = torch.empty(0, dtype=torch.int64)
        chunks = torch.tensor([(c.start, c.length, c.cached) for c in self.prefills], dtype=torch.int64).view(-1, 3)
        slots = [empty if c.slots is None else c.slots for c in self.prefills]
        units = [(i, a, b) for i, c in enumerate(self.prefills) for a, b, _ in c.units]
        masks = [mask for c in self.prefills for _, _, mask in c.units]
        return chunks, slots, torch.tensor(units, dtype=torch.int64).view(-1, 3), masks


def build_plan(
    work: list[tuple[list[int], int, int, bool]],
    tokens_per_block: int,
    unit: int,
    reads_own_kv: bool = True,
    batched: bool = False,
) -> StepPlan:
    """Metadata for ``(block_table, num_cached, num_new, is_prompt)`` entries, generation entries first.

    Generation rows (``is_prompt`` False) each attend alone, like a decode.  A prompt chunk's
    queries attend in units of ``unit`` rows aligned to absolute positions, so a row's numbers do
    not depend on how the prompt was split into steps.  ``reads_own_kv``: a chunk starting at
    position 0 may use its fresh K/V instead of reading them back (not when the pool quantizes).
    """
    # the slots in numpy: a step's plan is a few small arrays per sequence, and torch's per-call overhead made
    # this ~40 us a sequence (8 streams: 0.3-0.4 ms of every step, on the engine's thread)
    tpb = tokens_per_block
    in_block = np.arange(tpb, dtype=np.int64)
    positions, slots = [], []
    decode_ctx: list[np.ndarray] = []
    bounds: list[tuple[int, int]] = []
    prefills = []
    row = offset = 0
    for table, cached, new, is_prompt in work:
        ctx = cached + new
        all_slots = (np.asarray(table, dtype=np.int64)[:, None] * tpb + in_block).reshape(-1)[:ctx]
        positions.append(np.arange(cached, ctx, dtype=np.int64))
        slots.append(all_slots[cached:])
        if not is_prompt:
            if prefills:
                raise ValueError("generation entries must come before prompt chunks")
            decode_ctx.append(all_slots)
            bounds.extend((offset, offset + cached + i + 1) for i in range(new))
            offset += ctx
        else:
            units = []
            for a in range(0, new, unit):
                b = min(a + unit, new)
                qpos = torch.arange(cached + a, cached + b)
                units.append((a, b, torch.arange(cached + b)[None, :] <= qpos[:, None]))
            own = cached == 0 and reads_own_kv
            prefills.append(PrefillChunk(row, new, cached, None if own else torch.from_numpy(all_slots), units))
        row += new
    plan = StepPlan(
        positions=torch.from_numpy(np.concatenate(positions)),
        write_slots=torch.from_numpy(np.concatenate(slots)),
        num_decode=len(bounds),
        prefills=prefills,
    )
    if bounds:
        decode_slots = np.concatenate(decode_ctx)
        plan.decode_slots = torch.from_numpy(decode_slots)
        plan.decode_bounds = bounds
        if batched and len(bounds) > 1:
            starts = np.array([s for s, _ in bounds], dtype=np.int64)
            lengths = np.array([e - s for s, e in bounds], dtype=np.int64)
            cols = np.arange(int(lengths.max()), dtype=np.int64)
            valid = cols[None, :] < lengths[:, None]
            # padding points at the row's own first key: finite values, weight 0 after the mask
            plan.decode_padded = torch.from_numpy(decode_slots[starts[:, None] + np.where(valid, cols[None, :], 0)])
            plan.decode_mask = torch.from_numpy(valid)[:, None, None, :]
    return plan


# -- the model --------------------------------------------------------------------------------------


class Layer:
    def __init__(
        self,
        spec: dict,
        dtype: torch.dtype,
        pack: bool,
        probe_cache: dict,
        int_kernels: bool = False,
        full_batching: bool = False,
        gemv_kernel: bool = False,
        int4_gemv: str = "dot",
        blockwise_inputs: bool = False,
        float32_prompt_rows: str = "mkl",
    ):
        self.input_norm = spec["input_layernorm"].to(dtype)
        self.post_norm = spec["post_attention_layernorm"].to(dtype)
        args = (dtype, pack, probe_cache, int_kernels, full_batching, gemv_kernel, int4_gemv, blockwise_inputs)
        args += (float32_prompt_rows,)  # Projection's arguments in its order
        self.qkv = FusedGroup([spec["q_proj"], spec["k_proj"], spec["v_proj"]], *args)
        self.o = FusedGroup([spec["o_proj"]], *args)
        self.gate_up = FusedGroup([spec["gate_proj"], spec["up_proj"]], *args)
        self.down = FusedGroup([spec["down_proj"]], *args)

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.o.nbytes + self.gate_up.nbytes + self.down.nbytes


class Transformer:
    """Weights prepared for the CPU plus the forward over a :class:`KVPool`."""

    def __init__(
        self,
        ckpt: Checkpoint,
        dtype: torch.dtype,
        max_positions: int,
        attention_dtype: torch.dtype = torch.float32,
        int_kernels: bool = True,
        batch_invariant: bool = True,
        cpu_kernels: bool = True,
        fused_decode: bool = True,
        int4_gemv: str = "dot",
        huge_pages: bool = True,
        decode_attention: str = "auto",
        float32_prompt_rows: str = "mkl",
    ):
        cfg = ckpt.config
        self.config = cfg
        self.quant_algo = ckpt.quant_algo
        self.dtype = dtype
        # oneDNN's packed bf16 weights only with native bf16: where oneDNN converts (onednn_bf16() alone), the
        # packed kernel rounds apart from torch's plain bf16 linear (transformers' bits: docs/engine.md)
        pack = dtype == torch.bfloat16 and bf16_is_fast()
        self.packed = pack
        self.eps = cfg.rms_norm_eps
        self.embed = ckpt.embed_tokens.to(dtype)
        self.final_norm = ckpt.final_norm.to(dtype)
        probes: dict = {}  # weight shape -> min_rows (see Projection)
        self.lm_head = Projection(
            [ckpt.lm_head],
            dtype,
            pack,
            probes,
            gemv_kernel=cpu_kernels,
            int4_gemv=int4_gemv,
            blockwise_inputs=True,
            float32_prompt_rows=float32_prompt_rows,
            # its logit rows in the lanes where they take every row (no AMX): 0.45-0.62x w4a8's time at 2-4 rows
            # over SmolLM2's INT4 head (docs/engine-measurements.md, "INT4 tiles on 2 MiB pages, and the INT4 head
            # in the lanes")
            prompt_tiles=kernels_avx2.prompt_lanes(),
        )
        self.layers = [
            Layer(
                spec,
                dtype,
                pack,
                probes,
                int_kernels,
                not batch_invariant,
                cpu_kernels,
                int4_gemv,
                blockwise_inputs=True,
                float32_prompt_rows=float32_prompt_rows,
            )
            for spec in ckpt.layers
        ]
        # a float32 engine with rtk's AVX2 kernels: decode attention read in place, the fused float32 step and
        # the prompt rows' RMSNorm in one C++ call (same bits as torch's composite)
        self.avx2_kernels = cpu_kernels and dtype == torch.float32 and kernels_avx2.available()
        self.huge_pages = huge_pages
        if huge_pages:
            self._weights_on_huge_pages()
        # K/V reads for float32 attention through rtk's gather kernel (a plain copy: no check needed)
        self.fast_gather = cpu_kernels and dtype == torch.bfloat16 and kernels.available()
        # greedy tokens through the loaded kernels' argmax (the same indices as torch.argmax, ~4x faster a step):
        # a bf16 engine's AVX512 library (fast_gather's), a float32 engine's AVX2 one
        self.argmax_rows = (
            kernels.argmax_rows if self.fast_gather else kernels_avx2.argmax_rows if self.avx2_kernels else None
        )
        # min_rows per weight shape, and the shapes whose one-row calls run rtk's GEMV
        self.single_row_modes = {
            f"{o}x{i} {k}": f"{m[0]}" + (f", calls of {m[2]} to {m[1]} rows" if m[1] else "")
            for (o, i, _, k), m in probes.items()
            if k != "gemv"
        }
        self.gemv_own_rounding = any(how == "own" for (_, _, _, k), how in probes.items() if k == "gemv")
        self.gemv_shapes = sorted(
            f"{o}x{i}" + (" (own rounding)" if how == "own" else "")
            for (o, i, _, k), how in probes.items()
            if k == "gemv" and how
        )
        self.cos, self.sin = rope_tables(cfg, max_positions, dtype)
        half = cfg.head_dim // 2
        self.rope_swap = torch.cat([torch.arange(half, cfg.head_dim), torch.arange(half)])
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.attn_dtype = attention_dtype
        self.kv_quant = self._kv_quant(ckpt)
        # decode rows attend through rtk's kernel, over the K/V where they lie in the pool, in the operator path
        # and the fused step alike (EngineConfig.decode_attention): a float32 engine's float32 pool unless "sdpa"
        # (kernels_avx2.decode_attention), a bf16 engine's bf16 pool with "in_place" (kernels.decode_attention,
        # the same code; docs/engine-measurements.md, "Decode attention read in place on bf16 engines")
        in_place = (self.avx2_kernels and decode_attention != "sdpa") or (
            self.fast_gather and decode_attention == "in_place"
        )
        self.pool_attention = in_place and attention_dtype == torch.float32 and self.kv_quant is None
        # the op over this engine's pool: bf16 (rtk_kernels) or float32 (rtk_avx2 / rtk_vnni)
        self._attend_in_place = kernels.decode_attention if self.fast_gather else kernels_avx2.decode_attention
        if decode_attention == "in_place" and not self.pool_attention:
            log.info(
                "decode_attention 'in_place' needs rtk's kernels, float32 attention and an unquantized K/V cache; "
                "SDPA runs the decode rows' attention"
            )
        # a bf16 engine's decode rows without pool_attention: torch's SDPA bits for all rows in one call
        # (kernels.sdpa_decode, checked bit for bit against SDPA at load) instead of one SDPA call per row;
        # RTK_SDPA_DECODE=0 in the environment keeps the calls (docs/engine-measurements.md, "SDPA's bits in one call")
        self.sdpa_decode = (
            self.fast_gather
            and attention_dtype == torch.float32
            and not self.pool_attention
            and os.environ.get("RTK_SDPA_DECODE", "1") != "0"
            and kernels.sdpa_decode_agrees(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        )
        self.batch_invariant = batch_invariant
        self.fused = None
        if fused_decode and self.fast_gather:
            self.fused = self._fused_decode()
        elif fused_decode and self.avx2_kernels:
            self.fused = self._fused_decode_fp32()

    @property
    def attends_rows_in_one_call(self) -> bool:
        """Decode rows attend in one call, each over its own context (:attr:`pool_attention` or
        :attr:`sdpa_decode`): no padded plan is needed to batch them, and their numbers never depend on the step."""
        return self.pool_attention or self.sdpa_decode

    @property
    def projections(self) -> list[Projection]:
        """Every decoder layer's projections (q/k/v, o, gate/up and down parts), the LM head not among them."""
        return [p for layer in self.layers for g in (layer.qkv, layer.o, layer.gate_up, layer.down) for p in g.parts]

    @property
    def kernels(self) -> str:
        """What computes the model, in one line for logs: dtype, the decoder projections' decode-row kernels
        (:attr:`Projection.kernel`) with their counts, INT4 prompt rows in AMX tiles or VNNI lanes, the fused step,
        rtk's decode attention, the head's."""
        counts = collections.Counter(p.kernel for p in self.projections)
        tiled = [p.int_products for p in self.projections if p.int_products and p.int_products.tiles is not None]
        tiles = len(tiled)
        parts = [str(self.dtype).removeprefix("torch."), ", ".join(f"{k} x{n}" for k, n in counts.items())]
        if tiles:
            rows = "prompt rows" if self.batch_invariant else f"prompt rows and calls of {TILE_DECODE_ROWS}+ rows"
            if tiled[0].amx:
                parts.append(f"{rows} of {tiles} in AMX tiles")
            else:
                parts.append(f"every row of {tiles} in VNNI lanes")
        gemv_rows = sum(p.gemv_prompt_rows for p in [*self.projections, self.lm_head])
        if gemv_rows:
            parts.append(f"prompt rows of {gemv_rows} in the GEMV")
        if self.fused is not None:
            rows = "every row" if self.fused.takes_prompt_rows else "decode rows"
            parts.append(f"fused step ({type(self.fused).__module__.rsplit('.', 1)[-1]}, {rows})")
        if self.pool_attention or self.sdpa_decode:
            parts.append("decode attention " + ("in place" if self.pool_attention else "SDPA's bits in one call"))
        lanes = self.lm_head.int_products is not None and self.lm_head.int_products.lanes
        parts.append(f"head {self.lm_head.kernel}{' in VNNI lanes' if lanes else ''}")
        return "; ".join(parts)

    def _weights_on_huge_pages(self) -> None:
        """Move the weights the decode kernels stream every step onto 2 MiB pages (:mod:`hugepages`): a float32
        engine's (``Fp32Weight``, ``W8A8Weight``, ``W4A8Weight``'s codes or, in the lanes, its tiles; with 4 KiB
        pages the W8A8 kernel took 12-17 % longer over SmolLM2's codes, the lanes 1.16-1.37x at 1-8 rows) and a bf16
        engine's GEMV weights and codes (``kernels.gemv`` / ``gemv_q``: a bf16 decode step's GEMVs 11-27 % faster,
        docs/engine-measurements.md "A bf16 engine's GEMV weights on 2 MiB pages")."""
        projections = [self.lm_head, *self.projections]
        ints = [p.int_products for p in projections if p.int_products is not None]
        # INT4 in AVX512-VNNI's lanes reads its tiles for every row, never its codes (W4A8Weight.lanes)
        owners = [(w, "codes") for w in ints if not w.lanes]
        owners += [(w, "tiles") for w in ints if w.tiles is not None]
        owners += [(w, "plain") for w in ints if w.plain is not None]  # the GEMM's copy of the codes
        owners += [(p.fp32_gemv, "weights") for p in projections if p.fp32_gemv is not None]
        owners += [(p, "gemv") for p in projections if p.gemv is not None]
        owners += [(p.quant, "codes") for p in projections if p.quant is not None]
        if owners:
            moved = hugepages.pack([getattr(o, name) for o, name in owners])
            for (o, name), t in zip(owners, moved, strict=True):
                setattr(o, name, t)

    def _fused_decode(self):
        """rtk's fused decode layers (``kernels.DecodeLayers``) where every projection runs rtk's GEMV, else None."""
        if self.attn_dtype != torch.float32 or self.dtype != torch.bfloat16:
            return None
        groups = [g for layer in self.layers for g in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        for g in groups:
            p = g.parts[0]
            quantized_input = p.pre_quant_scale is not None or p.act_kind is not None
            no_gemv = p.gemv is None and p.quant is None
            if len(g.parts) != 1 or no_gemv or p.int8 or p.int4 or (quantized_input and not p.fused_input):
                log.info("rtk's fused decode step does not apply here (%s); torch's operators run it", p.kernel)
                return None
        kv = self.kv_quant
        fused = kernels.DecodeLayers(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.eps,
            self.scale,
            kv.kind if kv else None,
            self.cos,
            self.sin,
        )
        fused.set_pool_attention(self.pool_attention)
        fused.set_sdpa_decode(self.sdpa_decode)
        # a step's prompt rows through the same call (decode_batching "full": every call by its row count, as
        # Projection without singles); RTK_FUSED_PROMPT_ROWS=0 in the environment keeps torch's operators for them
        # (docs/engine-measurements.md, "Prompt rows through the fused layers on bf16 engines")
        prompt_rows = os.environ.get("RTK_FUSED_PROMPT_ROWS", "1") != "0"
        for li, layer in enumerate(self.layers):
            fused.add_layer(
                layer.input_norm, layer.post_norm, kv.k_scales[li] if kv else 1.0, kv.v_scales[li] if kv else 1.0
            )
            for g in (layer.qkv, layer.o, layer.gate_up, layer.down):
                fused.add_projection(g.parts[0], prompt_rows=prompt_rows, full=not self.batch_invariant)
        return fused

    def _fused_decode_fp32(self):
        """A float32 engine's fused decode layers (``kernels_avx2.DecodeLayers``) where every projection runs
        rtk's AVX2 GEMV or integer products and the K/V pool holds float32, else None."""
        if not self.pool_attention:
            log.info(
                "the float32 fused decode step needs float32 attention and K/V, attended in place; "
                "torch's operators run it"
            )
            return None
        for g in (g for layer in self.layers for g in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            p = g.parts[0]
            if len(g.parts) != 1 or (p.fp32_gemv is None and p.int_products is None):
                log.info("the float32 fused decode step does not apply here (%s); torch's operators run it", p.kernel)
                return None
        fused = kernels_avx2.DecodeLayers(
            self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale, self.cos, self.sin
        )
        for layer in self.layers:
            fused.add_layer(layer.input_norm, layer.post_norm)
            for g in (layer.qkv, layer.o, layer.gate_up, layer.down):
                fused.add_projection(g.parts[0], prompt_rows=self.batch_invariant)
        if not self.batch_invariant:  # decode_batching "full": as Projection.__call__ without singles
            fused.set_tile_decode_rows(TILE_DECODE_ROWS)
        return fused

    @staticmethod
    def _kv_quant(ckpt: Checkpoint) -> KVQuant | None:
        kind = {"FP8": "fp8", "INT8": "int8"}.get((ckpt.kv_cache_quant_algo or "").upper())
        if ckpt.kv_cache_quant_algo and kind is None:
            raise SourceError(
                f"{ckpt.path}: kv_cache_quant_algo '{ckpt.kv_cache_quant_algo}' is not supported by the CPU engine "
                "(FP8, INT8)"
            )
        if kind is None:
            return None

        def scale(layer, name):  # TensorRT-LLM uses 1.0 where no scaling factor was calibrated
            s = layer.get(name)
            return 1.0 if s is None else float(s)

        return KVQuant(
            kind, [scale(lay, "k_scale") for lay in ckpt.layers], [scale(lay, "v_scale") for lay in ckpt.layers]
        )

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights a single-token forward reads: every projection, the lm_head and one embedding row."""
        per = sum(layer.nbytes for layer in self.layers) + self.lm_head.nbytes
        return per + self.config.hidden_size * self.embed.element_size()

    def new_pool(self, num_blocks: int, tokens_per_block: int) -> KVPool:
        pool = KVPool(
            len(self.layers),
            num_blocks,
            tokens_per_block,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.kv_quant,
            self.huge_pages,
        )
        pool.fast_gather = self.fast_gather
        return pool

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale in the input dtype
        # (F.rms_norm on fp32 gives the same bits as its pow/mean/rsqrt sequence, in one op).  A float32
        # engine with rtk's AVX2 kernels computes the same bits in one C++ call (kernels_avx2.rms_norm).
        if self.avx2_kernels:
            return kernels_avx2.rms_norm(x, weight, self.eps)
        return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def forward(self, input_ids: torch.Tensor, plan: StepPlan, pool: KVPool) -> torch.Tensor:
        """Logits (float32) for ``plan.logit_rows`` (all rows when None) of the flat token batch."""
        h = F.embedding(input_ids, self.embed)
        B = plan.num_decode
        if plan.prefills and self.fused is not None and self.fused.takes_prompt_rows:
            # a float32 engine's fused layers take prompt rows as Projection does: decode and prompt rows in one call
            h = self.fused.forward_rows(h, plan, pool, 0, len(self.layers))
        elif self.fused is not None and 0 < B <= GEMV_MAX_ROWS:
            # decode rows through rtk's fused layers, prompt rows (if any) through torch's operators
            bounds = torch.tensor(plan.decode_bounds, dtype=torch.int64)
            positions, slots, ctx = plan.positions[:B], plan.write_slots[:B], plan.decode_slots
            padded, mask = plan.decode_padded, plan.decode_mask  # None: each row attends alone

            def decode(x: torch.Tensor, begin: int, end: int) -> torch.Tensor:
                return self.fused.forward(x, positions, slots, ctx, bounds, pool, begin, end, padded, mask)

            if not plan.prefills:
                h = decode(h, 0, len(self.layers))
            else:
                rest = plan.prompt_rows()
                rope = self._rope(rest)  # once per step, not per layer
                for li in range(len(self.layers)):
                    h = torch.cat([decode(h[:B], li, li + 1), self._layers(h[B:], rest, pool, li, li + 1, rope)])
        else:
            h = self._layers(h, plan, pool, 0, len(self.layers))
        singles = 0 if self.batch_invariant else None  # every row of a scoring pass is a prefill row
        if plan.logit_rows is not None:
            h = h.index_select(0, plan.logit_rows)
            if self.batch_invariant:
                singles = h.shape[0]  # one row per sequence, like transformers' logits_to_keep=1
        return self.lm_head(self._rms_norm(h, self.final_norm), singles).float()

    def _rope(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at the plan's positions, ``[T, 1, head_dim]`` each."""
        pos = plan.positions
        return self.cos.index_select(0, pos)[:, None, :], self.sin.index_select(0, pos)[:, None, :]

    def _layers(self, h: torch.Tensor, plan: StepPlan, pool: KVPool, begin: int, end: int, rope=None) -> torch.Tensor:
        """Layers ``[begin, end)`` over the rows of ``plan`` with torch's operators (``rope``: :meth:`_rope`'s)."""
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        T = h.shape[0]
        cos, sin = rope or self._rope(plan)
        swap = self.rope_swap
        B = plan.num_decode
        rows = B if self.batch_invariant else None  # see Projection.__call__
        gqa = KVH != H
        bounds = torch.tensor(plan.decode_bounds, dtype=torch.int64) if B and self.attends_rows_in_one_call else None
        for li in range(begin, end):
            layer = self.layers[li]
            x = self._rms_norm(h, layer.input_norm)
            qkv = layer.qkv(x, rows)
            qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)
            qk = qk * cos + qk.index_select(-1, swap) * sin
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
            pool.write(li, plan.write_slots, k, v)
            outs = []
            ad = self.attn_dtype
            q = q.to(ad)
            if B and self.pool_attention:
                # every decode row over its exact context, read in place: batch-invariant whatever the batching
                kp, vp = pool.layer(li)
                outs.append(self._attend_in_place(q[:B], kp, vp, plan.decode_slots, bounds, self.scale))
            elif plan.decode_padded is not None and not self.sdpa_decode:
                # One SDPA for every decode row over its context padded to the longest (masked): a
                # few calls instead of one per sequence, but the float reductions see the padding,
                # so a row's last bits may depend on the batch (EngineConfig.decode_batching).
                kd, vd = pool.gather(li, plan.decode_padded, ad)  # [B, Lmax, KVH, D]
                o = F.scaled_dot_product_attention(
                    q[:B].view(B, H, 1, D),
                    kd.transpose(1, 2),
                    vd.transpose(1, 2),
                    attn_mask=plan.decode_mask,
                    scale=self.scale,
                    enable_gqa=gqa,
                )
                outs.append(o.view(B, H * D))
            elif B and self.sdpa_decode and pool.quant is None:
                # every row over its exact context with the bits of the SDPA call transformers makes for a
                # single decode, in one call that reads each row's context from the pool (sdpa_decode.h)
                kp, vp = pool.layer(li)
                outs.append(kernels.sdpa_decode(q[:B], kp, vp, bounds, self.scale, plan.decode_slots))
            elif B:
                # One gather for all decodes, then each sequence over its exact context with the SDPA call
                # transformers makes for a single decode, so results do not depend on who else is in the
                # batch (a padded, masked batch would change the float reductions); with sdpa_decode, the
                # same bits for every row in one call.
                kd, vd = pool.gather(li, plan.decode_slots, ad)  # [sum L, KVH, D]
                if self.sdpa_decode:
                    outs.append(kernels.sdpa_decode(q[:B], kd, vd, bounds, self.scale))
                else:
                    for i, (s, e) in enumerate(plan.decode_bounds):
                        o = F.scaled_dot_product_attention(
                            q[i].view(1, H, 1, D),
                            kd[s:e].transpose(0, 1)[None],
                            vd[s:e].transpose(0, 1)[None],
                            scale=self.scale,
                            enable_gqa=gqa,
                        )
                        outs.append(o.view(1, H * D))
            for c in plan.prefills:
                if c.slots is None:
                    kc = k[c.start : c.start + c.length].transpose(0, 1)[None]
                    vc = v[c.start : c.start + c.length].transpose(0, 1)[None]
                else:
                    kc, vc = pool.gather(li, c.slots, ad)
                    kc, vc = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]
                kc, vc = kc.to(ad), vc.to(ad)  # no-op when gathered
                qc = q[c.start : c.start + c.length].transpose(0, 1)[None]
                for a, b, mask in c.units:
                    end = c.cached + b
                    o = F.scaled_dot_product_attention(
                        qc[:, :, a:b], kc[:, :, :end], vc[:, :, :end], attn_mask=mask, scale=self.scale, enable_gqa=gqa
                    )
                    outs.append(o[0].transpose(0, 1).reshape(b - a, H * D))
            attn = (outs[0] if len(outs) == 1 else torch.cat(outs)).to(self.dtype)
            h = h + layer.o(attn, rows)
            x = self._rms_norm(h, layer.post_norm)
            gu = layer.gate_up(x, rows)
            inter = gu.shape[-1] // 2
            h = h + layer.down(F.silu(gu[:, :inter]) * gu[:, inter:], rows)
        return h
