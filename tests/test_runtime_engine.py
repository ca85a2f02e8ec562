"""The CPU engine on the tiny random Llama, checked against transformers (the independent reference).

The engine computes attention in float32 (its default, ``attention_dtype="float32"``); the
reference is transformers' own model with its SDPA attention run in float32 through a registered
attention function, everything else (embedding, norms, RoPE, MLP, cache, generate) stock.  With
``attention_dtype="model"`` the engine is compared with stock bf16 transformers.  Every comparison
is exact (token for token): the engine reproduces transformers' arithmetic and is batch-invariant
(see docs/engine.md), so batching, chunked prefill, prefix reuse and preemption must not change a
single greedy token.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from toolkit.errors import UsageError
from toolkit.runtime.engine import (
    BackgroundEngine,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from toolkit.runtime.os_threads import ENGINE_THREAD

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 24


def config(**kw) -> EngineConfig:
    base = dict(
        max_batch_size=8,
        max_num_tokens=64,
        max_input_len=256,
        max_seq_len=512,
        tokens_per_block=16,
        decode_batching="exact",
        dtype="bfloat16",  # transformers' dtype here, whatever this CPU's default ("auto") is
    )
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    return Engine(tiny_llama_dir, config())


def transformers_model(path, fp32_attention: bool = True, dtype: torch.dtype = torch.bfloat16):
    """transformers' model (bf16 by default); with ``fp32_attention`` its SDPA runs on float32 q/k/v (as the
    engine's default)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sdpa_fp32(module, query, key, value, attention_mask, **kw):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kw)
        return out.to(query.dtype), weights

    AttentionInterface.register("sdpa_fp32", sdpa_fp32)
    impl = "sdpa_fp32" if fp32_attention else "sdpa"
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=impl).eval()


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return transformers_model(tiny_llama_dir)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


_HF_CACHE: dict = {}


def hf_greedy(model, ids: list[int], n: int = NEW) -> list[int]:
    """transformers' greedy continuation (memoized: several tests ask for the same one)."""
    key = (id(model), tuple(ids), n)
    if key not in _HF_CACHE:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        _HF_CACHE[key] = out[0, len(ids) :].tolist()
    return _HF_CACHE[key]


def greedy(ids: list[int], n: int = NEW, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=ids, max_new_tokens=n, end_id=-1, **kw)


def run(engine: Engine, reqs: list[GenerationRequest], arrivals: dict[int, int] | None = None, max_steps: int = 10_000):
    """Step until done; request i is added before step ``arrivals[i]`` (default 0).

    Returns (ids, events by id, steps)."""
    arrivals = arrivals or {}
    ids: list[str | None] = [None] * len(reqs)
    events: dict[str, list[TokenEvent]] = {}
    step = 0
    while step < max_steps:
        for i, r in enumerate(reqs):
            if ids[i] is None and arrivals.get(i, 0) <= step:
                ids[i] = engine.add_request(r)
                events[ids[i]] = []
        if all(i is not None for i in ids) and not engine.has_work():
            break
        for ev in engine.step():
            events[ev.request_id].append(ev)
        step += 1
    return ids, events, step


def tokens(evs: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in evs if e.token_id is not None]


# -- agreement with transformers -------------------------------------------------------------------


def test_greedy_matches_transformers_generate(engine, hf_model):
    # lengths around block (16) and step (64) boundaries; 130 and 150 are prefilled in chunks
    for n, seed in [(1, 1), (5, 2), (16, 3), (23, 4), (64, 5), (130, 6), (150, 7)]:
        ids = prompt(n, seed)
        assert engine.generate(greedy(ids)) == hf_greedy(hf_model, ids), f"prompt of {n} tokens"


def test_bf16_attention_matches_stock_transformers(tiny_llama_dir):
    stock = transformers_model(tiny_llama_dir, fp32_attention=False)
    eng = Engine(tiny_llama_dir, config(attention_dtype="model"))
    for n, seed in [(5, 2), (23, 4), (130, 6)]:
        ids = prompt(n, seed)
        assert eng.generate(greedy(ids)) == hf_greedy(stock, ids), f"prompt of {n} tokens"


def test_prompt_logits_match_transformers(engine, hf_model):
    ids = prompt(150, 11)  # three chunks of max_num_tokens=64 through the paged cache
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    got = engine.prompt_logits(ids)
    assert got.shape == ref.shape
    # chunked attention reads K/V back from the pool; the first chunk is bit-identical, later ones
    # may differ in the last bf16 bit of a logit
    assert torch.equal(got[:64], ref[:64])
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
    assert engine.kv_stats()["blocks_used"] == 0


def test_int8_lm_head_is_transformers_with_a_per_row_int8_head_and_the_embedding_untouched(tiny_llama_dir):
    """``lm_head: int8`` (dense path: cpu_kernels off, so the head's weights alone change): transformers with its
    head replaced by ``int8_rows`` of it, untied, gives the same logits; the tied embedding keeps its bf16 values."""
    from toolkit.runtime.checkpoint import Linear, int8_rows, load_checkpoint

    ckpt = load_checkpoint(tiny_llama_dir)
    head = int8_rows(ckpt.lm_head)
    codes, scale = head.codes.codes, head.codes.scale
    nonzero = ckpt.lm_head.weight.abs().amax(1) > 0  # the tiny model's padding row is zeros: it stays zeros
    assert codes.dtype == torch.int8 and bool((codes.abs().amax(1) == torch.where(nonzero, 127, 0)).all())
    step = scale[:, None] / 2 * (1 + 1e-5)  # bf16 weights give exact ties: half a step off
    assert bool(((head.weight - ckpt.lm_head.weight).abs() <= step).all())
    assert head.weight.shape == ckpt.lm_head.weight.shape and not torch.equal(head.weight, ckpt.lm_head.weight)
    assert int8_rows(Linear(weight=torch.zeros(2, 8))).weight.abs().sum() == 0  # an all-zero row stays zero

    dense = dict(cpu_kernels=False, int_weight_kernels=False)  # the dense path: only the head's weights differ
    eng = Engine(tiny_llama_dir, config(lm_head="int8", **dense))
    assert eng.model.lm_head.kernel in ("dense", "packed")
    ref = transformers_model(tiny_llama_dir)
    ref.config.tie_word_embeddings = False
    ref.lm_head.weight = torch.nn.Parameter(head.weight.to(torch.bfloat16))
    assert torch.equal(ref.model.embed_tokens.weight.float(), ckpt.embed_tokens.to(torch.bfloat16).float())
    ids = prompt(40, 31)
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0].float()
    assert torch.equal(eng.prompt_logits(ids), want)
    assert eng.generate(greedy(ids)) == hf_greedy(ref, ids)
    exported = Engine(tiny_llama_dir, config(**dense)).prompt_logits(ids)
    assert not torch.equal(exported, want)  # the option changed the head


# -- in-flight batching --------------------------------------------------------------------------------


