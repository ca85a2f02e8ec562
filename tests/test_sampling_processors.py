"""The CPU engine's logits processing and log-probabilities against transformers (the independent reference).

* Repetition penalty and min tokens: transformers' ``RepetitionPenaltyLogitsProcessor`` and
  ``MinNewTokensLengthLogitsProcessor``, on single rows and through ``generate`` on the tiny Llama.
* Presence and frequency penalties: transformers has no processor for them, so the reference is
  a LogitsProcessor written here from the OpenAI formula ``x - c * f - (c > 0) * p``, with ``c``
  counting prompt and generated tokens and applied after temperature, as TensorRT-LLM's
  ``batchApplyPenalty`` does (NVIDIA/TensorRT-LLM cpp/tensorrt_llm/kernels/penaltyKernels.cu).
* Log-probabilities: ``log_softmax`` of the processed scores ``generate`` reports.
* Bad values are refused naming the field.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from toolkit.errors import UsageError
from toolkit.runtime.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from toolkit.runtime.sampling import field_problems, process_logits

VOCAB = 300


class PresenceFrequency(LogitsProcessor):
    """OpenAI's presence/frequency penalties over every token of the sequence (prompt included)."""

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = presence, frequency

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for b in range(scores.shape[0]):
            counts = torch.bincount(input_ids[b], minlength=scores.shape[1]).to(scores.dtype)
            out[b] -= counts * self.frequency + (counts > 0).to(scores.dtype) * self.presence
        return out


def row_and_history(seed: int, n: int = 40):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=g) * 4
    history = torch.randint(0, 50, (n,), generator=g).tolist()  # repeats: counts > 1
    return logits, history


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    for seed in range(5):
        logits, history = row_and_history(seed)
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), logits[None].clone())[0]
        got = process_logits(logits, SamplingParams(repetition_penalty=penalty), history, (), 0)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        # with a temperature: transformers applies it after the penalty; both orders agree (both scale)
        want_t = TemperatureLogitsWarper(0.6)(None, want[None].clone())[0]
        got_t = process_logits(logits, SamplingParams(temperature=0.6, repetition_penalty=penalty), history, (), 0)
        torch.testing.assert_close(got_t, want_t, rtol=1e-6, atol=1e-6)


def test_min_tokens_matches_transformers():
    logits, history = row_and_history(7)
    prompt_len, eos = 30, [5, 9]
    for generated in range(0, 6):
        ids = torch.tensor([history[: prompt_len + generated]])
        want = MinNewTokensLengthLogitsProcessor(prompt_len, 4, eos)(ids, logits[None].clone())[0]
        got = process_logits(logits, SamplingParams(min_tokens=4), ids[0].tolist(), frozenset(eos), generated)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), generated
        torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)], rtol=0, atol=0)
        assert bool(torch.isinf(got[5])) == (generated < 4)


def test_presence_and_frequency_follow_the_openai_formula_after_temperature():
    for seed in range(5):
        logits, history = row_and_history(seed)
        params = SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.25)
        scaled = TemperatureLogitsWarper(0.8)(None, logits[None].clone())
        want = PresenceFrequency(0.5, 0.25)(torch.tensor([history]), scaled)[0]
        got = process_logits(logits, params, history, (), 0)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        unseen = [t for t in range(VOCAB) if t not in history]
        torch.testing.assert_close(got[unseen], logits[unseen] / 0.8)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("temperature", float("nan"), "sampling.temperature nan"),
        ("temperature", -0.5, "sampling.temperature -0.5"),
        ("top_p", 0.0, "sampling.top_p 0.0 must be in"),
        ("top_p", 1.5, "sampling.top_p 1.5"),
        ("top_p", float("nan"), "sampling.top_p nan"),
        ("top_k", -1, "sampling.top_k -1"),
        ("seed", -1, "sampling.seed -1"),
        ("seed", 2**64, "sampling.seed"),
        ("min_tokens", -2, "sampling.min_tokens -2"),
        ("repetition_penalty", 0.0, "sampling.repetition_penalty 0.0"),
        ("repetition_penalty", float("inf"), "sampling.repetition_penalty inf"),
        ("presence_penalty", float("nan"), "sampling.presence_penalty nan"),
        ("frequency_penalty", float("-inf"), "sampling.frequency_penalty -inf"),
    ],
)
def test_bad_sampling_values_are_refused_naming_the_field(field, value, match):
    params = SamplingParams(**{field: value})
    assert [name for name, _, _ in field_problems(params)] == [field]
    with pytest.raises(UsageError, match=match):
        params.validate()


