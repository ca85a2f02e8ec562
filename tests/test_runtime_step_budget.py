"""The step's time budget (``step_budget_ms``, ``step_budget_ratio``): the cost model fitted to measured steps,
the scheduler's cut of prompt chunks, and an engine under it giving the same tokens as transformers."""

from __future__ import annotations

import random

import pytest

from toolkit.runtime.kv_cache import BlockManager
from toolkit.runtime.sampling import SamplingParams
from toolkit.runtime.scheduler import Scheduler, Sequence
from toolkit.runtime.step_times import MIN_STEPS, REFIT_EVERY, WINDOW, StepTimes, attention_rows

TRUE = (4.0, 1.5, 2.0, 3.0)  # fixed, per decode row, per prompt row, per 1024 tokens of chunk context (ms)


def true_ms(decode: int, chunks: list[tuple[int, int]], scale: float = 1.0, coef=TRUE) -> float:
    fixed, per_decode, per_row, per_context = (scale * c for c in coef)
    return (
        fixed
        + per_decode * decode
        + sum(per_row * n + per_context * attention_rows(n, context) for n, context in chunks)
    )


def feed(times: StepTimes, steps: int, seed: int = 0, noise: float = 0.0, scale: float = 1.0, coef=TRUE) -> None:
    """Steps of 1-8 decode rows, every other one with a prompt chunk, timed by ``coef`` x ``scale``."""
    rng = random.Random(seed)
    for i in range(steps):
        decode = rng.randint(1, 8)
        chunks = [] if i % 2 else [(rng.choice([8, 16, 32]), rng.choice([0, 64, 256, 700]))]
        ms = true_ms(decode, chunks, scale, coef) * (1 + rng.uniform(-noise, noise))
        times.observe(decode, sum(n for n, _ in chunks), sum(attention_rows(n, c) for n, c in chunks), ms)


def hold_cost(times: StepTimes, coef) -> None:
    """``times`` fitted to steps timed exactly by ``coef`` (both windows filled with them), then deaf to the
    steps that follow: a known cost for the scheduler's cuts, through the same fit the engine feeds."""
    feed(times, 2 * WINDOW, seed=3, coef=coef)
    assert times.coef == pytest.approx(coef, rel=1e-6, abs=1e-9)
    times.observe = lambda *step: None


def test_the_fit_recovers_a_linear_step_cost_and_inverts_it():
    times = StepTimes()
    feed(times, 2 * MIN_STEPS - 1)
    assert not times.ready  # one kind of step is still short of MIN_STEPS: the token budget alone
    feed(times, 40, seed=1)
    assert times.ready
    assert times.coef == pytest.approx(TRUE, rel=1e-6)
    assert times.decode_ms(3) == pytest.approx(4 + 3 * 1.5)
    for context in (0, 100, 900):
        rows = times.prompt_rows_within(25.0, context)
        assert times.prompt_ms(rows, context) <= 25.0 < times.prompt_ms(rows + 1, context)
    assert times.prompt_rows_within(0.0, 0) == times.prompt_rows_within(-3.0, 0) == 0


def test_the_fit_follows_the_host_and_tolerates_noise():
    times = StepTimes()
    feed(times, 64, noise=0.05)
    assert times.coef[2] == pytest.approx(2.0, rel=0.15)
    feed(times, 64, seed=2, noise=0.05, scale=1.5)  # the host slows by half: the window forgets the old speed
    assert times.coef[2] == pytest.approx(3.0, rel=0.15)


def test_once_it_predicts_the_fit_waits_for_refit_every_new_steps():
    times = StepTimes()
    feed(times, 64)
    assert times.coef == pytest.approx(TRUE, rel=1e-6)
    for i in range(REFIT_EVERY):  # the host doubles its step times: seen only at the next fit
        assert times.coef == pytest.approx(TRUE, rel=1e-6)
        feed(times, 1, seed=10 + i, scale=2.0)
    assert times.coef != pytest.approx(TRUE, rel=1e-3)


