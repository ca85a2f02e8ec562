"""Next-token selection: logits processing (bias, temperature, penalties, min tokens), then greedy or
temperature / top-k / top-p sampling with a per-request seed, and the chosen token's log-probability.

The order of the logits processing is TensorRT-LLM's ``batchApplyPenalty`` (NVIDIA/TensorRT-LLM
``cpp/tensorrt_llm/kernels/penaltyKernels.cu``, 249d93d): embedding bias, temperature, then for each
token that occurs in the sequence so far (prompt and generated tokens, counted ``c``): repetition
(``x < 0 ? x * r : x / r``), presence (``x - p``), frequency (``x - f * c``); and while fewer than
``min_tokens`` tokens were generated, the end ids are masked.  Presence and frequency are the
OpenAI formula ``x - c * f - (c > 0) * p``; like TensorRT-LLM (and unlike OpenAI's description,
which counts sampled tokens only), ``c`` counts the prompt's tokens too.

``log_prob`` is the log-probability of the chosen token under the processed distribution over the
whole vocabulary (after bias, temperature and penalties, before top-k / top-p truncation): what
TensorRT-LLM adds to ``cum_log_probs``.

Each request owns a ``torch.Generator`` seeded from its ``seed``, and its row of logits does not
depend on what else is in the batch (bf16 GEMMs here are batch-invariant; see docs/engine.md), so
a seeded request draws the same tokens alone or in a crowd.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import UsageError

SEED_LIMIT = 2**64  # TensorRT-LLM's seed is an unsigned 64-bit integer


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0  # end ids cannot end the request before this many tokens
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    embedding_bias: Sequence[float] | None = None  # added to the logits (index = token id)
    log_probs: bool = False  # compute the chosen token's log-probability

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain(self) -> bool:
        """Greedy argmax over the raw logits is the whole job (the fast path)."""
        return (
            self.greedy
            and not self.penalized
            and not self.min_tokens
            and self.embedding_bias is None
            and not self.log_probs
        )

    def validate(self) -> None:
        """Raise UsageError naming the first bad field (``sampling.<field>``)."""
        for name, value, rule in field_problems(self):
            raise UsageError(f"sampling.{name} {value} {rule}")

    def make_generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        # torch seeds are signed 64-bit; fold an unsigned seed into that range.
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        g.manual_seed(seed % (2**63))
        return g


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def field_problems(p: SamplingParams) -> list[tuple[str, object, str]]:
    """(field, value, what is wrong) for each invalid field of ``p``; empty when all are valid."""
    out = []
    if not (_finite(p.temperature) and p.temperature >= 0.0):
        out.append(("temperature", p.temperature, "must be a number >= 0 (0 = greedy)"))
    if not isinstance(p.top_k, int) or p.top_k < 0:
        out.append(("top_k", p.top_k, "must be an integer >= 0 (0 = no limit)"))
    if not (_finite(p.top_p) and 0.0 < p.top_p <= 1.0):
        out.append(("top_p", p.top_p, "must be in (0, 1]"))
    if p.seed is not None and not (isinstance(p.seed, int) and 0 <= p.seed < SEED_LIMIT):
        out.append(("seed", p.seed, "must be an unsigned 64-bit integer (0 .. 2**64 - 1)"))
    if not isinstance(p.min_tokens, int) or p.min_tokens < 0:
        out.append(("min_tokens", p.min_tokens, "must be an integer >= 0"))
    if not (_finite(p.repetition_penalty) and p.repetition_penalty > 0.0):
        out.append(("repetition_penalty", p.repetition_penalty, "must be a number > 0 (1 = off)"))
    for name in ("presence_penalty", "frequency_penalty"):
        if not _finite(getattr(p, name)):
            out.append((name, getattr(p, name), "must be a finite number (0 = off)"))
    if p.embedding_bias is not None and not bool(torch.isfinite(torch.as_tensor(p.embedding_bias)).all()):
        out.append(("embedding_bias", "(values)", "must hold finite numbers"))
    return out


class SequenceState(Protocol):
    """What selection reads of a sequence (toolkit.runtime.scheduler.Sequence)."""

    sampling: SamplingParams
    generator: torch.Generator | None
    tokens: list[int]  # prompt + generated so far
    end_ids: frozenset[int]

    @property
    def num_generated(self) -> int: ...


def process_logits(logits: torch.Tensor, params: SamplingParams, tokens: Sequence[int], end_ids, num_generated: int):
    """The float32 ``[vocab]`` row that tokens are drawn from (see the module doc for the order)."""
    x = logits.to(torch.float32).clone()
    vocab = x.numel()
    if params.embedding_bias is not None:
        bias = torch.as_tensor(params.embedding_bias, dtype=torch.float32)[:vocab]
        x[: bias.numel()] += bias
    if params.temperature > 0.0 and params.temperature != 1.0:  # 0 = greedy: nothing to scale
        x = x / params.temperature
    if params.penalized and len(tokens):
        ids = torch.as_tensor(list(tokens), dtype=torch.int64)
        counts = torch.bincount(ids[ids < vocab], minlength=vocab).to(torch.float32)
        seen = counts > 0
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            x = torch.where(seen, torch.where(x < 0, x * r, x / r), x)
        if params.presence_penalty:
            x = x - params.presence_penalty * seen.to(torch.float32)
        if params.frequency_penalty:
            x = x - params.frequency_penalty * counts
    if num_generated < params.min_tokens:
        masked = [t for t in end_ids if 0 <= t < vocab]
        if masked:
            x[masked] = -math.inf
    return x


def draw(x: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a processed row (temperature already applied)."""
    if params.greedy:
        return int(torch.argmax(x))
    if 0 < params.top_k < x.numel():
        values, ids = torch.topk(x, params.top_k)  # sorted, descending
    else:
        values, ids = torch.sort(x, descending=True, stable=True)  # ties: lowest id first, as argmax
    probs = torch.softmax(values, dim=-1)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(ids[choice])


def sample_sequences(
    logits: torch.Tensor,
    seqs: Sequence[SequenceState],
    argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[int], list[float | None]]:
    """For each row of ``logits`` ``[B, vocab]`` (row i belongs to ``seqs[i]``): the token id, and its
    log-probability when ``sampling.log_probs`` asks for it (else None).  ``argmax_rows``: a faster
    ``torch.argmax(x, dim=-1)`` for float32 rows (rtk's kernels), used when every row is greedy."""
    if all(s.sampling.plain for s in seqs):
        ids = argmax_rows(logits) if argmax_rows is not None else torch.argmax(logits, dim=-1)
        return ids.tolist(), [None] * len(seqs)
    ids, log_probs = [], []
    for i, s in enumerate(seqs):
        p = s.sampling
        if p.plain:
            ids.append(int(torch.argmax(logits[i])))
            log_probs.append(None)
            continue
        x = process_logits(logits[i], p, s.tokens if p.penalized else (), s.end_ids, s.num_generated)
        tok = draw(x, p, s.generator)
        ids.append(tok)
        log_probs.append(float(torch.log_softmax(x, dim=-1)[tok]) if p.log_probs else None)
    return ids, log_probs
