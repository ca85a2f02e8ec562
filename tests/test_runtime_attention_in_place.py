"""Decode attention read in place on bf16 engines (``decode_attention: in_place``; runtime/decode_attention.h).

The kernel itself is held to a float64 softmax and to SDPA's own error in test_runtime_kernels_avx2.py (float32
pools); here: a bf16 pool gives exactly the numbers of its float32 widening, both libraries compile the same
arithmetic, and a bf16 engine that attends in place keeps every other property of its decode rows (fused step ==
operators, rows independent of the batch) while its greedy tokens stay transformers' up to bf16 ties.
"""

from __future__ import annotations

import pytest
import torch
from conftest import greedy_ties_taken
from test_runtime_engine import config, greedy, hf_greedy, prompt, transformers_model
from test_runtime_kernels_avx2 import attention_float64, decode_logits_unpadded_and_padded, pool_and_rows

from toolkit.errors import UsageError
from toolkit.runtime import kernels, kernels_avx2
from toolkit.runtime.engine import Engine

pytestmark = [
    pytest.mark.skipif(not kernels.available(), reason="a bf16 engine with rtk's kernels needs AVX512-BF16"),
    pytest.mark.usefixtures("one_torch_thread"),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 24), (8, 8, 128)])
def test_a_bf16_pool_gives_its_float32_widenings_numbers_in_both_libraries(heads, kv_heads, head_dim):
    q, k_pool, v_pool, slots, bounds = pool_and_rows(heads, kv_heads, head_dim, [1, 7, 66, 513])
    kb, vb = k_pool.bfloat16(), v_pool.bfloat16()
    scale = head_dim**-0.5
    got = kernels.decode_attention(q, kb, vb, slots, bounds, scale)
    assert torch.equal(got, kernels.decode_attention(q, kb.float(), vb.float(), slots, bounds, scale))
    if kernels_avx2.available():  # the float32 engines' build of decode_attention.h: the same arithmetic
        assert torch.equal(got, kernels_avx2.decode_attention(q, kb.float(), vb.float(), slots, bounds, scale))
    want = attention_float64(q, kb.float(), vb.float(), slots, bounds, scale)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        kernels.decode_attention(q, kb.half(), vb.half(), slots, bounds, scale)


def in_place(**kw):
    return config(decode_attention="in_place", **kw)


def test_only_in_place_takes_it_on_a_bf16_engine_and_sdpa_turns_it_off_on_a_float32_one(tiny_llama_dir):
    assert not Engine(tiny_llama_dir, config()).model.pool_attention  # auto: transformers' SDPA, its bits
    eng = Engine(tiny_llama_dir, in_place())
    assert eng.model.pool_attention and eng.model.fused is not None
    assert not Engine(tiny_llama_dir, in_place(cpu_kernels=False)).model.pool_attention  # no kernel: SDPA
    if kernels_avx2.available():
        f32 = Engine(tiny_llama_dir, config(dtype="float32"))
        assert f32.model.pool_attention and f32.model.fused is not None
        sdpa = Engine(tiny_llama_dir, config(dtype="float32", decode_attention="sdpa"))
        assert not sdpa.model.pool_attention and sdpa.model.fused is None  # the fused float32 step attends in place
    with pytest.raises(UsageError, match="decode_attention"):
        Engine(tiny_llama_dir, config(decode_attention="fast"))


@pytest.mark.parametrize("fused", [True, False])
def test_a_rows_numbers_never_depend_on_the_decode_batching(tiny_llama_dir, fused):
    """With attention in place a padded, masked plan ("attention" batching) gives the unpadded plan's bits, and
    the engine builds no padded plan."""
    eng = Engine(tiny_llama_dir, in_place(decode_batching="attention", fused_decode=fused))
    assert (eng.model.fused is not None) == fused
    a, b = decode_logits_unpadded_and_padded(eng)
    assert torch.equal(a, b)


def test_greedy_tokens_are_transformers_up_to_bf16_ties(tiny_llama_dir):
    """transformers' greedy tokens, but where two bf16 logits tie (or lie one bf16 step apart) either may be
    taken: the kernel sums in another order than SDPA, so the attention's last float32 bits, and now and then a
    bf16 rounding after them, differ."""
    hf_model = transformers_model(tiny_llama_dir)  # bf16, SDPA on float32 q/k/v: the sdpa path's bits
    eng = Engine(tiny_llama_dir, in_place())
    ties = same = 0
    for n, seed in [(3, 11), (17, 12), (64, 13), (120, 14)]:
        ids = prompt(n, seed)
        out = eng.generate(greedy(ids))
        ties += greedy_ties_taken(hf_model, ids, out)
        same += out == hf_greedy(hf_model, ids)
    assert ties <= 2 and same >= 2  # nearly always transformers' very tokens