@pytest.mark.parametrize("per_context", [0.0, 3e-16])
def test_a_per_context_cost_near_zero_cuts_as_none_does(monkeypatch, per_context):
    """A fit's per-context cost of ~1e-16 ms (lstsq's rounding of a true 0 on one host) gives the rows a zero one
    does: the quadratic's root taken without cancellation."""
    monkeypatch.setattr(StepTimes, "coef", property(lambda self: (5.0, 1.0, 2.0, per_context)))
    times = StepTimes()
    for ms, context in [(0.5, 0), (33.0, 0), (33.0, 700), (195.0, 100), (10001.0, 2000)]:  # off whole rows
        assert times.prompt_rows_within(ms, context) == int(ms / 2.0), (ms, context)


def test_prompt_rows_that_look_free_give_no_prediction():
    times = StepTimes()
    for i in range(12):  # prompt steps no slower than decode-only ones: nothing to cut on
        times.observe(2, 16 if i % 2 else 0, attention_rows(16, 0) if i % 2 else 0.0, 10.0 - (i % 2) * 0.5)
    assert not times.ready


# -- the scheduler's cut --------------------------------------------------------------------------


def sequence(order: int, prompt_len: int, max_new: int = 64) -> Sequence:
    return Sequence(
        request_id=f"r{order}",
        order=order,
        tokens=list(range(1000 * order, 1000 * order + prompt_len)),
        prompt_len=prompt_len,
        max_new_tokens=max_new,
        end_ids=frozenset(),
        stop_sequences=[],
        sampling=SamplingParams(),
        generator=None,
        arrival_ns=0,
    )


def decoding(
    budget_ms: float | None,
    coef=(5.0, 1.0, 2.0, 0.0),
    decoders: int = 3,
    ratio: float | None = None,
    backlog_steps: int = 0,
) -> Scheduler:
    """A scheduler (unit 16, 64-token steps) with ``decoders`` sequences generating and a known step cost."""
    sched = Scheduler(
        BlockManager(256, 16, True),
        8,
        64,
        step_budget_ms=budget_ms,
        step_budget_ratio=ratio,
        prompt_backlog_steps=backlog_steps,
    )
    for i in range(decoders):
        sched.add(sequence(i, 4))
    for seq, n in sched.schedule():  # no one decodes yet: the three prompts whole
        sched.commit(seq, n)
        seq.tokens.append(7)
    if coef is not None:
        hold_cost(sched.step_times, coef)
    return sched


def planned(work) -> list[tuple[str, int]]:
    return [(seq.request_id, n) for seq, n in work if seq.prefilling]


@pytest.mark.parametrize(
    "budget_ms, chunk",
    [
        (None, 48),  # the token budget alone: 61 left after 3 decodes, cut to whole units
        (200.0, 48),  # time to spare: the token budget still caps the rows
        (40.0, 16),  # 40 - (5 + 3) = 32 ms left: 16 rows at 2 ms
        (80.0, 32),  # 72 ms left: 36 rows fit, cut to 32 (whole units)
        (1.0, 16),  # decodes alone overrun it: still one unit, so the prompt advances
    ],
)
def test_a_prompt_chunk_is_cut_to_the_time_the_decodes_leave(budget_ms, chunk):
    sched = decoding(budget_ms)
    sched.add(sequence(10, 100))
    assert planned(sched.schedule()) == [("r10", chunk)]


@pytest.mark.parametrize(
    "decoders, ratio, budget_ms, chunk",
    [
        (3, 7.0, None, 16),  # 3 decodes: 5 + 3 = 8 ms, x 7 leaves 48 ms: 24 rows, cut to 16 (whole units)
        (7, 7.0, None, 32),  # 7 decodes: 12 ms leaves 72 ms: 36 rows, cut to 32
        (3, 9.1, None, 32),  # 64.8 ms: 32 rows
        (7, 9.1, None, 48),  # 97.2 ms: 48 rows, within the 57 tokens the step has left
        (7, 9.1, 80.0, 32),  # both budgets: the smaller (80 - 12 = 68 ms, 34 rows)
        (3, 1.01, None, 16),  # nothing left: still one unit, so the prompt advances
    ],
)
def test_a_ratio_budget_follows_the_decode_rows(decoders, ratio, budget_ms, chunk):
    sched = decoding(budget_ms, decoders=decoders, ratio=ratio)
    sched.add(sequence(10, 100))
    assert planned(sched.schedule()) == [("r10", chunk)]


