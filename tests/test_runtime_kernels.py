"""rtk's CPU kernels (toolkit/runtime/kernels.cpp): the bf16 GEMV against oneDNN's one-row kernel, the
K/V gather against index_select.

The engine may use them only because they compute the bits of what they replace (oneDNN's one-row
kernel is what transformers' bf16 decode runs here), so every comparison is exact: SmolLM2's
shapes, a reduction longer than one 512-wide chunk, output counts that are not a multiple of the
64-output block, a bias, and several rows in one call.
"""

from __future__ import annotations

import pytest
import torch

from toolkit.runtime import kernels
from toolkit.runtime.checkpoint import Linear
from toolkit.runtime.model import Projection, bf16_is_fast

pytestmark = pytest.mark.skipif(
    not (bf16_is_fast() and kernels.cpu_has_avx512_bf16()), reason="the kernel needs AVX512-BF16"
)


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.available(), "the kernel failed to build or load (see the log)"


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@pytest.mark.parametrize(
    "shape",
    [(960, 576), (3072, 576), (576, 1536), (49152, 576), (100, 64), (200, 1100), (16, 2048)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_gives_onednns_bits(shape, threads):
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    weight = torch.randn(*shape, generator=g).to(torch.bfloat16)
    packed = kernels.pack(weight)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(8):
            x = torch.randn(1, shape[1], generator=g).to(torch.bfloat16)
            assert torch.equal(kernels.gemv(x, packed, shape[0], None), onednn(x, weight, None))
    finally:
        torch.set_num_threads(before)


def test_gemv_with_bias():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 576, generator=g).to(torch.bfloat16)
    bias = torch.randn(200, generator=g).to(torch.bfloat16)
    packed = kernels.pack(weight)
    for _ in range(8):
        x = torch.randn(1, 576, generator=g).to(torch.bfloat16)
        assert torch.equal(kernels.gemv(x, packed, 200, bias), onednn(x, weight, bias))


def test_projection_uses_gemv_for_one_row_only():
    g = torch.Generator().manual_seed(4)
    lin = Linear(weight=torch.randn(960, 576, generator=g))
    proj = Projection([lin], torch.bfloat16, pack=True, gemv_kernel=True)
    plain = Projection([lin], torch.bfloat16, pack=True, gemv_kernel=False)
    assert proj.gemv is not None and plain.gemv is None
    x = torch.randn(5, 576, generator=g).to(torch.bfloat16)
    assert torch.equal(proj(x[:1]), plain(x[:1]))
    assert torch.equal(proj(x), plain(x))  # more rows: oneDNN on both sides


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (200, 1100)])
def test_every_row_of_a_multi_row_call_gets_the_one_row_bits(shape):
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(*shape, generator=g).to(torch.bfloat16)
    packed = kernels.pack(weight)
    x = torch.randn(11, shape[1], generator=g).to(torch.bfloat16)
    many = kernels.gemv(x, packed, shape[0], None)
    assert many.shape == (11, shape[0])
    for i in range(11):
        assert torch.equal(many[i : i + 1], onednn(x[i : i + 1], weight, None))


def test_gather_kv_is_index_select_then_float():
    g = torch.Generator().manual_seed(6)
    k = torch.randn(300, 3, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(300, 3, 64, generator=g).to(torch.bfloat16)
    slots = torch.randint(0, 300, (257,), generator=g)
    ko, vo = kernels.gather_kv(k, v, slots)
    assert ko.dtype == torch.float32 and ko.shape == (257, 3, 64)
    assert torch.equal(ko, k.index_select(0, slots).float()) and torch.equal(vo, v.index_select(0, slots).float())
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.gather_kv(k, v, torch.tensor([300]))
