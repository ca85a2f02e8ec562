"""rtk's CPU kernels (toolkit/runtime/kernels.cpp): the bf16 GEMV against oneDNN's one-row kernel, the
GEMV over FP8 / INT8 / INT4 codes against the bf16 GEMV over the dense weights, the fused input
quantization against torch's operators, the K/V gather against index_select.

The engine uses them as computing the bits of what they replace (oneDNN's one-row kernel is what
transformers' bf16 decode runs), so the comparisons are exact: SmolLM2's shapes, a reduction longer
than one 512-wide chunk, output counts that are not a multiple of the 64-output block, a bias, and
several rows in one call.  Where oneDNN's one-row kernel is its AMX one (Intel Sapphire Rapids and
later) the bf16 GEMV sums in another order: there it is held to the float product within its bf16
rounding and to batch invariance, and the codes kernels to the bf16 GEMV's bits, which is what the
engine checks at load on such hosts (``model.Projection``, own rounding).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from toolkit.runtime import kernels
from toolkit.runtime.checkpoint import Linear, fake_quant
from toolkit.runtime.model import Projection, bf16_is_fast

pytestmark = pytest.mark.skipif(
    not (bf16_is_fast() and kernels.cpu_supports_kernels()), reason="the kernels need AVX512-BF16 and AVX512-VBMI"
)


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.available(), "the kernel failed to build or load (see the log)"


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` for a block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def onednn_one_row_bits() -> bool:
    """Whether rtk's GEMV gives oneDNN's one-row bits on this host (false where oneDNN's one-row kernel is its
    AMX one): what the engine's load-time check finds (``conftest.gemv_rounds_its_own_way``)."""
    from conftest import gemv_rounds_its_own_way

    return not gemv_rounds_its_own_way()


def assert_one_row_result(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """``got`` (rtk's bf16 GEMV of ``x``) is oneDNN's one-row bits, or, where oneDNN's one-row kernel rounds
    apart from it, the float product within the bf16 rounding of each output and ``kernels.GEMV_TOLERANCE``."""
    if onednn_one_row_bits():
        want = torch.cat([onednn(x[i : i + 1], weight, bias) for i in range(x.shape[0])])
        assert torch.equal(got, want)
        return
    ref = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    err = (got.double() - ref).abs()
    assert err.max() <= kernels.GEMV_TOLERANCE * ref.abs().max()
    assert (err <= ref.abs() * 2**-8 + 1e-6 * ref.abs().max()).all()


@pytest.mark.parametrize(
    "shape",
    [(960, 576), (3072, 576), (576, 1536), (49152, 576), (100, 64), (200, 1100), (16, 2048)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_gives_onednns_bits_or_the_float_product(shape, threads):
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    weight = torch.randn(*shape, generator=g).to(torch.bfloat16)
    packed = kernels.pack(weight)
    with torch_threads(threads):
        for _ in range(8):
            x = torch.randn(1, shape[1], generator=g).to(torch.bfloat16)
            assert_one_row_result(kernels.gemv(x, packed, shape[0], None), x, weight, None)


def test_gemv_with_bias():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 576, generator=g).to(torch.bfloat16)
    bias = torch.randn(200, generator=g).to(torch.bfloat16)
    packed = kernels.pack(weight)
    for _ in range(8):
        x = torch.randn(1, 576, generator=g).to(torch.bfloat16)
        assert_one_row_result(kernels.gemv(x, packed, 200, bias), x, weight, bias)


def test_projection_uses_gemv_for_one_row_only():
    g = torch.Generator().manual_seed(4)
    lin = Linear(weight=torch.randn(960, 576, generator=g))
    proj = Projection([lin], torch.bfloat16, pack=True, gemv_kernel=True)
    plain = Projection([lin], torch.bfloat16, pack=True, gemv_kernel=False)
    assert proj.gemv is not None and plain.gemv is None
    assert proj.own_rounding == (not onednn_one_row_bits())
    x = torch.randn(5, 576, generator=g).to(torch.bfloat16)
    assert torch.equal(proj(x[:1]), plain(x[:1]))  # a prompt's row: oneDNN's one-row call, or rtk's with its bits
    assert torch.equal(proj(x), plain(x))  # more rows: oneDNN on both sides
    # a decode row: rtk's GEMV, with oneDNN's one-row bits or its own
    assert torch.equal(proj(x[:1], singles=1), kernels.gemv(x[:1], proj.gemv, 960, None))


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (200, 1100)])
def test_every_row_of_a_multi_row_call_gets_the_one_row_bits(shape):
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(*shape, generator=g).to(torch.bfloat16)
    packed = kernels.pack(weight)
    x = torch.randn(11, shape[1], generator=g).to(torch.bfloat16)
    many = kernels.gemv(x, packed, shape[0], None)
    assert many.shape == (11, shape[0])
    for i in range(11):
        assert torch.equal(many[i : i + 1], kernels.gemv(x[i : i + 1], packed, shape[0], None))
    assert_one_row_result(many, x, weight, None)


