"""The `rtk` command: a thin click layer over the library.

Each command lives in ``toolkit/commands/<name>.py`` and only parses options, calls one library
function and prints its result.  Errors are mapped to exit codes here, in one place:

=====  ==============================================================
0      success (for ``rtk slo``: every objective met)
1      unexpected failure of a stage or tool (the cause is printed)
2      usage error: bad spec, flag, path or request — nothing written
3      quality gate failed (quantized checkpoint too far from baseline)
4      tritonserver failed to start / answer
10-11  ``rtk slo`` verdicts: FAIL (10), INCONCLUSIVE (11) — see docs/slo.md
=====  ==============================================================
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from . import __version__
from .errors import RtkError

# Command modules, each exposing ``command`` (a click.Command).
COMMANDS = ["fetch", "quantize", "doctor", "slo", "build", "emit", "serve", "chat", "deploy", "sessions"]


class RtkGroup(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RtkError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.secho("interrupted; nothing half-written was left behind", fg="yellow", err=True)
            sys.exit(130)


@click.group(cls=RtkGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="rtk")
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="Show library output (ModelOpt, transformers) instead of keeping it in the stage log; -vv for debug.",
)
def cli(verbose: int) -> None:
    """rtk: take an LLM from a hub to a measured, low-latency Triton deployment."""
    from .console import set_verbosity

    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    set_verbosity(verbose)


for _name in COMMANDS:
    cli.add_command(importlib.import_module(f".commands.{_name}", __package__).command)


def main() -> None:
    cli(prog_name="rtk")


if __name__ == "__main__":
    main()
