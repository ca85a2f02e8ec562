"""``rtk slo``: drive streaming load at Triton (or an OpenAI-compatible server) and gate on latency objectives.

A thin layer: options are parsed here and given meaning in toolkit/slo (options.py, runner.py).
Exit codes: 0 every objective met, 10 an objective missed, 11 inconclusive (too few samples for a
percentile, or the client could not keep its schedule), 2 usage error, 4 server unreachable.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal, get_args, get_origin

import click

from . import set_option

# Options generated from the spec's slo section: each field is declared once (toolkit/spec.py),
# and its description is the help text.  Values given here override the spec.
_GENERATED = [
    "transport",
    "endpoint",
    "model",
    "concurrency",
    "request_rate",
    "arrival",
    "burstiness",
    "max_inflight",
    "num_requests",
    "duration_s",
    "warmup_requests",
    "input_tokens",
    "input_tokens_stddev",
    "output_tokens",
    "output_tokens_stddev",
    "turns",
    "dataset",
    "tokenizer",
    "seed",
    "request_timeout_s",
    "max_schedule_lag_ms",
]


def _slo_options(fn):
    from ..spec import SLOSpec

    for name in reversed(_GENERATED):
        f = SLOSpec.model_fields[name]
        ann = f.annotation
        choices = get_args(ann) if get_origin(ann) is Literal else None
        base = [a for a in get_args(ann) if a is not type(None)] or [ann]
        typ = click.Choice(list(choices)) if choices else {int: int, float: float}.get(base[0], str)
        help_text = (f.description or name.replace("_", " ")) + (
            f" [spec default: {f.default}]" if f.default is not None else ""
        )
        fn = click.option(f"--{name.replace('_', '-')}", name, type=typ, default=None, help=help_text)(fn)
    return fn


@click.command("slo")
@click.argument("spec_path", metavar="[SPEC]", required=False, type=click.Path(dir_okay=False, path_type=Path))
@set_option
@click.option(
    "--url",
    "urls",
    multiple=True,
    metavar="URL",
    help="gRPC host:port, http://host:port, or an OpenAI-compatible base URL (default: the spec's). "
    "Repeat for replicas (--balance).",
)
@click.option(
    "--balance",
    type=click.Choice(["round_robin", "least_loaded"]),
    default="round_robin",
    show_default=True,
    help="Several --url: each request to the next URL, or to the one with the fewest in flight.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Client processes on this host sharing one schedule.",
)
@click.option("--metrics-url", help="Triton /metrics URL (default: the spec's metrics port).")
@click.option(
    "--check-metric",
    "check_metrics",
    multiple=True,
    metavar="NAME",
    help="A server metric (NAME or 'NAME{label=\"value\"}') that must rise above zero under load, "
    "e.g. an autoscaling signal (repeatable).",
)
@click.option(
    "--start-at",
    type=float,
    default=None,
    metavar="UNIX_TIME",
    help="Start the schedule at this Unix time (several client hosts; merge their reports with --merge).",
)
@click.option(
    "--merge",
    "merge_paths",
    multiple=True,
    type=click.Path(exists=True, path_type=Path),
    metavar="REPORT",
    help="Merge the report.json (or report directories) of runs on several hosts instead of running (repeat).",
)
@click.option(
    "--repository",
    type=click.Path(file_okay=False, path_type=Path),
    help="Model repository (for its tokenizer); default: the spec's.",
)
@click.option(
    "--objective",
    "objective_texts",
    multiple=True,
    metavar="EXPR",
    help="An objective, e.g. 'ttft:p99<=300', 'itl:p99<=50', 'error_rate<=0.001', 'shed_rate<=0.05', "
    "'attainment>=0.99' (repeatable; replaces the spec's).",
)
@click.option(
    "--objectives",
    "objectives_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="YAML file with a list of objectives (replaces the spec's).",
)
@click.option("--sweep", type=click.Choice(["rate", "concurrency"]), help="Run at several loads (--values).")
@click.option(
    "--search",
    type=click.Choice(["rate", "concurrency"]),
    help="Find the highest load meeting every objective (--start, --limit).",
)
@click.option("--values", help="Sweep loads, comma separated (e.g. 1,2,4,8).")
@click.option(
    "--start",
    type=float,
    default=1.0,
    show_default=True,
    help="Search: first load tried (doubled while it passes, halved while it fails).",
)
@click.option("--limit", type=float, default=64.0, show_default=True, help="Search: highest load tried.")
@click.option(
    "--serve",
    is_flag=True,
    help="Start tritonserver on the spec's repository (free local ports) for this run, then stop it.",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Report directory (default: reports/slo/<name>-<time>/).",
)
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
@_slo_options
def command(
    spec_path,
    overrides,
    urls,
    balance,
    workers,
    metrics_url,
    check_metrics,
    start_at,
    merge_paths,
    repository,
    objective_texts,
    objectives_file,
    sweep,
    search,
    values,
    start,
    limit,
    serve,
    output,
    no_plots,
    **fields,
):
    """Drive streaming load at Triton and check latency objectives.

    Exit status: 0 every objective met (PASS), 10 an objective missed (FAIL), 11 INCONCLUSIVE (too
    few samples for a percentile, e.g. p99 needs 100 requests, or the client could not keep its
    schedule), 2 usage error, 4 server unreachable.  Reports (JSON with every request, Markdown,
    JUnit XML, PNG plots) go to --output.
    """
    import contextlib

    from ..console import err, step
    from ..errors import UsageError
    from ..slo import report as rep
    from ..slo.options import configure, objectives_from, parse_values
    from ..slo.runner import merge_reports, run_slo, search_slo, sweep_slo
    from ..spec import load_spec

    if overrides and spec_path is None:
        raise UsageError("--set needs a SPEC; without one, use the --concurrency/--request-rate/... options")
    if sweep and search:
        raise UsageError("use either --sweep or --search, not both")
    if sweep and not values:
        raise UsageError("--sweep needs --values, e.g. --values 1,2,4,8")
    loads = parse_values(values) if sweep else None
    objectives = objectives_from(objective_texts, objectives_file)
    stamp = time.strftime("%Y%m%d-%H%M%S")

    if merge_paths:
        if sweep or search or serve or urls or start_at is not None:
            raise UsageError(
                "--merge combines existing reports; it takes no --url, --serve, --sweep, --search or --start-at"
            )
        result = merge_reports(list(merge_paths), objectives)
        out_dir = output or Path("reports") / "slo" / f"merged-{stamp}"
        rep.print_report(result)
        paths = rep.write_report(result, out_dir, plots=not no_plots)
        err.print(f"reports: {out_dir}/ ({', '.join(p.name for p in paths.values())})")
        click.get_current_context().exit(result.exit_code)

    spec = load_spec(spec_path, list(overrides)) if spec_path is not None else None
    config = configure(spec, fields, objectives)
    slo = config.slo if spec is not None else config
    url = list(urls) if len(urls) > 1 else (urls[0] if urls else None)
    out_dir = output or Path("reports") / "slo" / f"{spec.name if spec is not None else 'run'}-{stamp}"

    server_ctx = contextlib.nullcontext()
    if serve:
        if spec is None and repository is None:
            raise UsageError("--serve needs a SPEC or --repository to serve")
        if urls:
            raise UsageError("--serve starts its own server; drop --url")
        from ..triton.launch import running

        # The same launch as `rtk serve` (host check, MPI / orchestrator, configs as written), on free local ports.
        source = repository if repository is not None else spec_path
        server_ctx = running(source, overrides=overrides if repository is None else (), free_ports=True)
        err.print(f"starting tritonserver on {source} (models load and warm up) …")
    with server_ctx as server:
        if server is not None:
            if slo.transport == "openai":
                url = getattr(server, "frontdoor_url", None)
                if url is None:
                    raise UsageError(
                        "--serve with transport openai needs the front door's address, which this server "
                        "does not report; start it with rtk serve and pass --url"
                    )
            else:
                url = server.grpc_url if slo.transport == "grpc" else server.http_url
            metrics_url = metrics_url or server.metrics_url
        kwargs = dict(
            metrics_url=metrics_url,
            repository=repository,
            workers=workers,
            balance=balance,
            check_metrics=list(check_metrics),
            start_at=start_at,
        )
        if sweep or search:
            if start_at is not None:
                raise UsageError("--start-at applies to a single run, not to a --sweep or --search")
            kwargs.pop("start_at")
            on_point = lambda p: err.print(f"  {p.plan.kind} {p.plan.value:g}: {p.verdict.status}")  # noqa: E731
            if sweep:
                result = sweep_slo(config, url, kind=sweep, values=loads, on_point=on_point, **kwargs)
            else:
                result = search_slo(config, url, kind=search, start=start, limit=limit, on_point=on_point, **kwargs)
            rep.print_sweep(result)
            paths = rep.write_sweep(result, out_dir, plots=not no_plots)
        else:
            with step(f"{slo.transport} load at {slo.model or slo.endpoint}"):
                result = run_slo(config, url, **kwargs)
            rep.print_report(result)
            paths = rep.write_report(result, out_dir, plots=not no_plots)
    err.print(f"reports: {out_dir}/ ({', '.join(p.name for p in paths.values())})")
    click.get_current_context().exit(result.exit_code)
