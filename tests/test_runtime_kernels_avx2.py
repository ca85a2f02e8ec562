"""rtk's float32 decode GEMV for CPUs without native bf16 (runtime/kernels_avx2.cpp), against float64
products and transformers' float32 model.

It reads weights as stored (bf16, or an export's FP8 / INT8 / INT4 codes) and sums in its own order:
within a stated tolerance of the exact product, never dependent on the other rows of its call.
"""

from __future__ import annotations

import pytest
import torch

from toolkit.runtime import kernels_avx2
from toolkit.runtime.checkpoint import Linear, WeightCodes
from toolkit.runtime.engine import Engine
from toolkit.runtime.model import Projection

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not kernels_avx2.available(), reason="rtk's AVX2 GEMV needs AVX2 and FMA and a compiler"),
]

SHAPES = [(960, 576), (64, 1536), (77, 40)]  # fused qkv, a down projection, odd outputs and a K of 5 chunks


def weights(kind: str, n: int, k: int, g: torch.Generator):
    """Dense float32 weights and, for codes, ``(kind, codes, scale)`` with ``dense == codes * scale``."""
    if kind == "bf16":
        return torch.randn(n, k, generator=g).to(torch.bfloat16).float(), None
    if kind == "fp8":
        codes = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)  # normals and subnormals
        scale = torch.full((n,), 0.013)
    elif kind == "int8":
        codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) * 0.01
    else:  # int4, groups of 8 inputs (K = 40 has 5)
        codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, k // 8, generator=g) * 0.1
    dense = codes.float() * (scale[:, None] if scale.dim() == 1 else scale.repeat_interleave(8, dim=1))
    return dense, (kind, codes, scale)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "int8", "int4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_products_are_the_float64_ones_within_the_tolerance_and_rows_never_depend_on_the_batch(kind, shape):
    g = torch.Generator().manual_seed(1)
    n, k = shape
    dense, codes = weights(kind, n, k, g)
    packed = kernels_avx2.Fp32Weight.pack(dense, codes)
    assert packed is not None and packed.kind == ("int8" if kind == "int4" else kind)
    bias = torch.randn(n, generator=g)
    x = torch.randn(9, k, generator=g)
    ref = x.double() @ dense.double().t() + bias.double()
    got = packed(x, bias)
    assert (got.double() - ref).abs().max() <= kernels_avx2.TOLERANCE * ref.abs().max()
    # every row alone, in pairs, and all nine together: the same bits
    assert torch.equal(torch.cat([packed(x[i : i + 1], bias) for i in range(9)]), got)
    assert torch.equal(torch.cat([packed(x[i : i + 2], bias) for i in range(0, 9, 2)]), got)
    assert packed.within(dense, bias)


def test_weights_it_cannot_hold_exactly_are_left_to_the_dense_path():
    g = torch.Generator().manual_seed(2)
    assert kernels_avx2.Fp32Weight.pack(torch.randn(8, 64, generator=g), None) is None  # not bf16 values
    assert kernels_avx2.Fp32Weight.pack(torch.randn(8, 60, generator=g).bfloat16().float(), None) is None  # K % 8
    # a layout or scale error is caught by the check at load
    dense, (_, codes, scale) = weights("int8", 16, 64, g)
    assert not kernels_avx2.Fp32Weight.pack(dense, ("int8", codes, scale * 2)).within(dense, None)


def test_a_float32_projection_reads_the_codes_for_decode_rows_and_mkl_for_prompt_rows():
    g = torch.Generator().manual_seed(3)
    dense, (_, codes, scale) = weights("int8", 96, 64, g)
    lin = Linear(weight=dense, codes=WeightCodes(bits=8, codes=codes, scale=scale))
    proj = Projection([lin], torch.float32, pack=False, gemv_kernel=True)
    assert proj.kernel == "rtk-avx2-int8" and proj.codes_own_rounding
    assert proj.nbytes == 96 * 64 + 96 * 4  # a byte a weight and the scales, not 4 bytes a weight
    x = torch.randn(5, 64, generator=g)
    kernel, rows_seen = proj.fp32_gemv, []

    def counted(rows, bias):
        rows_seen.append(rows.shape[0])
        return kernel(rows, bias)

    proj.fp32_gemv = counted
    with torch.inference_mode():
        y = proj(x, singles=2)  # two decode rows, three prompt rows
        prompt_alone = proj(x[2:], singles=0)
    assert rows_seen == [2]  # the prompt rows never reach the kernel
    assert torch.equal(y[:2], kernel(x[:2], None))
    assert torch.equal(y[2:], prompt_alone)
    assert (y[2:] - x[2:] @ dense.t()).abs().max() <= 1e-5 * y.abs().max()
    assert Projection([lin], torch.float32, pack=False, gemv_kernel=False).fp32_gemv is None


def test_float32_engine_greedy_tokens_equal_transformers_float32(tiny_llama_dir):
    from test_runtime_engine import config, greedy, hf_greedy, prompt, run, tokens, transformers_model

    hf = transformers_model(tiny_llama_dir, dtype=torch.float32)
    eng = Engine(tiny_llama_dir, config(dtype="float32", decode_batching="attention"))
    assert {p.kernel for layer in eng.model.layers for p in layer.qkv.parts} == {"rtk-avx2-bf16"}
    assert eng.model.lm_head.kernel == "rtk-avx2-bf16"
    reqs = [greedy(prompt(n, 300 + n)) for n in (1, 23, 90)]
    for r in reqs:
        assert eng.generate(r) == hf_greedy(hf, r.prompt_ids, r.max_new_tokens)
    ids, events, _ = run(eng, reqs, arrivals={1: 2, 2: 4})  # decode rows share GEMV calls
    assert [tokens(events[i]) for i in ids] == [eng.generate(r) for r in reqs]
