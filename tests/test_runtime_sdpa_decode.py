"""SDPA's bits for every decode row in one call (``kernels.sdpa_decode``; runtime/sdpa_decode.h).

The op reproduces torch's own CPU SDPA for one query row, so the reference is torch's SDPA itself, called as the
engine (and transformers, for a lone decode) calls it, compared bit for bit: several head layouts, key counts on
either side of its 16-lane vectors and its 512-key blocks, one to three threads (its buffers' places, and so its
bits, follow the thread count).  An engine with it gives the logits of an engine that calls SDPA per row.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_runtime_engine import config, prompt
from test_runtime_fused_decode import forced_logits

from toolkit.runtime import kernels
from toolkit.runtime.engine import Engine

pytestmark = pytest.mark.skipif(
    not kernels.available() or torch.backends.cpu.get_cpu_capability() != "AVX512",
    reason="sdpa_decode reproduces torch's AVX512 SDPA, on hosts with rtk's bf16 kernels (AVX512-BF16)",
)

LENGTHS = [1, 7, 16, 33, 255, 512, 513, 1100]  # one key; vector tails; one, two and three blocks of 512


def rows(heads, kv_heads, head_dim, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.tensor(lengths)
    q = torch.randn(len(lengths), heads, head_dim, generator=g) * 3
    k, v = (torch.randn(int(keys.sum()), kv_heads, head_dim, generator=g).bfloat16().float() for _ in range(2))
    return q, k, v, torch.stack([keys.cumsum(0) - keys, keys.cumsum(0)], 1)


def as_pool(k, v, seed=0):
    """k and v as a bf16 paged pool: their rows at shuffled slots among unused ones, and those slots."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(len(k) + 64, generator=g)[: len(k)]
    pool = (torch.randn(len(k) + 64, *k.shape[1:], generator=g).bfloat16() for _ in range(2))
    k_pool, v_pool = (p.index_copy_(0, slots, t.bfloat16()) for p, t in zip(pool, (k, v), strict=True))
    return k_pool, v_pool, slots


def sdpa_per_row(q, k, v, bounds):
    """model.py's SDPA call for each decode row over its own keys (transformers' call for a lone decode)."""
    heads, head_dim = q.shape[1:]
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[i].view(1, heads, 1, head_dim),
                k[s:e].transpose(0, 1)[None],
                v[s:e].transpose(0, 1)[None],
                scale=head_dim**-0.5,
                enable_gqa=k.shape[1] != heads,
            ).view(1, -1)
            for i, (s, e) in enumerate(bounds.tolist())
        ]
    )


@pytest.fixture(params=[1, 2, 3], ids=lambda t: f"{t}-threads")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 24), (8, 8, 128), (32, 8, 128)])
def test_every_row_has_sdpas_bits_alone_and_together(threads, heads, kv_heads, head_dim):
    for seed in range(3):
        q, k, v, bounds = rows(heads, kv_heads, head_dim, LENGTHS, seed)
        want = sdpa_per_row(q, k, v, bounds)
        got = kernels.sdpa_decode(q, k, v, bounds, head_dim**-0.5)
        diff = (got != want).nonzero()[:4].tolist()
        assert torch.equal(got, want), f"seed {seed}: differs at (row, element) {diff}"
        k_pool, v_pool, slots = as_pool(k, v, seed)  # read where the rows lie in a bf16 pool, as the engine does
        assert torch.equal(kernels.sdpa_decode(q, k_pool, v_pool, bounds, head_dim**-0.5, slots), want)
        for i in (0, 5, 7):  # a row alone: its numbers do not depend on the others
            alone = kernels.sdpa_decode(q[i : i + 1], k, v, bounds[i : i + 1], head_dim**-0.5)
            assert torch.equal(alone, want[i : i + 1])


def test_sdpas_bits_follow_the_thread_count_and_so_do_its_own():
    """Why the op places its buffers as torch's threads would: torch's SDPA itself gives other bits for some heads
    with 2 threads than with 1 (MKL's sgemm rounds an output that starts off a 64-byte boundary another way, and
    torch's buffer for its second thread starts at keys + 2 + head_dim floats, on the AMD Zen 4 host; on an Intel
    AMX host, 2026-12-05, MKL gave both counts the same bits); the op follows each count."""
    assert kernels.sdpa_decode_agrees(9, 3, 64)
    q, k, v, bounds = rows(9, 3, 64, [7, 33, 255, 300])
    before = torch.get_num_threads()
    try:
        by_threads = {}
        for t in (1, 2):
            torch.set_num_threads(t)
            by_threads[t] = sdpa_per_row(q, k, v, bounds)
            assert torch.equal(kernels.sdpa_decode(q, k, v, bounds, 0.125), by_threads[t])
    finally:
        torch.set_num_threads(before)


def test_bad_input_is_refused_by_name():
    q, k, v, bounds = rows(9, 3, 64, [5, 9])
    with pytest.raises(RuntimeError, match="sdpa_decode: a row's key range is out of bounds"):
        kernels.sdpa_decode(q, k, v, torch.tensor([[0, 5], [5, 15]]), 0.125)
    with pytest.raises(RuntimeError, match="sdpa_decode: k and v must be"):
        kernels.sdpa_decode(q, k.bfloat16(), v.bfloat16(), bounds, 0.125)
    with pytest.raises(RuntimeError, match="sdpa_decode: heads must be a multiple of kv_heads"):
        kernels.sdpa_decode(q[:, :8], k, v, bounds, 0.125)
    k_pool, v_pool, slots = as_pool(k, v)
    with pytest.raises(RuntimeError, match="sdpa_decode: a context slot is out of range"):
        kernels.sdpa_decode(q, k_pool, v_pool, bounds, 0.125, torch.where(slots == slots[3], len(k_pool), slots))
    with pytest.raises(RuntimeError, match="sdpa_decode: a K/V pool must be"):
        kernels.sdpa_decode(q, k_pool.half(), v_pool.half(), bounds, 0.125, slots)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "operators"])
def test_an_engine_with_it_gives_the_logits_of_sdpa_per_row(tiny_llama_dir, fused, monkeypatch):
    """A bf16 engine takes it by default (``decode_attention`` auto / sdpa); ``RTK_SDPA_DECODE=0`` keeps one SDPA
    call per row.  Decode steps of rows of several lengths, fed the same tokens: the same logits, bit for bit."""
    eng = Engine(tiny_llama_dir, config(fused_decode=fused))
    assert eng.model.sdpa_decode and not eng.model.pool_attention and (eng.model.fused is not None) == fused
    assert "decode attention SDPA's bits in one call" in eng.model.kernels  # the line the served model logs
    monkeypatch.setenv("RTK_SDPA_DECODE", "0")
    per_row = Engine(tiny_llama_dir, config(fused_decode=fused))
    assert not per_row.model.sdpa_decode
    prompts = [prompt(n, seed) for n, seed in [(3, 1), (17, 2), (40, 3)]]
    forced = [prompt(12, seed) for seed in (4, 5, 6)]
    steps = zip(forced_logits(eng, prompts, forced), forced_logits(per_row, prompts, forced), strict=True)
    for step, (a, b) in enumerate(steps):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max().item()}"
