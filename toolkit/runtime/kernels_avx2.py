"""rtk's float32-engine kernels for CPUs without native bf16 (``kernels_avx2.cpp``: AVX2 + FMA).

Where the CPU has no bf16 dot products (AMD Zen 1-3, Intel before Cooper Lake / Sapphire Rapids),
the engine computes in float32 and its dense weights take 4 bytes each.  Decode is bound by reading
them, and MKL's float32 GEMM of a few rows is slow besides.  This kernel reads the weights as they
were stored, bf16 or the FP8 / INT8 / INT4 codes of a quantized export (2 or 1 bytes a weight), makes
each back into exactly the dense path's float32 weight in registers, and sums in float32 in its own
fixed order: within :data:`TOLERANCE` of the float64 product (checked per projection at load), and
batch-invariant (a row's sums do not depend on the other rows of its call).

Decode rows always go through it and prompt rows never do (``Projection.own_rounding``), so
neither kind of row changes its numbers with what shares its step; prompt rows take MKL's GEMM over weights
packed once, in calls of a fixed row count (:class:`MklTiles`), instead of float32 copies of the weights.

INT8 SmoothQuant (W8A8) exports take :class:`W8A8Weight` instead, for every row: the input's int8
codes times the weights' int8 codes summed as integers (exact in any order), scaled once.  Weight-only
INT8 and INT4 weights (W8A16, AWQ's W4A16) take integer products too, over inputs quantized per block
of 32 (:class:`W8A8Weight` blockwise, :class:`W4A8Weight`): a stated tolerance, as llama.cpp's Q8_0 /
Q4_0 dot products.  :class:`DecodeLayers` runs the decode rows' whole layers around these kernels in
one C++ call.

Where the CPU has AVX512-VNNI the same source is built a second time as ``rtk_vnni`` (:func:`library`), its
integer lane sums one ``vpdpbusd`` each with the same bits, INT8-SQ calls of many rows (prompt chunks) take
oneDNN's int8 GEMM over the codes in the export's order (:attr:`W8A8Weight.plain`), again the same bits, and
GEMV calls (one row too) and blockwise and INT4 calls of two rows or more run in 512-bit registers holding two
outputs each, every half doing lane for lane what the 256-bit kernel does: the same bits with half the instructions.
INT4 prompt rows take a layout of their own (:meth:`W4A8Weight.prompt`): the same integer block sums, the float sums
in another order, in AMX's int8 tiles where the CPU has AMX-INT8 (Intel Sapphire Rapids and later;
:func:`prompt_tiles`), else with 16 outputs in a 512-bit register's lanes (:func:`prompt_lanes`), the same bits.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..hostinfo import AMX_INT8_FLAGS, AVX2_KERNEL_FLAGS, VNNI_KERNEL_FLAGS
from . import kernels
from .checkpoint import fake_quant

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels_avx2.cpp")
# -ffp-contract=off: DecodeLayers' elementwise loops must round each float32 operation as torch does
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
CPU_FLAGS = AVX2_KERNEL_FLAGS
# The same source with the integer products' lane sums in one vpdpbusd (kernels_avx2.cpp, dot4_add) and the
# blockwise / INT4 products of many rows in 512-bit tiles (idot_wide, idot4_wide): the same bits, fewer
# instructions; built and preferred where the CPU has AVX512-VNNI (Intel Ice Lake,
# Cascade Lake and later, AMD Zen 4 and later).  RTK_VNNI=0 in the environment keeps the AVX2 build.
VNNI_FLAGS = [*FLAGS, "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni", "-mprefer-vector-width=256"]
# and AMX's int8 tiles, for INT4 prompt rows (w4a8_tiles), run only where the CPU has them (:func:`prompt_tiles`);
# elsewhere the VNNI build takes them with the same bits in 512-bit lanes (w4a8_lanes, :func:`prompt_lanes`)
VNNI_FLAGS += ["-mamx-tile", "-mamx-int8"]
VNNI_FLAGS.append("-DRTK_KERNELS_LIB=rtk_vnni")  # its own torch.ops namespace: both builds can be loaded
VNNI_CPU_FLAGS = VNNI_KERNEL_FLAGS
AMX_CPU_FLAGS = AMX_INT8_FLAGS
KINDS = {"bf16": 0, "int8": 1, "fp8": 2}
INT_KINDS = {"int8": 0, "int4": 4}  # DecodeLayers' integer path: w8a8 / w8a8_blockwise, or w4a8 (kW4)
# The kernel's sums against the float64 product, relative to the largest output: float32 rounding of a
# dot product of a few thousand terms is ~1e-6 of it; a layout or scale error is of the outputs' order.
TOLERANCE = 1e-4


def wants_vnni() -> bool:
    """Whether this host takes the VNNI build: its CPU has AVX512-VNNI and RTK_VNNI is not 0."""
    return os.environ.get("RTK_VNNI", "1") != "0" and kernels.cpu_has(VNNI_CPU_FLAGS)


@functools.cache
def library() -> str | None:
    """Build (first use on this host) and load the kernels; the ``torch.ops`` namespace they were loaded
    as (``rtk_vnni`` where :func:`wants_vnni`, else ``rtk_avx2``), None, logged, where they cannot be."""
    if not kernels.cpu_has(CPU_FLAGS):
        log.info("rtk's float32 decode GEMV needs AVX2 and FMA; this CPU lacks them, torch's operators run")
        return None
    if wants_vnni():
        if hasattr(torch.ops.rtk_vnni, "gemv") or kernels.build_and_load("rtk_vnni", SOURCE, VNNI_FLAGS):
            return "rtk_vnni"
        log.warning("rtk's VNNI kernels could not be built; the AVX2 build runs")
    if hasattr(torch.ops.rtk_avx2, "gemv") or kernels.build_and_load("rtk_avx2", SOURCE, FLAGS):
        return "rtk_avx2"
    return None


def available() -> bool:
    """Whether rtk's float32-engine kernels run on this host (:func:`library`)."""
    return library() is not None


