"""rtk's fused decode step (``kernels.DecodeLayers``, ``EngineConfig.fused_decode``) against torch's operators.

The fused step runs the decode rows' layers in one C++ call; it must give the operator path's
logits bit for bit (the operator path is itself bit-identical to transformers, test_runtime_engine.py),
on every decode step, for one and several sequences, grouped-query and multi-query attention,
biases, quantized KV caches and quantized exports, and a row's logits must not depend on what
else is in the step.  The float32 engine is the check that the comparison can fail: it differs.
"""

from __future__ import annotations

import pytest
import torch

from toolkit.runtime import kernels
from toolkit.runtime.engine import Engine, EngineConfig, GenerationRequest
from toolkit.runtime.model import Projection, build_plan

pytestmark = [
    pytest.mark.skipif(not kernels.available(), reason="rtk's CPU kernels need AVX512-BF16 and a compiler"),
    pytest.mark.usefixtures("one_torch_thread"),
]

BASE = dict(max_batch_size=8, max_num_tokens=64, max_input_len=256, max_seq_len=512, tokens_per_block=16)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


def forced_logits(engine: Engine, prompts: list[list[int]], forced: list[list[int]]) -> list[torch.Tensor]:
    """Logits of each decode step (``[len(prompts), vocab]``) with the given tokens fed back (teacher forcing)."""
    model, tpb = engine.model, engine.config.tokens_per_block
    per_seq = -(-engine.config.max_seq_len // tpb)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    with torch.inference_mode():
        for table, ids in zip(tables, prompts, strict=True):
            model.forward(torch.tensor(ids), build_plan([(table, 0, len(ids), True)], tpb, 64), engine.pool)
        steps = []
        for s in range(len(forced[0])):
            work = [(t, len(p) + s, 1, False) for t, p in zip(tables, prompts, strict=True)]
            ids = torch.tensor([f[s] for f in forced])
            steps.append(model.forward(ids, build_plan(work, tpb, 64), engine.pool))
    return steps


def assert_same_bits(fused, operators, float32, what: str) -> None:
    for step, (a, b, c) in enumerate(zip(fused, operators, float32, strict=True)):
        assert torch.equal(a, b), f"{what}, step {step}: max difference {(a - b).abs().max().item()}"
        assert not torch.equal(a, c)  # a different arithmetic shows


def engines(path, **kw):
    """The fused step, torch's operators (the same decode batching), float32."""
    fused = Engine(path, EngineConfig(**BASE, **kw))
    assert fused.model.fused is not None
    operators = Engine(path, EngineConfig(**BASE, **kw, fused_decode=False))
    assert operators.model.fused is None
    float32 = Engine(path, EngineConfig(**BASE, **{**kw, "dtype": "float32"}))
    return fused, operators, float32


def compare(path, what: str, batch: int = 3, steps: int = 12, **kw) -> None:
    fused, operators, float32 = engines(path, **kw)
    prompts = [prompt(n, seed) for n, seed in [(5, 1), (37, 2), (16, 3), (70, 4)][:batch]]  # unequal contexts
    forced = [prompt(steps, 10 + i) for i in range(batch)]
    got = [forced_logits(e, prompts, forced) for e in (fused, operators, float32)]
    assert_same_bits(*got, what)


@pytest.mark.parametrize("batch,batching", [(1, "attention"), (3, "attention"), (3, "exact"), (4, "full")])
def test_fused_logits_are_the_operators_bits(tiny_llama_dir, batch, batching):
    """ "attention" (the default): one masked attention call for all decode rows; "exact": one per row."""
    compare(tiny_llama_dir, f"bf16, batch {batch}, {batching}", batch=batch, decode_batching=batching)


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_logits_are_the_operators_bits_with_attention_in_place(tiny_llama_dir, batch):
    """``decode_attention: in_place``: both paths attend through decode_attention.h over the bf16 pool."""
    compare(tiny_llama_dir, f"bf16, batch {batch}, in place", batch=batch, decode_attention="in_place")


def test_one_kv_head_and_attention_biases(tmp_path, smollm2_tokenizer_dir):
    from conftest import make_tiny_llama

    path = make_tiny_llama(tmp_path / "mqa", smollm2_tokenizer_dir, seed=3, num_key_value_heads=1, attention_bias=True)
    compare(path, "one KV head, q/k/v biases")


@pytest.mark.parametrize("kind,scales", [("FP8", (0.02, 0.01)), ("INT8", (0.05, 0.03))])
def test_quantized_kv_cache(tmp_path, tiny_llama_dir, kind, scales):
    """K/V stored as 1-byte codes with per-layer scales (as in test_runtime_engine's KV-cache test)."""
    from conftest import with_kv_cache_scales

    path = with_kv_cache_scales(tiny_llama_dir, tmp_path / f"kv-{kind}", kind, scales)
    compare(path, f"{kind} KV cache")


def test_a_rows_numbers_do_not_depend_on_the_batch(tiny_llama_dir):
    """Alone, or decoding beside others while a long prompt is prefilled in chunks: the same bits
    (decode batching "exact": each row attends alone)."""
    engine = Engine(tiny_llama_dir, EngineConfig(**BASE, decode_batching="exact"))
    ids = prompt(9, 5)
    alone = forced_logits(engine, [ids], [prompt(6, 20)])
    engine = Engine(tiny_llama_dir, EngineConfig(**BASE, decode_batching="exact"))
    batched = forced_logits(engine, [prompt(30, 6), ids, prompt(3, 7)], [prompt(6, 21), prompt(6, 20), prompt(6, 22)])
    for a, b in zip(alone, batched, strict=True):
        assert torch.equal(a[0], b[1])
    exact = EngineConfig(**BASE, decode_batching="exact")
    alone = Engine(tiny_llama_dir, exact).generate(GenerationRequest(ids, 20, end_id=-1))
    assert tokens_beside_a_long_prompt(Engine(tiny_llama_dir, exact), ids) == alone


def tokens_beside_a_long_prompt(engine: Engine, ids: list[int]) -> list[int]:
    """Greedy tokens of ``ids`` while a 150-token prompt arrives mid-stream (mixed steps: decode rows fused,
    prompt rows through torch's operators)."""
    rid = engine.add_request(GenerationRequest(ids, 20, end_id=-1))
    got: list[int] = []
    for step in range(200):
        if step == 3:
            engine.add_request(GenerationRequest(prompt(150, 8), 4, end_id=-1))
        got += [e.token_id for e in engine.step() if e.request_id == rid and e.token_id is not None]
        if not engine.has_work():
            break
    return got


def test_prompt_rows_are_the_operators_bits(tiny_llama_dir):
    fused, operators, _ = engines(tiny_llama_dir)
    ids = prompt(40, 9)
    assert torch.equal(fused.prompt_logits(ids), operators.prompt_logits(ids))


def test_it_applies_only_where_rtks_kernels_run(tiny_llama_dir, monkeypatch):
    assert Engine(tiny_llama_dir, EngineConfig(**BASE, cpu_kernels=False)).model.fused is None
    # prompt rows: decode_batching "full" too (every call by its row count); RTK_FUSED_PROMPT_ROWS=0 keeps them on
    # torch's operators
    assert Engine(tiny_llama_dir, EngineConfig(**BASE, decode_batching="full")).model.fused.takes_prompt_rows
    monkeypatch.setenv("RTK_FUSED_PROMPT_ROWS", "0")
    engine = Engine(tiny_llama_dir, EngineConfig(**BASE))
    assert engine.model.fused is not None and not engine.model.fused.takes_prompt_rows
    assert "fused step (kernels, decode rows)" in engine.model.kernels
    assert Engine(tiny_llama_dir, EngineConfig(**BASE, attention_dtype="model")).model.fused is None
    # a float32 engine has its own fused step (kernels_avx2.DecodeLayers, tests/test_runtime_kernels_avx2.py)
    float32 = Engine(tiny_llama_dir, EngineConfig(**BASE, dtype="float32"))
    assert not isinstance(float32.model.fused, kernels.DecodeLayers)


def test_bad_inputs_are_refused_by_the_kernel(tiny_llama_dir):
    engine = Engine(tiny_llama_dir, EngineConfig(**BASE))
    fused, pool = engine.model.fused, engine.pool
    h = torch.zeros(1, engine.model.config.hidden_size, dtype=torch.bfloat16)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="out of range"):
        fused.forward(h, one, torch.tensor([pool.num_slots]), one, torch.tensor([[0, 1]]), pool, 0, 1)
    with pytest.raises(RuntimeError, match="layer range"):
        fused.forward(h, one, one, one, torch.tensor([[0, 1]]), pool, 0, 99)


