from __future__ import annotations

from pathlib import Path

import click

from . import set_option


@click.command("chat")
@click.argument("source", metavar="SPEC|REPOSITORY", type=click.Path(exists=True, path_type=Path))
@click.argument("question")
@set_option
@click.option(
    "--url", default=None, help="gRPC address of a running server (default: the background one, else start one)."
)
@click.option("--model", type=click.Choice(["ensemble", "tensorrt_llm_bls"]), default="ensemble", show_default=True)
@click.option("--system", default=None, help="System prompt.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--no-build", is_flag=True, help="Do not run `rtk build` first (SPEC only).")
def command(source, question, overrides, url, model, system, max_tokens, no_build):
    """Stream the answer to QUESTION from the model of SPEC (built and served for the occasion if needed)."""
    from ..chat import chat

    result = chat(
        source,
        question,
        overrides=overrides,
        url=url,
        model=model,
        system=system,
        max_tokens=max_tokens,
        build=not no_build,
    )
    if result.dropped_turns:
        click.secho(
            f"({result.dropped_turns} oldest turns were dropped to fit the context window)", err=True, fg="yellow"
        )
