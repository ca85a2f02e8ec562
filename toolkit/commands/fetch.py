from __future__ import annotations

import click

from . import force_option, load, output_option, set_option, spec_argument


@click.command("fetch")
@spec_argument
@set_option
@output_option
@force_option
def command(spec_path, overrides, output, force):
    """Get the model named by model.source into a checkpoint directory with a manifest."""
    from ..fetch import fetch

    result = fetch(load(spec_path, overrides), output=output, force=force)
    click.echo(result.summary)
