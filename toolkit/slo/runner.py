"""The library entry points: :func:`run_slo`, :func:`sweep_slo`, :func:`search_slo`.

``rtk slo`` only parses options, calls one of these and writes the report; everything it can do
is available from Python::

    from toolkit.slo import run_slo
    report = run_slo(spec, "127.0.0.1:8001")
    print(report.verdict.status, report.exit_code)
"""

from __future__ import annotations

import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import ValidationError

from .. import __version__
from ..errors import SpecError, UsageError
from ..spec import Objective, SLOSpec, Spec
from . import server_metrics
from .loadgen import LoadGenerator, LoadPlan
from .metrics import Distribution, Summary, summarize
from .records import RequestRecord
from .transport import finish_record, make_transport
from .verdict import EXIT_CODES, FAIL, INCONCLUSIVE, PASS, Verdict, evaluate
from .workload import JsonlWorkload, SyntheticWorkload, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Target:
    """Where the load goes."""

    url: str
    transport: str = "grpc"
    model: str = "ensemble"
    endpoint: str = "ensemble"
    metrics_url: str | None = None
    repository: str | None = None

    @classmethod
    def from_spec(cls, spec: Spec | None, slo: SLOSpec, url: str | None = None, metrics_url: str | None = None,
                  repository: str | os.PathLike | None = None) -> Target:
        s = spec.serving if spec is not None else None
        host = s.host if s else "127.0.0.1"
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        if url is None:
            if s is None:
                raise UsageError("no server to load: pass --url (gRPC host:port or http://host:port) or a spec")
            if slo.transport == "openai":
                if not s.frontend.enabled:
                    raise UsageError("serving.frontend is off: pass --url http://HOST:PORT of an OpenAI-compatible server")
                fhost = "127.0.0.1" if s.frontend.host in ("0.0.0.0", "") else s.frontend.host
                url = f"http://{fhost}:{s.frontend.port}"
            else:
                url = f"{host}:{s.grpc_port}" if slo.transport == "grpc" else f"http://{host}:{s.http_port}"
        if metrics_url is None and s is not None:
            metrics_url = f"http://{host}:{s.metrics_port}/metrics"
        if repository is None and spec is not None:
            repository = spec.repository_dir()
        model = slo.model or ("" if slo.transport == "openai" else slo.endpoint)  # openai: the server's first model
        return cls(url=url, transport=slo.transport, model=model, endpoint=slo.endpoint,
                   metrics_url=metrics_url, repository=str(repository) if repository else None)


@dataclass
class SLOReport:
    target: Target
    plan: LoadPlan
    slo: SLOSpec
    workload: dict
    summary: Summary
    verdict: Verdict
    records: list[RequestRecord]
    server_metrics: dict = field(default_factory=dict)
    client: dict = field(default_factory=dict)
    started_unix: float = 0.0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    def dist(self, tag: str) -> Distribution:
        return self.summary.distributions[tag]

    def to_dict(self, records: bool = True) -> dict:
        from dataclasses import asdict

        d = {
            "rtk_version": __version__,
            "verdict": self.verdict.to_dict(),
            "target": asdict(self.target),
            "load": {**asdict(self.plan), "kind": self.plan.kind, "description": self.plan.describe()},
            "slo": self.slo.model_dump(),
            "workload": self.workload,
            "summary": self.summary.to_dict(),
            "server_metrics": self.server_metrics,
            "client": self.client,
            "started_unix": self.started_unix,
            "wall_s": self.wall_s,
            "notes": self.notes,
        }
        if records:
            d["records"] = [r.to_dict() for r in self.records]
        return d


def as_slo(config: Spec | SLOSpec | dict) -> tuple[Spec | None, SLOSpec]:
    if isinstance(config, Spec):
        return config, config.slo
    if isinstance(config, SLOSpec):
        return None, config
    if isinstance(config, dict):
        try:
            return None, SLOSpec.model_validate(config)
        except ValidationError as exc:
            first = exc.errors()[0]
            field_name = "slo." + ".".join(str(p) for p in first["loc"])
            raise SpecError(first["msg"].removeprefix("Value error, "), field=field_name) from None
    raise UsageError(f"run_slo needs a Spec, an SLOSpec or a dict, not {type(config).__name__}")


def with_load(slo: SLOSpec, kind: Literal["rate", "concurrency"], value: float) -> SLOSpec:
    """The same SLO section with its load replaced."""
    data = slo.model_dump()
    if kind == "rate":
        data.update(request_rate=float(value), concurrency=None)
    else:
        data.update(concurrency=int(value), request_rate=None)
    return SLOSpec.model_validate(data)


def plan_of(slo: SLOSpec) -> LoadPlan:
    return LoadPlan(
        concurrency=slo.concurrency if slo.request_rate is None else None, rate=slo.request_rate,
        arrival=slo.arrival, burstiness=slo.burstiness, max_inflight=slo.max_inflight,
        num_requests=slo.num_requests, duration_s=slo.duration_s, seed=slo.seed,
    )


