"""rtk's CPU kernels (``kernels.cpp``) for the decode step, each bit-identical to what it replaces
except the INT4 group sums (``int4-dot``), which are held to the float32 product within a tolerance.

* ``gemv``: bf16 matmul of up to a few rows.  oneDNN's one-row bf16 kernel read SmolLM2's layer
  weights at ~18 GB/s on the development host (2 threads) against ~31 GB/s for a plain read; this
  kernel reads them at ~30 GB/s with the same arithmetic (:func:`agrees` checks it per weight shape
  at load), and computes each row of a multi-row call exactly as a one-row call.
* ``gemv_q``: the same GEMV reading 8-bit (INT8, FP8) or 4-bit (INT4) weight codes and their
  float32 scales, each weight made back into the dense path's ``bf16(float(code) * scale)`` in
  registers (per-tensor FP8: looked up in a per-block table of the 128 bf16 magnitudes), so its
  results are the bf16 GEMV's bits with a half / a quarter of the bytes read
  (:func:`QuantizedWeight.agrees` checks the weights and the products at load).  INT4-AWQ by
  default instead sums code x activation per group of inputs and scales each group's sum
  (``int4-dot``: no per-weight conversion, ~2.5x faster; :func:`QuantizedWeight.within` checks it
  against the float32 product and for batch invariance at load).
* ``quantize_input``: ``pre_quant_scale`` and the FP8 / INT8 activation quantize-dequantize of a
  projection's input in one pass (eight torch operators otherwise), with torch's bits.
* ``gather_kv``: K and V of a paged-cache layer at the given slots, bf16 -> float32 in one pass
  (for float32 attention; two index_select and two conversions otherwise).
* ``DecodeLayers``: the decode rows' whole decoder layers in one call, the ~30 small operators per
  layer between the GEMVs done in C++ with the operators' bits (:class:`DecodeLayers`); a step's prompt rows
  too, through oneDNN's GEMM as the operator path calls it.
* ``decode_attention``: decode rows' attention over the bf16 pool, read where it lies
  (``decode_attention.h``, shared with the float32 engines' ``kernels_avx2``): not SDPA's bits, within
  float32 rounding of them; the operator path and ``DecodeLayers`` both run it.
* ``sdpa_decode``: torch's SDPA for decode rows over their gathered contexts with SDPA's bits, every row
  and head in one call (``sdpa_decode.h``): the ``sdpa`` attention without SDPA's cost per call, where
  :func:`sdpa_decode_agrees`.

They are compiled once per host with torch's C++ extension builder (g++ with AVX512-BF16 and
AVX512-VBMI, about 10 s) into rtk's cache and loaded as ``torch.ops.rtk_kernels``.  Where that is
impossible (a CPU without them, no compiler, a build error) :func:`available` is False and the
engine keeps torch's operators.  A CPU without AVX512-BF16 runs a float32 engine, whose decode GEMV
is :mod:`toolkit.runtime.kernels_avx2` (built the same way, by :func:`build_and_load`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import hostinfo

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
# -mfma: decode_attention.h's 256-bit multiply-adds (explicit intrinsics; -ffp-contract=off below keeps the rest
# unfused)
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vbmi", "-mfma"]
FLAGS.append("-fopenmp")
FLAGS.append("-ffp-contract=off")  # no fused multiply-adds: every product and sum rounded as torch rounds it
# sdpa_decode.h: ATen's Vectorized<float> as torch's AVX512 kernels compile it (16 lanes; needs AVX512DQ)
FLAGS += ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
# AMX's bf16 tiles for the GEMVs (kernels.cpp, tile_blocks), run only where the CPU has them (:func:`gemv_tiles`)
FLAGS += ["-mamx-tile", "-mamx-bf16"]
AMX_CPU_FLAGS = hostinfo.AMX_BF16_FLAGS
CPU_FLAGS = hostinfo.BF16_KERNEL_FLAGS


def cpu_has(flags: tuple[str, ...]) -> bool:
    """True when /proc/cpuinfo lists every one of ``flags``."""
    return set(flags) <= hostinfo.cpu_flags()  # looked up at each call (tests stand in other CPUs' flags)


def cpu_supports_kernels() -> bool:
    """True when this CPU has what kernels.cpp is compiled for (:data:`CPU_FLAGS`: AVX512-BF16, -VBMI, -DQ, ...)."""
    return cpu_has(CPU_FLAGS)


def build_dir(source: Path = SOURCE, flags: list[str] = FLAGS) -> Path:
    """``$XDG_CACHE_HOME/rtk/kernels/<stem>-<hash>-<torch version>``: a changed source, a changed header it
    includes from its own directory (``#include "name.h"``), other flags or another torch rebuilds."""
    text = source.read_bytes()
    headers = [source.parent / name.decode() for name in re.findall(rb'^#include "([^"]+)"', text, re.M)]
    key = hashlib.sha256(b"".join([text, *(h.read_bytes() for h in headers), " ".join(flags).encode()]))
    key = key.hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "rtk" / "kernels" / f"{source.stem}-{key}-torch{torch.__version__.replace('+', '_')}"


# torch's builder holds ``<build dir>/lock`` while it compiles and waits, without a timeout, for any lock it
# finds; a build that was killed leaves its lock behind.  A build takes 15-60 s on 2 cores.
STALE_LOCK_SECONDS = 300


def clear_stale_lock(build: Path) -> None:
    """Remove the build lock a killed build left (older than :data:`STALE_LOCK_SECONDS`), so that loading the
    kernels does not wait for it forever."""
    lock = build / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def build_and_load(name: str, source: Path, flags: list[str]) -> bool:
    """Compile ``source`` (first use on this host) into rtk's cache and load it as ``torch.ops.<name>``;
    False, logged, where it cannot be (no compiler, a build error): the engine keeps torch's operators."""
    if not source.is_file():
        log.warning("rtk's kernel source %s is missing; torch's operators run", source)
        return False
    from torch.utils import cpp_extension

    out = build_dir(source, flags)
    out.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(out)
    # torch's builder runs ninja from PATH: the one installed beside this interpreter (pip's ninja) counts
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(out),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build or load failure means: keep torch's operators
        log.warning("rtk's kernels %s could not be built in %s (%s); torch's operators run", source.name, out, exc)
        return False
    finally:
        os.environ["PATH"] = path
    return True


@functools.cache
def available() -> bool:
    """Build (first use on this host) and load the kernel; False, logged, where it cannot be."""
    if not hasattr(torch.ops.rtk_kernels, "gemv"):
        if not cpu_supports_kernels():
            log.info("rtk's CPU kernels need %s; this CPU lacks some, torch's operators run", ", ".join(CPU_FLAGS))
            return False
        if not build_and_load("rtk_kernels", SOURCE, FLAGS):
            return False
    gemv_tiles()
    return True


@functools.cache
def gemv_tiles() -> bool:
    """Whether rtk's GEMVs run in AMX's bf16 tiles (kernels.cpp, ``tile_blocks``): the CPU has AMX-BF16 (Intel
    Sapphire Rapids and later), Linux grants the tile data, and RTK_AMX is not 0.  There every row of a call gets
    oneDNN's one-row bits, as tdpbf16ps sums them, where the AVX512 GEMV rounds its own way (``model.Projection``),
    and reads bf16 weights at the memory's speed for one row as for many; elsewhere the AVX512 GEMV runs."""
    loaded = hasattr(torch.ops.rtk_kernels, "gemv")
    return bool(torch.ops.rtk_kernels.set_gemv_tiles(wants_gemv_tiles())) if loaded else False


def tiles_take(in_features: int) -> bool:
    """Whether a GEMV over ``in_features`` inputs runs in AMX's tiles here (:func:`gemv_tiles`, a multiple of 32)."""
    return in_features % 32 == 0 and available() and gemv_tiles()


def wants_gemv_tiles() -> bool:
    """Whether :func:`gemv_tiles` asks for AMX's tiles: the CPU has AMX-BF16 and RTK_AMX is not 0."""
    return os.environ.get("RTK_AMX", "1") != "0" and cpu_has(AMX_CPU_FLAGS)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bf16 weight -> the kernel's blocked layout (``[ceil(N/64), K/2, 64, 2]``)."""
    return torch.ops.rtk_kernels.pack(weight.contiguous())


def gemv(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [1, K]`` bf16 -> ``[1, out_features]`` bf16: ``x W^T + bias``."""
    return torch.ops.rtk_kernels.gemv(x, packed, out_features, bias)


def agrees(reference, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, rows: int = 64) -> bool:
    """True when the kernel gives ``reference(x)``'s bits (oneDNN's one-row call) on ``rows`` random rows,
    called one row at a time and all rows at once (false where oneDNN runs its AMX kernel: see
    ``model.Projection``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, packed.shape[1] * 2, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        expected = torch.cat([reference(x[i : i + 1]) for i in range(rows)])
        one = torch.cat([gemv(x[i : i + 1], packed, out_features, bias) for i in range(rows)])
        return torch.equal(one, expected) and torch.equal(gemv(x, packed, out_features, bias), expected)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for float32 ``x [B, V]`` (argmax_rows.h: the same indices, vectorized)."""
    return torch.ops.rtk_kernels.argmax_rows(x)


def gather_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``slots`` (1-D) of bf16 ``k`` and ``v`` (``[S, ...]``) as float32, in one pass."""
    ko, vo = torch.ops.rtk_kernels.gather_kv(k, v, slots)
    return ko, vo


def decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`toolkit.runtime.kernels_avx2.decode_attention` for a bf16 engine: ``k_pool`` and ``v_pool`` bf16
    (each value widened exactly to float32 as it is read) or float32; ``q`` float32."""
    return torch.ops.rtk_kernels.decode_attention(q, k_pool, v_pool, slots, bounds, scale)


def sdpa_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [rows, H, D]`` float32 -> ``[rows, H * D]``, each row torch's SDPA of that row alone over its keys
    (``sdpa_decode.h``).  Without ``slots``, ``k``, ``v`` are gathered float32 rows ``[keys, KVH, D]``, row ``r``'s
    at ``bounds[r, 0] : bounds[r, 1]``; with ``slots``, they are the paged pool ``[slots, KVH, D]`` (bf16 or
    float32) and row ``r``'s keys lie at ``slots[bounds[r, 0] : bounds[r, 1]]``."""
    return torch.ops.rtk_kernels.sdpa_decode(q, k, v, slots, bounds, scale)


SDPA_CHECK_KEYS = (1, 5, 16, 17, 66, 300, 513, 1100)  # vector tails, one block and two (of 512 keys)


@functools.cache
def sdpa_decode_agrees(heads: int, kv_heads: int, head_dim: int) -> bool:
    """True when :func:`sdpa_decode` gives torch's SDPA bits (the engine's call for a lone decode row) on random
    rows of :data:`SDPA_CHECK_KEYS` keys, alone and in one call, gathered and read from a bf16 pool, with this
    process's thread count (its buffers' places follow the thread count at each call, as torch's do; tests cover
    other counts).  False where they
    part: another torch, another BLAS, torch dispatching to other than its AVX512 kernels; the engine then
    calls SDPA itself."""
    if not available() or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    g = torch.Generator().manual_seed(0)
    keys = torch.tensor(SDPA_CHECK_KEYS)
    q = torch.randn(len(keys), heads, head_dim, generator=g) * 3
    k, v = (torch.randn(int(keys.sum()), kv_heads, head_dim, generator=g).bfloat16().float() for _ in range(2))
    bounds = torch.stack([keys.cumsum(0) - keys, keys.cumsum(0)], 1)
    scale = head_dim**-0.5
    with torch.inference_mode():
        want = [
            torch.nn.functional.scaled_dot_product_attention(
                q[i].view(1, heads, 1, head_dim),
                k[s:e].transpose(0, 1)[None],
                v[s:e].transpose(0, 1)[None],
                scale=scale,
                enable_gqa=kv_heads != heads,
            ).view(1, -1)
            for i, (s, e) in enumerate(bounds.tolist())
        ]
        alone = [sdpa_decode(q[i : i + 1], k, v, bounds[i : i + 1], scale) for i in range(len(q))]
        same = torch.equal(sdpa_decode(q, k, v, bounds, scale), torch.cat(want))
        same = same and all(torch.equal(a, b) for a, b in zip(alone, want, strict=True))
        # the same keys as a bf16 pool in shuffled slots, as the engine reads them
        slots = torch.randperm(len(k), generator=g)
        k_pool, v_pool = (torch.empty_like(t, dtype=torch.bfloat16).index_copy_(0, slots, t.bfloat16()) for t in (k, v))
        same = same and torch.equal(sdpa_decode(q, k_pool, v_pool, bounds, scale, slots), torch.cat(want))
    if not same:
        log.info("rtk's sdpa_decode parts from torch's SDPA on this host; SDPA runs the decode rows")
    return same


QUANT_KINDS = {"int8": 0, "fp8": 1, "int4": 2, "fp8-table": 3, "int4-dot": 4}
# int4-dot's products against the float32 ones, relative to the largest output: its own error is the
# bf16 output rounding (2^-9 of a value; 2-4e-3 of the largest measured on SmolLM2's shapes); a layout
# or scale error would be of the order of the outputs themselves
INT4_DOT_TOLERANCE = 1e-2
# rtk's bf16 GEMV against the float product, where it does not give oneDNN's one-row bits (oneDNN's AMX
# kernel sums in another order): its own error is the bf16 rounding of each output (2^-9 of a value)
GEMV_TOLERANCE = 4e-3
ACT_KINDS = {None: 0, "fp8": 1, "int8": 2}


@dataclass
class QuantizedWeight:
    """Codes and scales packed for :func:`gemv_q`: ``weight == bf16(float(code) * scale)``.

    ``codes``: ``[N, K]`` int8 (``int8``; ``int4`` values in -8..7) or the raw bits of float8_e4m3fn
    (``fp8``); ``scale``: float32 per output ``[N]``, or per output and group of inputs ``[N, K / g]``.
    FP8 codes whose every 64-output block has one scale (per-tensor FP8) are packed as ``fp8-table``:
    per block, a table of the 128 bf16 magnitudes that the kernel looks the codes up in.
    """

    kind: str
    out_features: int
    codes: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def pack(cls, kind: str, codes: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
        """``kind``: ``int8``, ``fp8``, ``int4`` (the dense path's bits) or ``int4-dot`` (group sums scaled)."""
        if kind == "int4-dot":
            packed = torch.ops.rtk_kernels.pack_q(codes.contiguous(), QUANT_KINDS[kind])
            scales = torch.ops.rtk_kernels.pack_group_scales(scale.to(torch.float32).contiguous())
            return cls(kind, codes.shape[0], packed, scales)
        if kind == "fp8":
            codes = codes.view(torch.uint8)
            block_scales = _block_scales(scale.to(torch.float32))
            if block_scales is not None:
                packed = torch.ops.rtk_kernels.pack_q(codes.contiguous(), QUANT_KINDS["fp8-table"])
                return cls("fp8-table", codes.shape[0], packed, torch.ops.rtk_kernels.fp8_tables(block_scales))
            scale = scale.to(torch.float32) * 2.0**120  # the kernel's float32 view of e4m3 is 2^-120 of its value
        packed = torch.ops.rtk_kernels.pack_q(codes.contiguous(), QUANT_KINDS[kind])
        scales = torch.ops.rtk_kernels.pack_scales(scale.to(torch.float32).contiguous())
        return cls(kind, codes.shape[0], packed, scales)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def weight(self) -> torch.Tensor:
        """The bf16 ``[N, K]`` weights the kernel computes with."""
        return torch.ops.rtk_kernels.unpack_q(self.codes, self.scales, QUANT_KINDS[self.kind], self.out_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.rtk_kernels.gemv_q(x, self.codes, self.scales, QUANT_KINDS[self.kind], self.out_features, bias)

    def within(self, exact: torch.Tensor, bias: torch.Tensor | None, rows: int = 16) -> bool:
        """For ``int4-dot``, which does not give the dense path's bits: :func:`within_and_invariant` of the
        float32 weights ``exact`` (``codes * scale``) and ``INT4_DOT_TOLERANCE``, on bf16 rows."""
        return within_and_invariant(self, exact, bias, INT4_DOT_TOLERANCE, torch.bfloat16, rows)

    def agrees(self, weight: torch.Tensor, reference, bias: torch.Tensor | None, rows: int = 16) -> bool:
        """True when the kernel's weights are ``weight`` (bf16) exactly and it gives ``reference(x)``'s bits
        (the bf16 one-row product) on ``rows`` random rows, one at a time and all at once."""
        if not torch.equal(self.weight(), weight):
            return False
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, weight.shape[1], generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            expected = torch.cat([reference(x[i : i + 1]) for i in range(rows)])
            one = torch.cat([self(x[i : i + 1], bias) for i in range(rows)])
            return torch.equal(one, expected) and torch.equal(self(x, bias), expected)


def within_and_invariant(
    kernel, exact: torch.Tensor, bias, tolerance: float, dtype: torch.dtype, rows: int = 16, quantize=None
) -> bool:
    """True when ``kernel(x, bias)`` is the float64 product ``x exact^T + bias`` within ``tolerance`` of the
    outputs' largest magnitude on ``rows`` random rows of ``dtype``, and every row alone gives the bits it
    gets with the others (batch invariance): the check at load of a kernel that rounds its own way.
    ``quantize``: what the kernel does to its input first (the product is then ``quantize(x) exact^T``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, exact.shape[1], generator=g).to(dtype)
    with torch.inference_mode():
        xe = x if quantize is None else quantize(x)
        ref = xe.double() @ exact.double().t() + (0 if bias is None else bias.double())
        got = kernel(x, bias)
        one = torch.cat([kernel(x[i : i + 1], bias) for i in range(rows)])
    err = (got.double() - ref).abs().max().item()
    return torch.equal(one, got) and err <= tolerance * ref.abs().max().item()


def _block_scales(scale: torch.Tensor) -> torch.Tensor | None:
    """The one scale of each 64-output block, or None where a block's outputs have different scales."""
    if scale.dim() != 1:
        return None
    n = scale.shape[0]
    padded = torch.cat([scale, scale[-1:].expand(-(-n // 64) * 64 - n)]).view(-1, 64)  # padding: no codes
    return padded[:, 0].contiguous() if bool((padded == padded[:, :1]).all()) else None


def quantize_input(
    x: torch.Tensor, pre_quant_scale: torch.Tensor | None, act_kind: str | None, act_scale: float
) -> torch.Tensor:
    """``fake_quant(x * pre_quant_scale, act_kind, act_scale)`` for bf16 ``x`` (either step optional), in one pass."""
    return torch.ops.rtk_kernels.quantize_input(x, pre_quant_scale, ACT_KINDS[act_kind], act_scale)


KV_KINDS = {None: 0, "fp8": 1, "int8": 2}


class DecodeLayers:
    """Decode rows through whole decoder layers in one C++ call (``kernels.cpp``, 5).

    It runs what ~30 torch operators per layer do around the GEMVs (RMSNorm, RoPE, K/V writes into
    the paged pool, float32 attention over each row's own context, residual adds, SiLU), with the
    projections through :func:`gemv` / :func:`gemv_q` and :func:`quantize_input` as the operator
    path calls them, and gives the operator path's bits: elementwise steps are single correctly
    rounded operations done by hand (16 lanes at a time, rows split across threads in steps of many rows),
    RMSNorm's sum, the attention and SiLU are ATen's own operators called from C++ (no Python between them).
    Each row attends alone, as decode batching "exact"; with :meth:`set_pool_attention`, through
    :func:`decode_attention` over its context where it lies (as the operator path does then), else gathered and
    through SDPA.  A step with prompt rows takes the same call (:meth:`forward_rows`): prompt rows through
    oneDNN's GEMM (in its tiles where the library's calls are cut into tiles) and SDPA per attention unit, as the
    operator path computes them.
    """

    def __init__(self, heads, kv_heads, head_dim, eps, scale, kv_kind, cos, sin):
        self._layers = torch.classes.rtk_kernels.DecodeLayers(
            heads, kv_heads, head_dim, float(eps), float(scale), KV_KINDS[kv_kind], cos, sin
        )
        self.takes_prompt_rows = True  # every projection added so far takes prompt rows (forward_rows)

    def set_pool_attention(self, on: bool) -> None:
        """Decode rows attend through :func:`decode_attention` over the bf16 pool (``Transformer.pool_attention``)."""
        self._layers.set_pool_attention(bool(on))

    def set_sdpa_decode(self, on: bool) -> None:
        """Decode rows attend through :func:`sdpa_decode`, SDPA's bits in one call (``Transformer.sdpa_decode``)."""
        self._layers.set_sdpa_decode(bool(on))

    def add_layer(self, input_norm: torch.Tensor, post_norm: torch.Tensor, k_scale: float, v_scale: float) -> None:
        self._layers.add_layer(input_norm, post_norm, float(k_scale), float(v_scale))

    def add_projection(self, proj, prompt_rows: bool = True, full: bool = False) -> None:
        """A :class:`toolkit.runtime.model.Projection` with rtk's GEMV (qkv, o, gate_up, down in this order).

        ``prompt_rows``: it also takes a step's prompt rows as ``Projection`` does when rows are batch-invariant
        (the engine's default): through oneDNN's GEMM over its packed weights (else ``F.linear``'s), calls of
        fewer than its ``min_rows`` padded, and where the library's calls are cut into tiles (oneDNN's AMX GEMM:
        ``tile_rows``), cut and padded the same way.  ``full`` (``decode_batching: full``): as ``Projection``
        without ``singles``, a call by its row count (:attr:`~toolkit.runtime.model.Projection.full_gemv_rows`),
        decode rows too.  Where the projection dropped the library's copy (``library_free``: AMX's tiles give the
        library's bits for every call), every call goes through rtk's GEMV."""
        q = proj.quant
        prompt_rows = prompt_rows and (proj.packed is not None or proj.weight is not None or proj.library_free)
        self.takes_prompt_rows = self.takes_prompt_rows and prompt_rows
        self._layers.add_projection(
            proj.gemv,
            q.codes if q else None,
            q.scales if q else None,
            QUANT_KINDS[q.kind] if q else 0,
            proj.codes_max_rows,
            proj.out_features,
            proj.bias,
            proj.pre_quant_scale,
            ACT_KINDS[proj.act_kind],
            proj.act_scale_value,
            proj.packed if prompt_rows else None,
            proj.weight if prompt_rows and proj.packed is None else None,
            proj.min_rows,
            proj.own_rounding,
            proj.whole_gemv_rows,
            (proj.tile_rows or 0) if prompt_rows and not proj.library_free else 0,
            proj.pad_rows,
            proj.full_gemv_rows if prompt_rows and full else 0,
            proj.library_free,
        )

    def forward(
        self, h, positions, write_slots, ctx_slots, ctx_bounds, pool, begin: int, end: int, padded=None, mask=None
    ) -> torch.Tensor:
        """``h [rows, hidden]`` bf16 after layers ``[begin, end)``; row ``r`` writes its K/V at ``write_slots[r]``
        and attends to ``ctx_slots[ctx_bounds[r, 0]:ctx_bounds[r, 1]]`` of ``pool`` (a ``KVPool``), or, given
        ``padded`` slots ``[rows, L]`` and their ``mask`` ``[rows, 1, 1, L]``, all rows in one masked call."""
        return self._layers.forward(
            h, positions, write_slots, ctx_slots, ctx_bounds, pool.k, pool.v, begin, end, padded, mask
        )

    def forward_rows(self, h, plan, pool, begin: int, end: int) -> torch.Tensor:
        """Every row of a step with prompt rows (a ``model.StepPlan``) through layers ``[begin, end)`` in one call,
        where every projection takes them (:attr:`takes_prompt_rows`): decode rows as :meth:`forward`'s (with the
        plan's padded contexts where it has them), prompt rows through each projection as ``model.Projection``
        takes them and the SDPA calls of the operator path (``model.Transformer._layers``), so with its bits."""
        B = plan.num_decode
        empty = torch.empty(0, dtype=torch.int64)
        ctx = plan.decode_slots if B else empty
        bounds = torch.tensor(plan.decode_bounds, dtype=torch.int64) if B else empty.view(0, 2)
        padded, mask = (plan.decode_padded, plan.decode_mask) if B else (None, None)
        rows = (plan.positions, plan.write_slots, ctx, bounds, pool.k, pool.v, begin, end, padded, mask)
        return self._layers.forward_rows(h, B, *rows, *plan.prompt_tensors())
