"""LLM latency metrics: small classes that register themselves (the AIPerf pattern).

A *request metric* gives one value per successful measured request (TTFT, E2E, TPOT, …); a *gap
metric* gives several (ITL: every gap between token-carrying responses); an *aggregate* gives one
number for the run (throughput, error rate, attainment).  Definitions are in docs/slo.md; every
latency is measured from the request's **scheduled** time unless its name ends in ``_sent``.

Which requests a metric covers follows the outcome rule (outcome.py): latency metrics describe
*served* requests; TTFT and E2E also take every failed or timed-out request at the request timeout;
``refusal_latency`` describes refused (429/503) ones.

Percentiles are nearest-rank: ``pq`` is the smallest value that at least q of the samples do not
exceed (``sorted[ceil(q·n) − 1]``), so a reported p99 is always a value that was observed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from . import outcome as O
from .records import ARRIVAL, FIRST_SCHEDULED, FIRST_TOKEN, LAST_TOKEN, RequestRecord

STATS = ("p50", "p90", "p95", "p99", "p99.9")
QUANTILES = {"p50": 0.50, "p90": 0.90, "p95": 0.95, "p99": 0.99, "p99.9": 0.999}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in (0, 1])."""
    if not sorted_values:
        raise ValueError("no samples")
    k = max(1, math.ceil(q * len(sorted_values) - 1e-9))
    return sorted_values[k - 1]


@dataclass
class Distribution:
    """Summary of a metric's samples; ``requests`` is how many requests contributed."""

    count: int
    requests: int
    mean: float | None = None
    min: float | None = None
    max: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    p999: float | None = None

    @classmethod
    def of(cls, values: Iterable[float], requests: int | None = None) -> Distribution:
        v = sorted(values)
        n = len(v)
        if not n:
            return cls(count=0, requests=requests or 0)
        p = {s.replace(".", ""): percentile(v, q) for s, q in QUANTILES.items()}
        return cls(count=n, requests=n if requests is None else requests, mean=sum(v) / n, min=v[0], max=v[-1], **p)

    def stat(self, name: str) -> float | None:
        return getattr(self, name.replace(".", ""))

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


# -- registry ---------------------------------------------------------------------------------

REQUEST_METRICS: dict[str, RequestMetric] = {}
AGGREGATES: dict[str, Aggregate] = {}


def register(cls):
    inst = cls()
    (REQUEST_METRICS if isinstance(inst, RequestMetric) else AGGREGATES)[cls.tag] = inst
    return cls


class RequestMetric:
    """One value per measured request of the outcomes it covers (``None`` = not defined for it)."""

    tag: ClassVar[str]
    header: ClassVar[str]
    unit: ClassVar[str] = "ms"
    # Whether this metric can be bounded per request for goodput/attainment.
    per_request_slo: ClassVar[bool] = False
    # Shown in the console table (the others go to the JSON and Markdown reports).
    headline: ClassVar[bool] = False
    # Whether an objective may bound it (spec ``slo.objectives``; the names are OBJECTIVE_METRICS).
    objective: ClassVar[bool] = False
    # Whose values it holds, and whether failed / timed-out requests enter at the request timeout.
    outcomes: ClassVar[tuple[str, ...]] = (O.SERVED,)
    failures_at_timeout: ClassVar[bool] = False

    def values(self, rec: RequestRecord) -> list[float]:
        v = self.value(rec)
        return [] if v is None else [v]

    def value(self, rec: RequestRecord) -> float | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def distribution(
        self, records: list[RequestRecord], failure_ms: float | None = None, outcomes: list[str] | None = None
    ) -> Distribution:
        """Over ``records`` (measured ones); ``failure_ms`` is what a failed or timed-out request counts as;
        ``outcomes``: each record's outcome, when the caller has them already."""
        vals, contributing = [], 0
        outcomes = outcomes if outcomes is not None else [r.outcome for r in records]
        for r, out in zip(records, outcomes, strict=True):
            if out in self.outcomes:
                v = self.values(r)
            elif self.failures_at_timeout and failure_ms is not None and out in (O.FAILED, O.TIMED_OUT):
                v = [failure_ms]
            else:
                continue
            if v:
                contributing += 1
                vals.extend(v)
        return Distribution.of(vals, contributing)


def _metric(tag: str, header: str, fn: Callable[[RequestRecord], float | None], *, unit: str = "ms", **flags) -> None:
    register(
        type(
            f"Metric_{tag}",
            (RequestMetric,),
            {
                "tag": tag,
                "header": header,
                "unit": unit,
                **flags,
                "value": lambda self, r: fn(r),
                "__doc__": header,
            },
        )
    )