amx_tiles = pytest.mark.skipif(
    not kernels.wants_gemv_tiles(), reason="AMX's bf16 tiles need AMX-BF16 (Sapphire Rapids and later), RTK_AMX not 0"
)


@contextlib.contextmanager
def gemv_tiles(on: bool):
    """The GEMVs in AMX's tiles (``on``) or the AVX512 GEMV for a block, restored after."""
    assert torch.ops.rtk_kernels.set_gemv_tiles(on) == on
    try:
        yield
    finally:
        torch.ops.rtk_kernels.set_gemv_tiles(kernels.gemv_tiles())


@amx_tiles
@pytest.mark.parametrize("kind", ["bf16", "int8", "fp8", "fp8-table", "int4"])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (100, 640), (64, 288)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_in_amx_tiles_gives_every_row_onednns_one_row_bits(kind, shape, threads):
    """Where the CPU has AMX-BF16 the GEMVs run in its tiles (``kernels.gemv_tiles``, kernels.cpp ``tile_blocks``):
    every row of a call of 1 to 40 rows (row tiles of 16 and a short last one; outputs not a multiple of 64) gets
    oneDNN's one-row bits over the same bf16 weights, with and without a bias, bf16 weights and codes alike."""
    assert kernels.gemv_tiles()
    if kind == "bf16":
        g = torch.Generator().manual_seed(shape[0])
        weight = torch.randn(*shape, generator=g).to(torch.bfloat16)
        packed = kernels.pack(weight)

        def kernel(x, b):
            return kernels.gemv(x, packed, shape[0], b)
    else:
        codes, scale, dense = quantized(kind, *shape, seed=shape[0], group=32)
        weight = dense.to(torch.bfloat16)
        kernel = kernels.QuantizedWeight.pack(kind.removesuffix("-table"), codes, scale)
        assert kernel.kind == kind
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(shape[0], generator=g).to(torch.bfloat16)
    with torch_threads(threads):
        for rows in (1, 5, 16, 17, 40):
            x = torch.randn(rows, shape[1], generator=g).to(torch.bfloat16)
            for b in (None, bias):
                want = torch.cat([onednn(x[i : i + 1], weight, b) for i in range(rows)])
                assert torch.equal(kernel(x, b), want), (rows, b is not None)


