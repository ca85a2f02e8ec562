"""Reports of an SLO run: console table (rich), JSON with every request, Markdown, JUnit XML, PNG plots.

:func:`write_report` / :func:`write_sweep` write a directory atomically (through
toolkit.artifacts.atomic_stage): a run that dies half way leaves no report that looks whole.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

from ..artifacts import atomic_stage, sha256_json, tool_versions
from .metrics import AGGREGATES, REQUEST_METRICS
from .outcome import OUTCOMES
from .runner import SLOReport, SweepReport
from .verdict import FAIL, INCONCLUSIVE, PASS

LATENCY_ROWS = [
    "ttft",
    "itl",
    "tpot",
    "e2e",
    "schedule_lag",
    "ttft_sent",
    "e2e_sent",
    "server_queue",
    "server_ttft",
    "server_e2e",
    "ttft_outside_server",
    "refusal_latency",
]
STAT_COLS = ["mean", "p50", "p90", "p95", "p99", "p99.9", "max"]
AGG_ROWS = [
    "request_throughput",
    "output_token_throughput",
    "error_rate",
    "shed_rate",
    "fallback_rate",
    "short_output_rate",
    "attainment",
    "goodput",
    "duration",
]
COLOR = {PASS: "green", FAIL: "red", INCONCLUSIVE: "yellow"}


def _fmt(v, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def _sig(v) -> str:
    return "–" if v is None else f"{v:.4g}"


def _agg_fmt(tag: str, v) -> str:
    if v is None:
        return "–"
    if AGGREGATES[tag].unit == "fraction":
        return f"{v * 100:.2f} %"
    return f"{v:,.2f} {AGGREGATES[tag].unit}"


def outcome_line(report: SLOReport) -> str:
    """'100 measured: 97 served, 2 shed, 1 failed, 0 timed out; tiers: primary 97, cache 1'."""
    s = report.summary
    parts = ", ".join(f"{s.outcomes.get(o, 0)} {o.replace('_', ' ')}" for o in OUTCOMES)
    line = f"{s.measured} measured: {parts}"
    if s.tiers:
        line += "; tiers: " + ", ".join(f"{t} {n}" for t, n in sorted(s.tiers.items()))
    if s.short:
        line += f"; {s.short} shorter than requested"
    return line


def latency_rows(report: SLOReport) -> list[list[str]]:
    rows = []
    for tag in LATENCY_ROWS:
        d = report.dist(tag)
        if not d.count:
            continue
        rows.append(
            [
                tag,
                REQUEST_METRICS[tag].header,
                str(d.requests if tag != "itl" else d.count),
                *[_fmt(d.stat(c)) for c in STAT_COLS],
            ]
        )
    return rows


# -- console ------------------------------------------------------------------------------------


def _console():
    """stdout; wide enough for the tables when it is a CI log rather than a terminal."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=max(c.width, 132))


def print_report(report: SLOReport, console=None) -> None:
    from rich.table import Table

    console = console or _console()
    v = report.verdict
    console.print(
        f"[bold]rtk slo[/] {report.target.transport}://{report.target.url.removeprefix('http://')} "
        f"model [cyan]{report.target.model}[/] ({report.target.endpoint}) — {report.plan.describe()}"
    )
    s = report.summary
    console.print(
        f"{outcome_line(report)}; {report.workload['warmup_requests']} warm-up excluded; "
        f"{report.client.get('schedule', '')}"
    )
    t = Table(title="latency, ms (from the scheduled time unless marked 'from the send')", title_justify="left")
    t.add_column("metric", no_wrap=True, min_width=20)
    for c in ["n", *STAT_COLS]:
        t.add_column(c, justify="right")
    for tag, _header, n, *vals in latency_rows(report):
        t.add_row(f"{tag}", n, *vals)
    console.print(t)
    a = Table(show_header=False, box=None)
    for tag in AGG_ROWS:
        a.add_row(AGGREGATES[tag].header, _agg_fmt(tag, s.aggregates.get(tag)))
    console.print(a)
    if s.errors:
        for msg, n in s.errors.items():
            console.print(f"[red]{n} × {msg}[/]")
    o = Table(title="objectives", title_justify="left")
    for c in ["objective", "observed", "samples", "verdict"]:
        o.add_column(c)
    for r in v.results:
        label = r.label + (" (implied)" if r.implicit else "")
        o.add_row(label, _sig(r.observed), f"{r.samples}/{r.required}", f"[{COLOR[r.status]}]{r.status}[/]")
    console.print(o)
    for n in report.notes:
        console.print(f"[dim]note: {n}[/]")
    for reason in v.reasons:
        console.print(f"[{COLOR[v.status]}]• {reason}[/]")
    console.print(f"verdict: [bold {COLOR[v.status]}]{v.status}[/] (exit {v.exit_code})")