_metric(
    "ttft",
    "time to first token",
    lambda r: r.ttft_ms(),
    per_request_slo=True,
    headline=True,
    objective=True,
    failures_at_timeout=True,
)
_metric("tpot", "time per output token", lambda r: r.tpot_ms(), per_request_slo=True, headline=True, objective=True)
_metric(
    "e2e",
    "end-to-end latency",
    lambda r: r.e2e_ms(),
    per_request_slo=True,
    headline=True,
    objective=True,
    failures_at_timeout=True,
)
_metric("schedule_lag", "schedule lag (sent − scheduled)", lambda r: r.schedule_lag_ms(), headline=True, objective=True)
_metric("client_lag", "client send lag (sent − released)", lambda r: r.client_lag_ms())
_metric("ttft_sent", "TTFT from the send", lambda r: r.ttft_ms(from_sent=True))
_metric("e2e_sent", "E2E from the send", lambda r: r.e2e_ms(from_sent=True))
_metric("server_queue", "server: first scheduled − arrival", lambda r: r.server_ms(ARRIVAL, FIRST_SCHEDULED))
_metric("server_ttft", "server: first token − arrival", lambda r: r.server_ms(ARRIVAL, FIRST_TOKEN))
_metric("server_e2e", "server: last token − arrival", lambda r: r.server_ms(ARRIVAL, LAST_TOKEN))
_metric(
    "refusal_latency",
    "refused (429/503): scheduled → refusal",
    lambda r: r.refusal_ms(),
    objective=True,
    outcomes=(O.SHED,),
)


def _outside_server(r: RequestRecord) -> float | None:
    """TTFT from the send minus the server's own arrival→first token: network, gRPC/HTTP, client."""
    a, b = r.ttft_ms(from_sent=True), r.server_ms(ARRIVAL, FIRST_TOKEN)
    return None if a is None or b is None else a - b


_metric("ttft_outside_server", "TTFT outside the server (network + client)", _outside_server)
_metric("input_tokens", "input tokens", lambda r: float(r.input_tokens), unit="tokens")
_metric("output_tokens", "output tokens", lambda r: float(r.output_tokens), unit="tokens")


@register
class InterTokenLatency(RequestMetric):
    """Every gap between consecutive token-carrying responses, pooled over requests (vLLM's ITL)."""

    tag = "itl"
    header = "inter-token latency (gaps)"
    headline = True
    objective = True

    def values(self, rec: RequestRecord) -> list[float]:
        return rec.itl_ms()


# -- aggregates -------------------------------------------------------------------------------


@dataclass
class RunWindow:
    """What aggregates need: the measured records and the run's time window."""

    records: list[RequestRecord]  # measured (warm-up excluded), whatever their outcome
    start_ns: int  # first measured request's scheduled time
    end_ns: int  # last measured request's final response (or error)
    good: int  # requests meeting every per-request objective
    outcomes: list[str] | None = None  # each record's outcome, when known already

    def __post_init__(self):
        if self.outcomes is None:
            self.outcomes = [r.outcome for r in self.records]
        self.ok = [r for r, o in zip(self.records, self.outcomes, strict=True) if o == O.SERVED]

    @property
    def seconds(self) -> float:
        return max(self.end_ns - self.start_ns, 1) / 1e9

    def count(self, *outcomes: str) -> int:
        return sum(o in outcomes for o in self.outcomes)

    def fraction(self, n: int) -> float | None:
        return n / len(self.records) if self.records else None


class Aggregate:
    tag: ClassVar[str]
    header: ClassVar[str]
    unit: ClassVar[str]
    objective: ClassVar[bool] = True
    # A FAIL that the client's lag cannot have caused (outcomes, not latencies): it stands even
    # when the client could not keep its schedule.
    lag_immune: ClassVar[bool] = False
    # Which requests its sample count is (verdict.py): "measured" or "served".
    samples: ClassVar[str] = "measured"

    def value(self, w: RunWindow) -> float | None:  # pragma: no cover - overridden
        raise NotImplementedError


@register
class RequestThroughput(Aggregate):
    tag, header, unit, samples = "request_throughput", "served requests per second", "req/s", "served"

    def value(self, w):
        return len(w.ok) / w.seconds


@register
class OutputTokenThroughput(Aggregate):
    tag, header, unit, samples = "output_token_throughput", "output tokens per second (served)", "tok/s", "served"

    def value(self, w):
        return sum(r.output_tokens for r in w.ok) / w.seconds


@register
class ErrorRate(Aggregate):
    tag, header, unit, lag_immune = "error_rate", "failed or timed out / measured requests", "fraction", True

    def value(self, w):
        return w.fraction(w.count(O.FAILED, O.TIMED_OUT))


@register
class ShedRate(Aggregate):
    tag, header, unit = "shed_rate", "shed (refused 429/503 or answered by a fallback tier) / measured", "fraction"

    def value(self, w):
        return w.fraction(w.count(O.SHED))


@register
class FallbackRate(Aggregate):
    tag, header, unit = "fallback_rate", "answered by a fallback tier / measured", "fraction"

    def value(self, w):
        return w.fraction(sum(o == O.SHED and r.error is None for r, o in zip(w.records, w.outcomes, strict=True)))


@register
class ShortOutputRate(Aggregate):
    tag, header, unit = "short_output_rate", "served with fewer tokens than requested / served", "fraction"
    lag_immune, samples = True, "served"

    def value(self, w):
        ok = w.ok
        return sum(r.output_tokens < r.requested_output_tokens for r in ok) / len(ok) if ok else None


