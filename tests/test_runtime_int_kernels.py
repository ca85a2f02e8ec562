"""Quantized weights read as codes by the CPU engine's decode GEMVs instead of dequantized bf16.

* rtk's own GEMV (``cpu_kernels``, toolkit/runtime/kernels.cpp) reads FP8, INT8 and INT4 codes and
  rebuilds the dense bf16 weights in registers: its logits equal the dense path's bit for bit.
* torch's W8A16 / W4A16 CPU kernels (``int_weight_kernels`` without rtk's kernels) round
  differently (bf16 scales, their own accumulation order), so agreement with the dense product
  (``codes * scale``, what the quality report and TensorRT-LLM compute) is within a stated
  tolerance; batch invariance stays exact.
"""

from __future__ import annotations

import pytest
import torch

from toolkit.runtime.checkpoint import Linear, WeightCodes
from toolkit.runtime.model import INT_MAX_ROWS, Projection, bf16_is_fast

pytestmark = pytest.mark.skipif(not bf16_is_fast(), reason="integer kernels are used with bf16 compute only")


def int_linear(out_f: int, in_f: int, bits: int, seed: int, group: int = 64) -> Linear:
    """Random codes and scales; ``bits`` 8 (INT8, per-output scales), 4 (INT4, per group), or "fp8" (one scale)."""
    g = torch.Generator().manual_seed(seed)
    if bits == "fp8":
        codes = (torch.randn(out_f, in_f, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.full((out_f,), 3.7e-4)
        return Linear(weight=codes.float() * scale[:, None], codes=WeightCodes(8, codes, scale))
    if bits == 8:
        codes = torch.randint(-127, 128, (out_f, in_f), generator=g, dtype=torch.int8)
        scale = torch.rand(out_f, generator=g) * 1e-3 + 1e-4
        weight = codes.float() * scale[:, None]
        return Linear(weight=weight, codes=WeightCodes(8, codes, scale))
    codes = torch.randint(-8, 8, (out_f, in_f), generator=g, dtype=torch.int8)
    scale = torch.rand(out_f, in_f // group, generator=g) * 1e-2 + 1e-3
    weight = codes.float() * scale.repeat_interleave(group, dim=1)
    return Linear(weight=weight, codes=WeightCodes(4, codes, scale, group))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536)])  # SmolLM2's fused q/k/v and down_proj