def goodput_bounds(objectives: list[Objective]) -> dict[str, float]:
    """Per-request bounds for attainment/goodput: the tightest ``max`` of each ttft/tpot/e2e objective."""
    out: dict[str, float] = {}
    for o in objectives:
        if o.metric in ("ttft", "tpot", "e2e") and o.max is not None:
            out[o.metric] = min(o.max, out.get(o.metric, math.inf))
    return out


def schedule_check(records: list[RequestRecord], max_lag_ms: float) -> tuple[bool, str, float | None]:
    """Did the client send each request within ``max_lag_ms`` of when it was free to go?"""
    lags = [r.client_lag_ms() for r in records if r.measured and r.sent_ns is not None]
    d = Distribution.of([x for x in lags if x is not None])
    if not d.count:
        return True, "no request was sent", None
    stat, value = ("p99", d.p99) if d.count >= 100 else ("max", d.max)
    ok = value <= max_lag_ms
    msg = f"client send lag {stat} {value:.3f} ms {'≤' if ok else '>'} {max_lag_ms:g} ms (slo.max_schedule_lag_ms)"
    return ok, msg, value


def run_slo(
    config: Spec | SLOSpec | dict,
    url: str | None = None,
    *,
    metrics_url: str | None = None,
    repository: str | os.PathLike | None = None,
    objectives: list[Objective] | None = None,
    progress: Callable[[int, int | None], None] | None = None,
    keep_output: bool = True,
) -> SLOReport:
    """Drive the load described by ``config`` (a Spec, its ``slo`` section or a dict) at ``url``.

    ``url`` defaults to the spec's serving host and port for the spec's transport.
    ``objectives`` replaces the spec's.  Never raises for a missed objective: the verdict says it.
    Raises ServerError when the server cannot be reached, UsageError for bad input.
    """
    spec, slo = as_slo(config)
    target = Target.from_spec(spec, slo, url, metrics_url, repository)
    objectives = list(slo.objectives if objectives is None else objectives)
    slo = slo.model_copy(update={"objectives": objectives})  # the report names what was checked
    plan = plan_of(slo)
    notes: list[str] = []

    want_ids = slo.endpoint == "tensorrt_llm"
    tokenizer = load_tokenizer(slo.tokenizer, target.repository)
    if slo.dataset:
        workload = JsonlWorkload(slo.dataset, output_tokens=slo.output_tokens, tokenizer=tokenizer, want_ids=want_ids)
    else:
        workload = SyntheticWorkload(
            input_tokens=slo.input_tokens, input_std=slo.input_tokens_stddev, output_tokens=slo.output_tokens,
            output_std=slo.output_tokens_stddev, turns=slo.turns, seed=slo.seed, tokenizer=tokenizer, want_ids=want_ids,
        )
    tok_name = workload.tokenizer.name if workload.tokenizer else "none"
    if tokenizer is None:
        notes.append("no model tokenizer (slo.tokenizer or the repository's preprocessing): synthetic input lengths are in words")

    transport = make_transport(target.transport, target.url, target.model, target.endpoint)
    info = transport.model_info()
    target.model = info.name
    if slo.transport != "openai":
        if not info.stamps:
            notes.append(f"model '{info.name}' does not return server timestamps (return_perf_metrics); server-side columns are empty")
        if "min_tokens" not in info.inputs:
            notes.append(f"model '{info.name}' does not take min_tokens: output length is not enforced, and responses "
                         "shorter than requested are counted in short_output_rate")
    before = server_metrics.scrape(target.metrics_url)
    if target.metrics_url and before is None:
        notes.append(f"could not read {target.metrics_url}; no server counters in this report")

    gen = LoadGenerator(transport, workload, request_timeout_s=slo.request_timeout_s, progress=progress)
    old_switch = sys.getswitchinterval()
    # The sender, the response reader and the HTTP loop share the GIL; a short switch interval
    # bounds how long a due send can wait for it (the default 5 ms would show as schedule lag).
    sys.setswitchinterval(0.0005)
    started, t_wall = time.time(), time.perf_counter()
    records: list[RequestRecord] = []
    try:
        transport.open(gen.on_response, gen.on_error)
        if slo.warmup_requests:
            warm = LoadPlan(concurrency=max(1, min(slo.warmup_requests, slo.concurrency or slo.max_inflight or 4)),
                            num_requests=slo.warmup_requests, seed=slo.seed)
            records += gen.run(warm, phase="warmup")
        records += gen.run(plan, phase="measure")
    finally:
        sys.setswitchinterval(old_switch)
        transport.close()
    wall = time.perf_counter() - t_wall
    if gen.unmatched_errors:
        notes.append(f"{len(gen.unmatched_errors)} error response(s) named no request sent: {gen.unmatched_errors[0][:200]}")
    for r in records:
        if r.raw:
            finish_record(r, info, transport.name, keep_output)
    after = server_metrics.scrape(target.metrics_url)
    delta = server_metrics.diff(before, after)
    summary = summarize(records, goodput_bounds(objectives), failure_ms=slo.request_timeout_s * 1000)
    if summary.failed:
        notes.append(f"{summary.failed} failed or timed-out request(s) count as {slo.request_timeout_s:g} s "
                     "(slo.request_timeout_s) in the TTFT and E2E distributions")
    if summary.short:
        notes.append(f"{summary.short} served request(s) had fewer output tokens than requested (short_output_rate); "
                     "their latencies describe a shorter workload than the one asked for")
    ok, msg, _ = schedule_check(records, slo.max_schedule_lag_ms)
    verdict = evaluate(objectives, summary, schedule_ok=ok, schedule_message=msg)
    return SLOReport(
        target=target, plan=plan, slo=slo,
        workload={
            "kind": "dataset" if slo.dataset else "synthetic", "dataset": slo.dataset, "tokenizer": tok_name,
            "input_tokens": slo.input_tokens, "input_tokens_stddev": slo.input_tokens_stddev,
            "output_tokens": slo.output_tokens, "output_tokens_stddev": slo.output_tokens_stddev,
            "turns": slo.turns, "seed": slo.seed, "warmup_requests": slo.warmup_requests,
        },
        summary=summary, verdict=verdict, records=records,
        server_metrics={**delta, "per_model": server_metrics.per_model(delta), "url": target.metrics_url},
        client={"rtk": __version__, "python": platform.python_version(), "cpus": os.cpu_count(), "host": platform.node(),
                "schedule": msg},
        started_unix=started, wall_s=wall, notes=notes,
    )


