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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from .. import __version__
from ..errors import UsageError
from ..spec import Objective, SLOSpec, Spec
from . import server_metrics
from .client import Client, ClientJob, model_info_note, start_time
from .client import plan_of as client_plan
from .loadgen import LoadPlan
from .metrics import QUANTILES, Distribution, Summary, percentile, summarize
from .options import validate_slo, with_load
from .records import RequestRecord
from .verdict import EXIT_CODES, FAIL, INCONCLUSIVE, PASS, Verdict, evaluate, metric_check

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
    urls: list[str] = field(default_factory=list)  # every server loaded (several: replicas)

    @classmethod
    def from_spec(
        cls,
        spec: Spec | None,
        slo: SLOSpec,
        url: str | None = None,
        metrics_url: str | None = None,
        repository: str | os.PathLike | None = None,
    ) -> Target:
        s = spec.serving if spec is not None else None
        # The spec's background server, from its state file: after `rtk serve --reload` it runs on other ports.
        running = _background_server(spec) if spec is not None and url is None else None
        if url is None:
            if s is None:
                raise UsageError("no server to load: pass --url (gRPC host:port or http://host:port) or a spec")
            if slo.transport == "openai":
                if not s.frontend.enabled:
                    raise UsageError(
                        "serving.frontend is off: pass --url http://HOST:PORT of an OpenAI-compatible server"
                    )
                url = running.frontdoor_url if running is not None and running.frontdoor_url else s.frontend.url
            else:
                url = (running or s).grpc_url if slo.transport == "grpc" else (running or s).http_url
        if metrics_url is None and s is not None:
            metrics_url = (running or s).metrics_url
        if repository is None and spec is not None:
            repository = spec.repository_dir()
        model = slo.model or ("" if slo.transport == "openai" else slo.endpoint)  # openai: the server's first model
        return cls(
            url=url,
            transport=slo.transport,
            model=model,
            endpoint=slo.endpoint,
            metrics_url=metrics_url,
            repository=str(repository) if repository else None,
        )


def _background_server(spec: Spec):
    """The live detached server (`rtk serve --detach`) of the spec's repository, or None."""
    from ..triton.server import http_ready, read_state

    st = read_state(spec.repository_dir())
    return st if st is not None and http_ready(st.http_url) else None


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
        return None, validate_slo(config)
    raise UsageError(f"run_slo needs a Spec, an SLOSpec or a dict, not {type(config).__name__}")