def test_integer_kernel_matches_the_dequantized_product(bits, shape):
    lin = int_linear(*shape, bits=bits, seed=bits)
    proj = Projection([lin], torch.bfloat16, pack=True, int_kernels=True)
    assert proj.kernel == f"int{bits}"
    bf16_bytes = shape[0] * shape[1] * 2
    assert proj.nbytes < bf16_bytes * (0.55 if bits == 8 else 0.3)  # codes (and scales), not bf16
    x = torch.randn(12, shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.inference_mode():
        got = proj(x).float()
        ref = x.float() @ lin.weight.t()
    # bf16 output rounding (2^-8 relative) plus bf16 scales: well under 1 % of the output's scale
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max()
    dense = Projection([lin], torch.bfloat16, pack=True, int_kernels=False)
    assert dense.kernel == "packed"


@pytest.mark.parametrize("bits", [8, 4])
def test_integer_kernel_rows_do_not_depend_on_the_batch(bits):
    lin = int_linear(576, 1536, bits=bits, seed=3)
    proj = Projection([lin], torch.bfloat16, pack=True, int_kernels=True)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        batch = proj(x, singles=40)  # 40 decode rows: one call of the integer kernel
        for i in range(8):
            assert torch.equal(proj(x[i : i + 1], singles=1), batch[i : i + 1]), f"decode row {i}"
        assert torch.equal(proj(x[8:20], singles=12), batch[8:20])
        prompt = proj(x)  # prompt rows (bf16 weights) in other groupings
        assert torch.equal(proj(x[8:20]), prompt[8:20])
        mixed = proj(x[28:36], singles=4)
        assert torch.equal(mixed[:4], batch[28:32]) and torch.equal(mixed[4:], prompt[32:36])


def test_fused_group_uses_integer_kernels_only_when_every_part_has_codes():
    from toolkit.runtime.model import FusedGroup

    a, b = int_linear(192, 576, bits=4, seed=5), int_linear(192, 576, bits=4, seed=6)
    fused = FusedGroup([a, b], torch.bfloat16, pack=True, int_kernels=True)
    assert [p.kernel for p in fused.parts] == ["int4"]
    plain = Linear(weight=b.weight)  # no codes (e.g. an excluded module): the group stays dense
    mixed = FusedGroup([a, plain], torch.bfloat16, pack=True, int_kernels=True)
    assert [p.kernel for p in mixed.parts] == ["packed"]


@pytest.mark.parametrize("fmt,bits", [("int4_awq", 4), ("int8_sq", 8)])
def test_engine_reads_integer_codes_of_an_export(tmp_path, tiny_llama_dir, fmt, bits):
    """A real ModelOpt export (tiny Llama): torch's integer kernels against the engine's dense path."""
    from conftest import spec_for

    from toolkit.quantize import quantize
    from toolkit.runtime.engine import Engine, EngineConfig

    calib = {
        "calibration": {"num_samples": 4, "max_length": 32, "batch_size": 4},
        "eval_samples": 2,
        "max_perplexity_increase": 100.0,
    }
    spec = spec_for(f"tiny-{fmt}", tiny_llama_dir, quantization={"format": fmt, **calib})
    hf = quantize(spec, checkpoint=tiny_llama_dir, output=tmp_path / "quantized").path / "hf"
    cfg = dict(max_batch_size=2, max_num_tokens=64, max_input_len=128, max_seq_len=256, tokens_per_block=16)
    fast = Engine(hf, EngineConfig(**cfg, cpu_kernels=False))
    dense = Engine(hf, EngineConfig(**cfg, int_weight_kernels=False, cpu_kernels=False))
    exact = Engine(hf, EngineConfig(**cfg, dtype="float32"))  # the quality report's arithmetic
    kernels = {
        p.kernel
        for layer in fast.model.layers
        for g in (layer.qkv, layer.o, layer.gate_up, layer.down)
        for p in g.parts
    }
    assert kernels == {f"int{bits}"}  # decode_batching "full" switches INT8 to bf16 above a few rows
    assert fast.model.weight_bytes_per_token < dense.model.weight_bytes_per_token
    ids = torch.randint(3, 1000, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    # The kernels round differently from dense bf16 (bf16 scales, their accumulation order), but must
    # be as faithful to the float32 result as dense bf16 is; W8A8's activation rounding to int8
    # amplifies any rounding difference from layer to layer on this random model (~4 % for both).
    assert_as_faithful_as_dense_bf16(fast.prompt_logits(ids), dense.prompt_logits(ids), exact.prompt_logits(ids))


def assert_as_faithful_as_dense_bf16(got: torch.Tensor, bf16: torch.Tensor, ref: torch.Tensor) -> None:
    """``got``'s logits are as close to float32's ``ref`` as the dense bf16 path's: relative error and
    the share of positions with float32's argmax."""

    def error(x):
        return ((x - ref).norm() / ref.norm()).item(), (x.argmax(-1) == ref.argmax(-1)).float().mean().item()

    (err_k, same_k), (err_d, same_d) = error(got), error(bf16)
    assert err_k <= 1.25 * err_d + 1e-3, (err_k, err_d)
    assert same_k >= same_d - 0.05, (same_k, same_d)


@pytest.mark.parametrize("bits", [8, 4])
def test_prompt_rows_use_the_bf16_weights(bits):
    """Decode rows go through the integer kernel, prompt rows through the bf16 weights (the integer
    kernels' cost grows fast with rows); with full batching the call's row count decides."""
    lin = int_linear(576, 1536, bits=bits, seed=7)
    proj = Projection([lin], torch.bfloat16, pack=True, int_kernels=True)
    full = Projection([lin], torch.bfloat16, pack=True, int_kernels=True, full_batching=True)
    dense = Projection([lin], torch.bfloat16, pack=True, int_kernels=False)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(3)).bfloat16()
    limit = INT_MAX_ROWS[bits]
    with torch.inference_mode():
        rows = proj(x, singles=3)
        assert torch.equal(rows[3:], dense(x[3:]))  # prompt rows: the dense path's bits
        assert torch.equal(rows[:3], proj(x[:3], singles=3))  # decode rows: the integer kernel
        assert not torch.equal(rows[:3], dense(x[:3]))
        # full batching (singles=None): by row count
        assert torch.equal(full(x[:limit], singles=None), proj(x[:limit], singles=limit))
        assert torch.equal(full(x, singles=None), dense(x, singles=None))


def step_logits(engine, prompts: list[list[int]], new_tokens: int = 10) -> list[torch.Tensor]:
    """Every forward's logits while ``prompts`` generate: the first alone, then all together."""
    from toolkit.runtime.engine import GenerationRequest

    steps: list[torch.Tensor] = []
    forward = engine.model.forward

    def record(*args):
        steps.append(forward(*args))
        return steps[-1]

    engine.model.forward = record
    engine.generate(GenerationRequest(prompt_ids=prompts[0], max_new_tokens=new_tokens, end_id=-1))
    for p in prompts:
        engine.add_request(GenerationRequest(prompt_ids=p, max_new_tokens=new_tokens, end_id=-1))
    while engine.has_work():
        engine.step()
    return steps


@pytest.mark.parametrize("fmt", ["fp8", "int8_sq", "int4_awq"])
def test_rtk_gemv_over_the_codes_gives_the_dense_paths_bits(tmp_path, tiny_llama_dir, fmt):
    """A real ModelOpt export (tiny Llama): decoding through rtk's GEMV over the codes and its fused decode
    step, alone and three sequences together, gives every step the logits of the dense bf16 path
    (torch's operators) exactly; where rtk's GEMV rounds its own way (AMX hosts; its codes kernels then give
    its bf16 GEMV's bits, tests/test_runtime_kernels.py), the same tokens and logits within a tolerance."""
    from conftest import same_tokens_logit_gap, spec_for

    from toolkit.quantize import quantize
    from toolkit.runtime import kernels
    from toolkit.runtime.engine import Engine, EngineConfig

    if not kernels.available():
        pytest.skip("rtk's CPU kernels are not available on this host")
    calib = {"calibration": {"num_samples": 4, "max_length": 32, "batch_size": 4}, "eval_samples": 2}
    spec = spec_for(
        f"tiny-{fmt}", tiny_llama_dir, quantization={"format": fmt, "max_perplexity_increase": 100.0, **calib}
    )
    hf = quantize(spec, checkpoint=tiny_llama_dir, output=tmp_path / "quantized").path / "hf"
    # each decode row attends alone on both sides (SDPA per row; with rtk's kernels its bits in one call,
    # kernels.sdpa_decode): "attention" batching would pad the dense path's rows only
    cfg = dict(max_batch_size=4, max_num_tokens=64, max_input_len=128, max_seq_len=256, tokens_per_block=16)
    cfg["decode_batching"] = "exact"
    # a bf16 engine (dtype auto takes float32 for int8 / int4 codes where rtk's VNNI integer products run)
    fast = Engine(hf, EngineConfig(**cfg, int4_gemv="exact", dtype="bfloat16"))  # INT4's group sums: not bit-exact
    assert fast.model.fused is not None
    dense = Engine(hf, EngineConfig(**cfg, int_weight_kernels=False, cpu_kernels=False))
    kind = {"fp8": "fp8-table", "int8_sq": "int8", "int4_awq": "int4"}[fmt]  # per-tensor FP8: the table
    used = {
        p.kernel
        for layer in fast.model.layers
        for g in (layer.qkv, layer.o, layer.gate_up, layer.down)
        for p in g.parts
    }
    assert used == {f"rtk-{kind}"}
    layer_bytes = [sum(layer.nbytes for layer in e.model.layers) for e in (fast, dense)]
    assert layer_bytes[0] < (0.55 if kind != "int4" else 0.35) * layer_bytes[1]  # codes, not bf16
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (21, 9, 34)]
    got, want = step_logits(fast, prompts), step_logits(dense, prompts)
    assert len(got) == len(want) > 15
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        if not fast.model.gemv_own_rounding:
            assert torch.equal(a, b), f"step {step}"
            continue
        assert same_tokens_logit_gap(a, b) <= 0.05, f"step {step}"