def test_mixed_batch_gives_each_request_its_alone_tokens(engine, hf_model):
    lens = [3, 17, 40, 90, 130, 7, 1, 64]
    reqs = [greedy(prompt(n, 20 + i), n=NEW + i) for i, n in enumerate(lens)]
    # staggered arrivals: requests join while others prefill and decode
    ids, events, _ = run(engine, reqs, arrivals={0: 0, 1: 0, 2: 1, 3: 2, 4: 2, 5: 5, 6: 9, 7: 12})
    for i, r in enumerate(reqs):
        assert tokens(events[ids[i]]) == hf_greedy(hf_model, r.prompt_ids, r.max_new_tokens), (
            f"request {i} (prompt {lens[i]})"
        )
        assert events[ids[i]][-1].finish_reason == "length"
    assert engine.kv_stats()["blocks_used"] == 0


def test_auto_dtype_is_bf16_only_where_the_cpu_has_native_bf16(monkeypatch):
    """oneDNN says bf16 is supported on every AVX512 CPU, converting to float32 where the CPU has no bf16 dot
    products (Skylake-SP to Ice Lake); "auto" computes in float32 there, and in bf16 where the CPU lists
    AVX512-BF16 or AMX-BF16 and oneDNN agrees."""
    from toolkit import hostinfo
    from toolkit.runtime import model

    onednn = model.onednn_bf16()
    assert onednn == bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert model.bf16_is_fast() == (onednn and bool(hostinfo.cpu_flags() & model.BF16_CPU_FLAGS))  # this host
    ice_lake = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx512_vnni"}
    monkeypatch.setattr(hostinfo, "cpu_flags", lambda: ice_lake)
    assert not model.bf16_is_fast() and model.resolve_dtype("auto") == torch.float32
    monkeypatch.setattr(hostinfo, "cpu_flags", lambda: ice_lake | {"avx512_bf16"})
    assert model.bf16_is_fast() == onednn
    assert model.resolve_dtype("auto") == (torch.bfloat16 if onednn else torch.float32)
    assert model.resolve_dtype("bfloat16") == torch.bfloat16  # asked for: given, native or not


def one_projection_export(codes: torch.Tensor | None, bits: int, inputs: str | None):
    """A checkpoint of one ``q_proj`` as the dtype / decode-batching rules read it: ``codes`` (None: dense) of
    ``bits`` (INT4 in groups of 32), inputs quantized as ``inputs`` (None: unquantized)."""
    from types import SimpleNamespace

    from toolkit.runtime.checkpoint import ActQuant, Linear, WeightCodes

    rows = 8 if codes is None else codes.shape[0]
    scale = torch.ones(rows) if bits == 8 else torch.ones(rows, 1)
    lin = Linear(
        torch.ones(rows, 32),
        codes=None if codes is None else WeightCodes(bits, codes, scale, None if bits == 8 else 32),
        act_quant=None if inputs is None else ActQuant(inputs, torch.tensor(1.0)),
    )
    return SimpleNamespace(layers=[{"input_layernorm": torch.ones(32), "q_proj": lin}])


def test_auto_dtype_is_float32_where_the_vnni_integer_products_take_the_export(monkeypatch):
    """rtk's integer products (INT8-SQ, W8A16, INT4-AWQ) run on float32 engines only, so on a CPU with native bf16
    and AVX512-VNNI an export they take computes in float32 (INT4's rows in AMX's tiles or VNNI's lanes); FP8 codes,
    W4A8-AWQ (FP8 inputs), INT4 with ``int4_gemv: exact`` and bf16 weights keep bf16, and so does everything where
    the VNNI build is not wanted (``RTK_VNNI=0``), not built, or rtk's kernels are off."""
    from types import SimpleNamespace

    from toolkit import hostinfo
    from toolkit.runtime import kernels_avx2, model

    if not model.onednn_bf16():
        pytest.skip("oneDNN has no bf16 here, so no CPU counts as native bf16")

    def export(codes: torch.Tensor | None, bits: int = 8, inputs: str | None = None) -> SimpleNamespace:
        return one_projection_export(codes, bits, inputs)

    int8 = export(torch.ones(8, 32, dtype=torch.int8), inputs="int8")  # INT8-SQ
    int4 = export(torch.ones(8, 32, dtype=torch.int8), bits=4)  # INT4-AWQ (W4A16)
    w4a8 = export(torch.ones(8, 32, dtype=torch.int8), bits=4, inputs="fp8")  # W4A8-AWQ: FP8 inputs
    fp8 = export(torch.ones(8, 32).to(torch.float8_e4m3fn), inputs="fp8")
    dense = export(None)
    assert model.integer_products_apply(int8) and model.integer_products_apply(int4)
    assert not model.integer_products_apply(int4, int4_gemv="exact")  # the float32 GEMV over the codes instead
    assert not any(model.integer_products_apply(e) for e in (w4a8, fp8, dense))
    sapphire = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx512_vnni"}
    sapphire.add("avx512_bf16")
    monkeypatch.setattr(hostinfo, "cpu_flags", lambda: sapphire)
    monkeypatch.setattr(kernels_avx2, "library", lambda: "rtk_vnni")  # stands in for a built VNNI library
    monkeypatch.delenv("RTK_VNNI", raising=False)
    monkeypatch.setattr(kernels_avx2, "prompt_tiles", lambda: True)  # an AMX host: INT4 prompt rows in int8 tiles
    assert model.resolve_dtype("auto", int8) == torch.float32
    assert model.resolve_dtype("auto", int4) == torch.float32
    assert model.resolve_dtype("auto", int4, int4_gemv="exact") == torch.bfloat16
    # no AMX (AMD Zen 4): INT4 too, its rows in AVX512-VNNI's lanes (the tiles' arithmetic), as are INT8 codes
    monkeypatch.setattr(kernels_avx2, "prompt_tiles", lambda: False)
    assert model.resolve_dtype("auto", int4) == torch.float32
    assert model.resolve_dtype("auto", int8) == torch.float32
    assert model.resolve_dtype("auto", export(torch.ones(8, 32, dtype=torch.int8))) == torch.float32  # W8A16
    assert all(model.resolve_dtype("auto", e) == torch.bfloat16 for e in (w4a8, fp8, dense))
    assert model.resolve_dtype("auto", int8, cpu_kernels=False) == torch.bfloat16
    assert model.resolve_dtype("bfloat16", int8) == torch.bfloat16  # asked for: given
    monkeypatch.setattr(kernels_avx2, "library", lambda: "rtk_avx2")  # the VNNI build failed
    assert model.resolve_dtype("auto", int8) == torch.bfloat16
    monkeypatch.setattr(kernels_avx2, "library", lambda: "rtk_vnni")
    monkeypatch.setenv("RTK_VNNI", "0")
    assert model.resolve_dtype("auto", int8) == torch.bfloat16
    monkeypatch.setattr(hostinfo, "cpu_flags", lambda: sapphire - {"avx512_vnni"})
    monkeypatch.delenv("RTK_VNNI")
    assert model.resolve_dtype("auto", int8) == torch.bfloat16


