"""``rtk slo``: drive streaming load at Triton and gate on latency objectives.

Exit codes: 0 every objective met, 10 an objective missed, 11 inconclusive (too few samples for a
percentile, or the client could not keep its schedule), 2 usage error, 4 server unreachable.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Literal, get_args, get_origin

import click

from . import set_option

_SHORTHAND = re.compile(r"^\s*([a-z0-9_]+)\s*(?::\s*(p50|p90|p95|p99\.9|p99|max|mean))?\s*(<=|>=|<|>)\s*([0-9.eE+-]+)\s*$")


def parse_objective(text: str):
    """``'ttft:p99<=300'``, ``'error_rate<=0.001'``, ``'attainment>=0.99'`` → Objective."""
    from pydantic import ValidationError

    from ..errors import UsageError
    from ..spec import Objective

    m = _SHORTHAND.match(text)
    if not m:
        raise UsageError(f"--objective '{text}' is not METRIC[:STAT]<=VALUE or >=VALUE, e.g. 'ttft:p99<=300' or 'attainment>=0.99'")
    metric, stat, op, value = m.groups()
    data = {"metric": metric, "stat": stat or "value", ("max" if op.startswith("<") else "min"): float(value)}
    try:
        return Objective.model_validate(data)
    except ValidationError as exc:
        msg = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise UsageError(f"--objective '{text}': {msg}") from None


def load_objectives(path: Path):
    import yaml
    from pydantic import ValidationError

    from ..errors import UsageError
    from ..spec import Objective

    if not path.is_file():
        raise UsageError(f"objectives file '{path}' does not exist")
    data = yaml.safe_load(path.read_text())
    items = data.get("objectives") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise UsageError(f"{path}: expected a list of objectives (or a mapping with 'objectives:')")
    out = []
    for i, item in enumerate(items):
        try:
            out.append(Objective.model_validate(item))
        except ValidationError as exc:
            msg = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
            raise UsageError(f"{path}: objective {i + 1}: {msg}") from None
    return out


# Options generated from the spec's slo section: each field is declared once (toolkit/spec.py),
# and its description is the help text.  Values given here override the spec.
_GENERATED = [
    "transport", "endpoint", "model", "concurrency", "request_rate", "arrival", "burstiness", "max_inflight",
    "num_requests", "duration_s", "warmup_requests", "input_tokens", "input_tokens_stddev", "output_tokens",
    "output_tokens_stddev", "turns", "dataset", "tokenizer", "seed", "request_timeout_s", "max_schedule_lag_ms",
]


def _slo_options(fn):
    from ..spec import SLOSpec

    for name in reversed(_GENERATED):
        f = SLOSpec.model_fields[name]
        ann = f.annotation
        choices = get_args(ann) if get_origin(ann) is Literal else None
        base = [a for a in get_args(ann) if a is not type(None)] or [ann]
        typ = click.Choice(list(choices)) if choices else {int: int, float: float}.get(base[0], str)
        help_text = (f.description or name.replace("_", " ")) + (f" [spec default: {f.default}]" if f.default is not None else "")
        fn = click.option(f"--{name.replace('_', '-')}", name, type=typ, default=None, help=help_text)(fn)
    return fn


@click.command("slo")
@click.argument("spec_path", metavar="[SPEC]", required=False, type=click.Path(dir_okay=False, path_type=Path))
@set_option
@click.option("--url", help="gRPC host:port or http://host:port (default: the spec's serving host and port).")
@click.option("--metrics-url", help="Triton /metrics URL (default: the spec's metrics port).")
@click.option("--repository", type=click.Path(file_okay=False, path_type=Path), help="Model repository (for its tokenizer); default: the spec's.")
@click.option("--objective", "objective_texts", multiple=True, metavar="EXPR",
              help="An objective, e.g. 'ttft:p99<=300', 'itl:p99<=50', 'error_rate<=0.001', 'attainment>=0.99' (repeatable; replaces the spec's).")
@click.option("--objectives", "objectives_file", type=click.Path(dir_okay=False, path_type=Path),
              help="YAML file with a list of objectives (replaces the spec's).")
@click.option("--sweep", type=click.Choice(["rate", "concurrency"]), help="Run at several loads (--values).")
@click.option("--search", type=click.Choice(["rate", "concurrency"]), help="Find the highest load meeting every objective (--start, --limit).")
@click.option("--values", help="Sweep loads, comma separated (e.g. 1,2,4,8).")
@click.option("--start", type=float, default=1.0, show_default=True, help="Search: first load tried.")
@click.option("--limit", type=float, default=64.0, show_default=True, help="Search: highest load tried.")
@click.option("--serve", is_flag=True, help="Start tritonserver on the spec's repository (free local ports) for this run, then stop it.")
@click.option("--output", "-o", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Report directory (default: reports/slo/<name>-<time>/).")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
@_slo_options
def command(spec_path, overrides, url, metrics_url, repository, objective_texts, objectives_file, sweep, search, values,
            start, limit, serve, output, no_plots, **fields):
    """Drive streaming load at Triton and check latency objectives.

    Exit status: 0 every objective met (PASS), 10 an objective missed (FAIL), 11 INCONCLUSIVE (too
    few samples for a percentile, e.g. p99 needs 100 requests, or the client could not keep its
    schedule), 2 usage error, 4 tritonserver unreachable.  Reports (JSON with every request,
    Markdown, JUnit XML, PNG plots) go to --output.
    """
    import contextlib

    from ..console import err, step
    from ..errors import UsageError
    from ..slo import report as rep
    from ..slo.runner import as_slo, search_slo, sweep_slo, run_slo
    from ..spec import SLOSpec, load_spec

    if spec_path is not None:
        spec = load_spec(spec_path, list(overrides))
        slo_data = spec.slo.model_dump()
    else:
        if overrides:
            raise UsageError("--set needs a SPEC; without one, use the --concurrency/--request-rate/... options")
        spec, slo_data = None, SLOSpec().model_dump()
    given = {k: v for k, v in fields.items() if v is not None}
    if "request_rate" in given and "concurrency" not in given:
        slo_data["concurrency"] = None
    if "concurrency" in given and "request_rate" not in given:
        slo_data["request_rate"] = None
    slo_data.update(given)
    objectives = None
    if objectives_file:
        objectives = load_objectives(objectives_file)
    if objective_texts:
        objectives = (objectives or []) + [parse_objective(t) for t in objective_texts]
    if objectives is not None:
        slo_data["objectives"] = [o.model_dump() for o in objectives]
    _, slo = as_slo(slo_data)
    config = spec.model_copy(update={"slo": slo}) if spec is not None else slo
    if sweep and search:
        raise UsageError("use either --sweep or --search, not both")
    if sweep and not values:
        raise UsageError("--sweep needs --values, e.g. --values 1,2,4,8")
    name = spec.name if spec is not None else "run"
    out_dir = output or Path("reports") / "slo" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"

    server_ctx = contextlib.nullcontext()
    if serve:
        if spec is None and repository is None:
            raise UsageError("--serve needs a SPEC or --repository to serve")
        from ..triton.launch import running

        # The same launch as `rtk serve` (host check, MPI / orchestrator, configs as written), on free local ports.
        source = repository if repository is not None else spec_path
        server_ctx = running(source, overrides=overrides if repository is None else (), free_ports=True)
        err.print(f"starting tritonserver on {source} (models load and warm up) …")
    with server_ctx as server:
        if server is not None:
            url = url or (server.grpc_url if slo.transport == "grpc" else server.http_url)
            metrics_url = metrics_url or server.metrics_url
        kwargs = dict(metrics_url=metrics_url, repository=repository)
        if sweep or search:
            on_point = lambda p: err.print(f"  {p.plan.kind} {p.plan.value:g}: {p.verdict.status}")  # noqa: E731
            if sweep:
                try:
                    loads = [float(v) for v in values.split(",") if v.strip()]
                except ValueError:
                    raise UsageError(f"--values '{values}' is not a comma-separated list of numbers") from None
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
