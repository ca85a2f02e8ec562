"""Objectives → PASS / FAIL / INCONCLUSIVE, with the exit code ``rtk slo`` ends with.

* An objective is **inconclusive** when its statistic rests on too few samples: ``pq`` needs at
  least ``1 / (1 − q)`` measured requests (p90: 10, p95: 20, p99: 100, p99.9: 1000), because with
  fewer the "p99" is just the maximum of a small sample.  ``attainment ≥ a`` needs ``1 / (1 − a)``.
* When the client could not keep its own schedule (its send lag p99 over ``max_schedule_lag_ms``),
  the latencies and rates measure the client as much as the server: the run is **inconclusive**,
  unless an objective on request outcomes that lag cannot cause (``error_rate``,
  ``short_output_rate``) failed, or a ``ttft`` / ``e2e`` objective failed whose statistic over the
  server's own time stamps (``server_ttft`` / ``server_e2e``: arrival in the model to first / last
  token, where the server returns them) fails it too: those FAILs stand.  A late client only sends
  later (a lighter load) and reads later; it cannot make the server's own clock run long.
* Otherwise any objective that is not met makes it **FAIL**; all met is **PASS**.
* With no ``error_rate`` objective, ``error_rate ≤ 0`` is implied: a gate never passes a run in
  which requests failed unless the user said how many may fail.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..spec import Objective
from .metrics import AGGREGATES, QUANTILES, REQUEST_METRICS, Summary

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
EXIT_CODES = {PASS: 0, FAIL: 10, INCONCLUSIVE: 11}  # also documented in toolkit/cli.py and docs/slo.md


def required_samples(obj: Objective) -> int:
    if obj.stat in QUANTILES:
        return math.ceil(1 / (1 - QUANTILES[obj.stat]) - 1e-9)
    if obj.metric == "attainment" and obj.min is not None:
        return 1000 if obj.min >= 0.999 else math.ceil(1 / (1 - obj.min) - 1e-9)
    return 1


def describe(obj: Objective) -> str:
    unit = REQUEST_METRICS[obj.metric].unit if obj.metric in REQUEST_METRICS else AGGREGATES[obj.metric].unit
    stat = f" {obj.stat}" if obj.stat != "value" else ""
    op, bound = ("≤", obj.max) if obj.max is not None else ("≥", obj.min)
    if unit == "fraction":
        return f"{obj.metric}{stat} {op} {bound * 100:g} %"
    return f"{obj.metric}{stat} {op} {bound:g} {unit}"


@dataclass
class ObjectiveResult:
    objective: dict
    label: str
    observed: float | None
    samples: int
    required: int
    status: str
    message: str
    implicit: bool = False


@dataclass
class Verdict:
    status: str
    exit_code: int
    results: list[ObjectiveResult]
    reasons: list[str] = field(default_factory=list)
    schedule_ok: bool = True
    schedule_message: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _check(obj: Objective, summary: Summary, implicit: bool = False) -> ObjectiveResult:
    label = describe(obj)
    if obj.metric in REQUEST_METRICS:
        dist = summary.distributions[obj.metric]
        observed, samples = dist.stat(obj.stat), dist.requests
    else:
        observed = summary.aggregates.get(obj.metric)
        samples = summary.succeeded if AGGREGATES[obj.metric].samples == "served" else summary.measured
    need = required_samples(obj)
    base = dict(
        objective=obj.model_dump(), label=label, observed=observed, samples=samples, required=need, implicit=implicit
    )
    if observed is None or samples < need:
        why = f"{samples} measured request(s); {obj.stat if obj.stat != 'value' else obj.metric} needs at least {need}"
        if observed is None and summary.measured and not summary.succeeded:
            n = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in summary.outcomes.items() if v)
            return ObjectiveResult(**base, status=FAIL, message=f"no request was served ({n})")
        return ObjectiveResult(**base, status=INCONCLUSIVE, message=why)
    met = observed <= obj.max if obj.max is not None else observed >= obj.min
    return ObjectiveResult(**base, status=PASS if met else FAIL, message=f"observed {observed:.4g}")


# Client-side latency -> the same span on the server's own clock (metrics.REQUEST_METRICS).
SERVER_SIDE = {"ttft": "server_ttft", "e2e": "server_e2e"}


def server_confirmed(result: ObjectiveResult, summary: Summary) -> float | None:
    """The failed latency objective's statistic over the server's own time stamps, where there are enough of
    them and it fails the objective too; else None."""
    obj = result.objective
    twin = SERVER_SIDE.get(obj["metric"])
    dist = summary.distributions.get(twin) if twin else None
    if result.status != FAIL or dist is None or obj.get("max") is None:
        return None
    if dist.requests < result.required:
        return None
    observed = dist.stat(obj["stat"])
    return observed if observed is not None and observed > obj["max"] else None


def lag_immune(metric: str) -> bool:
    """Whether a FAIL of this metric stands even when the client fell behind its schedule."""
    return metric in AGGREGATES and AGGREGATES[metric].lag_immune


def metric_check(selector: str, peak: float | None, scrapes: int) -> ObjectiveResult:
    """``--check-metric``: the server metric must rise above zero while the load runs."""
    base = dict(
        objective={"metric": selector, "check": "rises above 0 under load"},
        label=f"{selector} > 0 under load",
        observed=peak,
        samples=scrapes,
        required=1,
    )
    if not scrapes:
        return ObjectiveResult(**base, status=INCONCLUSIVE, message="the server's /metrics could not be read")
    if peak is None:
        return ObjectiveResult(**base, status=FAIL, message=f"not exported by the server ({scrapes} reads of /metrics)")
    if peak <= 0:
        return ObjectiveResult(
            **base, status=FAIL, message=f"stayed at {peak:g} in {scrapes} reads under load: no scaling signal"
        )
    return ObjectiveResult(**base, status=PASS, message=f"peaked at {peak:g}")


def evaluate(
    objectives: list[Objective],
    summary: Summary,
    *,
    schedule_ok: bool = True,
    schedule_message: str = "",
    checks: list[ObjectiveResult] = (),
) -> Verdict:
    """The verdict over ``objectives`` (plus the implied ``error_rate ≤ 0``) and extra ``checks``."""
    wanted = [(o, False) for o in objectives]
    if not any(o.metric == "error_rate" for o in objectives):
        wanted.append((Objective(metric="error_rate", max=0.0), True))
    results = [_check(o, summary, implicit) for o, implicit in wanted] + list(checks)
    reasons = []
    if not objectives and not checks:
        reasons.append("no objectives were given (spec slo.objectives, --objective or --objectives); nothing to pass")
    if not schedule_ok:
        reasons.append(f"the client could not keep the schedule: {schedule_message}")
    statuses = {r.status for r in results}
    lag_proof_fail = any(r.status == FAIL and lag_immune(r.objective["metric"]) for r in results)
    if not schedule_ok:
        for r in results:
            server = server_confirmed(r, summary)
            if server is not None:
                r.message += f"; the server's own time stamps give {server:.4g}, over the limit too"
                lag_proof_fail = True
    if not objectives and not checks:
        status = INCONCLUSIVE
    elif lag_proof_fail:
        status = FAIL
    elif not schedule_ok:
        status = INCONCLUSIVE
    elif FAIL in statuses:
        status = FAIL
    elif INCONCLUSIVE in statuses:
        status = INCONCLUSIVE
    else:
        status = PASS
    for r in results:
        if r.status != PASS:
            reasons.append(f"{r.label}: {r.status.lower()} ({r.message})")
    return Verdict(status, EXIT_CODES[status], results, reasons, schedule_ok, schedule_message)