def print_sweep(sweep: SweepReport, console=None) -> None:
    from rich.table import Table

    console = console or _console()
    t = Table(title=("search" if sweep.search else "sweep") + f" over {sweep.kind}", title_justify="left")
    for c in [sweep.kind, "req/s", "tok/s", "TTFT p50", "TTFT p99", "ITL p99", "E2E p99", "errors", "verdict"]:
        t.add_column(c, justify="right")
    for p in sweep.points:
        s = p.summary
        t.add_row(
            f"{p.plan.value:g}",
            _fmt(s.aggregates["request_throughput"]),
            _fmt(s.aggregates["output_token_throughput"], 1),
            _fmt(p.dist("ttft").p50),
            _fmt(p.dist("ttft").p99),
            _fmt(p.dist("itl").p99),
            _fmt(p.dist("e2e").p99),
            str(s.failed),
            f"[{COLOR[p.verdict.status]}]{p.verdict.status}[/]",
        )
    console.print(t)
    if sweep.search:
        console.print(
            f"highest {sweep.kind} meeting every objective: "
            f"[bold]{'none' if sweep.best is None else f'{sweep.best:g}'}[/]"
        )
    for n in sweep.notes:
        console.print(f"[dim]note: {n}[/]")
    console.print(f"verdict: [bold {COLOR[sweep.status]}]{sweep.status}[/] (exit {sweep.exit_code})")


# -- Markdown -----------------------------------------------------------------------------------