def plan_of(slo: SLOSpec) -> LoadPlan:
    return client_plan(slo.model_dump())


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
    url: str | list[str] | None = None,
    *,
    metrics_url: str | None = None,
    repository: str | os.PathLike | None = None,
    objectives: list[Objective] | None = None,
    progress: Callable[[int, int | None], None] | None = None,
    keep_output: bool = True,
    workers: int = 1,
    balance: str = "round_robin",
    check_metrics: list[str] | tuple[str, ...] = (),
    start_at: float | None = None,
) -> SLOReport:
    """Drive the load described by ``config`` (a Spec, its ``slo`` section or a dict) at ``url``.

    ``url`` defaults to the spec's serving host and port for the spec's transport; a list of URLs
    spreads the requests over replicas (``balance``: round_robin or least_loaded).  ``workers``
    client processes share one schedule.  ``check_metrics`` names server metrics (``NAME`` or
    ``NAME{label="v"}``) that must rise above zero while the load runs.  ``start_at`` (Unix time)
    starts the schedule then, so that several hosts can share it (``merge_reports``).
    ``objectives`` replaces the spec's.  Never raises for a missed objective: the verdict says it.
    Raises ServerError when the server cannot be reached, UsageError for bad input.
    """
    spec, slo = as_slo(config)
    urls = list(url) if isinstance(url, (list, tuple)) else None
    target = Target.from_spec(spec, slo, urls[0] if urls else url, metrics_url, repository)
    urls = urls or [target.url]
    target.urls = urls
    objectives = list(slo.objectives if objectives is None else objectives)
    slo = slo.model_copy(update={"objectives": objectives})  # the report names what was checked
    plan = plan_of(slo)
    if not 1 <= workers <= 64:
        raise UsageError(f"--workers {workers}: give 1 to 64 client processes")
    if workers > 1 and slo.max_inflight is not None and slo.max_inflight < workers:
        raise UsageError(f"slo.max_inflight {slo.max_inflight} is below --workers {workers}: each worker needs a slot")
    watch = [str(m) for m in check_metrics]
    for m in watch:
        try:
            server_metrics.parse_selector(m)
        except ValueError as exc:
            raise UsageError(f"--check-metric {exc}") from None
    if watch and not target.metrics_url:
        raise UsageError("--check-metric needs the server's /metrics: pass --metrics-url or a spec")
    job = ClientJob(
        slo=slo.model_dump(),
        urls=urls,
        transport=target.transport,
        model=target.model,
        endpoint=target.endpoint,
        repository=target.repository,
        balance=balance,
        keep_output=keep_output,
        workers=workers,
    )
    notes: list[str] = []
    before = server_metrics.scrape(target.metrics_url)
    if target.metrics_url and before is None:
        notes.append(f"could not read {target.metrics_url}; no server counters in this report")

    started, t_wall = time.time(), time.perf_counter()
    watcher = server_metrics.MetricWatcher(target.metrics_url, watch)
    if workers == 1:
        client = Client(job, progress=progress)
        info, tok_name, has_tok = client.info, client.tokenizer_name, client.has_tokenizer
        try:
            client.open_and_warm()
            with watcher:
                client.measure(start_time(start_at))
        finally:
            result = client.finish()
        results = [result]
    else:
        from .workers import run_workers

        info, tok_name, has_tok, results = run_workers(job, watcher, start_at)
    wall = time.perf_counter() - t_wall
    target.model = info.name
    notes += model_info_note(info, target.transport)
    if not has_tok:
        notes.append(
            "no model tokenizer (slo.tokenizer or the repository's preprocessing): synthetic input lengths are in words"
        )
    records = sorted(
        (r for res in results for r in res.records), key=lambda r: (r.phase != "warmup", r.scheduled_ns, r.index)
    )
    unmatched = [m for res in results for m in res.unmatched_errors]
    if unmatched:
        notes.append(f"{len(unmatched)} error response(s) named no request sent: {unmatched[0][:200]}")
    after = server_metrics.scrape(target.metrics_url)
    if target.metrics_url and before is not None and after is None:
        notes.append(f"could not read {target.metrics_url} after the run; no server counters in this report")
    delta = server_metrics.diff(before, after)
    checks = [metric_check(m, watcher.peak[m], watcher.scrapes) for m in watch]
    t0 = min(r.t0 for r in results)
    summary, verdict, more = judge(records, slo, objectives, checks)
    notes += more
    client_info = {
        "rtk": __version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "host": platform.node(),
        "schedule": verdict.schedule_message,
        "workers": workers,
        "cpu_s": sum(r.cpu_s for r in results),
        "t0_ns": t0,
        "t0_unix": started + (t0 - int(t_wall * 1e9)) / 1e9,
    }  # perf_counter is now_ns's clock
    if len(urls) > 1:
        client_info["replicas"] = {u: sum(r.replica == i for r in records if r.measured) for i, u in enumerate(urls)}
        client_info["balance"] = balance
    return SLOReport(
        target=target,
        plan=plan,
        slo=slo,
        workload=workload_info(slo, tok_name),
        summary=summary,
        verdict=verdict,
        records=records,
        server_metrics={
            **delta,
            "per_model": server_metrics.per_model(delta),
            "url": target.metrics_url,
            "checked": {m: watcher.peak[m] for m in watch},
        },
        client=client_info,
        started_unix=started,
        wall_s=wall,
        notes=notes,
    )


def workload_info(slo: SLOSpec, tokenizer_name: str) -> dict:
    return {
        "kind": "dataset" if slo.dataset else "synthetic",
        "dataset": slo.dataset,
        "tokenizer": tokenizer_name,
        "input_tokens": slo.input_tokens,
        "input_tokens_stddev": slo.input_tokens_stddev,
        "output_tokens": slo.output_tokens,
        "output_tokens_stddev": slo.output_tokens_stddev,
        "turns": slo.turns,
        "seed": slo.seed,
        "warmup_requests": slo.warmup_requests,
    }