def test_auto_decode_batching_is_full_only_where_int4_projections_take_amx_tiles(monkeypatch):
    """``decode_batching: auto`` batches a step's rows into one call (``full``) only for INT4 codes with unquantized
    inputs on a float32 engine whose CPU runs AMX's int8 tiles (``kernels_avx2.prompt_tiles``), where that is what
    makes decoding faster; everywhere else a request's numbers stay its own (``attention``); names asked for are
    kept."""
    from types import SimpleNamespace

    from toolkit.runtime import kernels_avx2, model

    def export(codes: torch.Tensor | None, bits: int = 4, inputs: str | None = None) -> SimpleNamespace:
        return one_projection_export(codes, bits, inputs)

    codes = torch.ones(16, 32, dtype=torch.int8)
    int4, int8 = export(codes), export(codes, bits=8, inputs="int8")
    w4a8, dense = export(codes, inputs="fp8"), export(None)
    f32 = torch.float32
    monkeypatch.setattr(kernels_avx2, "prompt_tiles", lambda: True)  # stands in for a CPU with AMX-INT8
    assert model.resolve_decode_batching("auto", int4, f32) == "full"
    assert model.resolve_decode_batching("auto", int4, torch.bfloat16) == "attention"
    assert model.resolve_decode_batching("auto", int4, f32, cpu_kernels=False) == "attention"
    assert model.resolve_decode_batching("auto", int4, f32, int4_gemv="exact") == "attention"
    assert all(model.resolve_decode_batching("auto", e, f32) == "attention" for e in (int8, w4a8, dense))
    assert [model.resolve_decode_batching(n, int4, f32) for n in ("exact", "attention")] == ["exact", "attention"]
    monkeypatch.setattr(kernels_avx2, "prompt_tiles", lambda: False)  # no AMX, or RTK_AMX=0
    assert model.resolve_decode_batching("auto", int4, f32) == "attention"
    assert model.resolve_decode_batching("full", dense, f32) == "full"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_projection_rows_do_not_depend_on_the_batch(dtype, caplog):
    """The GEMM kernel choice by row count must not change any row's bits (see model.Projection), where the
    library has a row count from which calls agree or tiles whose calls do; where it has neither, the probe
    says so (MKL's float32 GEMM on an Intel AMX host, 2026-12-05: no call of 2 to 64 rows gave a row its one-row
    bits, for any SmolLM2 shape)."""
    from toolkit.runtime.checkpoint import Linear
    from toolkit.runtime.model import Projection, bf16_is_fast

    g = torch.Generator().manual_seed(0)
    lin = Linear(weight=torch.randn(576, 1536, generator=g) * 0.05)  # SmolLM2's down_proj shape
    proj = Projection([lin], dtype, pack=dtype == torch.bfloat16 and bf16_is_fast())
    if "is not row-invariant for large batches here" in caplog.text:
        pytest.skip(f"this host's {dtype} GEMM of 576 x 1536 has no batch-invariant row count (the probe warned)")
    x = torch.randn(64, 1536, generator=g).to(dtype)
    with torch.inference_mode():
        batch = proj(x, singles=32)  # 32 decode rows, then a 32-row prompt chunk
        for i in range(32):  # a decode row alone, as in a batch of one
            assert torch.equal(proj(x[i : i + 1], singles=1), batch[i : i + 1]), f"decode row {i}"
        for a, b in [(32, 34), (32, 64), (40, 43)]:  # prompt rows in other groupings
            assert torch.equal(proj(x[a:b]), batch[a:b]), f"prompt rows {a}:{b}"
        assert torch.equal(proj(x[28:36], singles=4), batch[28:36])


@pytest.mark.parametrize("in_features", [576, 1536])
def test_a_mixed_calls_decode_rows_join_the_gemm_only_where_they_keep_the_gemvs_bits(in_features, monkeypatch):
    """A shape whose one-row bits are every call's (``whole_gemv_rows``) takes a call of more rows than the GEMV's
    whole through the library's GEMM, decode rows included (the weights read once); its decode rows keep the bits
    rtk's GEMV gives them alone.  Elsewhere (``min_rows`` > 1) decode rows still go through the GEMV."""
    from toolkit.runtime import kernels
    from toolkit.runtime.checkpoint import Linear
    from toolkit.runtime.model import WHOLE_GEMV_MAX_ROWS, WHOLE_TILES_MAX_ROWS, Projection, bf16_is_fast

    if not (bf16_is_fast() and kernels.available()):
        pytest.skip("rtk's bf16 GEMV needs AVX512-BF16")
    g = torch.Generator().manual_seed(3)
    lin = Linear(weight=(torch.randn(1536 if in_features == 576 else 576, in_features, generator=g) * 0.05))
    proj = Projection([lin], torch.bfloat16, pack=True, gemv_kernel=True)
    if proj.gemv is None:
        pytest.skip("rtk's GEMV does not give oneDNN's bits on this host")
    x = torch.randn(128, in_features, generator=g).to(torch.bfloat16)
    gemv_rows: list[int] = []
    gemv = proj._gemv
    monkeypatch.setattr(proj, "_gemv", lambda rows: gemv_rows.append(rows.shape[0]) or gemv(rows))
    with torch.inference_mode():
        batch = proj(x, singles=3)  # 3 decode rows and a 125-row prompt chunk
        through_gemv = list(gemv_rows)
        for i in range(3):
            assert torch.equal(proj(x[i : i + 1], singles=1), batch[i : i + 1]), f"decode row {i}"
        gemv_rows.clear()
        assert torch.equal(proj(x[:40], singles=3), batch[:40])  # a smaller call: the same bits
    if proj.whole_gemv_rows >= 128:  # AMX's tiles: any call through the GEMV whole
        assert proj.whole_gemv_rows == WHOLE_TILES_MAX_ROWS and through_gemv == [128] and gemv_rows == [40]
    elif proj.whole_gemv_rows:  # 128 rows through the GEMM, 40 through the GEMV whole
        assert proj.whole_gemv_rows == WHOLE_GEMV_MAX_ROWS and through_gemv == [] and gemv_rows == [40]
    else:
        assert through_gemv == [3] and gemv_rows == [3]


