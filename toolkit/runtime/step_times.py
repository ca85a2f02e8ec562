"""A step's time predicted from the engine's last measured steps, for the step's time budget.

The scheduler's token budget (``max_num_tokens``) bounds the rows of a step, but what a generating
request waits for is the step's *time*, and a row's cost moves by a third between hours on a shared
host and by 2x between weight formats.  With ``step_budget_ms`` the scheduler cuts each prompt chunk
so the step it joins is predicted to stay within that time (Sarathi-Serve's stall-free batching sizes
its chunks from an offline profile of the same cost, arXiv:2403.02310; here the profile is the live
one).

The model, fitted by least squares over the last :data:`WINDOW` steps with prompt rows and the last
:data:`WINDOW` without (those weighted by :data:`DECODE_ONLY_WEIGHT`)::

    ms = fixed + per_decode_row x decode rows + per_prompt_row x prompt rows
         + per_context x sum over prompt chunks of rows x (context before the chunk + rows / 2) / 1024

The last term is a chunk's attention over what precedes it (a 768-token prompt's last chunk costs
more a row than its first); it is dropped from the fit when the prompt steps seen so far do not tell
it apart from the per-row cost (it comes out negative).  Until both kinds of step have been seen the
model predicts nothing and the token budget alone applies.

Only steps with prompt rows are ever predicted, and served they run on other threads than
decode-only steps (``prefill_threads``: there a decode row costs about half as much), so decode-only
steps count for little: they settle only what the prompt steps leave open, such as how the fixed
cost and the decode rows' split when every mixed step had the same decode rows.
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 32  # steps of each kind the fit remembers (the host's speed moves; old steps must not hold it)
MIN_STEPS = 3  # of each kind before the model predicts
DECODE_ONLY_WEIGHT = 0.1  # a decode-only step's residual counts this much of a prompt step's
REFIT_EVERY = 8  # steps observed between fits once the model predicts (a fit costs 0.1-0.5 ms of the step's gap)


def attention_rows(rows: int, context: int) -> float:
    """The attention feature of a prompt chunk of ``rows`` after ``context`` tokens (in 1024-token units)."""
    return rows * (context + rows / 2) / 1024


class StepTimes:
    """The fit: the scheduler asks it (``ready``, ``decode_ms``, ``prompt_rows_within``), the engine feeds it."""

    def __init__(self) -> None:
        self._with_prompt: deque[tuple[float, float, float, float]] = deque(maxlen=WINDOW)
        self._without: deque[tuple[float, float, float, float]] = deque(maxlen=WINDOW)
        self._coef: tuple[float, float, float, float] | None = None
        self._new = 0  # steps observed since the last fit

    @property
    def coef(self) -> tuple[float, float, float, float] | None:
        """Fixed, per decode row, per prompt row, per context unit (ms); None until it can predict.

        Fitted when asked after new steps, so the decode steps that only record pay nothing; once it predicts,
        after :data:`REFIT_EVERY` new steps at most (served, a fit before every mixed step took 1.3 ms of the
        gap between steps: the host's speed moves over seconds, not from one step to the next)."""
        if self._new and (self._coef is None or self._new >= REFIT_EVERY):
            self._new = 0
            enough = len(self._with_prompt) >= MIN_STEPS and len(self._without) >= MIN_STEPS
            self._coef = self._fit() if enough else None
        return self._coef

    @property
    def ready(self) -> bool:
        return self.coef is not None

    @property
    def observed(self) -> tuple[int, int]:
        """Steps in the fit's windows: with prompt rows, without."""
        return len(self._with_prompt), len(self._without)

    def observe(self, decode_rows: int, prompt_rows: int, attention: float, ms: float) -> None:
        """Record a step: its decode rows, prompt rows, chunks' :func:`attention_rows` summed, and time."""
        (self._with_prompt if prompt_rows else self._without).append((decode_rows, prompt_rows, attention, ms))
        self._new += 1

    def _fit(self) -> tuple[float, float, float, float] | None:
        data = np.array([*self._with_prompt, *self._without], dtype=np.float64)
        weight = np.where(np.arange(len(data)) < len(self._with_prompt), 1.0, DECODE_ONLY_WEIGHT)
        x = np.column_stack([np.ones(len(data)), data[:, :3]]) * weight[:, None]
        y = data[:, 3] * weight
        for cols in ((0, 1, 2, 3), (0, 1, 2)):
            sol = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
            coef = dict(zip(cols, sol, strict=True))
            if coef[2] > 0 and coef.get(3, 0.0) >= 0:
                return (float(coef[0]), float(coef[1]), float(coef[2]), float(coef.get(3, 0.0)))
        return None  # prompt rows looked free: no evidence to cut on

    def decode_ms(self, decode_rows: int) -> float:
        fixed, per_decode, _, _ = self.coef
        return max(0.0, fixed + per_decode * decode_rows)  # a noisy fit's line may cross zero

    def prompt_ms(self, rows: int, context: int) -> float:
        """Predicted cost of a prompt chunk of ``rows`` after ``context`` cached tokens."""
        _, _, per_row, per_context = self.coef
        return per_row * rows + per_context * attention_rows(rows, context)

    def prompt_rows_within(self, ms: float, context: int) -> int:
        """The most prompt rows after ``context`` cached tokens predicted to cost at most ``ms``."""
        if ms <= 0:
            return 0
        _, _, per_row, per_context = self.coef
        # per_context / 2048 x n^2 + (per_row + per_context x context / 1024) x n - ms <= 0, whose positive root
        # (-b + sqrt(b^2 + 4a ms)) / 2a is written 2 ms / (b + sqrt(b^2 + 4a ms)): the same value without the
        # cancellation that made it 0 for a fitted per_context of 3e-16 ms (an AMD Zen 2 host's lstsq)
        a, b = per_context / 2048, per_row + per_context * context / 1024
        n = 2 * ms / (b + (b * b + 4 * a * ms) ** 0.5)
        return max(0, int(n))
