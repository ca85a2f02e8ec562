"""One module per `rtk` command; each exposes ``command``.  Shared options live here."""

from __future__ import annotations

from pathlib import Path

import click

spec_argument = click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, path_type=Path))
set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a spec field, e.g. --set quantization.format=int4_awq (repeatable).",
)
output_option = click.option(
    "--output",
    "-o",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output directory (default: under engines/<name>/).",
)
force_option = click.option("--force", is_flag=True, help="Redo the stage even if its manifest matches.")


def load(spec_path: Path, overrides: tuple[str, ...]):
    from ..spec import load_spec

    return load_spec(spec_path, list(overrides))
