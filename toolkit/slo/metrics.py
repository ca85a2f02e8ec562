"""LLM latency metrics: small classes that register themselves (the AIPerf pattern).

A *request metric* gives one value per successful measured request (TTFT, E2E, TPOT, …); a *gap
metric* gives several (ITL: every gap between token-carrying responses); an *aggregate* gives one
number for the run (throughput, error rate, attainment).  Definitions are in docs/slo.md; every
latency is measured from the request's **scheduled** time unless its name ends in ``_sent``.

Percentiles are nearest-rank: ``pq`` is the smallest value that at least q of the samples do not
exceed (``sorted[ceil(q·n) − 1]``), so a reported p99 is always a value that was observed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable

from .records import RequestRecord

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
    def of(cls, values: Iterable[float], requests: int | None = None) -> "Distribution":
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

REQUEST_METRICS: dict[str, "RequestMetric"] = {}
AGGREGATES: dict[str, "Aggregate"] = {}


def register(cls):
    inst = cls()
    (REQUEST_METRICS if isinstance(inst, RequestMetric) else AGGREGATES)[cls.tag] = inst
    return cls


class RequestMetric:
    """One value per successful measured request (``None`` = not defined for it)."""

    tag: ClassVar[str]
    header: ClassVar[str]
    unit: ClassVar[str] = "ms"
    # Whether this metric can be bounded per request for goodput/attainment.
    per_request_slo: ClassVar[bool] = False
    # Shown in the console table (the others go to the JSON and Markdown reports).
    headline: ClassVar[bool] = False

    def values(self, rec: RequestRecord) -> list[float]:
        v = self.value(rec)
        return [] if v is None else [v]

    def value(self, rec: RequestRecord) -> float | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def distribution(self, records: list[RequestRecord]) -> Distribution:
        vals, contributing = [], 0
        for r in records:
            v = self.values(r)
            if v:
                contributing += 1
                vals.extend(v)
        return Distribution.of(vals, contributing)


def _metric(tag: str, header: str, fn: Callable[[RequestRecord], float | None], *, unit: str = "ms",
            per_request_slo: bool = False, headline: bool = False) -> None:
    register(type(f"Metric_{tag}", (RequestMetric,), {
        "tag": tag, "header": header, "unit": unit, "per_request_slo": per_request_slo, "headline": headline,
        "value": lambda self, r: fn(r), "__doc__": header,
    }))


_metric("ttft", "time to first token", lambda r: r.ttft_ms(), per_request_slo=True, headline=True)
_metric("tpot", "time per output token", lambda r: r.tpot_ms(), per_request_slo=True, headline=True)
_metric("e2e", "end-to-end latency", lambda r: r.e2e_ms(), per_request_slo=True, headline=True)
_metric("schedule_lag", "schedule lag (sent − scheduled)", lambda r: r.schedule_lag_ms(), headline=True)
_metric("client_lag", "client send lag (sent − released)", lambda r: r.client_lag_ms())
_metric("ttft_sent", "TTFT from the send", lambda r: r.ttft_ms(from_sent=True))
_metric("e2e_sent", "E2E from the send", lambda r: r.e2e_ms(from_sent=True))
_metric("server_queue", "server: first scheduled − arrival", lambda r: r.server_ms("arrival_time_ns", "first_scheduled_time_ns"))
_metric("server_ttft", "server: first token − arrival", lambda r: r.server_ms("arrival_time_ns", "first_token_time_ns"))
_metric("server_e2e", "server: last token − arrival", lambda r: r.server_ms("arrival_time_ns", "last_token_time_ns"))


def _outside_server(r: RequestRecord) -> float | None:
    """TTFT from the send minus the server's own arrival→first token: network, gRPC/HTTP, client."""
    a, b = r.ttft_ms(from_sent=True), r.server_ms("arrival_time_ns", "first_token_time_ns")
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

    def values(self, rec: RequestRecord) -> list[float]:
        return rec.itl_ms()


# -- aggregates -------------------------------------------------------------------------------

@dataclass
class RunWindow:
    """What aggregates need: the measured records and the run's time window."""

    records: list[RequestRecord]  # measured (warm-up excluded), finished or failed
    start_ns: int  # first measured request's scheduled time
    end_ns: int  # last measured request's final response (or error)
    good: int  # requests meeting every per-request objective

    @property
    def seconds(self) -> float:
        return max(self.end_ns - self.start_ns, 1) / 1e9

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]


class Aggregate:
    tag: ClassVar[str]
    header: ClassVar[str]
    unit: ClassVar[str]

    def value(self, w: RunWindow) -> float | None:  # pragma: no cover - overridden
        raise NotImplementedError


@register
class RequestThroughput(Aggregate):
    tag, header, unit = "request_throughput", "completed requests per second", "req/s"

    def value(self, w):
        return len(w.ok) / w.seconds


@register
class OutputTokenThroughput(Aggregate):
    tag, header, unit = "output_token_throughput", "output tokens per second", "tok/s"

    def value(self, w):
        return sum(r.output_tokens for r in w.ok) / w.seconds


@register
class ErrorRate(Aggregate):
    tag, header, unit = "error_rate", "failed / measured requests", "fraction"

    def value(self, w):
        return (len(w.records) - len(w.ok)) / len(w.records) if w.records else None


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
    tag, header, unit = "duration", "first scheduled send to last response", "s"

    def value(self, w):
        return w.seconds


# -- summary ----------------------------------------------------------------------------------

def is_good(rec: RequestRecord, bounds: dict[str, float]) -> bool:
    """A successful request whose TTFT / TPOT / E2E are within ``bounds`` (ms); errors are misses."""
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
    succeeded: int
    failed: int
    good: int
    goodput_bounds: dict[str, float]
    errors: dict[str, int]  # error message (first line) -> count

    def to_dict(self) -> dict:
        return {
            "measured": self.measured, "succeeded": self.succeeded, "failed": self.failed, "good": self.good,
            "goodput_bounds_ms": self.goodput_bounds, "errors": self.errors, "aggregates": self.aggregates,
            "distributions": {k: v.to_dict() for k, v in self.distributions.items()},
        }


def summarize(records: list[RequestRecord], goodput_bounds: dict[str, float] | None = None) -> Summary:
    """Metrics over the measured records (warm-up excluded)."""
    bounds = dict(goodput_bounds or {})
    for tag in bounds:
        if tag not in REQUEST_METRICS or not REQUEST_METRICS[tag].per_request_slo:
            raise ValueError(f"'{tag}' cannot bound a single request; use one of ttft, tpot, e2e")
    measured = [r for r in records if r.measured]
    ok = [r for r in measured if r.ok]
    dists = {tag: m.distribution(ok) for tag, m in REQUEST_METRICS.items()}
    times_start = [r.scheduled_ns for r in measured]
    times_end = [t for r in measured for t in (r.final_ns, r.last_token_ns) if t is not None]
    start = min(times_start) if times_start else 0
    end = max(times_end) if times_end else start
    good = sum(is_good(r, bounds) for r in measured)
    w = RunWindow(records=measured, start_ns=start, end_ns=end, good=good)
    aggs = {tag: a.value(w) for tag, a in AGGREGATES.items()}
    errors: dict[str, int] = {}
    for r in measured:
        if not r.ok:
            key = (r.error or "no final response").splitlines()[0][:200]
            errors[key] = errors.get(key, 0) + 1
    return Summary(dists, aggs, len(measured), len(ok), len(measured) - len(ok), good, bounds, errors)