def test_a_projection_the_tiles_take_whole_keeps_no_library_copy(monkeypatch):
    """Where AMX's tiles give oneDNN's bits for every call (``whole_gemv_rows``, checked at load against oneDNN over
    its packed copy), that copy is dropped (``library_free``); a call of more rows than the tiles take whole, which
    went to oneDNN, goes through the GEMV and still gives every row the one-row bits of oneDNN's GEMM."""
    from toolkit.runtime import kernels, model
    from toolkit.runtime.checkpoint import Linear
    from toolkit.runtime.model import Projection, bf16_is_fast

    if not (bf16_is_fast() and kernels.available() and kernels.tiles_take(576)):
        pytest.skip("needs AMX's bf16 tiles (kernels.gemv_tiles)")
    g = torch.Generator().manual_seed(5)
    lin = Linear(weight=(torch.randn(960, 576, generator=g) * 0.05))
    proj = Projection([lin], torch.bfloat16, pack=True, gemv_kernel=True)
    library = Projection([lin], torch.bfloat16, pack=True)  # oneDNN's GEMM over its packed copy
    assert proj.whole_gemv_rows and proj.library_free and proj.packed is None and proj.gemv is not None
    assert library.packed is not None and not library.library_free
    monkeypatch.setattr(model, "WHOLE_TILES_MAX_ROWS", 8)  # so that a 40-row call is beyond it
    x = torch.randn(40, 576, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        one_row = torch.cat([library(x[i : i + 1], singles=1) for i in range(40)])
        assert torch.equal(proj(x, singles=3), one_row)
        assert torch.equal(proj(x, singles=None), one_row)
        assert torch.equal(proj(x[:8], singles=8), one_row[:8])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_row_probe_finds_a_rare_kernel_difference(seed):
    """``Projection.min_rows`` (the smallest call whose rows get every larger call's bits) over a reduction of 1,160:
    oneDNN's one-row bf16 kernel rounds ~1.5 outputs in 10,000 apart from its multi-row one, which the probe missed
    for some weights when it compared 64 rows of 120 outputs.  Whatever it finds must hold over 2,048 other rows."""
    from toolkit.runtime.checkpoint import Linear
    from toolkit.runtime.model import Projection, bf16_is_fast

    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(120, 1160, generator=g) * 0.05).to(torch.bfloat16)
    proj = Projection([Linear(weight)], torch.bfloat16, pack=bf16_is_fast())
    x = torch.randn(2048, 1160, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with torch.inference_mode():
        whole = proj._matmul(x)
        m = proj.min_rows
        parts = torch.cat([proj._matmul(x[i : i + m]) for i in range(0, x.shape[0], m)])
    assert torch.equal(parts, whole), f"calls of {m} rows (min_rows) give other bits than one call"


@pytest.mark.parametrize("least, tile", [(1, 32), (32, 32), (40, 128)])
def test_library_tiles_give_a_row_the_bits_of_its_own_tile(least, tile):
    """Where the row probe sets ``tile_rows`` and ``pad_rows`` (oneDNN's AMX GEMM), every call has that many rows:
    a longer call is cut into tiles, a shorter one (or last tile) padded with zero rows, and each row gets what a
    call of its tile alone gives."""
    from toolkit.runtime.checkpoint import Linear
    from toolkit.runtime.model import Projection

    g = torch.Generator().manual_seed(1)
    proj = Projection([Linear(weight=torch.randn(200, 576, generator=g) * 0.05)], torch.bfloat16, pack=True)
    if proj.packed is None:
        pytest.skip("oneDNN's packed bf16 weights are not available on this host")
    proj.tile_rows, proj.pad_rows = tile, least
    x = torch.randn(2 * tile + 6, 576, generator=g).to(torch.bfloat16)

    def alone(rows: torch.Tensor) -> torch.Tensor:  # one call of a tile's rows, zero-padded to ``least`` rows
        n = rows.shape[0]
        rows = torch.cat([rows, rows.new_zeros(max(0, least - n), rows.shape[1])])
        return torch.ops.mkldnn._linear_pointwise(rows, proj.packed, None, "none", [], "")[:n]

    with torch.inference_mode():
        got = proj(x)
        want = torch.cat([alone(x[:tile]), alone(x[tile : 2 * tile]), alone(x[2 * tile :])])
        assert got.shape == (2 * tile + 6, 200) and torch.equal(got, want)
        assert torch.equal(proj(x[3:9]), alone(x[3:9]))
        assert torch.equal(proj(x[: tile + 1]), torch.cat([alone(x[:tile]), alone(x[tile : tile + 1])]))
        assert proj(x[:0]).shape == (0, 200)


def test_batched_decode_attention_agrees_with_one_call_per_sequence(tiny_llama_dir):
    """decode_batching attention/full: one masked SDPA over padded contexts instead of one call per sequence.

    Same keys, same queries; only the float reductions see the padding, so logits agree to rounding.
    """
    from toolkit.runtime.model import build_plan

    eng = Engine(tiny_llama_dir, config(decode_batching="attention"))
    reqs = [greedy(prompt(n, 300 + n), 40) for n in (5, 37, 70, 16)]
    for r in reqs:
        eng.add_request(r)
    for _ in range(8):  # every prompt prefilled; all four decoding, contexts of different lengths
        eng.step()
    scheduled = eng.scheduler.schedule()  # the next step's work, blocks allocated
    assert len(scheduled) == 4 and all(n == 1 and not s.prefilling for s, n in scheduled)
    work = [(s.block_table, s.num_cached, 1, False) for s, _ in scheduled]
    ids = torch.tensor([s.tokens[s.num_cached] for s, _ in scheduled])
    logits = {}
    with torch.inference_mode():
        for batched in (False, True):
            plan = build_plan(work, 16, eng.scheduler.unit, batched=batched)
            assert (plan.decode_padded is not None) == batched
            logits[batched] = eng.model.forward(ids, plan, eng.pool)
    a, b = logits[False], logits[True]
    assert (a - b).abs().max() <= 1e-2 * a.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_float32_engine_is_batch_invariant_too(tiny_llama_dir):
    # MKL's fp32 GEMM changes kernels below ~12 rows: exercises the probe's padding and row-by-row paths
    eng = Engine(tiny_llama_dir, config(dtype="float32"))
    assert eng.model.dtype == torch.float32
    reqs = [greedy(prompt(n, 200 + n)) for n in (3, 40, 90, 1)]
    alone = [eng.generate(r) for r in reqs]
    ids, events, _ = run(eng, reqs, arrivals={2: 3})
    assert [tokens(events[i]) for i in ids] == alone


def test_long_prompt_is_chunked_and_does_not_stall_decodes(tiny_llama_dir):
    eng = Engine(tiny_llama_dir, config(max_num_tokens=35, enable_kv_cache_reuse=False))
    short = [greedy(prompt(8, 30 + i), n=40) for i in range(3)]
    long = greedy(prompt(200, 40), n=4)
    ids = [eng.add_request(r) for r in short]
    for _ in range(2):
        eng.step()  # all three prefilled and decoding
    long_id = eng.add_request(long)
    steps_until_first = None
    for s in range(12):
        evs = eng.step()
        got = {e.request_id for e in evs if e.token_id is not None}
        assert set(ids) <= got, f"step {s}: a decoding request got no token while the long prompt prefilled"
        if long_id in got and steps_until_first is None:
            steps_until_first = s + 1
    # 35 - 3 decodes = 32 prompt tokens per step (two 16-token units): 200 tokens need 7 steps,
    # and the decodes never wait
    assert steps_until_first == 7


def test_chunked_context_disabled_runs_prompts_whole(tiny_llama_dir, hf_model):
    eng = Engine(tiny_llama_dir, config(max_num_tokens=256, enable_chunked_context=False))
    reqs = [greedy(prompt(200, 50)), greedy(prompt(100, 51)), greedy(prompt(30, 52))]
    ids, events, _ = run(eng, reqs)
    for i, r in enumerate(reqs):
        assert tokens(events[ids[i]]) == hf_greedy(hf_model, r.prompt_ids)


# -- prefix reuse ------------------------------------------------------------------------------------


def test_prefix_reuse_gives_the_same_tokens_as_no_reuse(tiny_llama_dir, hf_model):
    history = prompt(100, 60)
    with_reuse = Engine(tiny_llama_dir, config())
    without = Engine(tiny_llama_dir, config(enable_kv_cache_reuse=False))
    first = with_reuse.generate(greedy(history))
    assert first == without.generate(greedy(history)) == hf_greedy(hf_model, history)
    # next turn: the whole conversation so far plus a new user message
    turn2 = history + first + prompt(20, 61)
    rid = with_reuse.add_request(greedy(turn2))
    out = tokens(with_reuse.step())
    # last turn computed K/V for 100 + 23 tokens (the last output token never ran): 7 full blocks
    # of 16, found again by the hash of their token prefix
    assert with_reuse.request_stats(rid)["reused_blocks"] == 7
    while with_reuse.has_work():
        out += tokens(with_reuse.step())
    assert out == without.generate(greedy(turn2)) == hf_greedy(hf_model, turn2)
    assert with_reuse.kv_stats()["blocks_reused_total"] == 7 and without.kv_stats()["blocks_reused_total"] == 0


def test_identical_prompts_in_flight_share_blocks(tiny_llama_dir):
    eng = Engine(tiny_llama_dir, config())
    p = prompt(64, 70)
    a = eng.add_request(greedy(p, n=30))
    eng.step()  # prefilled: 4 full blocks registered
    b = eng.add_request(greedy(p, n=30))
    eng.step()
    # b reuses 3 blocks (its last prompt token must run); the shared blocks are counted once
    assert eng.request_stats(b)["reused_blocks"] == 3
    used = eng.kv_stats()["blocks_used"]
    assert used == eng.request_stats(a)["blocks"] + eng.request_stats(b)["blocks"] - 3


# -- bounded memory ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy,reuse", [("guaranteed_no_evict", True), ("max_utilization", True), ("max_utilization", False)]
)
def test_pool_smaller_than_demand_every_request_completes(tiny_llama_dir, hf_model, policy, reuse):
    # 6 requests of 40 + 40 tokens need 5 blocks of 16 each (30 in all); the pool holds 8.  The oracle is
    # transformers' tokens: where rtk's GEMV rounds its own way (AMX hosts), a near-tie of this random model
    # took another token at 38 of 40, so the scheduler is checked on oneDNN's bits there
    from conftest import gemv_rounds_its_own_way

    eng = Engine(
        tiny_llama_dir,
        config(
            max_seq_len=128,
            max_input_len=64,
            kv_cache_blocks=8,
            scheduler_policy=policy,
            enable_kv_cache_reuse=reuse,
            cpu_kernels=not gemv_rounds_its_own_way(),
        ),
    )
    reqs = [greedy(prompt(40, 80 + i), n=40) for i in range(6)]
    most_running = 0
    ids = [eng.add_request(r) for r in reqs]
    events = {i: [] for i in ids}
    while eng.has_work():
        for ev in eng.step():
            events[ev.request_id].append(ev)
        stats = eng.kv_stats()
        assert stats["blocks_used"] <= 8
        most_running = max(most_running, stats["running"])
    for i, r in zip(ids, reqs, strict=False):
        assert tokens(events[i]) == hf_greedy(hf_model, r.prompt_ids, 40)
        assert [e.index for e in events[i]] == list(range(40))  # streamed once each, even across preemption
    stats = eng.kv_stats()
    assert stats["blocks_used"] == 0 and stats["waiting"] == 0
    if policy == "guaranteed_no_evict":
        assert stats["preempted_total"] == 0 and most_running == 1  # 5 blocks reserved each; 8 in the pool
    else:
        assert stats["preempted_total"] > 0 and most_running >= 2