def test_int4_group_sums_decode_close_to_the_dense_path_and_batch_invariant(tmp_path, tiny_llama_dir):
    """A real INT4-AWQ export (tiny Llama) through rtk's int4-dot GEMV (the default): a prompt run one token a
    step (so every position goes through the GEMV) is as faithful to the float32 result (the quality
    report's arithmetic) as the dense bf16 path is; and a request's logits do not depend on what else
    decodes with it."""
    from conftest import spec_for

    from toolkit.quantize import quantize
    from toolkit.runtime import kernels
    from toolkit.runtime.engine import Engine, EngineConfig

    if not kernels.available():
        pytest.skip("rtk's CPU kernels are not available on this host")
    calib = {"calibration": {"num_samples": 4, "max_length": 32, "batch_size": 4}, "eval_samples": 2}
    spec = spec_for(
        "tiny-int4", tiny_llama_dir, quantization={"format": "int4_awq", "max_perplexity_increase": 100.0, **calib}
    )
    hf = quantize(spec, checkpoint=tiny_llama_dir, output=tmp_path / "quantized").path / "hf"
    one = dict(max_batch_size=1, max_num_tokens=1, max_input_len=128, max_seq_len=256, tokens_per_block=16)
    fast = Engine(hf, EngineConfig(**one, dtype="bfloat16"))
    dense = Engine(hf, EngineConfig(**one, int_weight_kernels=False, cpu_kernels=False))
    exact = Engine(hf, EngineConfig(**one, dtype="float32"))
    parts = fast.model.projections
    assert {p.kernel for p in parts} == {"rtk-int4-dot"}
    for p in parts:  # the prompt's one-row calls through the group sums too, as decode rows
        p.own_rounding = False
    ids = torch.randint(3, 1000, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    assert_as_faithful_as_dense_bf16(fast.prompt_logits(ids), dense.prompt_logits(ids), exact.prompt_logits(ids))
    # batch invariance: each request's greedy tokens alone equal its tokens while the three decode together
    from toolkit.runtime.engine import GenerationRequest

    cfg = dict(max_batch_size=4, max_num_tokens=64, max_input_len=128, max_seq_len=256, tokens_per_block=16)
    batched = Engine(hf, EngineConfig(**cfg, enable_kv_cache_reuse=False, dtype="bfloat16"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (21, 9, 34)]
    alone = [batched.generate(GenerationRequest(prompt_ids=p, max_new_tokens=24, end_id=-1)) for p in prompts]
    rids = [batched.add_request(GenerationRequest(prompt_ids=p, max_new_tokens=24, end_id=-1)) for p in prompts]
    together: dict[str, list[int]] = {r: [] for r in rids}
    while batched.has_work():
        for ev in batched.step():
            if ev.token_id is not None:
                together[ev.request_id].append(ev.token_id)
    assert [together[r] for r in rids] == alone


@pytest.mark.parametrize("bits", [8, 4, "fp8"])
def test_rtk_projection_over_codes_gives_one_row_bits_at_any_row_count(bits):
    """INT8 / INT4: up to QUANT_MAX_ROWS decode rows read the codes, more read the bf16 copy; per-tensor FP8
    (the table kernel) reads its codes for every row count (in calls of at most GEMV_MAX_ROWS rows) and keeps no bf16
    GEMV copy.  In AMX's tiles every kind reads its codes for a call of any count, with no bf16 copy.  Every row has
    the bits of the dense weights' one-row product either way."""
    from toolkit.runtime import kernels
    from toolkit.runtime.model import GEMV_MAX_ROWS, QUANT_MAX_ROWS, WHOLE_TILES_MAX_ROWS

    if not kernels.available():
        pytest.skip("rtk's CPU kernels are not available on this host")
    lin = int_linear(576, 1536, bits=bits, seed=11)
    proj = Projection([lin], torch.bfloat16, pack=True, gemv_kernel=True, int4_gemv="exact")
    if bits == "fp8":
        calls = WHOLE_TILES_MAX_ROWS if kernels.tiles_take(1536) else GEMV_MAX_ROWS
        assert proj.kernel == "rtk-fp8-table" and proj.gemv is None and proj.codes_max_rows == calls
    elif kernels.tiles_take(1536):  # each block converted once a call, for all its rows
        assert proj.kernel == f"rtk-int{bits}" and proj.gemv is None and proj.codes_max_rows == WHOLE_TILES_MAX_ROWS
    else:
        assert proj.kernel == f"rtk-int{bits}" and proj.gemv is not None and proj.codes_max_rows == QUANT_MAX_ROWS
    # oneDNN over the dequantized bf16 weights; where rtk's GEMV rounds its own way (AMX hosts), that GEMV over them
    dense = Projection([Linear(weight=lin.weight)], torch.bfloat16, pack=True, gemv_kernel=proj.own_rounding)
    n = GEMV_MAX_ROWS + 2
    x = torch.randn(n, 1536, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.inference_mode():
        one_row = torch.cat([dense(x[i : i + 1], singles=1) for i in range(n)])
        for rows in (1, QUANT_MAX_ROWS, QUANT_MAX_ROWS + 1, 12, GEMV_MAX_ROWS, n):
            assert torch.equal(proj(x[:rows], singles=rows), one_row[:rows]), rows


def test_int4_group_sums_read_the_codes_for_every_row_count():
    """int4-dot rows never switch to a bf16 copy (whose rounding differs): no copy is kept, and a row's
    result is the same in a call of any row count."""
    from toolkit.runtime import kernels
    from toolkit.runtime.model import GEMV_MAX_ROWS

    if not kernels.available():
        pytest.skip("rtk's CPU kernels are not available on this host")
    lin = int_linear(576, 1536, bits=4, seed=11)
    proj = Projection([lin], torch.bfloat16, pack=True, gemv_kernel=True)
    assert proj.kernel == "rtk-int4-dot" and proj.gemv is None and proj.codes_max_rows == GEMV_MAX_ROWS
    n = 2 * GEMV_MAX_ROWS + 2
    x = torch.randn(n, 1536, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.inference_mode():
        one_row = torch.cat([proj(x[i : i + 1], singles=1) for i in range(n)])
        for rows in (2, 5, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, n):
            assert torch.equal(proj(x[:rows], singles=rows), one_row[:rows]), rows