# -- steps with prompt rows: every row through the fused layers (forward_rows) ------------------------------


def mixed_steps_logits(engine: Engine) -> list[torch.Tensor]:
    """Logits of six steps mixing decode rows with prompt chunks: two prompts from position 0 (their own K/V), a
    chunk of 30 rows after 16 cached positions (four attention units) beside a decode row and a third prompt,
    decode rows alone, a prompt of 5 rows and one of 3 after cached positions (padded where the library pads
    calls of few rows), four decode rows."""
    tpb, unit = engine.config.tokens_per_block, 8
    a, b, c, d = prompt(21, 1), prompt(46, 2), prompt(12, 3), prompt(8, 4)
    tables = [list(range(i * 40, (i + 1) * 40)) for i in range(4)]
    steps = [  # (table, cached, ids, is_prompt): decode rows first, then prompt chunks
        [(0, 0, a, True), (1, 0, b[:16], True)],
        [(0, 21, [7], False), (1, 16, b[16:46], True), (2, 0, c, True)],
        [(0, 22, [9], False), (1, 46, [11], False), (2, 12, [13], False)],
        [(0, 23, [5], False), (3, 0, d[:5], True)],
        [(0, 24, [6], False), (1, 47, [8], False), (3, 5, d[5:], True)],
        [(0, 25, [1], False), (1, 48, [2], False), (2, 13, [3], False), (3, 8, [4], False)],
    ]
    # the plan the engine builds (Engine.step): padded contexts only for SDPA's masked call, a chunk reads its
    # own K/V unless the pool quantizes them
    batched = engine.decode_batching != "exact" and not engine.model.attends_rows_in_one_call
    out = []
    with torch.inference_mode():
        for step in steps:
            work = [(tables[t], cached, len(ids), is_prompt) for t, cached, ids, is_prompt in step]
            ids = torch.tensor([i for _, _, row_ids, _ in step for i in row_ids])
            plan = build_plan(work, tpb, unit, reads_own_kv=engine.pool.quant is None, batched=batched)
            out.append(engine.model.forward(ids, plan, engine.pool))
    return out


