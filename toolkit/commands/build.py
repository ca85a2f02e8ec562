from __future__ import annotations

import click

from . import load, set_option, spec_argument


@click.command("build")
@spec_argument
@set_option
@click.option(
    "--force",
    "force",
    multiple=True,
    metavar="STAGE",
    help="Redo a stage even if its manifest matches: fetch, quantize, build, emit or all (repeatable).",
)
def command(spec_path, overrides, force):
    """Fetch, quantize, build and emit the Triton repository for SPEC, skipping stages that are up to date."""
    from ..pipeline import build

    spec = load(spec_path, overrides)
    result = build(spec, force=tuple(force))
    click.echo(f"repository: {result.repository}")
    click.echo(f'next: rtk serve {spec_path}   (or: rtk chat {spec_path} "What is the capital of France?")')
