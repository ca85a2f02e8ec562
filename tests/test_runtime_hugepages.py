"""runtime/hugepages.py: the engine's streamed buffers on 2 MiB pages, with the same values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from toolkit.hostinfo import transparent_hugepages
from toolkit.runtime import hugepages


def rollup_kb(field: str) -> int:
    """This process's ``field`` (``Rss``, ``AnonHugePages``) in kB, from /proc/self/smaps_rollup."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def anon_huge_kb() -> int:
    return rollup_kb("AnonHugePages")


def test_pack_copies_every_tensor_exactly_each_on_a_cache_line():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(-127, 128, (960, 576), generator=g, dtype=torch.int8),
        torch.randn(77, 40, generator=g).to(torch.bfloat16).view(torch.int16),
        torch.randn(3, generator=g),
    ]
    packed = hugepages.pack(tensors)
    for a, b in zip(tensors, packed, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous() and torch.equal(a, b)
        assert b.data_ptr() % hugepages.ALIGN == 0
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1  # one region


def test_empty_is_zeroed_and_starts_on_a_huge_page():
    t = hugepages.empty(5 << 20)
    assert t.dtype == torch.uint8 and t.numel() == 5 << 20 and int(t.count_nonzero()) == 0
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0


def test_empty_is_resident_before_its_first_use():
    """Every page is written at allocation, so no engine step pays the first touch of the K/V pool's pages."""
    before = rollup_kb("Rss")
    t = hugepages.empty(32 << 20)
    assert rollup_kb("Rss") - before >= 30 << 10
    del t


@pytest.mark.skipif(
    transparent_hugepages() not in ("always", "madvise"),
    reason=f"transparent huge pages are {transparent_hugepages()} here",
)
def test_the_advice_gives_huge_pages_where_the_kernel_allows_them():
    before = anon_huge_kb()
    t = hugepages.empty(16 << 20)
    t.fill_(1)  # fault the pages in
    assert anon_huge_kb() - before >= 8 << 10  # most of 16 MiB on 2 MiB pages (fragmentation may deny some)


def test_a_bf16_engines_gemv_weights_lie_in_one_advised_region(tiny_llama_dir):
    """The decode GEMV's packed weights (bf16 and the codes of a quantized export) are moved into one region advised
    for huge pages; ``huge_pages: false`` leaves each where it was made, and the logits do not change."""
    from toolkit.runtime import kernels
    from toolkit.runtime.engine import Engine, EngineConfig

    if not kernels.available():
        pytest.skip("rtk's bf16 kernels need AVX512-BF16 and a compiler")
    base = dict(max_batch_size=2, max_num_tokens=64, max_input_len=64, max_seq_len=128, tokens_per_block=16)
    engines = [Engine(tiny_llama_dir, EngineConfig(**base, huge_pages=on)) for on in (True, False)]
    regions = []
    for engine in engines:
        model = engine.model
        packed = [p.gemv for p in [model.lm_head, *model.projections] if p.gemv is not None]
        assert len(packed) == len(model.projections) + 1  # every projection's decode rows run rtk's GEMV here
        regions.append({t.untyped_storage().data_ptr() for t in packed})
    assert len(regions[0]) == 1 and len(regions[1]) == len(engines[1].model.projections) + 1
    ids = list(range(5, 15))  # 10 rows: through the GEMV (the tiny model's shapes give every row count its bits)
    assert torch.equal(engines[0].prompt_logits(ids), engines[1].prompt_logits(ids))
