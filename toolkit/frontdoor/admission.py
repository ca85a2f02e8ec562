"""Deadline-aware admission: predict a request's time to first token from the engine's live state.

The model (docs/guard.md) is the in-flight batcher's: a new request waits for a batch slot if the
batch is full, then for the prefill of the prompt tokens queued ahead of it and its own.

    predicted TTFT = slot wait + step time + (prompt tokens ahead + own prompt tokens) x prefill time per token

With chunked prompts (``step_tokens``: the engine's ``max_num_tokens``, decode rows and a prompt chunk in
one step), a prompt that arrives while others decode gets only what the decode rows leave of each step,
so it takes at least

    steps = ceil((prompt tokens ahead + own prompt tokens) / (step_tokens - decoding requests))

steps of the measured step time, plus half a step for the one running; the prediction is the larger
of the two.  (scripts/bench_overload.py at 1.4-1.5x capacity: without it 63-65 % of the admitted
answers came later than predicted, p90 1.6-1.7x the prediction; with it 13-29 %, p90 1.07-1.18x;
docs/guard-measurements.md, "How well the prediction holds".)

* requests and prompt tokens ahead: the front door's own requests that have no first token yet,
  plus requests the engine reports beyond those (``nv_trt_llm_request_metrics``, other clients),
  counted at the mean prompt length.  The gauge is read every ``metrics_poll_ms`` and the engine sets
  it every few tens of ms (rtk's cpu model: ``cancellation_check_period_ms``; TensorRT-LLM's backend:
  its stats period), so it may still count a request of ours that has just ended: ours that ended
  within :data:`GAUGE_LAG_S` before the read count as ours, not as another client's;
* slot wait: when running + waiting + 1 exceed the batch (``request_type="max"``), the steps until a slot
  is free for it, times the step time: the running requests free their slots as they end, and the
  requests waiting ahead take them in turn, each for its predicted length.  A request's
  remaining tokens are its ``max_tokens`` less those seen until :data:`MIN_LENGTH_SAMPLES` answers have
  ended; then the median length of the recent answers that outlived its tokens so far (an answer cut
  at its ``max_tokens`` counts as running on), capped at its ``max_tokens``: answers that end at their
  end of sequence free their slots early;
* step time and prefill time per token: measured on the answered requests (exponentially weighted),
  starting from conservative defaults until the first answers arrive;
* the bound the deadline is checked against: the prediction times its recent error, the ``quantile``
  (``serving.guard.prediction_quantile``) of measured / predicted TTFT over the last :data:`ERROR_WINDOW`
  admitted requests (the front door sees both: its prediction and when the first token came), never below
  1, once :data:`MIN_ERROR_SAMPLES` have their first token.  The model above is a typical TTFT; at 1.5x
  capacity on a 2-core host a tenth of the admitted answers came 1.5x or more later than predicted, so a
  request predicted just under the deadline missed it about as often as not (docs/guard.md, "The
  prediction's error as a margin");
* own prompt tokens: those the engine will prefill.  A session turn's stored ids are in the engine's
  prefix cache (app.py counts them out); for other requests sent as ids, :class:`PrefixCache` mirrors
  the engine's block reuse (kv_cache.py, after TensorRT-LLM's kvCacheManager.cpp: full blocks of
  ``tokens_per_block`` tokens, keyed by their tokens chained with the block before, the least recently
  used evicted when the pool is full), so a prompt that shares a system prompt with recent ones counts
  only what follows the shared full blocks.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from bisect import bisect_right, insort
from collections import OrderedDict, deque
from dataclasses import dataclass, field

# How long after a request ends the engine's gauge may still count it: the engine's update period (50 ms
# for rtk's cpu model, 100 ms for TensorRT-LLM's stats) plus a margin.
GAUGE_LAG_S = 0.25
# Answers that must have ended before their lengths stand for the running ones' (until then: max_tokens).
MIN_LENGTH_SAMPLES = 16
# The prediction's error: measured / predicted TTFT of the latest admitted requests, and how many first
# tokens it takes before their quantile widens the bound (until then the prediction is the bound).
ERROR_WINDOW = 128
MIN_ERROR_SAMPLES = 16


@dataclass
class InFlight:
    prompt_tokens: int
    max_tokens: int
    arrival: float
    ahead_tokens: int = 0  # prompt tokens ahead of it at admission (for the measurement)
    slot_wait_s: float = 0.0
    predicted_s: float = 0.0  # its predicted TTFT (for the prediction's error)
    first_at: float | None = None
    tokens: int = 0


@dataclass
class Prediction:
    ttft_s: float
    requests_ahead: int
    tokens_ahead: int
    slot_wait_s: float
    prompt_tokens: int = 0  # the request's own tokens to prefill (its prompt less the cached prefix)
    cached_tokens: int = 0  # its prompt tokens predicted to be in the engine's prefix cache
    bound_s: float | None = None  # what the deadline is checked against: ttft_s times its recent error's quantile

    def __post_init__(self):
        if self.bound_s is None:
            self.bound_s = self.ttft_s


class PrefixCache:
    """The engine's prefix cache as the front door can see it: the full prompt blocks of the requests it sent.

    ``capacity``: the engine's pool in blocks.  The engine also keeps blocks of generated tokens and of other
    clients' requests, which this does not see: then it counts fewer cached tokens than the engine holds, and
    the prediction errs late, as it did without the mirror.  It counts too many only where the engine evicted
    blocks that the mirror still holds."""

    def __init__(self, tokens_per_block: int, capacity: int):
        self.tpb, self.capacity = tokens_per_block, capacity
        self._keys: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._last: tuple[list[int], int, list[int]] | None = None  # the last prompt's chain, for admit after predict

    def _chain(self, ids: list[int]) -> list[int]:
        """The keys of ``ids``'s full blocks, each chained with the one before; a request's prediction and its
        admission ask for the same list, which is hashed once."""
        last = self._last
        if last is not None and last[0] is ids and last[1] == len(ids):
            return last[2]
        keys, parent, t = [], 0, self.tpb
        for i in range(len(ids) // t):
            parent = hash((parent, tuple(ids[i * t : (i + 1) * t])))
            keys.append(parent)
        self._last = (ids, len(ids), keys)
        return keys

    def cached_tokens(self, ids: list[int]) -> int:
        """Tokens of ``ids`` the engine will take from its cache: the leading full blocks it holds, short of
        the last token (which must run to give logits: the engine's ``(len - 1) // tokens_per_block``)."""
        n = 0
        for key in self._chain(ids)[: (len(ids) - 1) // self.tpb]:
            if key not in self._keys:
                break
            n += 1
        return n * self.tpb

    def add(self, ids: list[int]) -> None:
        """``ids`` were sent: their full blocks are (or will be, once prefilled) in the engine's cache."""
        for key in self._chain(ids):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


@dataclass
class Estimator:
    """The engine's measured speed and the front door's requests in flight."""

    max_batch: int = 8
    step_s: float = 0.05
    prefill_s_per_token: float = 0.002
    alpha: float = 0.2
    samples: int = 0
    inflight: dict[str, InFlight] = field(default_factory=dict)
    mean_prompt: float = 64.0
    step_tokens: int | None = None  # the engine's max_num_tokens with chunked prompts; None: whole prompts
    ended: deque = field(default_factory=lambda: deque(maxlen=256))  # when our latest requests ended (monotonic)
    prefix: PrefixCache | None = None  # the engine's block reuse, where it reuses blocks
    quantile: float | None = 0.9  # of measured / predicted TTFT, for the bound; None: the prediction is the bound
    # The latest answers' output tokens in the order they ended, and the same sorted (inf: cut at max_tokens).
    lengths: deque = field(default_factory=lambda: deque(maxlen=256), init=False, repr=False)
    _lengths_sorted: list = field(default_factory=list, init=False, repr=False)
    # The latest admitted requests' measured / predicted TTFT in the order their first tokens came, and sorted.
    errors: deque = field(default_factory=lambda: deque(maxlen=ERROR_WINDOW), init=False, repr=False)
    _errors_sorted: list = field(default_factory=list, init=False, repr=False)

    def margin(self) -> float:
        """The factor from a prediction to the bound checked against the deadline: the ``quantile`` of the
        recent measured / predicted TTFT, at least 1 (1 until :data:`MIN_ERROR_SAMPLES` first tokens)."""
        errs = self._errors_sorted
        if self.quantile is None or len(errs) < MIN_ERROR_SAMPLES:
            return 1.0
        return max(1.0, errs[max(0, math.ceil(self.quantile * len(errs)) - 1)])

    def tokens_left(self, r: InFlight) -> int:
        """``r``'s predicted remaining output tokens (the module's docstring, "slot wait")."""
        cap_left = max(1, r.max_tokens - r.tokens)
        lengths = self._lengths_sorted
        if len(lengths) < MIN_LENGTH_SAMPLES:
            return cap_left
        i = bisect_right(lengths, r.tokens)
        if i == len(lengths):  # longer than every answer seen
            return cap_left
        median = lengths[i + (len(lengths) - i) // 2]
        return cap_left if median >= r.max_tokens else max(1, int(median) - r.tokens)

    def _slot_steps(self, running: list[InFlight], waiting: list[InFlight], others: int, max_batch: int) -> int:
        """Steps until a new request gets a batch slot: the slots free as the running requests end; the requests
        waiting ahead take them first, in turn (other clients' before ours, then ours in arrival order), each
        holding its slot for its predicted length."""
        free = [0] * max(0, max_batch - len(running)) + [self.tokens_left(r) for r in running]
        heapq.heapify(free)
        if not free:
            return 0
        lengths = (self.tokens_left(r) for r in waiting)
        if others:  # another client's request, its length unknown: one of ours with the largest max_tokens
            cap = max((r.max_tokens for r in self.inflight.values()), default=1)
            lengths = itertools.chain(itertools.repeat(self.tokens_left(InFlight(0, cap, 0.0)), others), lengths)
        for length in lengths:
            heapq.heappush(free, heapq.heappop(free) + length)
        return free[0]

    def predict(self, prompt_tokens: int, gauges=None, ids: list[int] | None = None) -> Prediction:
        """``ids``: the prompt as sent, where known: its prefix in the engine's cache is not counted."""
        cached = self.prefix.cached_tokens(ids) if ids is not None and self.prefix is not None else 0
        prompt_tokens -= cached
        waiting = [r for r in self.inflight.values() if r.first_at is None]
        running = [r for r in self.inflight.values() if r.first_at is not None]
        tokens_ahead = sum(r.prompt_tokens for r in waiting)
        n_wait, n_run = len(waiting), len(running)
        max_batch, extra = self.max_batch, 0
        if gauges is not None and gauges.present and time.monotonic() - gauges.read_at < 2.0:
            max_batch = gauges.max_batch or max_batch
            # Requests the engine holds beyond ours (other clients, e.g. Triton's own endpoints); the gauge may
            # still hold ours that ended just before it was read.
            lagging, since = 0, gauges.read_at - GAUGE_LAG_S
            for t in reversed(self.ended):  # newest first: only the last few ended after ``since``
                if t <= since:
                    break
                lagging += 1
            extra = max(0, gauges.active - len(self.inflight) - lagging)
            n_wait += extra
            tokens_ahead += int(extra * self.mean_prompt)
        slot_wait = 0.0
        if n_run + n_wait + 1 > max_batch:
            slot_wait = self._slot_steps(running, waiting, extra, max_batch) * self.step_s
        ttft = slot_wait + self.step_s + (tokens_ahead + prompt_tokens) * self.prefill_s_per_token
        if self.step_tokens and slot_wait == 0.0 and n_run > 0:
            # Chunked beside the decoding requests: the steps it takes, whatever a step's prompt tokens cost.
            per_step = max(1, self.step_tokens - min(n_run, max_batch - 1))
            steps = math.ceil((tokens_ahead + prompt_tokens) / per_step)
            ttft = max(ttft, (steps + 0.5) * self.step_s)
        return Prediction(ttft, n_wait, tokens_ahead, slot_wait, prompt_tokens, cached, ttft * self.margin())

    # -- bookkeeping ------------------------------------------------------------------------------
    def admit(self, rid: str, max_tokens: int, p: Prediction, ids: list[int] | None = None) -> None:
        """The request was sent with prediction ``p`` (its prompt tokens: ``p.prompt_tokens``, those the engine
        prefills); ``ids``: the prompt as sent, where known (its blocks join the cache)."""
        prompt_tokens = p.prompt_tokens
        self.inflight[rid] = InFlight(
            prompt_tokens, max_tokens, time.monotonic(), p.tokens_ahead, p.slot_wait_s, predicted_s=p.ttft_s
        )
        self.mean_prompt += 0.05 * (prompt_tokens - self.mean_prompt)
        if ids is not None and self.prefix is not None:
            self.prefix.add(ids)

    def first_token(self, rid: str) -> None:
        r = self.inflight.get(rid)
        if r is None or r.first_at is not None:
            return
        r.first_at = time.monotonic()
        ttft = r.first_at - r.arrival
        work = r.ahead_tokens + r.prompt_tokens
        sample = max(0.0, ttft - r.slot_wait_s - self.step_s) / max(1, work)
        self.prefill_s_per_token += self.alpha * (sample - self.prefill_s_per_token)
        self.samples += 1
        if r.predicted_s > 0:
            self._add_sorted(self.errors, self._errors_sorted, ttft / r.predicted_s)

    def token(self, rid: str, n: int = 1) -> None:
        r = self.inflight.get(rid)
        if r is not None:
            r.tokens += n

    def finish(self, rid: str, output_tokens: int | None = None, stopped: bool = False) -> None:
        """``rid`` ended; ``output_tokens``: what it produced, when it ran to its end (None: cancelled or cut off,
        not a sample of the answers' lengths); ``stopped``: it ended before its ``max_tokens`` (end of sequence or
        a stop string)."""
        r = self.inflight.pop(rid, None)
        if r is not None:
            self.ended.append(time.monotonic())
        if output_tokens is not None:
            self._add_sorted(self.lengths, self._lengths_sorted, output_tokens if stopped else math.inf)
        if r is None or r.first_at is None or r.tokens < 3:
            return
        step = (time.monotonic() - r.first_at) / (r.tokens - 1)
        self.step_s += self.alpha * (step - self.step_s)

    @staticmethod
    def _add_sorted(window: deque, ordered: list, x: float) -> None:
        """``x`` into a bounded window and its sorted copy (the oldest value leaves both when it is full)."""
        if len(window) == window.maxlen:
            del ordered[bisect_right(ordered, window[0]) - 1]
        window.append(x)
        insort(ordered, x)