@functools.cache
def _tiles_permitted() -> bool:
    """Whether Linux lets this process use AMX's tile data (asked once: ``rtk_vnni.tiles_available``)."""
    return bool(ops().tiles_available())


def prompt_tiles() -> bool:
    """Whether INT4 prompt rows take AMX's int8 tiles (:attr:`W4A8Weight.tiles`): the VNNI build runs, the CPU has
    AMX-INT8 (Intel Sapphire Rapids and later), Linux grants the tile data, and RTK_AMX is not 0."""
    return (
        os.environ.get("RTK_AMX", "1") != "0"
        and kernels.cpu_has(AMX_CPU_FLAGS)
        and library() == "rtk_vnni"
        and _tiles_permitted()
    )


def prompt_lanes() -> bool:
    """Whether INT4 prompt rows take the tiles' arithmetic in AVX512-VNNI's lanes (``w4a8_lanes``, the same bits as
    AMX's ``w4a8_tiles``): the VNNI build runs and :func:`prompt_tiles` does not."""
    return library() == "rtk_vnni" and not prompt_tiles()


@functools.cache
def ops():
    """The loaded kernels' operators (``torch.ops.rtk_vnni`` or ``torch.ops.rtk_avx2``)."""
    return getattr(torch.ops, library())


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for float32 ``x [B, V]`` (argmax_rows.h: the same indices, vectorized)."""
    return ops().argmax_rows(x)


def quantize_input(x: torch.Tensor, pre_quant_scale: torch.Tensor | None, act_kind: str | None, act_scale: float):
    """``fake_quant(x * pre_quant_scale, act_kind, act_scale)`` for float32 ``x`` (either step optional), in one
    pass with torch's bits."""
    return ops().quantize_input(x, pre_quant_scale, kernels.ACT_KINDS[act_kind], act_scale)


