"""Paged KV cache bookkeeping: allocation, reference counts, prefix keys, LRU eviction; pool storage."""

from __future__ import annotations

import pytest
import torch

from toolkit.runtime.kv_cache import BlockManager, KVPool, KVQuant, OutOfBlocks, block_key


def keys_for(tokens: list[int], tpb: int) -> list[bytes]:
    keys, parent = [], b""
    for i in range(len(tokens) // tpb):
        parent = block_key(parent, tokens[i * tpb : (i + 1) * tpb])
        keys.append(parent)
    return keys


def test_block_key_depends_on_the_whole_prefix():
    a = keys_for([1, 2, 3, 4, 5, 6], 2)
    b = keys_for([9, 2, 3, 4, 5, 6], 2)
    assert a[0] != b[0]
    assert a[1] != b[1] and a[2] != b[2]  # same tokens in the block, different history
    assert keys_for([1, 2, 3, 4, 5, 6], 2) == a


def test_allocate_release_and_exhaustion():
    bm = BlockManager(3, 4)
    got = [bm.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and bm.num_available == 0
    with pytest.raises(OutOfBlocks):
        bm.allocate()
    bm.release(got[1])
    assert bm.num_available == 1 and bm.allocate() == got[1]
    with pytest.raises(AssertionError):
        bm.release(got[0]), bm.release(got[0])


def test_prefix_reuse_shares_blocks_and_keeps_them_in_lru():
    bm = BlockManager(4, 2)
    keys = keys_for([1, 2, 3, 4], 2)
    a = [bm.allocate(), bm.allocate()]
    for b, k in zip(a, keys, strict=False):
        bm.register(b, k)
    assert bm.match_prefix(keys) == a
    assert bm.match_prefix(keys_for([1, 2, 9, 9], 2)) == a[:1]
    # a second sequence takes references: the blocks are shared, not copied
    for b in a:
        bm.acquire(b)
    bm.release_all(a)  # first sequence finishes
    assert bm.num_used == 2
    bm.release_all(a)  # second one too: the blocks stay cached but count as available
    assert bm.num_used == 0 and bm.stats()["blocks_cached"] == 2 and bm.num_available == 4
    assert bm.match_prefix(keys) == a
    assert bm.stats()["blocks_reused_total"] == 2


def test_lru_evicts_least_recently_released_tail_first():
    bm = BlockManager(3, 1)
    keys = keys_for([7, 8], 1)
    a = [bm.allocate(), bm.allocate()]
    for b, k in zip(a, keys, strict=False):
        bm.register(b, k)
    bm.release_all(a)  # released tail first: the tail is the oldest LRU entry
    fresh = bm.allocate()  # the never-used block goes first
    assert fresh not in a
    evicted = bm.allocate()
    assert evicted == a[1]  # the tail, so the head of the prefix stays reusable
    assert bm.match_prefix(keys) == [a[0]]
    assert bm.stats()["blocks_evicted_total"] == 1


def test_register_ignores_duplicates_and_disabled_reuse():
    bm = BlockManager(3, 2)
    k = keys_for([1, 2], 2)[0]
    x, y = bm.allocate(), bm.allocate()
    bm.register(x, k)
    bm.register(y, k)  # same prefix computed twice: the first block keeps the key
    assert bm.match_prefix([k]) == [x]
    bm.release(y)
    assert bm.stats()["blocks_cached"] == 0  # y was not registered: back to the free list
    off = BlockManager(2, 2, enable_reuse=False)
    b = off.allocate()
    off.register(b, k)
    assert off.match_prefix([k]) == []


@pytest.mark.parametrize("kind", [None, "fp8", "int8"])
def test_pool_write_gather_roundtrip(kind):
    scales = (0.05, 0.04)
    quant = KVQuant(kind, [scales[0]], [scales[1]]) if kind else None
    pool = KVPool(1, num_blocks=4, tokens_per_block=4, kv_heads=2, head_dim=8, dtype=torch.bfloat16, quant=quant)
    torch.manual_seed(0)
    k = torch.randn(5, 2, 8).to(torch.bfloat16)
    v = torch.randn(5, 2, 8).to(torch.bfloat16)
    slots = torch.tensor([13, 2, 7, 0, 15])
    pool.write(0, slots, k, v)
    gk, gv = pool.gather(0, slots)
    assert gk.dtype == torch.bfloat16 and gk.shape == (5, 2, 8)
    if kind is None:
        assert torch.equal(gk, k) and torch.equal(gv, v)
        assert pool.nbytes == 2 * 16 * 2 * 8 * 2
        return
    # stored as 1-byte codes of x / scale; the error is what the format allows at that scale
    assert pool.k.element_size() == 1 and pool.nbytes == 2 * 16 * 2 * 8
    for got, want, s in ((gk, k, scales[0]), (gv, v, scales[1])):
        err = (got.float() - want.float()).abs()
        bf16_step = want.float().abs() * 2**-8
        bound = (
            s / 2 if kind == "int8" else want.float().abs() * 2**-4 + s * 2**-9
        ) + bf16_step  # fp8: + subnormal step
        assert (err <= bound).all()
        assert not torch.equal(got, want)