def library_calls(engine: Engine) -> list[tuple[int, int]]:
    """(rows, out_features) of every oneDNN GEMM call in :func:`mixed_steps_logits`, sorted."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        mixed_steps_logits(engine)
    calls = [e for e in prof.events() if e.name == "mkldnn::_linear_pointwise"]
    return sorted((e.input_shapes[0][0], e.input_shapes[1][0]) for e in calls)


def odd_shapes(tmp_path, smollm2_tokenizer_dir):
    """head_dim 24 (RoPE's halves not 16-lane aligned), rows of 120 and 1,160 (tails of 8), and the down
    projection's reduction over 1,160 inputs, where oneDNN's one-row kernel rounds apart from its multi-row
    one (``Projection.min_rows`` 2: short prompt calls padded)."""
    from conftest import make_tiny_llama

    shapes = dict(hidden_size=120, intermediate_size=1160, head_dim=24)
    return make_tiny_llama(tmp_path / "odd", smollm2_tokenizer_dir, seed=4, **shapes)


@pytest.mark.parametrize(
    "model,kw",
    [
        ("tiny", {}),
        ("tiny", {"decode_batching": "exact"}),
        ("tiny", {"decode_attention": "in_place"}),
        ("tiny-padded", {}),
        ("odd", {}),
        ("fp8", {"dtype": "bfloat16"}),
        ("int8_sq", {"dtype": "bfloat16"}),
        ("kv-int8", {}),
        ("tiles", {}),
        ("fp8-tiles", {"dtype": "bfloat16"}),
        ("tiny", {"decode_batching": "full"}),
        ("fp8-tiles", {"dtype": "bfloat16", "decode_batching": "full"}),
    ],
)
def test_steps_with_prompt_rows_give_the_operators_bits(
    tmp_path, tiny_llama_dir, smollm2_tokenizer_dir, monkeypatch, model, kw
):
    """A step's prompt rows go through the fused layers too (``forward_rows``): decode rows through the GEMV,
    prompt rows through oneDNN's GEMM (padded as ``model.Projection`` pads them), prompt attention through the
    operator path's SDPA calls; decode rows attend as the fused decode step does (``tiny-padded``: SDPA's
    padded masked call, ``RTK_SDPA_DECODE=0``).  Every step's logits are the operators' bits, and a request's
    tokens beside a long prompt are its tokens alone."""
    from conftest import spec_for, with_kv_cache_scales

    from toolkit.quantize import quantize

    path = tiny_llama_dir
    tiled = model.endswith("tiles")
    if tiled:
        # the library's calls cut into tiles as on AMX hosts (Projection._probe_rows), on any host: 4 to 8 rows a
        # call, so a step's 37 prompt rows take five calls, 42 six (the last padded), 3 one padded call; prompt rows
        # never through the GEMV whole, so every projection's prompt rows take the tiles
        probe = Projection._probe_rows

        def tiled_probe(self):
            return (1, 8, 4) if self.packed is not None else probe(self)

        monkeypatch.setattr(Projection, "_probe_rows", tiled_probe)
        monkeypatch.setattr(Projection, "whole_gemv_rows", property(lambda self: 0))
        model = model.removesuffix("-tiles") if model != "tiles" else "tiny"
    if model == "tiny-padded":
        monkeypatch.setenv("RTK_SDPA_DECODE", "0")
    elif model == "odd":
        path = odd_shapes(tmp_path, smollm2_tokenizer_dir)
    elif model == "kv-int8":
        path = with_kv_cache_scales(tiny_llama_dir, tmp_path / "kv-int8", "INT8", (0.05, 0.03))
    elif model in ("fp8", "int8_sq"):
        calib = {"calibration": {"num_samples": 4, "max_length": 32, "batch_size": 4}, "eval_samples": 2}
        quantization = {"format": model, "max_perplexity_increase": 100.0, **calib}
        spec = spec_for(f"tiny-{model}-rows", tiny_llama_dir, quantization=quantization)
        path = quantize(spec, checkpoint=tiny_llama_dir, output=tmp_path / "quantized").path / "hf"
    fused, operators, float32 = engines(path, **kw)
    projections = [g.parts[0] for layer in fused.model.layers for g in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    tiles = any(p.tile_rows is not None for p in projections)  # AMX hosts: the library's calls cut into tiles
    assert fused.model.fused.takes_prompt_rows
    if tiled:
        assert all(p.tile_rows == 8 and p.pad_rows == 4 for p in projections if p.packed is not None) and tiles
    if model == "odd" and not tiles:
        assert any(p.min_rows > 1 for p in projections)  # some prompt calls are padded
    if model == "tiny-padded":
        assert not fused.model.sdpa_decode
    full = kw.get("decode_batching") == "full"
    if tiled:  # the same library calls, every one of 4 to 8 rows
        calls = [library_calls(e) for e in (fused, operators)]
        assert calls[0] == calls[1] and calls[0] and all(4 <= rows <= 8 for rows, _ in calls[0])
        if full:
            # every call by its row count: the steps of more than 16 rows (37 prompt rows; 1 decode and 42 prompt
            # rows, the last tile padded to 4) through the library whole, decode rows too; the others through the
            # GEMV. The steps' prompt rows alone would take 37 + 44 + 5 + 4 rows a projection.
            n = projections[0].out_features
            alike = sum(p.out_features == n for p in projections)
            assert sum(rows for rows, out in calls[0] if out == n) == (37 + 44) * alike
    got = [mixed_steps_logits(e) for e in (fused, operators, float32)]
    assert_same_bits(*got, f"{model} {kw}")
    if full:  # a row's bits depend on its step
        return
    ids = prompt(9, 5)
    alone = Engine(path, EngineConfig(**BASE, **kw)).generate(GenerationRequest(ids, 20, end_id=-1))
    assert tokens_beside_a_long_prompt(Engine(path, EngineConfig(**BASE, **kw)), ids) == alone


def test_forward_rows_refuses_a_plan_it_cannot_follow(tiny_llama_dir):
    """Units that leave prompt rows out, or a projection without the library's weights: refused, not half done."""
    engine = Engine(tiny_llama_dir, EngineConfig(**BASE))
    fused, pool = engine.model.fused, engine.pool
    tables = [list(range(0, 40))]
    plan = build_plan([(tables[0], 16, 30, True)], BASE["tokens_per_block"], 8)
    plan.prefills[0].units = plan.prefills[0].units[:-1]
    h = torch.zeros(30, engine.model.config.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="units must cover each chunk's rows in order"):
        fused.forward_rows(h, plan, pool, 0, 1)
    plan = build_plan([(tables[0], 0, 30, True)], BASE["tokens_per_block"], 8)
    plan.write_slots = plan.write_slots.clone()
    plan.write_slots[3] = pool.num_slots
    with pytest.raises(RuntimeError, match="out of range"):
        fused.forward_rows(h, plan, pool, 0, 1)
