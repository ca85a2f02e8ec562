"""Memory on 2 MiB pages for the buffers a decode step streams: the decode kernels' weights and the K/V pool.

A decode step reads every weight once (~135 MB for SmolLM2-135M's INT8-SQ export with its head) and, from
memory, the context's keys and values.  On 4 KiB pages that is a TLB miss every 4 KiB, and the hardware
prefetchers stop at every page boundary.  Linux backs memory advised with ``MADV_HUGEPAGE`` with 2 MiB
transparent huge pages where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``
(madvise(2)).  torch's allocator can do the same (``THP_MEM_ALLOC_ENABLE=1``), but for every allocation
of the process, and only if set before its first large one; here the engine advises just its own buffers.
Where huge pages are off or the advice fails, the memory is ordinary pages and nothing else changes.
"""

from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each packed tensor starts on a cache line


def empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory as a ``uint8`` tensor, advised for huge pages from its first 2 MiB boundary
    (the tensor keeps the mapping alive).  Every page is written here, so no step pays the first touch:
    anonymous memory is mapped at its first write, and the K/V pool's blocks reach a new page of every layer
    together (SmolLM2's float32 pool: one prompt step in ~25 took 450-600 ms, against ~110, on the AMX host)."""
    out = _advised(nbytes)
    out.zero_()
    return out


def _advised(nbytes: int) -> torch.Tensor:
    """``nbytes`` of anonymous memory (zero-filled, mapped at its first write) advised for huge pages."""
    size = nbytes + HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = (-whole.data_ptr()) % HUGE_PAGE  # the mapping is page-aligned, so is this
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, size - start)
    except (AttributeError, OSError) as exc:  # not Linux, or a kernel without THP
        log.debug("huge pages not advised (%s); ordinary pages", exc)
    return whole[start : start + nbytes]


def pack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (same dtype, shape and values, contiguous) in one advised region; the copies write
    every page of it (the gaps between them are under a cache line), so it is not zeroed first."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    region = _advised(total)
    out = []
    for t, o in zip(tensors, offsets, strict=True):
        view = region[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out