# -- cancellation, stop conditions, sampling -----------------------------------------------------


def test_cancel_frees_blocks_and_ends_the_stream(tiny_llama_dir, hf_model):
    eng = Engine(tiny_llama_dir, config())
    keep = greedy(prompt(30, 90), n=20)
    a = eng.add_request(keep)
    b = eng.add_request(greedy(prompt(50, 91), n=100))
    c = eng.add_request(greedy(prompt(10, 92), n=5))
    evs = {a: [], b: [], c: []}
    for _ in range(3):
        for e in eng.step():
            evs[e.request_id].append(e)
    before = eng.kv_stats()["blocks_used"]
    b_blocks = eng.request_stats(b)["blocks"]
    eng.cancel(b)
    eng.cancel(b)  # twice: harmless
    eng.cancel("no-such-request")
    assert eng.kv_stats()["blocks_used"] == before - b_blocks
    while eng.has_work():
        for e in eng.step():
            evs[e.request_id].append(e)
    last = evs[b][-1]
    assert last.finished and last.finish_reason == "cancelled" and last.token_id is None
    assert sum(1 for e in evs[b] if e.finished) == 1
    assert tokens(evs[a]) == hf_greedy(hf_model, keep.prompt_ids, 20)
    assert eng.kv_stats()["blocks_used"] == 0
    # a request cancelled before it was ever scheduled
    w = eng.add_request(greedy(prompt(5, 93)))
    eng.cancel(w)
    (ev,) = eng.step()
    assert (ev.request_id, ev.finish_reason, ev.index) == (w, "cancelled", 0)
    assert not eng.has_work()


def test_end_id_and_stop_sequences(engine, hf_model):
    ids = prompt(12, 100)
    ref = hf_greedy(hf_model, ids, 30)
    # end id: generation stops before it, and it is not part of the output (TensorRT-LLM semantics)
    end = ref[9]
    cut = ref.index(end)
    _, evs, _ = run(engine, [GenerationRequest(prompt_ids=ids, max_new_tokens=30, end_id=end)])
    (evs,) = evs.values()
    assert tokens(evs) == ref[:cut]
    assert (evs[-1].finish_reason, evs[-1].token_id, evs[-1].index) == ("end_id", None, cut)
    # stop sequence: the stop tokens are part of the output
    stop = ref[14:16]
    first = next(i for i in range(len(ref) - 1) if ref[i : i + 2] == stop)
    _, evs, _ = run(engine, [greedy(ids, 30, stop_sequences=[[1, 2, 3], stop])])
    (evs,) = evs.values()
    assert tokens(evs) == ref[: first + 2] and evs[-1].finish_reason == "stop" and evs[-1].finished
    # the default end id is the checkpoint's EOS (2): a request whose output would contain it stops there
    assert engine.eos_ids == frozenset({2})


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine):
    ids = prompt(20, 110)
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=30, end_id=-1, sampling=sp))
    again = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=30, end_id=-1, sampling=sp))
    assert alone == again
    others = [
        GenerationRequest(
            prompt_ids=prompt(n, 111 + n),
            max_new_tokens=30,
            end_id=-1,
            sampling=SamplingParams(temperature=0.8, seed=n),
        )
        for n in (5, 50, 90)
    ]
    rids, evs, _ = run(
        engine, others + [GenerationRequest(prompt_ids=ids, max_new_tokens=30, end_id=-1, sampling=sp)], arrivals={3: 2}
    )
    assert tokens(evs[rids[3]]) == alone
    other_seed = engine.generate(
        GenerationRequest(
            prompt_ids=ids,
            max_new_tokens=30,
            end_id=-1,
            sampling=SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=99),
        )
    )
    assert other_seed != alone
    # degenerate settings reduce to greedy
    g = engine.generate(greedy(ids, 10))
    assert engine.generate(greedy(ids, 10, sampling=SamplingParams(temperature=0.7, top_k=1, seed=5))) == g
    assert engine.generate(greedy(ids, 10, sampling=SamplingParams(temperature=0.7, top_p=1e-6, seed=5))) == g


