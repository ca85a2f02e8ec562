"""Next-token selection: greedy, or temperature / top-k / top-p sampling with a per-request seed.

Each request owns a ``torch.Generator`` seeded from its ``seed``, and its row of logits does not
depend on what else is in the batch (bf16 GEMMs here are batch-invariant; see docs/engine.md), so
a seeded request draws the same tokens alone or in a crowd.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from ..errors import UsageError


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def validate(self) -> None:
        if not (self.temperature >= 0.0):
            raise UsageError(f"sampling.temperature {self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise UsageError(f"sampling.top_k {self.top_k} must be >= 0 (0 = no limit)")
        if not (0.0 < self.top_p <= 1.0):
            raise UsageError(f"sampling.top_p {self.top_p} must be in (0, 1]")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise UsageError(f"sampling.seed {self.seed} must be an unsigned 64-bit integer")

    def make_generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        # torch seeds are signed 64-bit; fold an unsigned seed into that range.
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        g.manual_seed(seed % (2**63))
        return g


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a float32 ``[vocab]`` row."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.numel():
        values, ids = torch.topk(scaled, params.top_k)  # sorted, descending
    else:
        values, ids = torch.sort(scaled, descending=True, stable=True)  # ties: lowest id first, as argmax
    probs = torch.softmax(values, dim=-1)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(ids[choice])


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Token ids for each row of ``logits`` ``[B, vocab]`` (float32)."""
    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    return [sample_row(logits[i], p, g) for i, (p, g) in enumerate(zip(params, generators))]