@amx_tiles
def test_the_avx512_gemv_rounds_apart_from_onednn_where_amx_runs():
    """What the tiles are for: on such a CPU the AVX512 GEMV (vdpbf16ps: a pair's products in the other order,
    the sum in chunks) parts from oneDNN's AMX kernel in a few of the LM head's outputs, the tiles in none."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(49152, 576, generator=g).to(torch.bfloat16)
    packed = kernels.pack(weight)
    x = torch.randn(4, 576, generator=g).to(torch.bfloat16)
    want = torch.cat([onednn(x[i : i + 1], weight, None) for i in range(4)])
    with gemv_tiles(False):
        assert not torch.equal(kernels.gemv(x, packed, 49152, None), want)
    assert torch.equal(kernels.gemv(x, packed, 49152, None), want)


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


def quantized(kind: str, n: int, k: int, seed: int, group: int = 64):
    """Codes, their scale and the dense float32 weight ``codes.float() * scale``, as the checkpoint reader has them."""
    g = torch.Generator().manual_seed(seed)
    if kind == "int8":
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) * 1e-3 + 1e-5
        return codes, scale, codes.float() * scale[:, None]
    if kind == "int4":
        codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, k // group, generator=g) * 1e-2 + 1e-4
        return codes, scale, codes.float() * scale.repeat_interleave(group, dim=1)
    w = torch.randn(n, k, generator=g) * 40
    w[0, :6] = torch.tensor([0.0, 448.0, -448.0, 2.0**-9, -(2.0**-7), 0.01])  # extremes and subnormals of e4m3
    finite = torch.cat([torch.arange(0, 127), torch.arange(128, 255)]).to(torch.uint8)
    w[1, :254] = finite.view(torch.float8_e4m3fn).float()  # every finite e4m3 value, both signs
    codes = w.clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.full((n,), 3.1e-4)
    # fused projections: a scale per part; parts that start at a multiple of 64 outputs (per-tensor
    # scales of real fused q/k/v, gate/up) give one scale per 64-output block: the table kernel
    scale[(n // 128) * 64 if kind == "fp8-table" else n // 2 + 8 :] = 0.0213
    return codes, scale, codes.float() * scale[:, None]


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8-table", "int4"])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (100, 640), (3072, 576)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_over_codes_gives_the_dense_weights_bits(kind, shape, threads):
    codes, scale, dense = quantized(kind, *shape, seed=shape[0])
    weight = dense.to(torch.bfloat16)
    q = kernels.QuantizedWeight.pack(kind.removesuffix("-table"), codes, scale)
    assert q.kind == kind  # fp8: a block with two scales keeps the per-output kernel
    assert torch.equal(q.weight(), weight)
    padded = -(-shape[0] // 64) * 64 * shape[1]  # outputs in blocks of 64, as the bf16 GEMV packs them
    assert q.nbytes < padded * 2 * (0.55 if kind != "int4" else 0.35)  # codes and scales, not bf16
    one_row = one_row_call(weight)
    with torch_threads(threads):
        for x, b in rows_and_biases(*shape):
            want = torch.cat([one_row(x[i : i + 1], b) for i in range(x.shape[0])])
            assert torch.equal(q(x, b), want), (x.shape[0], b is not None)


def one_row_call(weight: torch.Tensor):
    """``f(x, bias)``: the one-row product a codes kernel must give the bits of: oneDNN's, or rtk's bf16 GEMV
    over the dense weights where oneDNN's one-row kernel rounds apart from it (what the engine checks)."""
    if onednn_one_row_bits():
        return lambda x, b: onednn(x, weight, b)
    packed = kernels.pack(weight)
    return lambda x, b: kernels.gemv(x, packed, weight.shape[0], b)