# -- timing and streaming ---------------------------------------------------------------------------


def test_events_and_timestamps(engine):
    before = time.time_ns()
    rids, evs, _ = run(engine, [greedy(prompt(40, 120), n=12), greedy(prompt(10, 121), n=5)], arrivals={1: 3})
    for rid, n in zip(rids, (12, 5), strict=False):
        e = evs[rid]
        assert [x.index for x in e] == list(range(n)) and [x.finished for x in e] == [False] * (n - 1) + [True]
        assert all(a.time_ns <= b.time_ns for a, b in zip(e, e[1:], strict=False))
        t = engine.times(rid)  # still answered after the request finished
        assert before <= t.arrival_ns <= t.first_scheduled_ns <= t.first_token_ns <= t.last_token_ns
        assert t.first_token_ns == e[0].time_ns and t.last_token_ns == e[-1].time_ns
    with pytest.raises(UsageError):
        engine.times("never-seen")


def test_background_engine_streams_concurrent_submissions(engine, hf_model):
    reqs = [greedy(prompt(n, 130 + n), n=16) for n in (7, 33, 70, 2)]
    got: dict[str, list[TokenEvent]] = {}
    done = threading.Event()
    lock = threading.Lock()
    bg = BackgroundEngine(engine)
    try:

        def on_event(ev):
            with lock:
                got.setdefault(ev.request_id, []).append(ev)
                if sum(1 for v in got.values() if v[-1].finished) == len(reqs) + 1:
                    done.set()

        rids = [None] * len(reqs)

        def submit(i):
            rids[i] = bg.submit(reqs[i], on_event)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        long_id = bg.submit(greedy(prompt(50, 140), n=400), on_event)
        while not got.get(long_id):
            time.sleep(0.01)
        bg.cancel(long_id)
        assert done.wait(60)
        with pytest.raises(UsageError):
            bg.submit(greedy([]), on_event)
    finally:
        bg.close()
    for rid, r in zip(rids, reqs, strict=False):
        assert tokens(got[rid]) == hf_greedy(hf_model, r.prompt_ids, 16)
    assert got[long_id][-1].finish_reason == "cancelled"
    assert engine.kv_stats()["blocks_used"] == 0


def test_background_engine_hands_a_steps_first_tokens_over_before_its_other_tokens(engine):
    """A request that gets its first token in a step where others decode is called back first in that step, and
    every request's tokens still come in order."""
    calls: list[TokenEvent] = []
    done = threading.Event()
    bg = BackgroundEngine(engine)
    try:
        running = [bg.submit(greedy(prompt(5, 160 + i), n=40), calls.append) for i in range(3)]
        while sum(1 for e in list(calls) if e.token_id is not None) < 6:
            time.sleep(0.005)
        late = bg.submit(greedy(prompt(6, 170), n=4), lambda ev: (calls.append(ev), ev.finished and done.set()))
        assert done.wait(60)
    finally:
        bg.close()
    step = [e for e in calls if e.time_ns == next(e.time_ns for e in calls if e.request_id == late)]
    assert len(step) > 1 and {e.request_id for e in step} & set(running), "the late request's first step decoded others"
    assert step[0].request_id == late and step[0].index == 0
    for rid in [*running, late]:
        mine = [e.index for e in calls if e.request_id == rid and e.token_id is not None]
        assert mine == sorted(mine) and mine[0] == 0


def test_background_close_cancels_what_is_in_flight(engine):
    got = []
    bg = BackgroundEngine(engine)
    bg.submit(greedy(prompt(20, 150), n=400), got.append)
    while not got:
        time.sleep(0.01)
    bg.close()
    assert got[-1].finished and got[-1].finish_reason == "cancelled"
    with pytest.raises(UsageError):
        bg.submit(greedy(prompt(3, 151)), got.append)
    assert not engine.has_work() and engine.kv_stats()["blocks_used"] == 0


def test_background_engine_loads_on_the_thread_that_steps_it(tiny_llama_dir, hf_model):
    """Given a loader, the engine is built on its own thread (one OpenMP pool: see BackgroundEngine), serves as
    the engine given built does, and a loader's error reaches the caller, with no thread left behind."""
    loaded_on = []

    def load() -> Engine:
        loaded_on.append(threading.current_thread())
        return Engine(tiny_llama_dir, config())

    got = []
    bg = BackgroundEngine(load)
    try:
        assert loaded_on == [bg._thread] and isinstance(bg.engine, Engine)
        # the OS's name of the thread (top -H, py-spy, bench_serving.py's CPU per thread), where /proc has one
        comm = Path(f"/proc/self/task/{bg._thread.native_id}/comm")
        assert not comm.parent.is_dir() or comm.read_text().strip() == ENGINE_THREAD
        req = greedy(prompt(9, 160), n=8)
        bg.submit(req, got.append)
        while not (got and got[-1].finished):
            time.sleep(0.01)
    finally:
        bg.close()
    assert tokens(got) == hf_greedy(hf_model, req.prompt_ids, 8)

    def broken() -> Engine:
        raise UsageError("engine config 'max_seq_len': too long")

    before = threading.active_count()
    with pytest.raises(UsageError, match="max_seq_len"):
        BackgroundEngine(broken)
    assert threading.active_count() == before


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "req,match",
    [
        (GenerationRequest(prompt_ids=[], max_new_tokens=4), "empty"),
        (GenerationRequest(prompt_ids=[5] * 257, max_new_tokens=4), "max_input_len"),
        (GenerationRequest(prompt_ids=[5] * 200, max_new_tokens=400), "max_seq_len"),
        (GenerationRequest(prompt_ids=[5], max_new_tokens=0), "max_new_tokens"),
        (GenerationRequest(prompt_ids=[5, 49152], max_new_tokens=4), r"\[0, 49152\)"),
        (GenerationRequest(prompt_ids=[5, -1], max_new_tokens=4), "prompt_ids"),
        (GenerationRequest(prompt_ids=[5], max_new_tokens=4, end_id=10**6), "end_id"),
        (GenerationRequest(prompt_ids=[5], max_new_tokens=4, stop_sequences=[[]]), "stop sequence"),
        (GenerationRequest(prompt_ids=[5], max_new_tokens=4, sampling=SamplingParams(temperature=-1)), "temperature"),
        (GenerationRequest(prompt_ids=[5], max_new_tokens=4, sampling=SamplingParams(top_p=0)), "top_p"),
        (GenerationRequest(prompt_ids=[5], max_new_tokens=4, sampling=SamplingParams(top_k=-2)), "top_k"),
    ],
)
def test_bad_requests_raise_usage_error(engine, req, match):
    with pytest.raises(UsageError, match=match):
        engine.add_request(req)
    assert not engine.has_work()