def judge(
    records: list[RequestRecord], slo: SLOSpec, objectives: list[Objective], checks: list | None = None
) -> tuple[Summary, Verdict, list[str]]:
    """Summary, verdict and the notes they call for, from raw records (one run, or merged ones)."""
    notes = []
    summary = summarize(records, goodput_bounds(objectives), failure_ms=slo.request_timeout_s * 1000)
    if summary.failed:
        notes.append(
            f"{summary.failed} failed or timed-out request(s) count as {slo.request_timeout_s:g} s "
            "(slo.request_timeout_s) in the TTFT and E2E distributions"
        )
    if summary.short:
        notes.append(
            f"{summary.short} served request(s) had fewer output tokens than requested (short_output_rate); "
            "their latencies describe a shorter workload than the one asked for"
        )
    ok, msg, _ = schedule_check(records, slo.max_schedule_lag_ms)
    verdict = evaluate(objectives, summary, schedule_ok=ok, schedule_message=msg, checks=checks or [])
    notes += opening_wave_notes(records, slo, verdict)
    return summary, verdict, notes


def opening_wave_notes(records: list[RequestRecord], slo: SLOSpec, verdict: Verdict) -> list[str]:
    """For a closed loop's failed TTFT percentile: how much of the miss its opening wave makes.

    A closed loop sends its first ``concurrency`` requests together, so they queue behind each other's
    prompts, which a steady stream of arrivals never does; with ~100 requests a p99 is the second-largest
    value, and two of the wave decide it.  Said, not excused: the verdict counts them.
    """
    c = slo.concurrency
    if not c or c < 2:
        return []
    measured = sorted((r for r in records if r.measured), key=lambda r: (r.scheduled_ns, r.index))
    values = [r.ttft_ms() for r in measured]
    notes = []
    for res in verdict.results:
        obj = res.objective
        if obj["metric"] != "ttft" or res.status != FAIL or obj.get("max") is None or obj["stat"] not in QUANTILES:
            continue
        over = [i for i, v in enumerate(values) if v is None or v > obj["max"]]
        wave = [i for i in over if i < c]
        rest = sorted(v for v in values[c:] if v is not None)
        if not rest or 2 * len(wave) < len(over):
            continue
        stat = obj["stat"]
        notes.append(
            f"ttft {stat}: {len(wave)} of the {len(over)} requests over {obj['max']:g} ms are among the first {c}, "
            f"which the closed loop sends together; without them ttft {stat} is "
            f"{percentile(rest, QUANTILES[stat]):.1f} ms (the verdict counts them)"
        )
    return notes


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
            "kind": self.kind,
            "search": self.search,
            "best": self.best,
            "status": self.status,
            "exit_code": self.exit_code,
            "notes": self.notes,
            "points": [{"load": p.plan.value, **p.to_dict(records)} for p in self.points],
        }


def sweep_slo(
    config: Spec | SLOSpec | dict,
    url: str | None = None,
    *,
    kind: Literal["rate", "concurrency"],
    values: list[float],
    on_point: Callable[[SLOReport], None] | None = None,
    **kwargs,
) -> SweepReport:
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