def test_a_second_prompt_joins_only_within_the_time_left_and_a_short_rest_runs_whole():
    sched = decoding(50.0)  # 42 ms left: 21 rows
    sched.add(sequence(10, 100))
    sched.add(sequence(11, 12))
    assert planned(sched.schedule()) == [("r10", 16)]  # the 12-token prompt (24 ms) does not fit the 10 ms left
    sched = decoding(50.0)
    sched.add(sequence(10, 100))
    sched.add(sequence(11, 4))
    assert planned(sched.schedule()) == [("r10", 16), ("r11", 4)]  # 8 ms: it fits


def test_the_context_term_cuts_a_long_prompts_later_chunks():
    sched = decoding(60.0, coef=(5.0, 1.0, 1.0, 20.0))  # 52 ms left
    seq = sequence(10, 2000)
    sched.add(seq)
    first = planned(sched.schedule())  # 32 rows at the start: 32 + 20 x 32 x 16 / 1024 = 42 ms (48 would be 70)
    seq.num_cached = 1600  # deep into the prompt, a row's attention alone costs 20 x 1.6 ms
    sched.running.remove(seq), sched.running.append(seq)
    late = planned(sched.schedule())
    assert first == [("r10", 32)] and late == [("r10", 16)]


@pytest.mark.parametrize(
    "budget_ms, backlog_steps, prompts, chunks",
    [
        (1.0, 0, [100], [16]),  # the cut alone: a unit
        (1.0, 2, [100], [48]),  # 100 waiting over 2 steps: 50, in whole units 48
        (1.0, 4, [100], [16]),  # 25: one unit, what the cut keeps anyway
        (1.0, 4, [100, 60], [32]),  # 160 over 4 steps: 40 -> 32 rows, all the first prompt's (the oldest)
        (1.0, 2, [20, 100], [20, 16]),  # 120 over 2: 60 -> 48 rows: the first prompt whole, the 28 left to a unit
        (80.0, 4, [100], [32]),  # the cut leaves more than the floor: the cut's 32
        (1.0, 1, [500], [48]),  # the floor never passes the token budget (61 after 3 decodes, whole units)
    ],
)
def test_a_step_takes_the_prompt_backlogs_share_whatever_the_cut(budget_ms, backlog_steps, prompts, chunks):
    sched = decoding(budget_ms, backlog_steps=backlog_steps)
    for i, n in enumerate(prompts):
        sched.add(sequence(10 + i, n))
    assert [n for _, n in planned(sched.schedule())] == chunks


def serve_steps(sched: Scheduler, steps: int, arrive_every: int, prompt_len: int, max_new: int) -> list[int]:
    """Run ``sched`` for ``steps`` steps as the engine would (chunks committed, a token a generating row,
    finished sequences dropped), a ``prompt_len``-token request arriving every ``arrive_every`` steps; returns
    each finished request's steps from arrival to its first token."""
    arrived: dict[Sequence, int] = {}
    waits = []
    for step in range(steps):
        if step % arrive_every == 0:
            seq = sequence(100 + step, prompt_len, max_new=max_new)
            sched.add(seq)
            arrived[seq] = step
        for seq, n in sched.schedule():
            sched.commit(seq, n)
            if not seq.prefilling:
                if seq.num_generated == 0 and seq in arrived:
                    waits.append(step - arrived.pop(seq))
                seq.tokens.append(7)
                if seq.num_generated >= seq.max_new_tokens:
                    sched.drop(seq)
    return waits