def markdown(report: SLOReport) -> str:
    v, s = report.verdict, report.summary
    out = [f"# rtk slo: **{v.status}**", ""]
    out += [
        f"* target: `{report.target.url}` over {report.target.transport}, model `{report.target.model}` "
        f"({report.target.endpoint} interface)",
        f"* load: {report.plan.describe()}; {report.workload['warmup_requests']} warm-up requests excluded",
        f"* workload: {report.workload['kind']}, input {report.workload['input_tokens']} "
        f"± {report.workload['input_tokens_stddev']:g} "
        f"tokens, output {report.workload['output_tokens']} ± {report.workload['output_tokens_stddev']:g}, "
        f"{report.workload['turns']} turn(s), tokenizer {report.workload['tokenizer']}, seed {report.workload['seed']}",
        f"* requests: {outcome_line(report)}",
        f"* failed and timed-out requests count as {s.failure_ms:g} ms (the request timeout) in TTFT and E2E",
        f"* client: {report.client.get('schedule', '')}",
        "",
    ]
    out += ["## Objectives", "", "| objective | observed | samples (needed) | verdict |", "|---|---:|---:|---|"]
    for r in v.results:
        out.append(
            f"| {r.label}{' (implied)' if r.implicit else ''} | {_sig(r.observed)} "
            f"| {r.samples} ({r.required}) | {r.status} |"
        )
    out += [
        "",
        "## Latency (ms)",
        "",
        "Measured from each request's scheduled time; `_sent` rows from when it was sent; "
        "`server_*` rows from the server's own timestamps.",
        "",
        "| metric | n | " + " | ".join(STAT_COLS) + " |",
        "|---|---:|" + "---:|" * len(STAT_COLS),
    ]
    for tag, header, n, *vals in latency_rows(report):
        out.append(f"| {tag} ({header}) | {n} | " + " | ".join(vals) + " |")
    out += ["", "## Throughput and errors", "", "| metric | value |", "|---|---:|"]
    for tag in AGG_ROWS:
        out.append(f"| {AGGREGATES[tag].header} | {_agg_fmt(tag, s.aggregates.get(tag))} |")
    if s.tiers:
        out += ["", "## Tiers that answered", "", "| tier | requests |", "|---|---:|"]
        out += [f"| {t} | {n} |" for t, n in sorted(s.tiers.items())]
    if s.errors:
        out += ["", "## Errors", ""] + [f"* {n} × `{msg}`" for msg, n in s.errors.items()]
    pm = report.server_metrics.get("per_model") or {}
    if pm:
        out += [
            "",
            "## Triton /metrics during the run",
            "",
            "| model | success | failure | executions | avg queue µs | avg compute µs |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for m, row in sorted(pm.items()):
            if not (row.get("request_success") or row.get("request_failure")):
                continue
            out.append(
                f"| {m} | {row.get('request_success', 0):.0f} | {row.get('request_failure', 0):.0f} | "
                f"{row.get('exec_count', 0):.0f} | {_fmt(row.get('avg_queue_duration_us'), 0)} | "
                f"{_fmt(row.get('avg_compute_infer_duration_us'), 0)} |"
            )
    if v.reasons or report.notes:
        out += ["", "## Notes", ""] + [f"* {r}" for r in v.reasons] + [f"* {n}" for n in report.notes]
    return "\n".join(out) + "\n"


def sweep_markdown(sweep: SweepReport) -> str:
    out = [f"# rtk slo {'search' if sweep.search else 'sweep'} over {sweep.kind}: **{sweep.status}**", ""]
    if sweep.search:
        out += [
            f"Highest {sweep.kind} meeting every objective: **{'none' if sweep.best is None else f'{sweep.best:g}'}**",
            "",
        ]
    out += [
        "| " + sweep.kind + " | req/s | tok/s | TTFT p50 | TTFT p99 | ITL p99 | E2E p99 | errors | verdict |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in sweep.points:
        s = p.summary
        out.append(
            f"| {p.plan.value:g} | {_fmt(s.aggregates['request_throughput'])} "
            f"| {_fmt(s.aggregates['output_token_throughput'], 1)} | "
            f"{_fmt(p.dist('ttft').p50)} | {_fmt(p.dist('ttft').p99)} | {_fmt(p.dist('itl').p99)} "
            f"| {_fmt(p.dist('e2e').p99)} | "
            f"{s.failed} | {p.verdict.status} |"
        )
    out += [""] + [f"* {n}" for n in sweep.notes]
    return "\n".join(out) + "\n"


# -- JUnit --------------------------------------------------------------------------------------


def _junit_cases(suite: ET.Element, report: SLOReport, prefix: str = "") -> tuple[int, int]:
    failures = errors = 0
    for r in report.verdict.results:
        case = ET.SubElement(suite, "testcase", classname="rtk.slo", name=f"{prefix}{r.label}", time="0")
        ET.SubElement(
            case, "system-out"
        ).text = f"observed={r.observed} samples={r.samples} required={r.required}: {r.message}"
        if r.status == FAIL:
            failures += 1
            ET.SubElement(case, "failure", message=f"{r.label}: {r.message}", type="SLOFailure").text = r.message
        elif r.status == INCONCLUSIVE:
            errors += 1
            ET.SubElement(case, "error", message=f"{r.label}: {r.message}", type="SLOInconclusive").text = r.message
    case = ET.SubElement(suite, "testcase", classname="rtk.slo", name=f"{prefix}client kept the schedule", time="0")
    ET.SubElement(case, "system-out").text = report.verdict.schedule_message
    if not report.verdict.schedule_ok:
        errors += 1
        ET.SubElement(
            case, "error", message=report.verdict.schedule_message, type="SLOInconclusive"
        ).text = report.verdict.schedule_message
    return failures, errors


def _props(suite: ET.Element, report: SLOReport) -> None:
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="verdict", value=report.verdict.status)
    ET.SubElement(props, "property", name="load", value=report.plan.describe())
    for tag in ("ttft", "itl", "tpot", "e2e"):
        d = report.dist(tag)
        for stat in ("p50", "p99"):
            if d.stat(stat) is not None:
                ET.SubElement(props, "property", name=f"{tag}_{stat}_ms", value=f"{d.stat(stat):.3f}")
    for tag, val in report.summary.aggregates.items():
        if val is not None:
            ET.SubElement(props, "property", name=tag, value=f"{val:.6g}")


def junit_xml(report: SLOReport | SweepReport) -> str:
    root = ET.Element("testsuites", name="rtk slo")
    points = report.points if isinstance(report, SweepReport) else [report]
    for p in points:
        prefix = f"[{p.plan.kind} {p.plan.value:g}] " if isinstance(report, SweepReport) else ""
        suite = ET.SubElement(
            root,
            "testsuite",
            name=f"rtk slo {p.target.model} {p.plan.describe()}",
            timestamp=_iso(p.started_unix),
            time=f"{p.wall_s:.3f}",
        )
        _props(suite, p)
        failures, errors = _junit_cases(suite, p, prefix)
        suite.set("tests", str(len(p.verdict.results) + 1))
        suite.set("failures", str(failures))
        suite.set("errors", str(errors))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


# -- plots --------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency(report: SLOReport, path: Path) -> None:
    """Empirical CDFs of TTFT, ITL and E2E with p50/p99 marks and the objectives' bounds."""
    plt = _pyplot()
    ok = [r for r in report.records if r.measured and r.ok]
    series = {
        "ttft": [REQUEST_METRICS["ttft"].value(r) for r in ok],
        "itl": [g for r in ok for g in r.itl_ms()],
        "e2e": [REQUEST_METRICS["e2e"].value(r) for r in ok],
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (tag, vals) in zip(axes, series.items(), strict=True):
        vals = sorted(v for v in vals if v is not None)
        ax.set_title(f"{tag.upper()} (ms), n={len(vals)}")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples ≤ x")
        if not vals:
            ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes)
            continue
        n = len(vals)
        ax.step(vals, [(i + 1) / n for i in range(n)], where="post")
        d = report.dist(tag)
        for stat, style in (("p50", ":"), ("p99", "--")):
            ax.axvline(d.stat(stat), color="gray", linestyle=style, label=f"{stat} {d.stat(stat):.1f}")
        for r in report.verdict.results:
            if r.objective["metric"] == tag and r.objective.get("max") is not None:
                ax.axvline(
                    r.objective["max"], color="red", label=f"objective {r.objective['stat']} ≤ {r.objective['max']:g}"
                )
        if vals[-1] > 20 * max(vals[0], 1e-3):
            ax.set_xscale("log")
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report.target.model}: {report.plan.describe()} — {report.verdict.status}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_ttft_over_time(report: SLOReport, path: Path) -> None:
    """TTFT of every request against when it was due; from the send too, and errors marked."""
    plt = _pyplot()
    meas = [r for r in report.records if r.measured]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    if meas:
        t0 = min(r.scheduled_ns for r in meas)
        ok = [r for r in meas if r.ok and r.first_token_ns]
        xs = [(r.scheduled_ns - t0) / 1e9 for r in ok]
        ax.scatter(xs, [r.ttft_ms() for r in ok], s=8, label="TTFT from the scheduled time")
        ax.scatter(xs, [r.ttft_ms(from_sent=True) for r in ok], s=4, alpha=0.5, label="TTFT from the send")
        bad = [r for r in meas if not r.ok]
        if bad:
            ax.scatter(
                [(r.scheduled_ns - t0) / 1e9 for r in bad],
                [0] * len(bad),
                marker="x",
                color="red",
                label=f"errors ({len(bad)})",
            )
    ax.set_xlabel("scheduled time since the first measured request (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"TTFT over the run — {report.plan.describe()}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(sweep: SweepReport, path: Path) -> None:
    """Latency against achieved output-token throughput, one point per load."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    xs = [p.summary.aggregates["output_token_throughput"] or 0.0 for p in sweep.points]
    for ax, tag in zip(axes, ("ttft", "itl"), strict=True):
        for stat, marker in (("p50", "o"), ("p99", "s")):
            ys = [p.dist(tag).stat(stat) for p in sweep.points]
            ax.plot(
                xs, [y if y is not None else float("nan") for y in ys], marker=marker, label=f"{tag.upper()} {stat}"
            )
        for p, x in zip(sweep.points, xs, strict=True):
            y = p.dist(tag).p99
            if y is not None:
                ax.annotate(
                    f"{p.plan.value:g}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(3, 4),
                    fontsize=7,
                    color=COLOR[p.verdict.status],
                )
        ax.set_xlabel("output tokens per second (achieved)")
        ax.set_ylabel("ms")
        ax.set_title(f"{tag.upper()} vs throughput (labels: {sweep.kind})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- writing --------------------------------------------------------------------------------------


def _atomic(out_dir: Path, slo_section: dict, started: float):
    """A report directory is a stage output like any other: written aside, manifest last, renamed."""
    key = sha256_json({"slo": slo_section, "started": started})
    return atomic_stage(
        "slo", Path(out_dir), key, inputs={}, spec_section=slo_section, tools=tool_versions("tritonclient")
    )


def write_report(report: SLOReport, out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """report.json (every request), summary.md, junit.xml and the PNG plots, written atomically."""
    out_dir = Path(out_dir)
    data = report.to_dict()
    names = {"json": "report.json", "markdown": "summary.md", "junit": "junit.xml"}
    if plots:
        names.update(latency_plot="latency.png", ttft_plot="ttft_over_time.png")
    with _atomic(out_dir, data["slo"], report.started_unix) as st:
        (st.tmp / names["json"]).write_text(json.dumps(data, indent=1, default=str) + "\n")
        (st.tmp / names["markdown"]).write_text(markdown(report))
        (st.tmp / names["junit"]).write_text(junit_xml(report))
        if plots:
            plot_latency(report, st.tmp / names["latency_plot"])
            plot_ttft_over_time(report, st.tmp / names["ttft_plot"])
    return {k: out_dir / v for k, v in names.items()}


def write_sweep(sweep: SweepReport, out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    out_dir = Path(out_dir)
    data = sweep.to_dict()
    names = {"json": "report.json", "markdown": "summary.md", "junit": "junit.xml"}
    if plots:
        names["sweep_plot"] = "sweep.png"
    first = sweep.points[0] if sweep.points else None
    with _atomic(out_dir, first.slo.model_dump() if first else {}, first.started_unix if first else 0.0) as st:
        (st.tmp / names["json"]).write_text(json.dumps(data, indent=1, default=str) + "\n")
        (st.tmp / names["markdown"]).write_text(
            sweep_markdown(sweep) + "\n" + "\n".join(markdown(p) for p in sweep.points)
        )
        (st.tmp / names["junit"]).write_text(junit_xml(sweep))
        if plots:
            plot_sweep(sweep, st.tmp / names["sweep_plot"])
    return {k: out_dir / v for k, v in names.items()}
