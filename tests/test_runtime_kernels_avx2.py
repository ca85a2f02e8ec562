"""rtk's float32-engine kernels for CPUs without native bf16 (runtime/kernels_avx2.cpp), against float64
products and transformers' float32 model.

The decode GEMV reads weights as stored (bf16, or an export's FP8 / INT8 / INT4 codes) and sums in its
own order: within a stated tolerance of the exact product, never dependent on the other rows of its
call.  The W8A8 kernel (INT8 SmoothQuant) sums fake_quant's input codes times the weight codes as
integers, exact, for every row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from toolkit.runtime import kernels, kernels_avx2
from toolkit.runtime.checkpoint import ActQuant, Linear, WeightCodes, fake_quant
from toolkit.runtime.engine import Engine, EngineConfig, GenerationRequest
from toolkit.runtime.model import TILE_DECODE_ROWS, Projection, resolve_float32_prompt_rows

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not kernels_avx2.available(), reason="rtk's AVX2 GEMV needs AVX2 and FMA and a compiler"),
]

# fused qkv, a down projection, odd outputs with a K of 5 chunks of 8 (bf16: not taken) and of 3 blocks of 16
SHAPES = [(960, 576), (64, 1536), (77, 40), (77, 48)]


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
    if kind == "bf16" and k % 16:  # bf16 weights are read in blocks of 16
        assert packed is None
        return
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


@pytest.mark.parametrize("kind", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("shape", [(960, 576), (64, 1536), (77, 40)])
def test_calls_of_many_rows_give_each_row_the_bits_of_a_call_of_one(kind, shape):
    """From 8 rows on the GEMV decodes 3 outputs' weights at a time into float32 and tiles the rows over blocks of
    inputs (``gemv_many``): a row's sums keep the one-row path's order, over blocks of rows and of inputs, outputs
    left over from the tiles of 3, and groups whose 8-input chunks are odd in number (``int4``: groups of 8)."""
    g = torch.Generator().manual_seed(3)
    n, k = shape
    dense, codes = weights(kind, n, k, g)
    packed = kernels_avx2.Fp32Weight.pack(dense, codes)
    if packed is None:  # bf16 with K not a multiple of 16
        return
    x = torch.randn(100, k, generator=g)  # more rows than a block's (K = 1536: 32)
    alone = torch.cat([packed(x[i : i + 1], None) for i in range(100)])
    for rows in (8, 13, 100):
        assert torch.equal(packed(x[:rows], None), alone[:rows]), rows
    ref = x.double() @ dense.double().t()
    assert (alone.double() - ref).abs().max() <= kernels_avx2.TOLERANCE * ref.abs().max()


def test_weights_it_cannot_hold_exactly_are_left_to_the_dense_path():
    g = torch.Generator().manual_seed(2)
    assert kernels_avx2.Fp32Weight.pack(torch.randn(8, 64, generator=g), None) is None  # not bf16 values
    assert kernels_avx2.Fp32Weight.pack(torch.randn(8, 60, generator=g).bfloat16().float(), None) is None  # K % 8
    assert kernels_avx2.Fp32Weight.pack(torch.randn(8, 40, generator=g).bfloat16().float(), None) is None  # bf16: % 16
    # a layout or scale error is caught by the check at load
    dense, (_, codes, scale) = weights("int8", 16, 64, g)
    assert not kernels_avx2.Fp32Weight.pack(dense, ("int8", codes, scale * 2)).within(dense, None)


@pytest.mark.parametrize("prompt_rows", ["mkl", "gemv"])
def test_a_float32_projection_reads_the_codes_for_decode_rows_and_its_setting_for_prompt_rows(prompt_rows):
    """Decode rows through rtk's GEMV over the codes; prompt rows through MKL's packed weights (``mkl``) or the same
    GEMV in the decode rows' call (``gemv``): either way a row's bits never depend on what shares its call, and no
    float32 copy of the weights is kept (``gemv``: nor MKL's packed one)."""
    g = torch.Generator().manual_seed(3)
    dense, (_, codes, scale) = weights("int8", 96, 64, g)
    lin = Linear(weight=dense, codes=WeightCodes(bits=8, codes=codes, scale=scale))
    proj = Projection([lin], torch.float32, pack=False, gemv_kernel=True, float32_prompt_rows=prompt_rows)
    gemv = prompt_rows == "gemv"
    assert proj.kernel == "rtk-avx2-int8" and proj.own_rounding and proj.gemv_prompt_rows == gemv
    assert proj.nbytes == 96 * 64 + 96 * 4  # a byte a weight and the scales, not 4 bytes a weight
    assert (proj.mkl_tiles is None) == gemv and proj.weight is None
    x = torch.randn(5, 64, generator=g)
    kernel, rows_seen = proj.fp32_gemv, []

    def counted(rows, bias):
        rows_seen.append(rows.shape[0])
        return kernel(rows, bias)

    proj.fp32_gemv = counted
    with torch.inference_mode():
        y = proj(x, singles=2)  # two decode rows, three prompt rows
        alone = [proj(x[i : i + 1], singles=int(i < 2)) for i in range(5)]
    # gemv: one call for all five, then each alone; mkl: the prompt rows never reach the kernel
    assert rows_seen == ([5, 1, 1, 1, 1, 1] if gemv else [2, 1, 1])
    assert torch.equal(y, torch.cat(alone))
    assert (y - x @ dense.t()).abs().max() <= 1e-5 * y.abs().max()
    assert Projection([lin], torch.float32, pack=False, gemv_kernel=False).fp32_gemv is None


def test_float32_prompt_rows_auto_is_the_gemv_where_the_256_bit_build_runs(monkeypatch):
    monkeypatch.setattr(kernels_avx2, "library", lambda: "rtk_avx2")
    assert resolve_float32_prompt_rows("auto") == "gemv"
    monkeypatch.setattr(kernels_avx2, "library", lambda: "rtk_vnni")
    assert resolve_float32_prompt_rows("auto") == "mkl"
    assert [resolve_float32_prompt_rows(n) for n in ("mkl", "gemv")] == ["mkl", "gemv"]


@pytest.mark.parametrize("bias", [False, True])
def test_mkl_tiles_give_each_row_the_float32_product_whatever_its_call(bias):
    """Prompt rows through MKL's packed GEMM in calls of MKL_TILE rows: any number of rows, in any split, gives
    every row the same bits, within float32 rounding of the float64 product; the fused step's op is the same."""
    g = torch.Generator().manual_seed(4)
    dense = torch.randn(200, 96, generator=g).bfloat16().float()
    b = torch.randn(200, generator=g) if bias else None
    tiles = kernels_avx2.MklTiles.pack(dense)
    assert tiles is not None
    x = torch.randn(2 * kernels_avx2.MKL_TILE + 5, 96, generator=g)
    with torch.inference_mode():
        whole = tiles(x, b)
        ref = x.double() @ dense.double().t() + (0 if b is None else b.double())
        assert (whole.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
        for a, z in [(0, 1), (3, 20), (7, 7 + kernels_avx2.MKL_TILE), (30, 69)]:
            assert torch.equal(tiles(x[a:z], b), whole[a:z]), (a, z)
        assert tiles(x[:0], b).shape == (0, 200)


@pytest.mark.parametrize("prompt_rows", ["mkl", "gemv"])
def test_float32_engine_greedy_tokens_equal_transformers_float32(tiny_llama_dir, prompt_rows):
    from test_runtime_engine import config, greedy, hf_greedy, prompt, run, tokens, transformers_model

    hf = transformers_model(tiny_llama_dir, dtype=torch.float32)
    cfg = config(dtype="float32", decode_batching="attention", float32_prompt_rows=prompt_rows)
    eng = Engine(tiny_llama_dir, cfg)
    assert {p.kernel for layer in eng.model.layers for p in layer.qkv.parts} == {"rtk-avx2-bf16"}
    assert eng.model.lm_head.kernel == "rtk-avx2-bf16"
    assert all(p.gemv_prompt_rows == (prompt_rows == "gemv") for p in eng.model.projections)
    assert ("in the GEMV" in eng.model.kernels) == (prompt_rows == "gemv")
    reqs = [greedy(prompt(n, 300 + n)) for n in (1, 23, 90)]
    for r in reqs:
        assert eng.generate(r) == hf_greedy(hf, r.prompt_ids, r.max_new_tokens)
    ids, events, _ = run(eng, reqs, arrivals={1: 2, 2: 4})  # decode rows share GEMV calls
    assert [tokens(events[i]) for i in ids] == [eng.generate(r) for r in reqs]


# -- W8A8 (INT8 SmoothQuant): integer products for every row ------------------------------------------


def w8a8_linear(n: int, k: int, g: torch.Generator, act_scale: float = 0.02) -> Linear:
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    return Linear(
        weight=codes.float() * scale[:, None],
        codes=WeightCodes(bits=8, codes=codes, scale=scale),
        act_quant=ActQuant("int8", torch.tensor(act_scale)),
    )


@pytest.mark.parametrize("shape", [(960, 576), (64, 1536), (77, 64)])
def test_w8a8_is_the_float64_product_of_the_quantized_input_and_a_row_depends_on_itself_alone(shape):
    g = torch.Generator().manual_seed(4)
    n, k = shape
    lin = w8a8_linear(n, k, g)
    packed = kernels_avx2.W8A8Weight.pack(("int8", lin.codes.codes, lin.codes.scale), lin.act_quant.scale)
    bias = torch.randn(n, generator=g)
    # inputs past the codes' range (clamped), ties (x / s = m + 0.5: rounded half to even) and zeros
    x = torch.randn(37, k, generator=g) * 1.5
    x[0, :8] = torch.tensor([3.0, -3.0, 0.01, -0.01, 0.03, 0.05, -0.05, 0.0])
    ref = fake_quant(x, "int8", lin.act_quant.scale).double() @ lin.weight.double().t() + bias.double()
    got = packed(x, bias)
    assert (got.double() - ref).abs().max() <= kernels_avx2.TOLERANCE * ref.abs().max()
    # any split of the rows (one at a time, a decode batch, prompt chunks of 5 and 16) gives the same bits
    for size in (1, 3, 5, 16):
        assert torch.equal(torch.cat([packed(x[i : i + size], bias) for i in range(0, 37, size)]), got), size
    assert packed.within(lin.weight, bias)
    assert not kernels_avx2.W8A8Weight(packed.codes, packed.scales * 2, packed.act_scale).within(lin.weight, bias)


def test_w8a8_quantizes_its_input_to_fake_quants_codes_exactly():
    """Bit for bit: the sums are fake_quant's int8 codes times the weight codes (exact integers), scaled once.
    A power-of-two scale makes ``x / s`` exact, so the inputs below hit every tie (m + 0.5, rounded to even)."""
    g = torch.Generator().manual_seed(7)
    lin = w8a8_linear(40, 64, g, act_scale=2.0**-6)
    s = lin.act_quant.scale
    packed = kernels_avx2.W8A8Weight.pack(("int8", lin.codes.codes, lin.codes.scale), s)
    halves = torch.arange(-140, 140).float() + 0.5  # ties across the whole range and beyond the clamp
    x = torch.cat([halves, torch.randn(24 * 64 - halves.numel(), generator=g) * 3]).reshape(24, 64) * s
    codes = torch.round(x / s).clamp(-128, 127)  # checkpoint.fake_quant's codes
    assert torch.equal(codes * s, fake_quant(x, "int8", s))
    sums = codes.to(torch.int64) @ lin.codes.codes.to(torch.int64).t()
    assert torch.equal(packed(x, None), sums.to(torch.float32) * packed.scales)


def test_w8a8_folds_the_pre_quant_scale_into_its_quantization_with_torchs_bits():
    """``pre_quant_scale`` multiplied in while quantizing gives the codes of torch's ``x * pre_quant_scale`` first:
    the product rounds to float32 before the division, as the two operators round it."""
    g = torch.Generator().manual_seed(8)
    lin = w8a8_linear(77, 96, g)
    packed = kernels_avx2.W8A8Weight.pack(("int8", lin.codes.codes, lin.codes.scale), lin.act_quant.scale)
    x = torch.randn(37, 96, generator=g) * 0.9  # 37 rows: the blocks' K offsets wrap within and across rows
    pqs = torch.rand(96, generator=g) * 3 + 0.05
    assert torch.equal(packed(x, None, pqs), packed(x * pqs, None))
    assert not torch.equal(packed(x, None, pqs), packed(x, None))
    with pytest.raises(RuntimeError, match="pre_quant_scale must be"):
        packed(x, None, pqs[:64])


def test_w8a8_refuses_what_its_integer_sums_cannot_take():
    g = torch.Generator().manual_seed(5)
    lin = w8a8_linear(16, 64, g)
    codes, scale, act = lin.codes.codes, lin.codes.scale, lin.act_quant.scale
    assert kernels_avx2.W8A8Weight.pack(("int8", codes, scale), act) is not None
    assert kernels_avx2.W8A8Weight.pack(("int8", codes[:, :48], scale), act) is None  # K not a multiple of 32
    assert kernels_avx2.W8A8Weight.pack(("int8", codes, scale[:, None].repeat(1, 2)), act) is None  # groups
    low = codes.clone()
    low[3, 5] = -128  # vpmaddubsw's int16 pair sums would overflow
    assert kernels_avx2.W8A8Weight.pack(("int8", low, scale), act) is None
    assert kernels_avx2.W8A8Weight.pack(("fp8", codes, scale), act) is None


def test_a_float32_int8_smoothquant_projection_takes_every_row_through_the_integer_products():
    g = torch.Generator().manual_seed(6)
    lin = w8a8_linear(96, 64, g)
    lin.pre_quant_scale = torch.rand(64, generator=g) + 0.5
    proj = Projection([lin], torch.float32, pack=False, gemv_kernel=True)
    assert proj.kernel == "rtk-avx2-w8a8" and proj.fp32_gemv is None
    assert proj.nbytes == 96 * 64 + 96 * 4
    x = torch.randn(7, 64, generator=g)
    with torch.inference_mode():
        mixed = proj(x, singles=3)  # three decode rows, four prompt rows
        assert torch.equal(mixed, proj(x, singles=0)) and torch.equal(mixed[3:], proj(x[3:], singles=0))
        ref = lin(x)  # checkpoint.Linear: the reference semantics (pre_quant_scale, int8 QDQ, float32)
    assert (mixed - ref).abs().max() <= kernels_avx2.TOLERANCE * ref.abs().max()
    # a bf16 engine and an engine without rtk's kernels keep their own paths
    assert Projection([lin], torch.float32, pack=False, gemv_kernel=False).int_products is None


def test_float32_engine_on_a_real_int8_smoothquant_export(tmp_path, tiny_llama_dir):
    """A real ModelOpt INT8-SQ export (tiny Llama) on a float32 engine: every quantized projection runs the
    W8A8 kernel; its logits are the float32 dense path's within the tolerance the input quantization
    leaves (an activation on a rounding boundary may move one code); greedy tokens equal that path's; a
    prompt's logits do not depend on its chunking, nor a request's tokens on what decodes beside it."""
    from conftest import spec_for
    from test_runtime_engine import greedy, run, tokens

    from toolkit.quantize import quantize

    calib = {"calibration": {"num_samples": 4, "max_length": 32, "batch_size": 4}, "eval_samples": 2}
    spec = spec_for(
        "tiny-int8", tiny_llama_dir, quantization={"format": "int8_sq", "max_perplexity_increase": 100.0, **calib}
    )
    hf = quantize(spec, checkpoint=tiny_llama_dir, output=tmp_path / "quantized").path / "hf"
    cfg = dict(max_batch_size=4, max_input_len=128, max_seq_len=256, tokens_per_block=16, dtype="float32")
    fast = Engine(hf, EngineConfig(**cfg, max_num_tokens=64))
    chunked = Engine(hf, EngineConfig(**cfg, max_num_tokens=16))
    dense = Engine(hf, EngineConfig(**cfg, max_num_tokens=64, cpu_kernels=False))
    parts = fast.model.projections
    assert {p.kernel for p in parts} == {"rtk-avx2-w8a8"}
    from toolkit.runtime import model
    from toolkit.runtime.checkpoint import load_checkpoint

    assert model.integer_products_apply(load_checkpoint(hf))
    if kernels_avx2.library() == "rtk_vnni" or not model.bf16_is_fast():  # dtype auto: float32 for int8 codes
        assert Engine(hf, EngineConfig(**{**cfg, "dtype": "auto"}, max_num_tokens=64)).model.dtype == torch.float32
    ids = torch.randint(3, 1000, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    got, want = fast.prompt_logits(ids), dense.prompt_logits(ids)
    assert torch.equal(chunked.prompt_logits(ids), got)  # 16-token chunks: the same bits
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    reqs = [greedy(ids[:n]) for n in (5, 33, 70)]
    alone = [fast.generate(r) for r in reqs]
    assert alone == [dense.generate(r) for r in reqs]
    run_ids, events, _ = run(fast, reqs, arrivals={1: 2, 2: 4})
    assert [tokens(events[i]) for i in run_ids] == alone


# -- weight-only INT8 (the LM head of quantize_lm_head): blockwise integer products --------------------


def w8a16_linear(n: int, k: int, g: torch.Generator) -> Linear:
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    return Linear(weight=codes.float() * scale[:, None], codes=WeightCodes(bits=8, codes=codes, scale=scale))


def test_w8a8_blockwise_quantizes_each_block_of_32_on_its_own():
    """Identity weights give back the kernel's quantized input bit for bit: each block of 32 has its own scale
    (max |x| / 127), a block of zeros stays zero, a huge value elsewhere in the row changes no other block."""
    k = 128
    eye = torch.eye(k, dtype=torch.int8)
    packed = kernels_avx2.W8A8Weight.pack(("int8", eye, torch.ones(k)), None)
    assert packed.blockwise
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, k, generator=g)
    x[1, 32:64] = 0.0
    x[2, 100] = 1e6
    got = packed(x, None)
    assert torch.equal(got, kernels_avx2.quantize_blocks(x))
    assert torch.equal(got[1, 32:64], torch.zeros(32))
    assert torch.equal(got[2, :96], kernels_avx2.quantize_blocks(x[2:3, :96])[0])
    assert (got - x).abs().max() <= x.reshape(5, 4, 32).abs().amax(-1).max() / 254 * 1.0001  # half a step


@pytest.mark.parametrize("shape", [(960, 576), (77, 64)])
def test_w8a8_blockwise_is_the_float64_product_of_its_quantized_input_and_rows_stand_alone(shape):
    g = torch.Generator().manual_seed(9)
    lin = w8a16_linear(*shape, g)
    packed = kernels_avx2.W8A8Weight.pack(("int8", lin.codes.codes, lin.codes.scale), None)
    broken = kernels_avx2.W8A8Weight(packed.codes, packed.scales * 2, None)
    check_block_quantized_product(packed, broken, lin.weight, g)


def check_block_quantized_product(packed, broken, weight: torch.Tensor, g: torch.Generator) -> None:
    """``packed(x, bias)`` is the float64 product of ``quantize_blocks(x)`` and ``weight`` within the tolerance,
    a row alone or in calls of 3 or 16 gives the same bits, and ``broken`` (wrong scales) fails the check
    at load."""
    n, k = weight.shape
    bias = torch.randn(n, generator=g)
    x = torch.randn(37, k, generator=g) * torch.rand(37, 1, generator=g) * 10
    x[3, :64] = 0.0  # zero blocks
    ref = kernels_avx2.quantize_blocks(x).double() @ weight.double().t() + bias.double()
    got = packed(x, bias)
    assert (got.double() - ref).abs().max() <= kernels_avx2.TOLERANCE * ref.abs().max()
    for size in (1, 3, 16):
        assert torch.equal(torch.cat([packed(x[i : i + size], bias) for i in range(0, 37, size)]), got), size
    assert packed.within(weight, bias)
    assert not broken.within(weight, bias)


def test_a_weight_only_int8_head_takes_the_blockwise_kernel_where_asked_and_stays_near_float_inputs():
    """The LM head (``blockwise_inputs``) reads its codes as integer products; the export's arithmetic keeps the
    input in float, so the two differ by the input's quantization alone (here ~0.1-0.3 % of the largest
    logit); other weight-only projections keep the float32 GEMV over the same codes."""
    g = torch.Generator().manual_seed(10)
    lin = w8a16_linear(500, 64, g)
    head = Projection([lin], torch.float32, pack=False, gemv_kernel=True, blockwise_inputs=True)
    assert head.kernel == "rtk-avx2-w8a8-blockwise" and head.nbytes == 500 * 64 + 500 * 4
    assert Projection([lin], torch.float32, pack=False, gemv_kernel=True).kernel == "rtk-avx2-int8"
    x = torch.randn(6, 64, generator=g)
    with torch.inference_mode():
        got, ref = head(x, singles=6), lin(x)
        assert torch.equal(got[2:], head(x[2:], singles=4))
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max()
    assert not torch.equal(got, ref)  # it is not the float product: a different kernel, said so


def w4a16_linear(n: int, k: int, group: int, g: torch.Generator) -> Linear:
    codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.05 + 1e-3
    weight = codes.float() * scale.repeat_interleave(group, dim=1)
    return Linear(weight=weight, codes=WeightCodes(bits=4, codes=codes, scale=scale, group_size=group))


@pytest.mark.parametrize("shape", [(960, 576, 64), (77, 128, 128), (64, 1536, 128), (33, 384, 192)])
def test_w4a8_is_the_float64_product_of_its_block_quantized_input_and_rows_stand_alone(shape):
    """INT4 codes times the input quantized per block of 32 (as W8A8's blockwise kernel), per weight group:
    the float64 product of those values within the tolerance, the same bits for a row alone or in any call;
    wrong scales fail the check at load."""
    g = torch.Generator().manual_seed(11)
    n, k, group = shape
    lin = w4a16_linear(n, k, group, g)
    packed = kernels_avx2.W4A8Weight.pack(("int4", lin.codes.codes, lin.codes.scale))
    assert packed.nbytes == n * k // 2 + n * (k // group) * 4
    check_block_quantized_product(packed, kernels_avx2.W4A8Weight(packed.codes, packed.scales * 1.01), lin.weight, g)


def test_w4a8_reads_every_code_where_pack_put_it():
    """One-hot inputs read the codes back, output by output (odd N: the last output unpaired), in order."""
    g = torch.Generator().manual_seed(12)
    codes = torch.randint(-8, 8, (7, 192), generator=g, dtype=torch.int8)
    packed = kernels_avx2.W4A8Weight.pack(("int4", codes, torch.ones(7, 3)))
    got = packed(torch.eye(192) * 3.0, None) / 3.0  # block scale 3 / 127, the code 127: 3 times the weight
    assert torch.equal(got.t().round().to(torch.int8), codes)


def test_w4a8_refuses_what_its_layout_cannot_take():
    codes = torch.zeros(4, 128, dtype=torch.int8)
    assert kernels_avx2.W4A8Weight.pack(("int4", codes, torch.ones(4, 2))) is not None
    assert kernels_avx2.W4A8Weight.pack(("int4", codes, torch.ones(4, 4))) is None  # groups of 32
    assert kernels_avx2.W4A8Weight.pack(("int4", codes[:, :96], torch.ones(4, 1))) is None  # K not a multiple of 64
    assert kernels_avx2.W4A8Weight.pack(("int8", codes, torch.ones(4))) is None


def test_an_int4_projection_takes_the_integer_products_with_int4_gemv_dot_only():
    """``int4_gemv: "dot"`` (the default: a stated tolerance) takes W4A8 for decode rows, and for prompt rows too
    where AMX does not run (else :meth:`W4A8Weight.prompt`), every row in VNNI's lanes where the VNNI build runs
    without AMX; ``"exact"`` keeps the float32 GEMV over the same codes, whose weights are the dense path's."""
    g = torch.Generator().manual_seed(13)
    lin = w4a16_linear(96, 128, 64, g)
    dot = Projection([lin], torch.float32, pack=False, gemv_kernel=True, blockwise_inputs=True)
    exact = Projection([lin], torch.float32, pack=False, gemv_kernel=True, int4_gemv="exact", blockwise_inputs=True)
    assert dot.kernel == "rtk-avx2-w4a8" and exact.kernel == "rtk-avx2-int8"
    assert (dot.int_products.tiles is not None) == (kernels_avx2.prompt_tiles() or kernels_avx2.prompt_lanes())
    assert dot.int_products.lanes == kernels_avx2.prompt_lanes()
    x = torch.randn(5, 128, generator=g)
    alone = kernels_avx2.W4A8Weight.pack(("int4", lin.codes.codes, lin.codes.scale))
    if dot.int_products.lanes:  # every row through the lanes: the decode rows' kernel is the prompt rows'
        assert alone.add_tiles(lin.codes.codes, lin.weight, None) and alone.lanes
    with torch.inference_mode():
        assert torch.equal(dot(x, singles=5), alone(x, None))
        mixed = dot(x, singles=2)
        assert torch.equal(mixed[:2], alone(x[:2], None))
        assert torch.equal(mixed[2:], dot.int_products.prompt(x[2:], None))
        # decode_batching "full" (no singles): by the call's row count
        many = torch.randn(TILE_DECODE_ROWS, 128, generator=g)
        assert torch.equal(dot(many[:-1], singles=None), alone(many[:-1], None))
        assert torch.equal(dot(many, singles=None), dot.int_products.prompt(many, None))


needs_tiles = pytest.mark.skipif(
    not (kernels_avx2.prompt_tiles() or kernels_avx2.prompt_lanes()),
    reason="INT4 prompt rows in the tiles' layout: AMX-INT8 or AVX512-VNNI (Intel Ice Lake, AMD Zen 4 on)",
)
needs_amx = pytest.mark.skipif(
    not kernels_avx2.prompt_tiles(), reason="AMX's int8 tiles: an Intel CPU with AMX-INT8 (Sapphire Rapids on)"
)


def tiles_arithmetic(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w4a8_tiles``' arithmetic in float64 and numpy, each float32 operation rounded as the kernel rounds it: the
    block-quantized input's codes times the int4 codes, summed per block as integers; a group's block sums times
    their input scales, the first a product and the others multiply-adds in block order; each group's sum times
    its scale, multiply-added into the total in group order.  (A float64 multiply-add of float32 values rounds
    once more than a fused one only where the float64 result falls exactly halfway between two float32 values.)"""
    rows, k = x.shape
    n, nb, groups = codes.shape[0], k // 32, scale.shape[1]
    per_group = nb // groups
    blocks = x.reshape(rows, nb, 32)
    qs = blocks.abs().amax(-1) / 127.0
    q = torch.where(qs[..., None] > 0, blocks / torch.where(qs > 0, qs, 1.0)[..., None], 0.0).round()
    sums = np.einsum("rbi,nbi->rnb", q.to(torch.int64).numpy(), codes.to(torch.int64).numpy().reshape(n, nb, 32))
    qs, gs = qs.double().numpy(), scale.double().numpy()
    total = np.zeros((rows, n), np.float32)
    for gi in range(groups):
        group = np.zeros((rows, n))
        for h in range(per_group):
            b = gi * per_group + h
            term = sums[:, :, b].astype(np.float32).astype(np.float64) * qs[:, b : b + 1]
            group = (term + group).astype(np.float32).astype(np.float64)  # the first: term + 0, the product
        total = (group * gs[None, :, gi] + total.astype(np.float64)).astype(np.float32)
    return torch.from_numpy(total)


@needs_tiles
@pytest.mark.parametrize("shape", [(960, 576, 64), (48, 128, 128), (64, 1536, 128), (32, 384, 192)])
def test_int4_prompt_rows_round_as_the_tiles_arithmetic_states(shape):
    """The prompt-row kernel this host runs (AMX's tiles or AVX512-VNNI's lanes) gives exactly the bits of the tiles'
    arithmetic written out in numpy, for calls of 1 to 37 rows (every row tile and remainder) and a row alone."""
    g = torch.Generator().manual_seed(17)
    n, k, group = shape
    lin = w4a16_linear(n, k, group, g)
    packed = kernels_avx2.W4A8Weight.pack(("int4", lin.codes.codes, lin.codes.scale))
    assert packed.add_tiles(lin.codes.codes, lin.weight, None)
    assert packed.amx == kernels_avx2.prompt_tiles()
    for rows in (1, 3, 4, 5, 6, 7, 8, 16, 19, 37):
        x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 10
        x[0, :32] = 0.0  # a zero block
        got = packed.prompt(x, None)
        assert torch.equal(got, tiles_arithmetic(x, lin.codes.codes, lin.codes.scale)), rows
        assert torch.equal(torch.cat([packed.prompt(x[i : i + 1], None) for i in range(rows)]), got), rows
    bias = torch.randn(n, generator=g)
    assert torch.equal(packed.prompt(x, bias), got + bias)


@needs_amx
def test_amx_tiles_and_vnni_lanes_give_the_same_bits():
    """On an AMX host both prompt-row kernels run: ``w4a8_lanes`` (what AVX512-VNNI hosts run) equals ``w4a8_tiles``."""
    g = torch.Generator().manual_seed(18)
    lin = w4a16_linear(960, 576, 64, g)
    tiles, scales = kernels_avx2.pack_tiles(lin.codes.codes), kernels_avx2.pack_tile_scales(lin.codes.scale)
    for rows in (1, 5, 7, 8, 16, 19, 40):
        x = torch.randn(rows, 576, generator=g)
        amx = kernels_avx2.ops().w4a8_tiles(x, tiles, scales, None)
        assert torch.equal(kernels_avx2.ops().w4a8_lanes(x, tiles, scales, None), amx), rows


@needs_tiles
@pytest.mark.parametrize("shape", [(960, 576, 64), (48, 128, 128), (64, 1536, 128), (32, 384, 192)])
def test_w4a8_tiles_are_the_float64_product_of_w4a8s_inputs_and_rows_stand_alone(shape):
    """Prompt rows in the tiles' layout: the float64 product of the block-quantized input (w4a8's codes and scales)
    within the tolerance, the same bits for a row alone or in calls of 3 or 16 (tiles of 16 rows, the last of the
    call's rows % 16 alone), near
    w4a8's own sums (the same integers, float sums in another order); wrong scales fail the check at load."""
    g = torch.Generator().manual_seed(14)
    n, k, group = shape
    lin = w4a16_linear(n, k, group, g)
    packed = kernels_avx2.W4A8Weight.pack(("int4", lin.codes.codes, lin.codes.scale))
    assert packed.add_tiles(lin.codes.codes, lin.weight, None) and packed.tiles.numel() == n * k // 2
    broken = kernels_avx2.W4A8Weight(packed.codes, packed.scales * 1.01)
    check_block_quantized_product(TilePath(packed, lin.codes.codes), TilePath(broken, lin.codes.codes), lin.weight, g)
    assert broken.tiles is None and not broken.amx and not broken.lanes
    x = torch.randn(37, k, generator=g)
    assert torch.equal(broken.prompt(x, None), broken(x, None))  # w4a8 for every row after the failed check
    got = packed.prompt(x, None)
    w4a8 = kernels_avx2.ops().w4a8(x, packed.codes, packed.scales, None)  # w4a8: its float sums
    assert (got - w4a8).abs().max() <= 1e-5 * got.abs().max()


class TilePath:
    """A W4A8Weight's prompt rows as :func:`check_block_quantized_product` calls a kernel: ``within`` is the check
    at load (``add_tiles``)."""

    def __init__(self, weight: kernels_avx2.W4A8Weight, codes: torch.Tensor):
        self.weight, self.codes = weight, codes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.weight.prompt(x, bias)

    def within(self, dense: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return self.weight.add_tiles(self.codes, dense, bias)


@needs_tiles
def test_w4a8_tiles_read_every_code_where_pack_tiles_put_it():
    """One-hot inputs read the codes back through the tile layout, output by output, in order."""
    g = torch.Generator().manual_seed(15)
    codes = torch.randint(-8, 8, (48, 192), generator=g, dtype=torch.int8)
    packed = kernels_avx2.W4A8Weight.pack(("int4", codes, torch.ones(48, 3)))
    assert packed.add_tiles(codes, codes.float(), None)
    got = packed.prompt(torch.eye(192) * 3.0, None) / 3.0
    assert torch.equal(got.t().round().to(torch.int8), codes)


def test_w4a8_tiles_are_not_packed_where_the_layout_or_the_host_cannot_take_them(monkeypatch):
    """Outputs not a multiple of 16 keep w4a8 for prompt rows, as does every shape where neither AMX nor the VNNI
    build runs; RTK_AMX=0 on a VNNI build takes the lanes' kernel."""
    g = torch.Generator().manual_seed(16)
    lin = w4a16_linear(40, 128, 64, g)
    packed = kernels_avx2.W4A8Weight.pack(("int4", lin.codes.codes, lin.codes.scale))
    assert not packed.add_tiles(lin.codes.codes, lin.weight, None) and packed.tiles is None
    x = torch.randn(20, 128, generator=g)
    assert torch.equal(packed.prompt(x, None), packed(x, None))
    lin = w4a16_linear(48, 128, 64, g)
    monkeypatch.setenv("RTK_AMX", "0")
    assert not kernels_avx2.prompt_tiles()
    packed = kernels_avx2.W4A8Weight.pack(("int4", lin.codes.codes, lin.codes.scale))
    vnni = kernels_avx2.library() == "rtk_vnni"
    assert packed.add_tiles(lin.codes.codes, lin.weight, None) == vnni and not packed.amx
    monkeypatch.setattr(kernels_avx2, "prompt_lanes", lambda: False)  # the AVX2 build (RTK_VNNI=0, no VNNI)
    packed = kernels_avx2.W4A8Weight.pack(("int4", lin.codes.codes, lin.codes.scale))
    assert not packed.add_tiles(lin.codes.codes, lin.weight, None) and packed.tiles is None


@pytest.mark.parametrize(
    "fmt,head,layers,reach_bound",
    [
        ("int8_sq", "rtk-avx2-w8a8-blockwise", "rtk-avx2-w8a8", 0.02),
        # every layer's inputs quantized per block, through 2 random layers: ~2.6 % of the largest logit here
        ("int4_awq", "rtk-avx2-w4a8", "rtk-avx2-w4a8", 0.05),
    ],
)
def test_float32_engine_on_an_export_with_a_quantized_head(tmp_path, tiny_llama_dir, fmt, head, layers, reach_bound):
    """A real ModelOpt INT8-SQ or INT4-AWQ export with ``quantize_lm_head`` (tiny Llama) on a float32 engine: the
    weight-only projections (the INT8 head; INT4's head and layers) run integer products over inputs quantized
    per block of 32, the logits stay within that quantization's reach of the dense float32 path (the export's
    arithmetic), every greedy token is that path's best or within that reach of it (the random model has
    near-ties; the real model's chat replies are checked in docs/engine-measurements.md), and the perplexity is the
    quality report's within the issue's 0.5 %.  Where AVX512-VNNI's lanes take every INT4 row, the head's logit rows
    too, and the tiles they read (not the codes) are the ones moved onto 2 MiB pages."""
    import json

    from conftest import spec_for
    from test_runtime_engine import greedy

    from toolkit.quality import eval_token_lists, perplexity
    from toolkit.quantize import quantize

    calib = {"calibration": {"num_samples": 4, "max_length": 32, "batch_size": 4}, "eval_samples": 4}
    spec = spec_for(
        f"tiny-{fmt}-head",
        tiny_llama_dir,
        quantization={"format": fmt, "quantize_lm_head": True, "max_perplexity_increase": 100.0, **calib},
    )
    out = quantize(spec, checkpoint=tiny_llama_dir, output=tmp_path / "quantized").path
    cfg = dict(max_batch_size=4, max_input_len=128, max_seq_len=256, tokens_per_block=16, dtype="float32")
    fast = Engine(out / "hf", EngineConfig(**cfg, max_num_tokens=64))
    dense = Engine(out / "hf", EngineConfig(**cfg, max_num_tokens=64, cpu_kernels=False))
    assert fast.model.lm_head.kernel == head and dense.model.lm_head.kernel == "dense"
    assert {g.parts[0].kernel for layer in fast.model.layers for g in (layer.qkv, layer.o, layer.gate_up)} == {layers}
    lanes = [
        p.int_products for p in [fast.model.lm_head, *fast.model.projections] if getattr(p.int_products, "lanes", False)
    ]
    assert len(lanes) == (len(fast.model.projections) + 1 if fmt == "int4_awq" and kernels_avx2.prompt_lanes() else 0)
    if lanes:  # the lanes read the tiles for every row: they, not the codes, lie in the huge pages' one region
        assert len({w.tiles.untyped_storage().data_ptr() for w in lanes}) == 1
        assert len({w.codes.untyped_storage().data_ptr() for w in lanes}) == len(lanes)
    ids = torch.randint(3, 1000, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    got, want = fast.prompt_logits(ids), dense.prompt_logits(ids)
    reach = (got - want).abs().max()
    assert reach <= reach_bound * want.abs().max()
    best = want.gather(1, got.argmax(-1)[:, None])[:, 0]  # the dense path's logit of each position's choice
    assert bool((best >= want.max(-1).values - 2 * reach).all())
    for n in (5, 33, 70):
        tokens = fast.generate(greedy(ids[:n]))
        forced = dense.prompt_logits(ids[:n] + tokens)[n - 1 : -1]  # the dense path's logits at each choice
        chosen = forced.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert bool((chosen >= forced.max(-1).values - 2 * reach).all())
    report = json.loads((out / "quality.json").read_text())
    from transformers import AutoTokenizer

    texts = eval_token_lists(AutoTokenizer.from_pretrained(out / "hf"), report["eval_texts"])
    ppl = perplexity(lambda x: fast.prompt_logits(x[0].tolist())[None], texts)
    assert ppl == pytest.approx(report["quantized_ppl"], rel=5e-3)  # the bound for faster kernels


def test_float32_engine_reads_an_int8_lm_head_made_at_load(tiny_llama_dir):
    """``lm_head: int8`` on a bf16 checkpoint: the float32 engine's head runs the W8A16 head's kernel (blockwise
    integer products) over codes made at load; logits stay within that rounding's reach of the exported head's
    dense path, and every greedy token is that path's best or within that reach of it."""
    from test_runtime_engine import greedy

    cfg = dict(max_batch_size=4, max_input_len=128, max_seq_len=256, tokens_per_block=16, dtype="float32")
    fast = Engine(tiny_llama_dir, EngineConfig(**cfg, lm_head="int8"))
    dense = Engine(tiny_llama_dir, EngineConfig(**cfg, cpu_kernels=False))
    assert fast.model.lm_head.kernel == "rtk-avx2-w8a8-blockwise" and dense.model.lm_head.kernel == "dense"
    assert Engine(tiny_llama_dir, EngineConfig(**cfg)).model.lm_head.kernel == "rtk-avx2-bf16"
    ids = torch.randint(3, 1000, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    got, want = fast.prompt_logits(ids), dense.prompt_logits(ids)
    reach = (got - want).abs().max()
    assert 0 < reach <= 0.02 * want.abs().max()
    for n in (5, 33, 70):
        tokens = fast.generate(greedy(ids[:n]))
        forced = dense.prompt_logits(ids[:n] + tokens)[n - 1 : -1]
        chosen = forced.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert bool((chosen >= forced.max(-1).values - 2 * reach).all())


# -- decode attention over the float32 paged pool (kernels_avx2.decode_attention) ----------------------


def attention_float64(q, k_pool, v_pool, slots, bounds, scale):
    """Each row's softmax(q . k * scale) weighted sum of v over its own slots, in float64."""
    heads, kv_heads = q.shape[1], k_pool.shape[1]
    rows = []
    for r, (s, e) in enumerate(bounds.tolist()):
        k = k_pool[slots[s:e]].double().repeat_interleave(heads // kv_heads, 1)  # [L, heads, D]
        v = v_pool[slots[s:e]].double().repeat_interleave(heads // kv_heads, 1)
        p = (torch.einsum("hd,lhd->hl", q[r].double(), k) * scale).softmax(-1)
        rows.append(torch.einsum("hl,lhd->hd", p, v).reshape(-1))
    return torch.stack(rows)


def pool_and_rows(heads, kv_heads, head_dim, lens, seed=7, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(2048, kv_heads, head_dim, generator=g) * spread
    v_pool = torch.randn(2048, kv_heads, head_dim, generator=g)
    slots = torch.randperm(2048, generator=g)[: sum(lens)]  # scattered, as a paged pool's blocks may be
    ends = torch.tensor(lens).cumsum(0)
    bounds = torch.stack([ends - torch.tensor(lens), ends], 1)
    q = torch.randn(len(lens), heads, head_dim, generator=g) * spread
    return q, k_pool, v_pool, slots, bounds


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 24), (8, 8, 128)])
@pytest.mark.parametrize("spread", [2.0, 30.0])  # 30: scores thousands apart, most weights underflow
def test_decode_attention_is_each_rows_own_softmax_within_float32_rounding(heads, kv_heads, head_dim, spread):
    import torch.nn.functional as F

    lens = [1, 7, 66, 513]  # one key, a partial block of 8, several, more than SDPA's block of 512
    q, k_pool, v_pool, slots, bounds = pool_and_rows(heads, kv_heads, head_dim, lens, spread=spread)
    scale = head_dim**-0.5
    got = kernels_avx2.decode_attention(q, k_pool, v_pool, slots, bounds, scale)
    want = attention_float64(q, k_pool, v_pool, slots, bounds, scale)
    sdpa = torch.stack(
        [
            F.scaled_dot_product_attention(
                q[r].view(1, heads, 1, head_dim),
                k_pool[slots[s:e]].transpose(0, 1)[None],
                v_pool[slots[s:e]].transpose(0, 1)[None],
                scale=scale,
                enable_gqa=kv_heads != heads,
            ).reshape(-1)
            for r, (s, e) in enumerate(bounds.tolist())
        ]
    )
    err, sdpa_err = (got.double() - want).abs().max().item(), (sdpa.double() - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), (err, sdpa_err)  # float32 rounding, not a wrong weight
    assert err <= 4 * sdpa_err + 1e-7, (err, sdpa_err)  # of SDPA's own float32 order
    # a row depends on itself alone, and q may be a view (the fused qkv rows' first heads)
    alone = torch.cat(
        [
            kernels_avx2.decode_attention(q[r : r + 1], k_pool, v_pool, slots, bounds[r : r + 1], scale)
            for r in range(len(lens))
        ]
    )
    assert torch.equal(alone, got)
    wide = torch.cat([q, torch.randn(len(lens), 2 * kv_heads, head_dim)], 1)
    assert torch.equal(kernels_avx2.decode_attention(wide[:, :heads], k_pool, v_pool, slots, bounds, scale), got)


def test_decode_attention_refuses_what_it_cannot_read():
    q, k_pool, v_pool, slots, bounds = pool_and_rows(9, 3, 64, [5, 9])
    call = kernels_avx2.decode_attention
    with pytest.raises(RuntimeError, match="context slot out of range"):
        call(q, k_pool, v_pool, torch.cat([slots[:-1], torch.tensor([2048])]), bounds, 0.125)
    with pytest.raises(RuntimeError, match="context bound is out of range"):
        call(q, k_pool, v_pool, slots, torch.tensor([[0, 5], [5, 15]]), 0.125)
    with pytest.raises(RuntimeError, match="context bound is out of range"):
        call(q, k_pool, v_pool, slots, torch.tensor([[0, 5], [5, 5]]), 0.125)  # a row with no key
    with pytest.raises(RuntimeError, match="float32"):
        call(q.double(), k_pool, v_pool, slots, bounds, 0.125)
    with pytest.raises(RuntimeError, match="heads of kv_heads"):
        call(q[:, :8], k_pool, v_pool, slots, bounds, 0.125)


def float32_inputs(scale: float) -> torch.Tensor:
    """[64, 576] float32 over 2^-24..2^12 times ``scale``, with every tie of e4m3's rounding (both signs),
    values past its range, signed zeros and a NaN."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 576, generator=g) * torch.exp2(torch.randint(-24, 12, (64, 576), generator=g).float())
    x *= scale
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite value >= 0
    mids = (e4m3[1:] + e4m3[:-1]) / 2  # exact in float32: ties for the rounding
    x[0, : mids.numel()] = mids * scale
    x[1, : mids.numel()] = -mids * scale
    x[2, :5] = torch.tensor([1e4, -1e4, 0.0, -0.0, float("nan")])
    x[3, :4] = torch.tensor([0.5, 1.5, -2.5, 126.5]) * scale  # int8's round half to even (up to float32 rounding)
    return x


@pytest.mark.parametrize("act", [None, "fp8", "int8"])
@pytest.mark.parametrize("pre_quant", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.0173, 3.7])
def test_quantize_input_gives_torchs_bits(act, pre_quant, scale):
    """The one-pass input quantization equals checkpoint.fake_quant (torch's operators) bit for bit, signed
    zeros and NaN included, whatever rows share its call."""
    x = float32_inputs(scale)
    g = torch.Generator().manual_seed(2)
    pqs = torch.rand(576, generator=g) + 0.5 if pre_quant else None
    s = torch.tensor(scale, dtype=torch.float32)
    want = x if pqs is None else x * pqs
    if act is not None:
        want = fake_quant(want, act, s)
    got = kernels_avx2.quantize_input(x, pqs, act, float(s))
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 1  # NaN's bits are not compared
    assert torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))
    one = torch.cat([kernels_avx2.quantize_input(x[i : i + 1], pqs, act, float(s)) for i in range(4)])
    assert torch.equal(one.nan_to_num(0.0).view(torch.int32), got[:4].nan_to_num(0.0).view(torch.int32))


def test_a_float32_projection_checks_the_input_quantization_kernel_at_load(monkeypatch):
    """A float32 projection quantizes its input with rtk's kernel only where it gives torch's bits."""
    g = torch.Generator().manual_seed(9)
    lin = Linear(
        weight=torch.randn(128, 576, generator=g),
        pre_quant_scale=torch.rand(576, generator=g) + 0.5,
        act_quant=ActQuant("fp8", torch.tensor(0.02)),
    )
    proj = Projection([lin], torch.float32, pack=False, gemv_kernel=True)
    assert proj.fused_input
    x = float32_inputs(0.02)[4:8]
    want = fake_quant(x * lin.pre_quant_scale, "fp8", torch.tensor(0.02))
    assert torch.equal(proj._quantize_input(x).view(torch.int32), want.view(torch.int32))
    real = kernels_avx2.quantize_input
    monkeypatch.setattr(kernels_avx2, "quantize_input", lambda x, *a: real(x, *a) * 1.01)  # a kernel that drifted
    assert not Projection([lin], torch.float32, pack=False, gemv_kernel=True).fused_input
    # A W8A8 projection's kernel quantizes its own input: no check at load (it took ~0.1 ms per projection).
    checked = []
    monkeypatch.setattr(Projection, "_fused_input_agrees", lambda self: checked.append(self) or True)
    w8a8 = Projection([w8a8_linear(64, 576, g)], torch.float32, pack=False, gemv_kernel=True)
    assert w8a8.int_products is not None and not w8a8.fused_input and checked == []
    assert Projection([lin], torch.float32, pack=False, gemv_kernel=True).fused_input and len(checked) == 1


@pytest.mark.parametrize("rows, k", [(1, 576), (7, 576), (60, 576), (3, 64), (5, 1536)])
def test_rms_norm_gives_torchs_bits(rows, k):
    """The prompt rows' RMSNorm in one call: ``weight * F.rms_norm(x)`` bit for bit, rows of magnitudes 1e-3 to
    1e3 (the sum of squares is ATen's, everything else one rounding per operation)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    w = torch.randn(k, generator=g)
    assert torch.equal(kernels_avx2.rms_norm(x, w, 1e-5), w * F.rms_norm(x, (k,), eps=1e-5))
    assert torch.equal(kernels_avx2.rms_norm(x.t().contiguous().t(), w, 1e-6), w * F.rms_norm(x, (k,), eps=1e-6))
    with pytest.raises(RuntimeError, match=r"weight must be \[k\] float32"):
        kernels_avx2.rms_norm(x, w[:-1], 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        kernels_avx2.rms_norm(x.double(), w, 1e-5)


def decode_logits_unpadded_and_padded(eng: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """Three sequences decoding with contexts of different lengths: one step's logits through an unpadded plan
    and through a padded, masked one (``decode_batching: attention``'s), the engine's pool and model as they are."""
    from test_runtime_engine import greedy, prompt

    from toolkit.runtime.model import build_plan

    for n in (5, 37, 70):
        eng.add_request(greedy(prompt(n, 300 + n), 40))
    for _ in range(6):  # every prompt prefilled; all three decoding, contexts of different lengths
        eng.step()
    scheduled = eng.scheduler.schedule()
    assert len(scheduled) == 3 and all(n == 1 and not s.prefilling for s, n in scheduled)
    work = [(s.block_table, s.num_cached, 1, False) for s, _ in scheduled]
    ids = torch.tensor([s.tokens[s.num_cached] for s, _ in scheduled])
    with torch.inference_mode():
        plans = [build_plan(work, 16, eng.scheduler.unit, batched=batched) for batched in (False, True)]
        assert plans[1].decode_padded is not None
        a, b = (eng.model.forward(ids, plan, eng.pool) for plan in plans)
    return a, b


def test_a_float32_engine_decodes_through_it_and_its_rows_never_depend_on_the_decode_batching(tiny_llama_dir):
    """Masked, padded attention over every decode row (``decode_batching: attention``) used to round a row
    by its batch; the kernel reads each row's own context, so a padded plan gives the unpadded plan's bits,
    and the engine no longer builds padded plans for it."""
    for fused in (False, True):
        eng = Engine(tiny_llama_dir, EngineConfig(**FUSED_BASE, fused_decode=fused))
        assert eng.model.pool_attention and (eng.model.fused is not None) == fused
        a, b = decode_logits_unpadded_and_padded(eng)
        assert torch.equal(a, b)
    assert not Engine(tiny_llama_dir, EngineConfig(**FUSED_BASE, cpu_kernels=False)).model.pool_attention
    assert not Engine(tiny_llama_dir, EngineConfig(**{**FUSED_BASE, "dtype": "bfloat16"})).model.pool_attention


def test_huge_pages_move_the_decode_weights_and_pool_and_change_no_bit(tmp_path, tiny_llama_dir):
    from test_runtime_fused_decode import forced_logits, prompt

    engines = {huge: Engine(tiny_llama_dir, EngineConfig(**FUSED_BASE, huge_pages=huge)) for huge in (False, True)}
    parts = [p for layer in engines[True].model.layers for g in (layer.qkv, layer.down) for p in g.parts]
    regions = {p.fp32_gemv.weights.untyped_storage().data_ptr() for p in parts}
    regions.add(engines[True].model.lm_head.fp32_gemv.weights.untyped_storage().data_ptr())
    assert len(regions) == 1  # every streamed weight in the one advised region
    assert engines[True].pool.k.data_ptr() % (2 << 20) == 0
    prompts, forced = [prompt(9, 1), prompt(40, 2)], [prompt(6, 10), prompt(6, 11)]
    on, off = (forced_logits(engines[huge], prompts, forced) for huge in (True, False))
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


# -- the float32 fused decode step (kernels_avx2.DecodeLayers) -----------------------------------------

# "attention": these tests check that a row's bits never depend on its step ("auto" takes "full" for INT4 on AMX)
FUSED_BASE = dict(
    max_batch_size=8,
    max_num_tokens=64,
    max_input_len=256,
    max_seq_len=512,
    tokens_per_block=16,
    dtype="float32",
    decode_batching="attention",
)


def fused_matches_operators(path, what: str, batch: int = 3, steps: int = 10, **kw) -> None:
    """Every decode step's logits through the fused float32 step equal torch's operators' (the same kernels for
    the projections) bit for bit; MKL's float32 decode rows (``cpu_kernels: false``) differ, so it can fail."""
    from test_runtime_fused_decode import forced_logits, prompt

    fused = Engine(path, EngineConfig(**{**FUSED_BASE, **kw}))
    assert isinstance(fused.model.fused, kernels_avx2.DecodeLayers)
    operators = Engine(path, EngineConfig(**{**FUSED_BASE, **kw}, fused_decode=False))
    assert operators.model.fused is None
    mkl = Engine(path, EngineConfig(**{**FUSED_BASE, **kw}, cpu_kernels=False))
    prompts = [prompt(n, seed) for n, seed in [(5, 1), (37, 2), (16, 3), (70, 4)][:batch]]
    forced = [prompt(steps, 10 + i) for i in range(batch)]
    got, want, other = (forced_logits(e, prompts, forced) for e in (fused, operators, mkl))
    for step, (a, b, c) in enumerate(zip(got, want, other, strict=True)):
        assert torch.equal(a, b), f"{what}, step {step}: max difference {(a - b).abs().max().item()}"
        assert not torch.equal(a, c)


@pytest.mark.parametrize("batch,batching", [(1, "attention"), (3, "attention"), (3, "exact"), (4, "full")])
def test_float32_fused_decode_gives_the_operators_bits(tiny_llama_dir, batch, batching):
    fused_matches_operators(tiny_llama_dir, f"bf16 weights, batch {batch}, {batching}", batch, decode_batching=batching)


def test_float32_fused_decode_with_one_kv_head_and_biases(tmp_path, smollm2_tokenizer_dir):
    from conftest import make_tiny_llama

    path = make_tiny_llama(tmp_path / "mqa", smollm2_tokenizer_dir, seed=3, num_key_value_heads=1, attention_bias=True)
    fused_matches_operators(path, "one KV head, q/k/v biases")


# quantization sections of the real tiny exports below; int8_sq_w8a16_down: W8A16 down projections among W8A8
# ones (quantization.weight_only_modules), which the float32 engine runs through the blockwise kernel
EXPORTS = {
    "fp8": {"format": "fp8"},
    "int8_sq": {"format": "int8_sq"},
    "int8_sq_w8a16_down": {"format": "int8_sq", "weight_only_modules": ["down_proj"]},
    "int4_awq": {"format": "int4_awq"},
}


@pytest.mark.parametrize(
    "fmt,drifted",
    [("fp8", False), ("fp8", True), ("int8_sq", False), ("int8_sq_w8a16_down", False), ("int4_awq", False)],
)
def test_float32_fused_decode_on_real_exports(tmp_path, tiny_llama_dir, fmt, drifted, monkeypatch):
    """FP8 (the GEMV over e4m3 codes after the input's FP8 quantize-dequantize), INT8-SQ (W8A8) and INT8-SQ
    with W8A16 down projections (blockwise integer products).  Where rtk's input quantization is off
    torch's bits (``drifted``: checked at load), both paths quantize through torch's operators."""
    from conftest import spec_for

    from toolkit.quantize import quantize

    calib = {"calibration": {"num_samples": 4, "max_length": 32, "batch_size": 4}, "eval_samples": 2}
    quantization = {**EXPORTS[fmt], "max_perplexity_increase": 100.0, **calib}
    spec = spec_for(f"tiny-{fmt}", tiny_llama_dir, quantization=quantization)
    hf = quantize(spec, checkpoint=tiny_llama_dir, output=tmp_path / "quantized").path / "hf"
    if drifted:
        real = kernels_avx2.quantize_input
        monkeypatch.setattr(kernels_avx2, "quantize_input", lambda x, *a: real(x, *a) * 1.01)
        assert not any(p.fused_input for p in Engine(hf, EngineConfig(**FUSED_BASE)).model.layers[0].qkv.parts)
    fused_matches_operators(hf, fmt + (", torch's input quantization" if drifted else ""))


def test_float32_fused_decode_in_mixed_steps_and_where_it_does_not_apply(tmp_path, tiny_llama_dir):
    """Generation with a long prompt arriving mid-stream (decode rows fused, prompt rows through the operators)
    gives the tokens of the request alone; a quantized KV cache keeps the operators."""
    from conftest import with_kv_cache_scales
    from test_runtime_fused_decode import prompt, tokens_beside_a_long_prompt

    ids = prompt(9, 5)
    alone = Engine(tiny_llama_dir, EngineConfig(**FUSED_BASE)).generate(GenerationRequest(ids, 20, end_id=-1))
    assert tokens_beside_a_long_prompt(Engine(tiny_llama_dir, EngineConfig(**FUSED_BASE)), ids) == alone
    kv = with_kv_cache_scales(tiny_llama_dir, tmp_path / "kv-fp8", "FP8", (0.02, 0.01))
    assert Engine(kv, EngineConfig(**FUSED_BASE)).model.fused is None
    assert Engine(tiny_llama_dir, EngineConfig(**FUSED_BASE, cpu_kernels=False)).model.fused is None


@pytest.mark.parametrize("fmt", ["int8_sq", "int8_sq_w8a16_down", "int4_awq", "fp8", "none"])
def test_float32_steps_with_prompt_rows_give_the_operators_bits(tmp_path, tiny_llama_dir, fmt):
    """A step's prompt rows go through the fused layers too (forward_rows): W8A8 projections take every row
    (a row's result is its own), GEMV ones (bf16 weights, FP8 codes) their decode rows while MKL takes the
    prompt rows, as model.Projection splits them.  Steps mixing decode rows with prompt chunks (from
    position 0, after cached positions, several attention units) give torch's operators' logits bit for
    bit, and the tokens of a request alone."""
    from conftest import spec_for
    from test_runtime_fused_decode import prompt, tokens_beside_a_long_prompt

    from toolkit.quantize import quantize
    from toolkit.runtime.model import build_plan

    hf = tiny_llama_dir
    if fmt != "none":
        calib = {"calibration": {"num_samples": 4, "max_length": 32, "batch_size": 4}, "eval_samples": 2}
        quantization = {**EXPORTS[fmt], "max_perplexity_increase": 100.0, **calib}
        spec = spec_for(f"tiny-{fmt}-rows", tiny_llama_dir, quantization=quantization)
        hf = quantize(spec, checkpoint=tiny_llama_dir, output=tmp_path / "quantized").path / "hf"
    fused = Engine(hf, EngineConfig(**FUSED_BASE))
    assert fused.model.fused.takes_prompt_rows
    kernels = {g.parts[0].kernel for layer in fused.model.layers for g in (layer.qkv, layer.o, layer.gate_up)}
    gemv = {"int4_awq": "w4a8", "fp8": "fp8", "none": "bf16"}.get(fmt, "w8a8")
    assert kernels == {f"rtk-avx2-{gemv}"}
    down = {layer.down.parts[0].kernel for layer in fused.model.layers}
    assert down == ({"rtk-avx2-w8a8-blockwise"} if fmt == "int8_sq_w8a16_down" else kernels)
    operators = Engine(hf, EngineConfig(**FUSED_BASE, fused_decode=False))
    tpb, unit = FUSED_BASE["tokens_per_block"], 8
    a, b, c, d = prompt(21, 1), prompt(46, 2), prompt(12, 3), prompt(8, 4)
    tables = [list(range(i * 40, (i + 1) * 40)) for i in range(4)]
    steps = [  # (table, cached, ids, is_prompt): decode rows first, then prompt chunks
        [(0, 0, a, True), (1, 0, b[:16], True)],  # two prompts from position 0 (their own K/V)
        [(0, 21, [7], False), (1, 16, b[16:46], True), (2, 0, c, True)],  # 30 rows after 16 cached: 4 units
        [(0, 22, [9], False), (1, 46, [11], False), (2, 12, [13], False)],  # decode rows alone
        # few prompt rows, from position 0 and after cached ones: fewer than MKL's row-invariant count
        # (Projection.min_rows, 12 on the AVX2 host), so padded with zero rows as Projection pads them
        [(0, 23, [5], False), (3, 0, d[:5], True)],
        [(0, 24, [6], False), (1, 47, [8], False), (3, 5, d[5:], True)],
        [(0, 25, [1], False), (1, 48, [2], False), (2, 13, [3], False), (3, 8, [4], False)],  # 4 decode rows
    ]

    def logits(engine) -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for step in steps:
                work = [(tables[t], cached, len(ids), is_prompt) for t, cached, ids, is_prompt in step]
                ids = torch.tensor([i for _, _, row_ids, _ in step for i in row_ids])
                out.append(engine.model.forward(ids, build_plan(work, tpb, unit), engine.pool))
        return out

    pairs = [(fused, operators)]
    if fmt == "int4_awq":  # decode_batching "full": INT4 calls of 8 rows or more through AMX's tiles, on both paths
        full = {**FUSED_BASE, "decode_batching": "full"}
        pairs.append((Engine(hf, EngineConfig(**full)), Engine(hf, EngineConfig(**full, fused_decode=False))))
        auto = Engine(hf, EngineConfig(**{**FUSED_BASE, "decode_batching": "auto"}))  # full where the tiles run
        assert auto.decode_batching == ("full" if kernels_avx2.prompt_tiles() else "attention")
        assert auto.model.batch_invariant == (auto.decode_batching != "full")
        assert ("calls of 8+ rows" in auto.model.kernels) == kernels_avx2.prompt_tiles()
    for pair in pairs:
        for i, (x, y) in enumerate(zip(*map(logits, pair), strict=True)):
            assert torch.equal(x, y), f"step {i}: max difference {(x - y).abs().max().item()}"
    # a plan whose attention units leave prompt rows out is refused, not half computed
    work = [(tables[1], 16, 30, True)]
    plan = build_plan(work, tpb, unit)
    plan.prefills[0].units = plan.prefills[0].units[:-1]
    h = torch.zeros(30, fused.model_config.hidden_size)
    with pytest.raises(RuntimeError, match="units must cover each chunk's rows in order"):
        fused.model.fused.forward_rows(h, plan, fused.pool, 0, 1)
    ids = prompt(9, 5)
    alone = Engine(hf, EngineConfig(**FUSED_BASE)).generate(GenerationRequest(ids, 20, end_id=-1))
    assert tokens_beside_a_long_prompt(Engine(hf, EngineConfig(**FUSED_BASE)), ids) == alone


# -- the VNNI build: the same source, the integer products' lane sums in one vpdpbusd ------------------

needs_vnni = pytest.mark.skipif(
    not kernels.cpu_has(kernels_avx2.VNNI_CPU_FLAGS),
    reason="the VNNI build needs AVX512-VNNI (Intel Ice Lake / Cascade Lake, AMD Zen 4 and later)",
)


def both_builds():
    """``torch.ops.rtk_avx2`` and ``torch.ops.rtk_vnni``, each built and loaded, and their shared objects."""
    builds = []
    for name, flags in (("rtk_avx2", kernels_avx2.FLAGS), ("rtk_vnni", kernels_avx2.VNNI_FLAGS)):
        assert kernels.build_and_load(name, kernels_avx2.SOURCE, flags) or hasattr(getattr(torch.ops, name), "gemv")
        builds.append((getattr(torch.ops, name), kernels.build_dir(kernels_avx2.SOURCE, flags) / f"{name}.so"))
    return builds


GEMV_SHAPES = [("bf16", 960, 576), ("bf16", 77, 48), ("fp8", 64, 1536), ("int8", 33, 576), ("int4", 77, 40)]


@needs_vnni
def test_the_vnni_build_is_preferred_and_gives_the_avx2_builds_bits(monkeypatch):
    """On a VNNI CPU the engine takes ``rtk_vnni`` (``RTK_VNNI=0`` keeps AVX2), whose W8A8, blockwise W8A8,
    W4A8 products and GEMV are the AVX2 build's bits at every row count (integer lane sums: one vpdpbusd there,
    vpmaddubsw + vpmaddwd here; GEMV calls, blockwise and W4A8 ones of 2 rows or more in 512-bit registers holding two
    outputs each), and whose machine code really has the instruction, on 512-bit registers too; a SmoothQuant
    weight packed there carries its codes in the export's order for oneDNN's int8 GEMM, again the same bits."""
    import shutil
    import subprocess

    assert kernels_avx2.library() == "rtk_vnni"
    monkeypatch.setenv("RTK_VNNI", "0")
    assert not kernels_avx2.wants_vnni()
    (avx2, avx2_so), (vnni, vnni_so) = both_builds()
    if shutil.which("objdump"):
        code = {
            so: subprocess.run(["objdump", "-d", so], capture_output=True, text=True).stdout
            for so in (avx2_so, vnni_so)
        }
        assert "vpdpbusd" in code[vnni_so] and "vpdpbusd" not in code[avx2_so]
        assert any("vpdpbusd" in line and "zmm" in line for line in code[vnni_so].splitlines())
    g = torch.Generator().manual_seed(21)
    sq = w8a8_linear(960, 576, g)
    w8 = kernels_avx2.W8A8Weight.pack(("int8", sq.codes.codes, sq.codes.scale), sq.act_quant.scale)
    assert torch.equal(w8.plain, sq.codes.codes) and w8.nbytes == 960 * 576 + 960 * 4  # one row reads the codes
    wo = w8a16_linear(576, 1536, g)
    blockwise = kernels_avx2.W8A8Weight.pack(("int8", wo.codes.codes, wo.codes.scale), None)
    wo_odd = w8a16_linear(101, 1536, g)  # 50 pairs (tiles of 4 and a rest) and a last output alone
    blockwise_odd = kernels_avx2.W8A8Weight.pack(("int8", wo_odd.codes.codes, wo_odd.codes.scale), None)
    awq = [w4a16_linear(960, 576, 64, g), w4a16_linear(64, 1536, 128, g), w4a16_linear(33, 384, 192, g)]
    w4 = [kernels_avx2.W4A8Weight.pack(("int4", a.codes.codes, a.codes.scale)) for a in awq]
    pqs = torch.rand(576, generator=g) + 0.5
    # the GEMV over bf16 (paired in blocks of 16), FP8 and INT8 codes (groups with a last 8), odd outputs
    gemv_weights = [kernels_avx2.Fp32Weight.pack(*weights(kind, n, k, g)) for kind, n, k in GEMV_SHAPES]
    # 2 rows on: the VNNI build's 512-bit tiles (two outputs a register), in tiles of 4 rows and 16
    for rows in (1, 2, 3, 4, 5, 16, 37, 64):
        x384, x576, x1536 = (torch.randn(rows, k, generator=g) * 2 for k in (384, 576, 1536))
        calls = [
            ("w8a8", (x576, w8.act_scale_value, w8.codes, w8.scales, None, None)),
            ("w8a8", (x576, w8.act_scale_value, w8.codes, w8.scales, None, pqs)),
            ("w8a8_blockwise", (x1536, blockwise.codes, blockwise.scales, None)),
            ("w8a8_blockwise", (x1536, blockwise_odd.codes, blockwise_odd.scales, None)),
            ("w4a8", (x576, w4[0].codes, w4[0].scales, None)),
            ("w4a8", (x1536, w4[1].codes, w4[1].scales, None)),
            ("w4a8", (x384, w4[2].codes, w4[2].scales, None)),
        ]
        for w in gemv_weights:
            x = torch.randn(rows, w.weights.shape[1], generator=g)
            args = (x, w.weights, kernels_avx2.KINDS[w.kind], w.scales, None)
            calls.append((f"gemv {w.kind} {tuple(w.weights.shape)}", args))
        for name, args in calls:
            op = name.split()[0]
            assert torch.equal(getattr(vnni, op)(*args), getattr(avx2, op)(*args)), (rows, name)
        # with the codes in the export's order too, calls of 6 rows or more take oneDNN's int8 GEMM: the same bits
        bias = torch.randn(960, generator=g)
        idot = avx2.w8a8(x576, w8.act_scale_value, w8.codes, w8.scales, bias, pqs)
        assert torch.equal(vnni.w8a8(x576, w8.act_scale_value, w8.codes, w8.scales, bias, pqs, w8.plain), idot), rows


@pytest.mark.parametrize("library", ["float32 engines' (kernels_avx2)", "bf16 engines' (kernels)"])
def test_argmax_rows_gives_torch_argmax_indices_ties_infinities_and_nans_included(library):
    """The greedy tokens' kernel (argmax_rows.h, in both libraries): the index torch.argmax gives, the first of equal
    largest values (+0 and -0 equal), infinities, a NaN counted as the largest (the first NaN); rows of any length."""
    if library.startswith("bf16") and not kernels.available():
        pytest.skip("the bf16 engines' kernels need AVX512-BF16 and AVX512-VBMI")
    argmax_rows = kernels.argmax_rows if library.startswith("bf16") else kernels_avx2.argmax_rows
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 49152, 49157):
        x = torch.randn(3, n, generator=g)
        nan, inf = x.clone(), x.clone()
        nan[:, n // 2] = float("nan")
        nan[1, -1] = float("nan")
        inf[:, n // 3] = float("inf")
        inf[:, -1] = float("inf")
        signed_zeros = torch.zeros(3, n)
        signed_zeros[:, ::2] = -0.0
        for rows in (x, x.round(), nan, inf, signed_zeros, torch.full((3, n), float("-inf")), x[:1]):
            assert torch.equal(argmax_rows(rows), torch.argmax(rows, dim=-1)), (n, rows[:, :4])