@dataclass
class Fp32Weight:
    """A projection's weights as stored, for :meth:`__call__`: ``x [rows, K]`` float32 -> ``[rows, N]``."""

    kind: str
    # [N, K]: bf16 bits (int16, in :func:`bf16_unpack_order`), int8 codes, or e4m3 bits (uint8)
    weights: torch.Tensor
    scales: torch.Tensor | None  # [N, groups] float32 (codes; FP8's times 2^120)

    @classmethod
    def pack(cls, dense: torch.Tensor, codes=None) -> Fp32Weight | None:
        """The compact form of the float32 ``dense [N, K]`` weights: their codes (``WeightCodes`` of every
        linear, concatenated: ``dense == codes * scale``), else bf16 where every weight is a bf16 value;
        None where neither holds (the dense path keeps them)."""
        n, k = dense.shape
        if k % 8:
            return None
        if codes is not None:
            kind, values, scale = codes
            scale = scale.to(torch.float32).reshape(n, -1)
            groups = scale.shape[1]
            if k % groups or (k // groups) % 8:
                return None
            if kind == "fp8":
                weights = values.view(torch.uint8).contiguous()
                scale = scale * 2.0**120  # the kernel's float32 view of e4m3 is 2^-120 of its value
            else:  # int8, and int4 values (-8..7) held one a byte
                weights = values.to(torch.int8).contiguous()
                kind = "int8"
            return cls(kind, weights, scale.contiguous())
        bf16 = dense.to(torch.bfloat16)
        if k % 16 or not torch.equal(bf16.to(torch.float32), dense):
            return None
        return cls("bf16", bf16_unpack_order(bf16.view(torch.int16)), None)

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * 4
        return self.weights.numel() * self.weights.element_size() + scales

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops().gemv(x, self.weights, KINDS[self.kind], self.scales, bias)

    def within(self, dense: torch.Tensor, bias: torch.Tensor | None, rows: int = 16) -> bool:
        """:func:`kernels.within_and_invariant` of the dense float32 weights and :data:`TOLERANCE`."""
        return kernels.within_and_invariant(self, dense, bias, TOLERANCE, torch.float32, rows)


MKL_TILE = 32  # the rows of every MklTiles call


@dataclass
class MklTiles:
    """A float32 projection's prompt rows through MKL's packed GEMM, in calls of exactly :data:`MKL_TILE` rows.

    ``F.linear`` (MKL's sgemm) packs the weights again on every call: at 16-32 rows that is most of its time
    (SmolLM2's layer at 24 rows: 3.6-3.9 ms against 1.0-1.2 packed once, Ice Lake, 2 threads;
    docs/engine-measurements.md). torch's ``mkl::_mkl_linear`` (pytorch/pytorch aten/src/ATen/native/mkldnn/Linear.cpp,
    what inductor's frozen float32 linears call) runs ``cblas_sgemm_compute`` over weights packed once, for the one row
    count they were packed for; so every call here has that many rows, the last padded with zeros, and a row's result
    should not depend on how many rows its call had: model.Projection's row probe checks that once per weight shape and
    keeps ``F.linear`` where it fails."""

    packed: torch.Tensor  # MKL's packed weights (an opaque mkldnn tensor)
    shape: torch.Tensor  # [N, K] float32 of stride 0: the call reads only the shape of the weights it packed

    @classmethod
    def pack(cls, dense: torch.Tensor) -> MklTiles | None:
        """From float32 ``dense [N, K]``; None where this torch has no MKL packing."""
        try:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(dense, MKL_TILE)
        except (AttributeError, RuntimeError) as exc:  # pragma: no cover - a torch built without MKL
            log.info("MKL's packed GEMM is not available (%s); prompt rows take F.linear", exc)
            return None
        return cls(packed, dense.new_zeros(()).expand(dense.shape))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops().mkl_tiles(x, self.packed, self.shape, bias, MKL_TILE)


def interleave_pairs(codes: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``[N, K]`` codes as ``rtk_avx2.w8a8`` reads them: outputs ``2p`` and ``2p + 1`` alternate in blocks of
    32 codes (``block``), so that the two outputs the kernel computes together stream as one sequence; an odd
    ``N``'s last output follows unchanged."""
    n, k = codes.shape
    even = n - n % 2
    pairs = codes[:even].reshape(even // 2, 2, k // block, block).transpose(1, 2).reshape(even, k)
    return torch.cat([pairs, codes[even:]])  # a new, contiguous tensor


# Within 16 bf16 weights, the order in which unpacking each 128-bit lane's low and high four words against zeros
# (vpunpcklwd / vpunpckhwd) yields weights 0-7 and 8-15 as float32: one instruction per 8 weights
UNPACK_ORDER = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])


def bf16_unpack_order(bits: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bf16 bits (int16, ``K`` a multiple of 16) as ``rtk_avx2.gemv`` reads them: each 16 of an output
    in :data:`UNPACK_ORDER`, outputs paired in blocks of 16 (:func:`interleave_pairs`), so that one 64-byte load
    holds an output pair's 16 weights and two unpacks make them float32 (kernels_avx2.cpp, dot_wide)."""
    n, k = bits.shape
    return interleave_pairs(bits.reshape(n, k // 16, 16)[:, :, UNPACK_ORDER].reshape(n, k), 16)


def quantize_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x [rows, K]`` float32 quantized and dequantized as ``rtk_avx2.w8a8_blockwise`` quantizes its input:
    per block of 32, scale ``max |x| / 127`` and codes ``round(x / scale)`` (a block of zeros stays zero)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    codes = torch.where(scale > 0, blocks / torch.where(scale > 0, scale, 1.0), 0.0).round().clamp(-128, 127)
    return (codes * scale).reshape(x.shape)


@dataclass
class W8A8Weight:
    """An INT8 projection as integers: ``x [rows, K]`` float32 (before its quantization) -> ``[rows, N]``.

    * INT8 SmoothQuant (``act_scale`` given): ``float(sum q * code) * (act_scale * scale[o])``, where ``q``
      are the input's codes as ``checkpoint.fake_quant`` computes them.  The dense path sums the dequantized
      products in float32; the integer sum is exact, so the result is within :data:`TOLERANCE` of the
      float64 product of the same values (checked at load).
    * Weight-only INT8 (W8A16, ``act_scale`` None; the LM head of ``quantization.quantize_lm_head``):
      ``blockwise``, the input quantized here per block of 32 (:func:`quantize_blocks`, as llama.cpp's
      Q8_0 activations), each block's integer sum scaled by its block's scale and summed in float32.  This
      is not the export's arithmetic, whose inputs stay float: on SmolLM2-135M's INT8-SQ export with an
      INT8 head it moved the perplexity by +0.13 % (one scale per row instead: +1.5 %), and it reads half
      the bytes of the float32 GEMV over the same codes with a fifth of its instructions (docs/engine-measurements.md).

    Either way a row's result depends on that row alone: prompt and decode rows both take it, in any
    batch or chunk.
    """

    codes: torch.Tensor  # [N, K] int8 in -127..127, pair-interleaved (:func:`interleave_pairs`)
    scales: torch.Tensor  # [N] float32: act_scale * the weights' scale per output (blockwise: the weights')
    act_scale: torch.Tensor | None  # the input's per-tensor scale (float32, 0-dim); None: blockwise
    # the same codes in the export's order, for oneDNN's int8 GEMM on calls of many rows (same bits; the VNNI
    # build's hosts, SmoothQuant only): a second byte a weight
    plain: torch.Tensor | None = None
    kind = "int8"  # its codes (INT_KINDS); not a field
    tiles = None  # prompt rows in the tiles' layout: INT4's only (W4A8Weight.tiles, W4A8Weight.amx)
    tile_scales = None  # and their scales (W4A8Weight.tile_scales)
    amx = False
    lanes = False  # (W4A8Weight.lanes)

    def __post_init__(self):
        # read once: the call is on every projection of every step
        self.act_scale_value = 0.0 if self.act_scale is None else float(self.act_scale)

    @property
    def blockwise(self) -> bool:
        return self.act_scale is None

    @classmethod
    def pack(cls, codes, act_scale: torch.Tensor | None) -> W8A8Weight | None:
        """From ``(kind, codes, scale)`` of the linears' weights (``model._stored_codes``) and the inputs'
        int8 scale (None: blockwise); None where the kernel cannot take them: not INT8 with one scale per
        output, ``K`` not a multiple of 32, or a code of -128 (vpmaddubsw's int16 pair sums need codes within
        -127..127)."""
        if codes is None:
            return None
        kind, values, scale = codes
        if kind != "int8" or scale.dim() != 1 or values.shape[1] % 32 or bool((values == -128).any()):
            return None
        scale = scale.to(torch.float32)
        act = None if act_scale is None else act_scale.to(torch.float32).reshape(())
        scales = scale if act is None else act * scale
        values = values.to(torch.int8)
        plain = values.contiguous() if act is not None and library() == "rtk_vnni" else None
        return cls(interleave_pairs(values), scales.contiguous(), act, plain)

    @property
    def nbytes(self) -> int:
        """Bytes a call of one row reads (``plain`` is read by calls of many rows only)."""
        return self.codes.numel() + self.scales.numel() * 4

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None, pre_quant_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``pre_quant_scale`` (float32 ``[K]``): the input's SmoothQuant scale, multiplied in as the input is
        quantized (the product rounded to float32 first: torch's ``x * pre_quant_scale`` bits, one pass)."""
        if self.act_scale is None:
            if pre_quant_scale is not None:
                x = x * pre_quant_scale
            return ops().w8a8_blockwise(x, self.codes, self.scales, bias)
        return ops().w8a8(x, self.act_scale_value, self.codes, self.scales, bias, pre_quant_scale, self.plain)

    def within(self, dense: torch.Tensor, bias: torch.Tensor | None, rows: int = 16) -> bool:
        """:func:`kernels.within_and_invariant` against the float64 product of the quantized inputs, on
        inputs spread over the int8 codes (about 40 steps of the scale per unit of ``randn``)."""
        if self.act_scale is None:
            return kernels.within_and_invariant(self, dense, bias, TOLERANCE, torch.float32, rows, quantize_blocks)
        spread = self.act_scale_value * 40.0

        def kernel(x, b):
            return self(x * spread, b)

        def quantize(x):
            return fake_quant(x * spread, "int8", self.act_scale)

        return kernels.within_and_invariant(kernel, dense, bias, TOLERANCE, torch.float32, rows, quantize)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int4 codes (-8..7) as ``rtk_avx2.w4a8`` reads them, ``[N, K / 2]`` uint8: per 64 inputs, 32 bytes
    holding ``code + 8`` of inputs ``j`` (low nibble) and ``j + 32`` (high), outputs ``2p`` and ``2p + 1``
    alternating 32 bytes by 32 bytes (an odd ``N``'s last output follows as it is)."""
    n, k = codes.shape
    nibbles = (codes.to(torch.int16) + 8).to(torch.uint8).reshape(n, k // 64, 2, 32)
    packed = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(n, k // 2)
    even = n - n % 2
    pairs = packed[:even].reshape(even // 2, 2, k // 64, 32).transpose(1, 2).reshape(even, k // 2)
    return torch.cat([pairs, packed[even:]])


def pack_tiles(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int4 codes (-8..7; ``N`` a multiple of 16, ``K`` of 32) as ``rtk_vnni.w4a8_tiles`` (and
    ``w4a8_lanes``) read them,
    ``[N / 16, K / 32, 256]`` uint8: per 16 outputs and block of 32 inputs, the 512 bytes of tdpbssd's B tile
    (byte ``64 kk + 4 o + i``: output ``o``'s input ``4 kk + i``) as nibbles ``code + 8``, bytes ``j`` (low) and
    ``j + 256`` (high) in byte ``j``."""
    n, k = codes.shape
    tile = (codes.to(torch.int16) + 8).to(torch.uint8).reshape(n // 16, 16, k // 32, 8, 4)
    tile = tile.permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 512)
    return (tile[:, :, :256] | (tile[:, :, 256:] << 4)).contiguous()


def pack_tile_scales(scales: torch.Tensor) -> torch.Tensor:
    """``[N, G]`` group scales (``N`` a multiple of 16) as ``rtk_vnni.w4a8_tiles`` and ``w4a8_lanes`` read them,
    ``[N / 16, G, 16]``: per 16 outputs (a tile of :func:`pack_tiles`), each group's 16 scales side by side."""
    n, groups = scales.shape
    return scales.reshape(n // 16, 16, groups).transpose(1, 2).contiguous()


@dataclass
class W4A8Weight:
    """An INT4 projection (AWQ, W4A16) as integer products: ``x [rows, K]`` float32 -> ``[rows, N]``.

    The input is quantized per block of 32 as :class:`W8A8Weight`'s blockwise inputs (:func:`quantize_blocks`),
    each block's products with the 4-bit codes summed as integers, times the block's scale, summed per
    weight group in float32 and times the group's scale: llama.cpp's Q4_0 x Q8_0 arithmetic with AWQ's
    groups.  Not the export's arithmetic (float inputs): a stated tolerance (``int4_gemv: "dot"``;
    docs/engine-measurements.md).  It reads half of INT8's bytes, and a row's result depends on that row alone, so
    prompt and decode rows both take it.  With the VNNI build the codes are packed again (:attr:`tiles`) for the
    same integer block sums with the float sums in another order, each block's once: where the CPU has AMX, prompt
    rows take them in its int8 tiles (:meth:`prompt`, ~3x faster at 64 rows) and decode rows ``w4a8``; elsewhere every
    row takes them in AVX512-VNNI's lanes (:attr:`lanes`), the tiles' bits."""

    codes: torch.Tensor  # [N, K / 2] uint8 (:func:`pack_nibbles`)
    scales: torch.Tensor  # [N, groups] float32
    # the codes again, for prompt rows in AMX's tiles or every row in VNNI's lanes (:func:`pack_tiles`,
    # :meth:`add_tiles`); None: every row w4a8
    tiles: torch.Tensor | None = None
    tile_scales: torch.Tensor | None = None  # :attr:`scales` for the tiles' kernels (:func:`pack_tile_scales`)
    amx: bool = False  # the tiles' kernel: AMX's (w4a8_tiles) or AVX512-VNNI's lanes (w4a8_lanes), the same bits
    plain = None  # no GEMM path: per-block input scales are not one integer GEMM (W8A8Weight.plain)
    kind = "int4"

    blockwise = True  # quantizes its input per block itself, as W8A8Weight without an input scale
    act_scale_value = 0.0

    @classmethod
    def pack(cls, codes) -> W4A8Weight | None:
        """From ``(kind, codes, scale)`` of the linears' weights (``model._stored_codes``); None where the kernel
        cannot take them: not INT4, or groups that are not a multiple of 64 inputs."""
        if codes is None:
            return None
        kind, values, scale = codes
        k = values.shape[1]
        if kind != "int4" or k % 64 or scale.dim() != 2 or (k // 64) % scale.shape[1]:
            return None
        return cls(pack_nibbles(values), scale.to(torch.float32).contiguous())

    def add_tiles(self, codes: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Pack ``codes`` (``[N, K]`` int4) for prompt rows where the VNNI build runs (:func:`prompt_tiles`,
        :func:`prompt_lanes`) and the shape allows (``N`` a multiple of 16) and the kernel is the float64 product
        within :data:`TOLERANCE` and batch-invariant (``dense``: the float32 weights); True where they are."""
        if not (prompt_tiles() or prompt_lanes()) or codes.shape[0] % 16:
            return False
        self.amx = prompt_tiles()
        self.tiles, self.tile_scales = pack_tiles(codes), pack_tile_scales(self.scales)
        if not kernels.within_and_invariant(self.prompt, dense, bias, TOLERANCE, torch.float32, 32, quantize_blocks):
            log.info("rtk's INT4 tile kernel is off the float32 product for %s; w4a8 takes every row", codes.shape[0])
            self.tiles, self.tile_scales, self.amx = None, None, False
        return self.tiles is not None

    @property
    def nbytes(self) -> int:
        """Bytes a call of one row reads (``codes`` or, in the lanes, ``tiles``: as many)."""
        return self.codes.numel() + self.scales.numel() * 4

    @property
    def lanes(self) -> bool:
        """Whether every row (decode rows too) takes ``w4a8_lanes``: :attr:`tiles` without AMX.  Over SmolLM2's INT4
        layers read from memory (AMD Zen 4, 2 threads) it took 0.91-1.04x w4a8's time at one row, 0.63-0.80x at 2-4
        rows and 0.52x at 64 (docs/engine-measurements.md, "INT4-AWQ rows in AVX512-VNNI's lanes"); one arithmetic for
        every row keeps a row's result its own, whatever its step holds."""
        return self.tiles is not None and not self.amx

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None, pre_quant_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        if pre_quant_scale is not None:
            x = x * pre_quant_scale
        if self.lanes:
            return ops().w4a8_lanes(x, self.tiles, self.tile_scales, bias)
        return ops().w4a8(x, self.codes, self.scales, bias)

    def prompt(
        self, x: torch.Tensor, bias: torch.Tensor | None, pre_quant_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Prompt rows: with AMX (:attr:`amx`), ``w4a8_tiles`` (the same quantized inputs and integer block sums,
        the float sums in another order), else as :meth:`__call__`."""
        if self.tiles is None or not self.amx:
            return self(x, bias, pre_quant_scale)
        if pre_quant_scale is not None:
            x = x * pre_quant_scale
        return ops().w4a8_tiles(x, self.tiles, self.tile_scales, bias)

    def within(self, dense: torch.Tensor, bias: torch.Tensor | None, rows: int = 16) -> bool:
        """:func:`kernels.within_and_invariant` against the float64 product of the block-quantized inputs."""
        return kernels.within_and_invariant(self, dense, bias, TOLERANCE, torch.float32, rows, quantize_blocks)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * F.rms_norm(x, (k,), eps=eps)`` on float32 ``x [rows, k]``, with its bits, in one call (torch's
    composite runs ~10 operators: ~210 us a call at 60 rows against ~20 here)."""
    return ops().rms_norm(x, weight, eps)


def decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode rows' attention over a paged pool (float32; bf16 too), the keys and values read where they lie.

    ``q [rows, heads, head_dim]`` float32; ``k_pool``, ``v_pool`` one layer's ``[slots, kv_heads, head_dim]``;
    row ``r`` attends to ``slots[bounds[r, 0] : bounds[r, 1]]``.  Returns ``[rows, heads * head_dim]``.
    Each row is computed alone in one fixed order (batch-invariant), within float32 rounding of SDPA
    (``decode_attention.h`` says how)."""
    return ops().decode_attention(q, k_pool, v_pool, slots, bounds, scale)


class DecodeLayers:
    """A float32 engine's decode rows through whole decoder layers in one C++ call (``kernels_avx2.cpp``).

    The float32 counterpart of ``kernels.DecodeLayers``: RMSNorm, RoPE, the K/V writes into a float32 paged
    pool, float32 attention (:func:`decode_attention`), residual adds and SiLU around the projections'
    kernels (:class:`Fp32Weight`, :class:`W8A8Weight`), with the operator path's bits; no KV-cache
    quantization.
    """

    def __init__(self, heads, kv_heads, head_dim, eps, scale, cos, sin):
        self._layers = getattr(torch.classes, library()).DecodeLayers(
            heads, kv_heads, head_dim, float(eps), float(scale), cos, sin
        )
        self.takes_prompt_rows = True  # every projection takes prompt rows so far (forward_rows)

    def add_layer(self, input_norm: torch.Tensor, post_norm: torch.Tensor) -> None:
        self._layers.add_layer(input_norm, post_norm)

    def set_tile_decode_rows(self, rows: int) -> None:
        """INT4 projections with AMX tiles take a step's rows through them where it has at least ``rows`` rows, else
        through w4a8, decode and prompt rows alike (``decode_batching: full``, as ``model.Projection`` without
        ``singles``): a row's last bits then depend on its step.  0 (the default): decode rows w4a8, prompt rows
        tiles."""
        self._layers.set_tile_decode_rows(rows)

    def add_projection(self, proj, prompt_rows: bool = True) -> None:
        """A :class:`toolkit.runtime.model.Projection` with ``fp32_gemv`` or ``int_products`` (qkv, o, gate_up, down).

        ``prompt_rows``: a GEMV projection also takes prompt rows, through MKL (:class:`MklTiles`, else over its float32
        weights) as ``Projection`` does when its rows are batch-invariant (the engine's default); integer products
        always do."""
        if proj.int_products is not None:
            w = proj.int_products
            self._layers.add_projection(
                True,
                w.codes,
                INT_KINDS[w.kind],
                w.scales,
                w.act_scale_value,
                proj.bias,
                proj.pre_quant_scale,
                0,
                None,
                None,
                1,
                False,
                w.blockwise,
                w.plain,
                0,
                w.tiles,
                w.tile_scales,
                w.amx,
                False,
            )
            return
        g = proj.fp32_gemv
        act = None if proj.act_scale is None else proj.act_scale.to(torch.float32).reshape(())
        act_kind = kernels.ACT_KINDS[proj.act_kind]  # the same codes as rtk's AVX512 kernels
        tiles = proj.mkl_tiles if prompt_rows else None
        if tiles is not None:
            dense = tiles.packed
        elif prompt_rows and proj.weight is not None and proj.weight.dtype == torch.float32:
            dense = proj.weight
        else:
            dense = None
        gemv_rows = prompt_rows and proj.gemv_prompt_rows  # the GEMV takes them too (Projection.gemv_prompt_rows)
        self.takes_prompt_rows = self.takes_prompt_rows and (dense is not None or gemv_rows)
        pad_rows = proj.min_rows if proj.single_rows else 1  # Projection._padded's zero rows
        self._layers.add_projection(
            False,
            g.weights,
            KINDS[g.kind],
            g.scales,
            0.0,
            proj.bias,
            proj.pre_quant_scale,
            act_kind,
            act,
            dense,
            pad_rows,
            not proj.fused_input,  # quantize_input off torch's bits for it (checked at load): ATen's operators
            False,
            None,
            0 if tiles is None else MKL_TILE,
            None,
            None,
            False,
            gemv_rows,
        )

    def forward(
        self, h, positions, write_slots, ctx_slots, ctx_bounds, pool, begin: int, end: int, padded=None, mask=None
    ) -> torch.Tensor:
        """As ``kernels.DecodeLayers.forward``, for float32 ``h`` and a float32 ``pool``."""
        return self._layers.forward(
            h, positions, write_slots, ctx_slots, ctx_bounds, pool.k, pool.v, begin, end, padded, mask
        )

    def forward_rows(self, h, plan, pool, begin: int, end: int) -> torch.Tensor:
        """Every row of a step with prompt rows (a ``model.StepPlan``) through layers ``[begin, end)`` in one call,
        where every projection takes them (:attr:`takes_prompt_rows`): decode rows as :meth:`forward`'s, prompt
        rows through each projection as ``model.Projection`` takes them (W8A8, else MKL: :class:`MklTiles`, or
        the float32 weights) and the SDPA calls of the operator path (``model.Transformer._layers``), so with its
        bits."""
        B = plan.num_decode
        empty = torch.empty(0, dtype=torch.int64)
        ctx = plan.decode_slots if B else empty
        bounds = torch.tensor(plan.decode_bounds, dtype=torch.int64) if B else empty.view(0, 2)
        return self._layers.forward_rows(
            h, B, plan.positions, plan.write_slots, ctx, bounds, pool.k, pool.v, begin, end, *plan.prompt_tensors()
        )
