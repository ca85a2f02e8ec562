from __future__ import annotations

from pathlib import Path

import click

from ..targets import TARGET_NAMES


@click.command("doctor")
@click.option(
    "--target",
    "-t",
    type=click.Choice(TARGET_NAMES),
    default=None,
    help="Check one target and exit non-zero if this host cannot run it (default: report all three).",
)
@click.option(
    "--engine",
    "engine_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also check that a built artifact (engines/<name>/engine) can run on this host.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def command(target, engine_dir, as_json):
    """GPU, driver, CUDA, TensorRT-LLM, TensorRT, tritonserver and ModelOpt against what each target needs."""
    from rich.console import Console

    from ..doctor import failure_summary, render, run_doctor, to_json
    from ..errors import HostMismatchError

    host, reports = run_doctor([target] if target else None, engine_dir=engine_dir)
    if as_json:
        click.echo(to_json(host, reports))
    else:
        render(host, reports, Console())
    gating = [r for r in reports if (target and r.target == target) or r.target == "artifact"]
    failed = [r for r in gating if not r.ok]
    if failed:
        raise HostMismatchError(
            f"this host cannot run {', '.join(r.target for r in failed)}: {failure_summary(failed)}"
        )
