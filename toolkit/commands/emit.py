from __future__ import annotations

from pathlib import Path

import click

from . import force_option, load, set_option, spec_argument


@click.command("emit")
@spec_argument
@set_option
@click.option(
    "--engine",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Build stage output to serve (default: engines/<name>/engine).",
)
@click.option(
    "--tokenizer",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory with the tokenizer (default: found in the engine or quantize output).",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Repository directory (default: serving.repository or triton_repo/<name>).",
)
@force_option
def command(spec_path, overrides, engine, tokenizer, output, force):
    """Write the Triton model repository for a built engine."""
    from ..triton.emit import emit

    result = emit(load(spec_path, overrides), engine, output, tokenizer_dir=tokenizer, force=force)
    click.echo(result.summary)
