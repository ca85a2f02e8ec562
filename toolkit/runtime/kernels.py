"""rtk's CPU kernels (``kernels.cpp``) for the decode step, each bit-identical to what it replaces.

* ``gemv``: bf16 matmul of up to a few rows.  oneDNN's one-row bf16 kernel read SmolLM2's layer
  weights at ~18 GB/s on the development host (2 threads) against ~31 GB/s for a plain read; this
  kernel reads them at ~30 GB/s with the same arithmetic (:func:`agrees` checks it per weight shape
  at load), and computes each row of a multi-row call exactly as a one-row call.
* ``gather_kv``: K and V of a paged-cache layer at the given slots, bf16 -> float32 in one pass
  (for float32 attention; two index_select and two conversions otherwise).

They are compiled once per host with torch's C++ extension builder (g++ with AVX512-BF16, about
10 s) into rtk's cache and loaded as ``torch.ops.rtk_kernels``.  Where that is impossible (no
AVX512-BF16, no compiler, a build error) :func:`available` is False and the engine keeps torch's
operators.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-ffp-contract=off"]


def cpu_has_avx512_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags and " avx512bw" in flags and " avx512vl" in flags


def build_dir() -> Path:
    """``$XDG_CACHE_HOME/rtk/kernels/<source hash>-<torch version>``: a changed source or torch rebuilds."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "rtk" / "kernels" / f"kernels-{key}-torch{torch.__version__.replace('+', '_')}"


@functools.cache
def available() -> bool:
    """Build (first use on this host) and load the kernel; False, logged, where it cannot be."""
    if hasattr(torch.ops.rtk_kernels, "gemv"):
        return True
    if not cpu_has_avx512_bf16():
        log.info("rtk's bf16 GEMV kernel needs AVX512-BF16; this CPU lacks it, oneDNN computes one-row matmuls")
        return False
    if not SOURCE.is_file():
        log.warning("rtk's bf16 GEMV kernel source %s is missing; oneDNN computes one-row matmuls", SOURCE)
        return False
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    # torch's builder runs ninja from PATH: the one installed beside this interpreter (pip's ninja) counts
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        cpp_extension.load(
            name="rtk_kernels",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(out),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build or load failure means: keep oneDNN
        log.warning("rtk's bf16 GEMV kernel could not be built in %s (%s); oneDNN computes one-row matmuls", out, exc)
        return False
    finally:
        os.environ["PATH"] = path
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bf16 weight -> the kernel's blocked layout (``[ceil(N/64), K/2, 64, 2]``)."""
    return torch.ops.rtk_kernels.pack(weight.contiguous())


def gemv(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [1, K]`` bf16 -> ``[1, out_features]`` bf16: ``x W^T + bias``."""
    return torch.ops.rtk_kernels.gemv(x, packed, out_features, bias)


def agrees(reference, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, rows: int = 64) -> bool:
    """True when the kernel gives ``reference(x)``'s bits (oneDNN's one-row call) on ``rows`` random rows,
    called one row at a time and all rows at once."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, packed.shape[1] * 2, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        expected = torch.cat([reference(x[i : i + 1]) for i in range(rows)])
        one = torch.cat([gemv(x[i : i + 1], packed, out_features, bias) for i in range(rows)])
        return torch.equal(one, expected) and torch.equal(gemv(x, packed, out_features, bias), expected)


def gather_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``slots`` (1-D) of bf16 ``k`` and ``v`` (``[S, ...]``) as float32, in one pass."""
    ko, vo = torch.ops.rtk_kernels.gather_kv(k, v, slots)
    return ko, vo