def search_slo(
    config: Spec | SLOSpec | dict,
    url: str | None = None,
    *,
    kind: Literal["rate", "concurrency"],
    start: float,
    limit: float,
    precision: float = 0.1,
    max_steps: int = 10,
    on_point: Callable[[SLOReport], None] | None = None,
    **kwargs,
) -> SweepReport:
    """The highest load (up to ``limit``) at which every objective passes.

    Doubles from ``start`` while the verdict is PASS (halves while it is FAIL, when ``start`` itself
    fails), then bisects between the last pass and the first miss until they are within
    ``precision`` (relative; concurrency: 1).  A point that is not PASS — FAIL or INCONCLUSIVE —
    counts as a miss.  At most ``max_steps`` points are run.
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
            if v >= limit or hi is not None:
                break
            v = min(v * 2, limit)
        else:
            hi = v
            # A start that failed: look below it.  An INCONCLUSIVE one (too few samples for a percentile, a lagging
            # client) would not become conclusive lower down, where each point takes longer.
            if lo is not None or points[-1].verdict.status != FAIL:
                break
            v = v // 2 if kind == "concurrency" else v / 2
            if v < 1 and kind == "concurrency":
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
        notes.append(f"even the lowest load tried ({min(p.plan.value for p in points):g}) missed an objective")
    elif hi is None:
        notes.append(f"every load up to the limit ({limit:g}) passed; raise the limit to find the edge")
    return SweepReport(kind=kind, points=sorted(points, key=lambda p: p.plan.value), search=True, best=lo, notes=notes)


def _replace_slo(spec: Spec | None, slo: SLOSpec) -> Spec | SLOSpec:
    if spec is None:
        return slo
    return spec.model_copy(update={"slo": slo})


# -- several hosts ------------------------------------------------------------------------------

_NS_FIELDS = ("scheduled_ns", "released_ns", "sent_ns", "final_ns")


def merge_reports(paths: list[str | os.PathLike], objectives: list[Objective] | None = None) -> SLOReport:
    """One report from the raw ``report.json`` of runs on several client hosts.

    Each host's records are on its own monotonic clock; its report gives the Unix time of its
    schedule's start (``client.t0_unix``, see ``--start-at``), which places them on one timeline.
    Percentiles, rates and the verdict are computed again from every record, never averaged.
    Clock offsets between hosts enter only the throughput window; every latency is a difference
    of one host's own clock.
    """
    import json
    from pathlib import Path

    if len(paths) < 2:
        raise UsageError("--merge needs the report.json (or report directory) of at least two runs")
    reports = []
    for p in paths:
        path = Path(p)
        path = path / "report.json" if path.is_dir() else path
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read report '{path}': {exc}") from None
        if "records" not in data or "points" in data:
            raise UsageError(
                f"'{path}' is not the report.json of a single rtk slo run with its records (sweeps cannot be merged)"
            )
        if "t0_unix" not in data.get("client", {}):
            raise UsageError(f"'{path}' has no schedule start (client.t0_unix); it was written by an older rtk")
        reports.append(data)
    base_unix = min(d["client"]["t0_unix"] for d in reports)
    records: list[RequestRecord] = []
    for host, d in enumerate(reports):
        shift = int(round((d["client"]["t0_unix"] - base_unix) * 1e9)) - int(d["client"]["t0_ns"])
        for raw in d["records"]:
            r = RequestRecord.from_dict(raw)
            for f in _NS_FIELDS:
                if getattr(r, f) is not None:
                    setattr(r, f, getattr(r, f) + shift)
            r.chunk_ns = [t + shift for t in r.chunk_ns]
            r.worker = host * 1000 + r.worker
            records.append(r)
    records.sort(key=lambda r: (r.phase != "warmup", r.scheduled_ns))
    for i, r in enumerate(records):
        r.index = i
    first = reports[0]
    slo = validate_slo(first["slo"])
    objectives = list(slo.objectives if objectives is None else objectives)
    slo = slo.model_copy(update={"objectives": objectives})
    summary, verdict, notes = judge(records, slo, objectives)
    spread = max(d["client"]["t0_unix"] for d in reports) - base_unix
    notes = [
        f"merged from {len(reports)} runs: {', '.join(str(p) for p in paths)}; their schedules started within "
        f"{spread * 1e3:.1f} ms of each other (Unix clocks)",
        *notes,
    ]
    seeds = {d["slo"]["seed"] for d in reports}
    if len(seeds) < len(reports):
        notes.append(
            "several runs used the same seed, so they sent the same prompts: a server that reuses KV cache "
            "answers the repeats faster than it would answer distinct users"
        )
    load = {k: v for k, v in first["load"].items() if k in LoadPlan.__dataclass_fields__}
    t = first["target"]
    target = Target(**{k: v for k, v in t.items() if k in Target.__dataclass_fields__})
    return SLOReport(
        target=target,
        plan=LoadPlan(**load),
        slo=slo,
        workload=first["workload"],
        summary=summary,
        verdict=verdict,
        records=records,
        server_metrics={},
        started_unix=min(d["started_unix"] for d in reports),
        wall_s=max(d["wall_s"] for d in reports),
        client={
            "merged": [str(p) for p in paths],
            "hosts": [d["client"].get("host") for d in reports],
            "schedule": verdict.schedule_message,
            "t0_unix": base_unix,
            "t0_ns": 0,
            "cpu_s": sum(d["client"].get("cpu_s", 0.0) for d in reports),
        },
        notes=notes,
    )