def test_valid_edges_are_accepted():
    for params in (
        SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=2**64 - 1),
        SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.5, min_tokens=0),
    ):
        assert field_problems(params) == []


# -- through the engine, against transformers' generate ---------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: see tests/test_runtime_engine.py
    yield Engine(
        tiny_llama_dir,
        EngineConfig(
            max_batch_size=4,
            max_num_tokens=64,
            max_input_len=128,
            max_seq_len=256,
            tokens_per_block=16,
            dtype="bfloat16",
        ),
    )
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    """transformers' model in bf16 with its SDPA on float32 q/k/v (the engine's default attention)."""
    from test_runtime_engine import transformers_model

    return transformers_model(tiny_llama_dir)


PROMPT = [1, 510, 3458, 282, 4649, 314, 510, 3458]


def hf_generate(model, ids, n, eos=None, processors=(), **kw):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            logits_processor=LogitsProcessorList(list(processors)),
            output_scores=True,
            return_dict_in_generate=True,
            **kw,
        )
    return out.sequences[0, len(ids) :].tolist(), out.scores


def engine_generate(engine, ids, n, end_id=-1, **sampling):
    """Generated ids and log-probabilities (end id not included, as TensorRT-LLM)."""
    rid = engine.add_request(
        GenerationRequest(
            prompt_ids=list(ids), max_new_tokens=n, end_id=end_id, sampling=SamplingParams(log_probs=True, **sampling)
        )
    )
    toks, lps = [], []
    while engine.has_work():
        for ev in engine.step():
            assert ev.request_id == rid
            if ev.token_id is not None:
                toks.append(ev.token_id)
                lps.append(ev.log_prob)
    return toks, lps


# The tiny random model never repeats a token within 20 greedy steps, so a penalty > 1 (which lowers
# seen tokens) changes nothing there; penalties that favour seen tokens (repetition < 1, negative
# presence / frequency) change the continuation, so these comparisons can fail.
def test_greedy_with_repetition_penalty_matches_generate_with_log_probs(engine, hf_model):
    want, scores = hf_generate(hf_model, PROMPT, 20, repetition_penalty=0.5)
    plain, _ = hf_generate(hf_model, PROMPT, 20)
    assert want != plain, "the penalty should change this continuation"
    got, lps = engine_generate(engine, PROMPT, 20, repetition_penalty=0.5)
    assert got == want
    want_lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(scores, want, strict=True)]
    # transformers' logits bit for bit, or, where rtk's GEMV rounds its own way (AMX hosts), within its rounding:
    # log-probs 0.031 apart at most there (2026-12-04)
    assert lps == pytest.approx(want_lps, abs=0.1 if engine.model.gemv_own_rounding else 1e-4)
    assert all(lp <= 0.0 for lp in lps)


def test_presence_and_frequency_penalties_match_generate_with_the_formula(engine, hf_model):
    want, _ = hf_generate(hf_model, PROMPT, 20, processors=[PresenceFrequency(-2.0, -1.5)])
    got, _ = engine_generate(engine, PROMPT, 20, presence_penalty=-2.0, frequency_penalty=-1.5)
    assert got == want
    plain, _ = engine_generate(engine, PROMPT, 20)
    assert got != plain


def test_min_tokens_holds_the_end_id_back_like_min_new_tokens(engine, hf_model):
    plain, _ = engine_generate(engine, PROMPT, 30)
    end_id = plain[3]  # greedy would end the request at its 4th token
    short, _ = engine_generate(engine, PROMPT, 30, end_id=end_id)
    assert short == plain[:3]
    want, _ = hf_generate(hf_model, PROMPT, 30, eos=end_id, min_new_tokens=12)
    got, _ = engine_generate(engine, PROMPT, 30, end_id=end_id, min_tokens=12)
    assert len(got) >= 12 and end_id not in got[:12]
    assert got == [t for t in want if t != end_id][: len(got)] and (len(want) == 30 or want[len(got)] == end_id)


def test_seeded_sampling_log_probs_are_of_the_processed_distribution(engine):
    toks, lps = engine_generate(engine, PROMPT, 12, temperature=0.7, top_k=20, seed=3, repetition_penalty=1.2)
    assert len(toks) == 12 and all(lp is not None and lp <= 0.0 and math.isfinite(lp) for lp in lps)
    again = engine_generate(engine, PROMPT, 12, temperature=0.7, top_k=20, seed=3, repetition_penalty=1.2)
    assert again == (toks, lps)
