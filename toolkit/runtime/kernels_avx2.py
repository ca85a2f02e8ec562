"""rtk's decode GEMV for CPUs without native bf16 (``kernels_avx2.cpp``: AVX2 + FMA).

Where the CPU has no bf16 dot products (AMD Zen 1-3, Intel before Cooper Lake / Sapphire Rapids),
the engine computes in float32 and its dense weights take 4 bytes each.  Decode is bound by reading
them, and MKL's float32 GEMM of a few rows is slow besides.  This kernel reads the weights as they
were stored, bf16 or the FP8 / INT8 / INT4 codes of a quantized export (2 or 1 bytes a weight), makes
each back into exactly the dense path's float32 weight in registers, and sums in float32 in its own
fixed order: within :data:`TOLERANCE` of the float64 product (checked per projection at load), and
batch-invariant (a row's sums do not depend on the other rows of its call).

Decode rows always go through it and prompt rows never do (``Projection.codes_own_rounding``), so
neither kind of row changes its numbers with what shares its step.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from . import kernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels_avx2.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
CPU_FLAGS = ("avx2", "fma")
KINDS = {"bf16": 0, "int8": 1, "fp8": 2}
# The kernel's sums against the float64 product, relative to the largest output: float32 rounding of a
# dot product of a few thousand terms is ~1e-6 of it; a layout or scale error is of the outputs' order.
TOLERANCE = 1e-4


@functools.cache
def available() -> bool:
    """Build (first use on this host) and load the kernel; False, logged, where it cannot be."""
    if hasattr(torch.ops.rtk_avx2, "gemv"):
        return True
    if not kernels.cpu_has(CPU_FLAGS):
        log.info("rtk's float32 decode GEMV needs AVX2 and FMA; this CPU lacks them, torch's operators run")
        return False
    return kernels.build_and_load("rtk_avx2", SOURCE, FLAGS)


@dataclass
class Fp32Weight:
    """A projection's weights as stored, for :meth:`__call__`: ``x [rows, K]`` float32 -> ``[rows, N]``."""

    kind: str
    weights: torch.Tensor  # [N, K]: bf16 bits (int16), int8 codes, or e4m3 bits (uint8)
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
        if not torch.equal(bf16.to(torch.float32), dense):
            return None
        return cls("bf16", bf16.view(torch.int16).contiguous(), None)

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * 4
        return self.weights.numel() * self.weights.element_size() + scales

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.rtk_avx2.gemv(x, self.weights, KINDS[self.kind], self.scales, bias)

    def within(self, dense: torch.Tensor, bias: torch.Tensor | None, rows: int = 16) -> bool:
        """:func:`kernels.within_and_invariant` of the dense float32 weights and :data:`TOLERANCE`."""
        return kernels.within_and_invariant(self, dense, bias, TOLERANCE, torch.float32, rows)