def test_duplicate_request_id_is_refused(engine):
    engine.add_request(GenerationRequest(prompt_ids=[5, 6], max_new_tokens=2, request_id="dup"))
    with pytest.raises(UsageError, match="already in flight"):
        engine.add_request(GenerationRequest(prompt_ids=[5, 6], max_new_tokens=2, request_id="dup"))
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(max_input_len=512), "max_input_len"),
        (dict(max_num_tokens=4), "max_num_tokens"),
        (dict(kv_cache_blocks=10), "kv_cache_blocks"),
        (dict(scheduler_policy="fifo"), "scheduler_policy"),
        (dict(max_seq_len=8192), "max_seq_len"),  # tiny model: max_position_embeddings 4096
        (dict(dtype="float16"), "dtype"),
        (dict(attention_dtype="bfloat16"), "attention_dtype"),
        (dict(prefill_threads=0), "prefill_threads"),
        (dict(lone_decode_threads=0), "lone_decode_threads"),
        (dict(int4_gemv="fast"), "int4_gemv"),
        (dict(float32_prompt_rows="sgemm"), "float32_prompt_rows"),
        (dict(lm_head="fp8"), "lm_head"),
        (dict(step_budget_ms=0.0), "step_budget_ms"),
        (dict(step_budget_ms=40.0, enable_chunked_context=False), "step_budget_ms"),
        (dict(step_budget_ratio=1.0), "step_budget_ratio"),
        (dict(step_budget_ratio=2.0, enable_chunked_context=False), "step_budget_ratio"),
        (dict(prompt_backlog_steps=-1), "prompt_backlog_steps"),
        (dict(context_chunk_unit=24), "context_chunk_unit"),
        (dict(context_chunk_unit=16, max_num_tokens=16), "context_chunk_unit"),
    ],
)
def test_bad_engine_config_names_the_field(tiny_llama_dir, kw, field):
    with pytest.raises(UsageError, match=field):
        Engine(tiny_llama_dir, config(**{"max_input_len": 256, **kw}))


def test_steps_that_prefill_run_on_prefill_threads(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, config(num_threads=1, prefill_threads=2, max_num_tokens_without_decode=64))
    seen = []
    forward = engine.model.forward

    def record(ids, plan, pool):
        seen.append((bool(plan.prefills), torch.get_num_threads()))
        return forward(ids, plan, pool)

    engine.model.forward = record
    engine.generate(greedy(prompt(100, 1), n=3))  # 100 tokens: two prefill steps of 64, then decodes
    assert seen == [(True, 2), (True, 2), (False, 1), (False, 1)]
    assert torch.get_num_threads() == 1


def test_decode_steps_of_one_sequence_alone_run_on_lone_decode_threads(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, config(num_threads=1, prefill_threads=1, lone_decode_threads=2))
    seen = []
    forward = engine.model.forward

    def record(ids, plan, pool):
        seen.append((len(ids), bool(plan.prefills), torch.get_num_threads()))
        return forward(ids, plan, pool)

    engine.model.forward = record
    run(engine, [greedy(prompt(20, 1), n=5), greedy(prompt(20, 2), n=2)], arrivals={1: 2})
    # alone: prefill (1 thread), decodes on 2; the second's prefill, then two decoding together on 1 thread,
    # then the first alone again
    assert seen == [(20, True, 1), (1, False, 2), (21, True, 1), (2, False, 1), (1, False, 2)]
    assert torch.get_num_threads() == 1


def test_a_step_without_decodes_takes_a_whole_prompt_and_one_with_decodes_keeps_the_budget(tiny_llama_dir, hf_model):
    """max_num_tokens bounds the steps that someone generating waits on; an idle engine prefills a prompt
    in one step (max_num_tokens_without_decode, default max_input_len), with the same tokens."""
    eng = Engine(tiny_llama_dir, config(max_num_tokens=35, enable_kv_cache_reuse=False))
    steps = []
    forward = eng.model.forward

    def record(ids, plan, pool):
        steps.append(len(ids))
        return forward(ids, plan, pool)

    eng.model.forward = record
    long = greedy(prompt(200, 41), n=4)
    assert eng.generate(long) == hf_greedy(hf_model, long.prompt_ids, 4)
    assert steps[0] == 200  # nobody was generating: the whole prompt in one step
    steps.clear()
    ids, events, _ = run(eng, [greedy(prompt(8, 42), n=40), long], arrivals={1: 1})  # arrives while one decodes
    assert max(steps) <= 35 and len(steps) > 7  # a decode in every step: the budget holds, the prompt is chunked
    assert tokens(events[ids[1]]) == hf_greedy(hf_model, long.prompt_ids, 4)


def test_max_num_tokens_without_decode_below_max_num_tokens_is_refused(tiny_llama_dir):
    with pytest.raises(UsageError, match="max_num_tokens_without_decode"):
        Engine(tiny_llama_dir, config(max_num_tokens=64, max_num_tokens_without_decode=32))


def test_engine_config_from_build_spec():
    from conftest import spec_for

    spec = spec_for(
        "t",
        "builtin:smollm2-135m-instruct",
        build={
            "max_batch_size": 4,
            "max_num_tokens": 128,
            "kv_cache_blocks": 300,
            "tokens_per_block": 64,
            "enable_kv_cache_reuse": False,
            "num_threads": 1,
            "prefill_threads": 2,
            "lone_decode_threads": 2,
            "step_budget_ms": 40,
            "step_budget_ratio": 2.5,
            "context_chunk_unit": 8,
            "lm_head": "int8",
            "decode_batching": "full",
        },
    )
    c = EngineConfig.from_build(spec.build)
    default = EngineConfig.from_build(spec_for("t", "x").build)
    assert (c.lm_head, c.decode_batching, default.lm_head, default.decode_batching) == (
        "int8",
        "full",
        "exported",
        "auto",
    )
    assert (c.num_threads, c.prefill_threads, c.lone_decode_threads) == (1, 2, 2)
    assert (c.step_budget_ms, c.step_budget_ratio, c.context_chunk_unit) == (40.0, 2.5, 8)
    assert (c.max_batch_size, c.max_num_tokens, c.tokens_per_block, c.kv_cache_blocks, c.enable_kv_cache_reuse) == (
        4,
        128,
        64,
        300,
        False,
    )
    assert (c.max_input_len, c.max_seq_len, c.enable_chunked_context) == (1024, 2048, True)
    assert (
        EngineConfig.from_build(spec_for("t", "x").build).num_blocks == 8 * 2048 // 32
    )  # default: a full batch of full sequences


# -- architectures and KV-cache quantization ----------------------------------------------------------