def test_under_a_ratio_budget_the_backlog_floor_keeps_prompts_from_queueing():
    """Prompts arriving at 20 tokens a step against a ratio budget that cuts them to a unit (16) a step: without
    the floor every prompt waits longer than the one before; with it the wait stays at a few steps."""
    waits = {}
    for backlog_steps in (0, 4):
        sched = Scheduler(
            BlockManager(4096, 16, True), 64, 64, step_budget_ratio=1.01, prompt_backlog_steps=backlog_steps
        )
        hold_cost(sched.step_times, (5.0, 1.0, 2.0, 0.0))
        waits[backlog_steps] = serve_steps(sched, 300, arrive_every=4, prompt_len=80, max_new=16)
    assert waits[0][-1] > 2 * waits[0][len(waits[0]) // 4] > 0  # a queue that grows for as long as it runs
    assert max(waits[4][len(waits[4]) // 4 :]) <= 8  # bounded: the backlog clears within about 4 steps (5 here)


def test_no_time_cut_without_decodes_or_before_the_fit():
    sched = Scheduler(BlockManager(256, 16, True), 8, 64, max_num_tokens_without_decode=512, step_budget_ms=1.0)
    hold_cost(sched.step_times, (5.0, 1.0, 2.0, 0.0))
    sched.add(sequence(0, 300))
    assert planned(sched.schedule()) == [("r0", 300)]  # nobody generating: the whole prompt
    sched = decoding(1.0, coef=None)
    sched.add(sequence(10, 100))
    assert planned(sched.schedule()) == [("r10", 48)]  # no measurements yet: the token budget alone


# -- an engine under a time budget ----------------------------------------------------------------


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    "unit, time_budget, chunks",
    [
        (None, dict(step_budget_ms=1e-3), [16] * 6 + [4]),  # the backlog's floor (over 6 steps) below a unit
        (8, dict(step_budget_ms=1e-3, prompt_backlog_steps=0), [8] * 12 + [4]),  # the cut alone: a unit a step
        # the floor: 100 waiting over 6 steps is two units, 84 one, below 48 the cut's unit
        (8, dict(step_budget_ratio=1.0001), [16] + [8] * 10 + [4]),
    ],
    ids=["unit16", "unit8", "unit8-ratio"],
)
def test_an_engine_under_a_tiny_time_budget_cuts_chunks_to_a_unit_and_keeps_the_tokens(
    tiny_llama_dir, unit, time_budget, chunks
):
    from test_runtime_engine import config, greedy, hf_greedy, prompt, run, tokens, transformers_model

    from toolkit.runtime.engine import Engine

    hf_model = transformers_model(tiny_llama_dir)
    budget = dict(max_num_tokens=64, context_chunk_unit=unit, **time_budget)
    eng = Engine(tiny_llama_dir, config(enable_kv_cache_reuse=False, **budget))
    run(eng, [greedy(prompt(8, 70 + i), n=6) for i in range(4)], arrivals={1: 1, 2: 2, 3: 3})  # the fit's data
    # the engine fed the fit both kinds of step; the tiny model's rows cost microseconds, so the fit itself is noise
    # (on a busy host prompt rows can even look free, and it declines to predict): hold the cost at one we know
    assert min(eng.scheduler.step_times.observed) >= MIN_STEPS
    hold_cost(eng.scheduler.step_times, (5.0, 1.0, 2.0, 0.0))
    seen: list[int] = []
    forward = eng.model.forward

    def record(ids, plan, pool):
        seen.append(sum(n for seq, n in eng._planned if seq.prefilling))
        return forward(ids, plan, pool)

    schedule = eng.scheduler.schedule

    def keep():
        eng._planned = schedule()
        return eng._planned

    eng.scheduler.schedule, eng.model.forward = keep, record
    reqs = [greedy(prompt(8, 80), n=30), greedy(prompt(8, 81), n=30), greedy(prompt(100, 82), n=4)]
    ids, events, _ = run(eng, reqs, arrivals={1: 1, 2: 4})
    # once two decode, the 100-token prompt goes a unit a step or its backlog's floor (the token budget alone: 48,
    # then 52)
    assert [c for c in seen if c][2:] == chunks
    for i, r in enumerate(reqs):
        assert tokens(events[ids[i]]) == hf_greedy(hf_model, r.prompt_ids, r.max_new_tokens)