def rows_and_biases(out_features: int, in_features: int):
    """(x, bias) pairs: 1, 3 and 6 random bf16 rows, each without and with a random bias."""
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
    for rows in (1, 3, 6):
        x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
        yield x, None
        yield x, bias


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (100, 640), (3072, 576)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_group_sums_are_the_float32_product_within_tolerance_and_batch_invariant(shape, threads):
    """int4-dot scales per-group sums of code x activation: not the dense path's bits (no bf16 weight
    rounding), so it is held to the float32 product; every row is the same alone and with others."""
    codes, scale, exact = quantized("int4", *shape, seed=shape[0])
    q = kernels.QuantizedWeight.pack("int4-dot", codes, scale)
    assert q.kind == "int4-dot" and q.nbytes < -(-shape[0] // 64) * 64 * shape[1] * 2 * 0.3
    with torch_threads(threads):
        for x, b in rows_and_biases(*shape):
            got = q(x, b)
            ref = x.float() @ exact.t() + (0 if b is None else b.float())
            err = (got.float() - ref).abs().max() / ref.abs().max()
            assert err <= kernels.INT4_DOT_TOLERANCE, (x.shape[0], err)
            # the bf16 output rounding is the only error: 2^-8 of each value at most, 1/512 at nearest
            assert ((got.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6 * ref.abs().max()).all()
            assert torch.equal(torch.cat([q(x[i : i + 1], b) for i in range(x.shape[0])]), got)
        assert q.within(exact, b)  # the last pair's bias
        wrong = exact.clone()
        wrong[5, :64] *= -1  # one group of one output that is not what the codes say: the check fails
        assert not q.within(wrong, None)


def test_gemv_over_codes_refuses_a_mismatch():
    codes, scale, dense = quantized("int8", 128, 256, seed=5)
    q = kernels.QuantizedWeight.pack("int8", codes, scale)
    weight = dense.to(torch.bfloat16)
    assert q.agrees(weight, lambda x: one_row_call(weight)(x, None), None)
    other = weight.clone()
    other[7, 9] = -other[7, 9] + 1  # one weight that is not what the codes say: the check fails
    assert not q.agrees(other, lambda x: one_row_call(other)(x, None), None)


def input_values(seed: int) -> torch.Tensor:
    """bf16 activations over 32 binades (both signs), and the midpoints between neighbouring e4m3 values."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(64, 576, generator=g) * 32 - 20)
    sign = torch.where(torch.rand(64, 576, generator=g) < 0.5, -1.0, 1.0)
    x = (mag * sign).to(torch.bfloat16)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite value >= 0
    mids = ((e4m3[1:] + e4m3[:-1]) / 2).to(torch.bfloat16)  # exact in bf16: ties for the rounding
    x[0, : mids.numel()] = mids
    x[1, : mids.numel()] = -mids
    x[2, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])
    return x


@pytest.mark.parametrize("act", [None, "fp8", "int8"])
@pytest.mark.parametrize("pre_quant", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.0173, 3.7])
def test_quantize_input_gives_torchs_bits(act, pre_quant, scale):
    x = input_values(int(scale * 100))
    if act == "int8":
        x[3, :4] = torch.tensor([0.5, 1.5, -2.5, 126.5]) * scale  # round half to even
    g = torch.Generator().manual_seed(2)
    pqs = (torch.rand(576, generator=g) + 0.5).to(torch.bfloat16) if pre_quant else None
    want = x if pqs is None else x * pqs
    if act is not None:
        want = fake_quant(want, act, torch.tensor(scale, dtype=torch.float32))
    got = kernels.quantize_input(x, pqs, act, float(torch.tensor(scale, dtype=torch.float32)))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # the bits, signed zeros included
    one = torch.cat([kernels.quantize_input(x[i : i + 1], pqs, act, float(torch.tensor(scale))) for i in range(3)])
    assert torch.equal(one.view(torch.int16), got[:3].view(torch.int16))


def test_projection_checks_the_input_quantization_kernel_at_load(monkeypatch):
    """A projection quantizes its input with rtk's kernel only where it gives torch's bits for its own scales."""
    from toolkit.runtime.checkpoint import ActQuant

    g = torch.Generator().manual_seed(9)
    lin = Linear(
        weight=torch.randn(128, 576, generator=g),
        pre_quant_scale=torch.rand(576, generator=g) + 0.5,
        act_quant=ActQuant("fp8", torch.tensor(0.02)),
    )
    assert Projection([lin], torch.bfloat16, pack=True, gemv_kernel=True).fused_input
    real = kernels.quantize_input
    monkeypatch.setattr(kernels, "quantize_input", lambda x, *a: real(x, *a) * 1.01)  # a kernel that drifted
    assert not Projection([lin], torch.bfloat16, pack=True, gemv_kernel=True).fused_input