def _tiny_variant(dest, tokenizer_dir, arch: str, **overrides):
    """A random 2-layer model of ``arch`` (Qwen2 has q/k/v biases) with the embedded tokenizer."""
    import json
    import shutil

    from conftest import TINY_CONFIG
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, dest / f.name)
    vocab = len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(1)
    cfg_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = cfg_cls(vocab_size=vocab, **{**TINY_CONFIG, **overrides})
    model = model_cls(cfg).to(torch.bfloat16)
    if arch == "qwen2":  # random, visible biases (transformers initialises them to zero)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_(0, 0.5)
    model.save_pretrained(dest)
    return dest


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("qwen2", dict(tie_word_embeddings=False)),
        (
            "llama",
            dict(
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            ),
        ),
    ],
    ids=["qwen2-bias-untied", "llama3-rope"],
)
def test_other_architectures_match_transformers(tmp_path, smollm2_tokenizer_dir, arch, overrides):
    path = _tiny_variant(tmp_path / arch, smollm2_tokenizer_dir, arch, **overrides)
    eng = Engine(path, config())
    ref = transformers_model(path)
    if arch == "qwen2":
        assert eng.model.config.attention_bias and eng.model.layers[0].qkv.parts[0].bias is not None
        assert not eng.model.config.tie_word_embeddings
    else:
        assert eng.model.config.rope_scaling["rope_type"] == "llama3"
    for n, seed in [(7, 1), (150, 2)]:  # positions beyond 64 exercise the llama3 frequency scaling
        ids = prompt(n, seed)
        assert eng.generate(greedy(ids)) == hf_greedy(ref, ids), f"{arch}, prompt of {n} tokens"


@pytest.mark.parametrize("kind,scales", [("FP8", (0.02, 0.01)), ("INT8", (0.05, 0.03))])
def test_quantized_kv_cache_matches_transformers_with_quantized_keys_and_values(tmp_path, tiny_llama_dir, kind, scales):
    """K/V stored as 1-byte codes after RoPE (as TensorRT-LLM's KV cache and ModelOpt's k/v_bmm_quantizer)."""
    from conftest import greedy_ties_taken, with_kv_cache_scales
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from toolkit.runtime.checkpoint import fake_quant

    path = with_kv_cache_scales(tiny_llama_dir, tmp_path / f"kv-{kind}", kind, scales)

    qkind = kind.lower()

    def sdpa_fp32_kvq(module, query, key, value, attention_mask, **kw):
        i = module.layer_idx
        # bf16 K/V after RoPE -> 1-byte codes -> dequantized in float32, where attention runs
        key = fake_quant(key.float(), qkind, torch.tensor(scales[0] * (i + 1)))
        value = fake_quant(value.float(), qkind, torch.tensor(scales[1] * (i + 1)))
        out, w = sdpa_attention_forward(module, query.float(), key, value, attention_mask, **kw)
        return out.to(query.dtype), w

    from transformers import AutoModelForCausalLM

    AttentionInterface.register(f"sdpa_fp32_kv_{qkind}", sdpa_fp32_kvq)
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation=f"sdpa_fp32_kv_{qkind}"
    ).eval()
    eng = Engine(path, config())
    assert eng.pool.quant.kind == qkind and eng.pool.k.element_size() == 1
    plain = Engine(tiny_llama_dir, config())
    ties = 0
    for n, seed in [(9, 3), (70, 4)]:
        ids = prompt(n, seed)
        out = eng.generate(greedy(ids))
        # the 9-token prompt's 4th token is an exact tie of two bf16 logits here (either is transformers' answer)
        ties += greedy_ties_taken(ref, ids, out)
        assert (
            eng.prompt_logits(ids).sub(plain.prompt_logits(ids)).abs().max() > 0
        )  # the quantization is really applied
    assert ties <= 1


def test_a_kernel_build_is_keyed_on_its_source_the_headers_it_includes_and_its_flags(tmp_path, monkeypatch):
    """An edited shared header (runtime/decode_plan.h) must rebuild both kernels, not load a stale one."""
    from toolkit.runtime import kernels, kernels_avx2

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source, header = tmp_path / "k.cpp", tmp_path / "shared.h"
    source.write_text('#include <vector>\n#include "shared.h"\nint f() { return g(); }\n')
    header.write_text("inline int g() { return 1; }\n")
    first = kernels.build_dir(source, ["-O3"])
    assert first.parent == tmp_path / "cache" / "rtk" / "kernels" and first.name.startswith("k-")
    assert kernels.build_dir(source, ["-O3"]) == first
    header.write_text("inline int g() { return 2; }\n")
    assert kernels.build_dir(source, ["-O3"]) != first
    assert kernels.build_dir(source, ["-O2"]) != kernels.build_dir(source, ["-O3"])
    for real in (kernels.SOURCE, kernels_avx2.SOURCE):
        assert '#include "decode_plan.h"' in real.read_text()  # both DecodeLayers share its checks


def test_a_kernel_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path):
    """torch's builder waits for ``<build dir>/lock`` without a timeout: one left by a killed build (older than
    any build takes) must not hang every later load; one a running build holds must stay."""
    import os
    import time

    from toolkit.runtime import kernels

    lock = tmp_path / "lock"
    lock.touch()
    kernels.clear_stale_lock(tmp_path)
    assert lock.exists()
    old = time.time() - kernels.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    kernels.clear_stale_lock(tmp_path)
    assert not lock.exists()
    kernels.clear_stale_lock(tmp_path)  # no lock: nothing to do


def test_the_step_trace_writes_one_line_a_step(tmp_path, tiny_llama_dir, monkeypatch):
    """``RTK_STEP_TRACE``: each step's start, decode and prompt rows, threads, wall and CPU ms and the scheduler's ms,
    appended to the file."""
    trace = tmp_path / "steps.txt"
    monkeypatch.setenv("RTK_STEP_TRACE", str(trace))
    eng = Engine(tiny_llama_dir, config(max_num_tokens=32))
    ids, _, _ = run(eng, [greedy(prompt(40, 1), n=3), greedy(prompt(5, 2), n=3)])
    lines = [line.split() for line in trace.read_text().splitlines()]
    assert len(lines) == eng.steps and all(len(fields) == 7 for fields in lines)
    rows = [(int(d), int(p)) for _, d, p, *_ in lines]
    assert sum(p for _, p in rows) == 45 and sum(d for d, _ in rows) == 4  # every prompt row; 2 + 2 decode rows
    assert all(int(t) >= 1 and float(ms) > 0 and float(plan) >= 0 for *_, t, ms, _, plan in lines)


def test_a_named_thread_passes_its_name_to_the_threads_it_starts_and_its_cpu_is_counted_by_name():
    """What the served engine's thread names rest on: threads started by a named thread (as libgomp's workers are
    by the engine's thread) carry its name, and :func:`cpu_by_thread_name` puts their CPU time under it."""
    from toolkit.runtime.os_threads import cpu_by_thread_name, name_this_thread

    if not Path("/proc/self/task").is_dir():
        pytest.skip("no /proc task list on this OS")
    seen = {}

    def spin():
        seen["child"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        seen["cpu"] = cpu_by_thread_name(os.getpid())

    def parent():
        assert name_this_thread("rtk-test-named-thread")  # cut to the OS's 15 bytes
        child = threading.Thread(target=spin)
        child.start()
        child.join()

    t = threading.Thread(target=parent)
    t.start()
    t.join()
    assert seen["child"] == "rtk-test-named-"
    assert seen["cpu"]["rtk-test-named-"] >= 0.15