# -- several loads ------------------------------------------------------------------------------

@dataclass
class SweepReport:
    """Several runs of the same SLO at different loads (a sweep, or the steps of a search)."""

    kind: str  # "rate" or "concurrency"
    points: list[SLOReport]
    search: bool = False
    best: float | None = None  # search: the highest load that passed
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.search:
            if self.best is not None:
                return PASS
            return INCONCLUSIVE if all(p.verdict.status == INCONCLUSIVE for p in self.points) else FAIL
        statuses = {p.verdict.status for p in self.points}
        return FAIL if FAIL in statuses else INCONCLUSIVE if INCONCLUSIVE in statuses else PASS

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def to_dict(self, records: bool = True) -> dict:
        return {
            "kind": self.kind, "search": self.search, "best": self.best, "status": self.status, "exit_code": self.exit_code,
            "notes": self.notes, "points": [{"load": p.plan.value, **p.to_dict(records)} for p in self.points],
        }


def sweep_slo(config: Spec | SLOSpec | dict, url: str | None = None, *, kind: Literal["rate", "concurrency"],
              values: list[float], on_point: Callable[[SLOReport], None] | None = None, **kwargs) -> SweepReport:
    """Run the SLO at each load in ``values`` (request rates or concurrencies), in order."""
    if not values:
        raise UsageError("a sweep needs at least one load value")
    spec, slo = as_slo(config)
    points = []
    for v in values:
        rep = run_slo(_replace_slo(spec, with_load(slo, kind, v)), url, **kwargs)
        points.append(rep)
        if on_point:
            on_point(rep)
    return SweepReport(kind=kind, points=points)


def search_slo(config: Spec | SLOSpec | dict, url: str | None = None, *, kind: Literal["rate", "concurrency"],
               start: float, limit: float, precision: float = 0.1, max_steps: int = 10,
               on_point: Callable[[SLOReport], None] | None = None, **kwargs) -> SweepReport:
    """The highest load (up to ``limit``) at which every objective passes.

    Doubles from ``start`` while the verdict is PASS, then bisects between the last pass and the
    first miss until they are within ``precision`` (relative; concurrency: 1).  A point that is
    not PASS — FAIL or INCONCLUSIVE — counts as a miss.
    """
    if not 0 < start <= limit:
        raise UsageError(f"search needs 0 < start ({start}) ≤ limit ({limit})")
    spec, slo = as_slo(config)
    points: list[SLOReport] = []
    tried: dict[float, bool] = {}

    def probe(v: float) -> bool:
        v = int(v) if kind == "concurrency" else float(v)
        if v not in tried:
            rep = run_slo(_replace_slo(spec, with_load(slo, kind, v)), url, **kwargs)
            points.append(rep)
            tried[v] = rep.verdict.status == PASS
            if on_point:
                on_point(rep)
        return tried[v]

    lo, hi, v = None, None, start
    while len(tried) < max_steps:
        if probe(v):
            lo = v
            if v >= limit:
                break
            v = min(v * 2, limit)
        else:
            hi = v
            break
    while lo is not None and hi is not None and len(tried) < max_steps:
        if (kind == "concurrency" and hi - lo <= 1) or (kind == "rate" and (hi - lo) / hi <= precision):
            break
        mid = (lo + hi) // 2 if kind == "concurrency" else (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    notes = []
    if lo is None:
        notes.append(f"even the lowest load tried ({start:g}) missed an objective")
    elif hi is None:
        notes.append(f"every load up to the limit ({limit:g}) passed; raise the limit to find the edge")
    return SweepReport(kind=kind, points=sorted(points, key=lambda p: p.plan.value), search=True, best=lo, notes=notes)


def _replace_slo(spec: Spec | None, slo: SLOSpec) -> Spec | SLOSpec:
    if spec is None:
        return slo
    return spec.model_copy(update={"slo": slo})