@register
class Attainment(Aggregate):
    tag, header, unit = "attainment", "requests meeting every per-request objective / measured", "fraction"

    def value(self, w):
        return w.good / len(w.records) if w.records else None


@register
class Goodput(Aggregate):
    tag, header, unit = "goodput", "requests meeting every per-request objective per second", "req/s"

    def value(self, w):
        return w.good / w.seconds


@register
class Duration(Aggregate):
    tag, header, unit, objective = "duration", "first scheduled send to last response", "s", False

    def value(self, w):
        return w.seconds


# The metric names an objective may bound: defined here, once; the spec's Objective reads them.
LATENCY_OBJECTIVES = tuple(t for t, m in REQUEST_METRICS.items() if m.objective)
RUN_OBJECTIVES = tuple(t for t, a in AGGREGATES.items() if a.objective)
OBJECTIVE_METRICS = LATENCY_OBJECTIVES + RUN_OBJECTIVES
FRACTION_METRICS = tuple(t for t, a in AGGREGATES.items() if a.unit == "fraction")
OBJECTIVE_STATS = (*STATS, "max", "mean")
DEFAULT_FAILURE_MS = 120_000.0  # slo.request_timeout_s's default, in ms


# -- summary ----------------------------------------------------------------------------------


def is_good(rec: RequestRecord, bounds: dict[str, float]) -> bool:
    """A served request whose TTFT / TPOT / E2E are within ``bounds`` (ms); any other outcome misses."""
    if not rec.ok:
        return False
    for tag, bound in bounds.items():
        v = REQUEST_METRICS[tag].value(rec)
        if v is not None and v > bound:
            return False
    return True


@dataclass
class Summary:
    distributions: dict[str, Distribution]
    aggregates: dict[str, float | None]
    measured: int
    succeeded: int  # served
    failed: int  # failed or timed out (what error_rate counts)
    good: int
    goodput_bounds: dict[str, float]
    errors: dict[str, int]  # error message (first line) -> count
    outcomes: dict[str, int] = field(default_factory=dict)  # served / shed / failed / timed_out -> count
    tiers: dict[str, int] = field(default_factory=dict)  # tier that answered -> count (servers that name tiers)
    short: int = 0  # served with fewer tokens than requested
    failure_ms: float = DEFAULT_FAILURE_MS  # what a failed / timed-out request counts as in TTFT and E2E

    def to_dict(self) -> dict:
        return {
            "measured": self.measured,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "good": self.good,
            "outcomes": self.outcomes,
            "tiers": self.tiers,
            "short_outputs": self.short,
            "failures_counted_in_ttft_e2e_as_ms": self.failure_ms,
            "goodput_bounds_ms": self.goodput_bounds,
            "errors": self.errors,
            "aggregates": self.aggregates,
            "distributions": {k: v.to_dict() for k, v in self.distributions.items()},
        }


def summarize(
    records: list[RequestRecord],
    goodput_bounds: dict[str, float] | None = None,
    *,
    failure_ms: float = DEFAULT_FAILURE_MS,
) -> Summary:
    """Metrics over the measured records (warm-up excluded).

    ``failure_ms``: the value a failed or timed-out request takes in TTFT and E2E (the request timeout).
    """
    bounds = dict(goodput_bounds or {})
    for tag in bounds:
        if tag not in REQUEST_METRICS or not REQUEST_METRICS[tag].per_request_slo:
            raise ValueError(f"'{tag}' cannot bound a single request; use one of ttft, tpot, e2e")
    measured = [r for r in records if r.measured]
    outs = [r.outcome for r in measured]
    ok = [r for r, o in zip(measured, outs, strict=True) if o == O.SERVED]
    dists = {tag: m.distribution(measured, failure_ms, outs) for tag, m in REQUEST_METRICS.items()}
    times_start = [r.scheduled_ns for r in measured]
    times_end = [t for r in measured for t in (r.final_ns, r.last_token_ns) if t is not None]
    start = min(times_start) if times_start else 0
    end = max(times_end) if times_end else start
    good = sum(is_good(r, bounds) for r in ok)
    w = RunWindow(records=measured, start_ns=start, end_ns=end, good=good, outcomes=outs)
    aggs = {tag: a.value(w) for tag, a in AGGREGATES.items()}
    errors: dict[str, int] = {}
    outcomes = {o: 0 for o in O.OUTCOMES}
    tiers: dict[str, int] = {}
    for r, o in zip(measured, outs, strict=True):
        outcomes[o] += 1
        if r.tier is not None:
            tiers[r.tier] = tiers.get(r.tier, 0) + 1
        if not r.ok and r.error is not None:
            key = r.error.splitlines()[0][:200]
            errors[key] = errors.get(key, 0) + 1
    short = sum(r.output_tokens < r.requested_output_tokens for r in ok)
    return Summary(
        dists,
        aggs,
        len(measured),
        len(ok),
        outcomes[O.FAILED] + outcomes[O.TIMED_OUT],
        good,
        bounds,
        errors,
        outcomes,
        tiers,
        short,
        failure_ms,
    )
