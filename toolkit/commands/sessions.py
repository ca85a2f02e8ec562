"""``rtk sessions list|show|delete SPEC``: the conversations a spec's front door keeps (docs/guard.md, Sessions).

It reads the session store itself (the SQLite file or Redis of serving.sessions), so it sees every
session, as the admin key does over HTTP (GET/DELETE /v1/sessions...).
"""

from __future__ import annotations

import asyncio
import json

import click

from . import load, set_option, spec_argument


@click.group("sessions")
def command() -> None:
    """List, show and delete the conversations kept for requests with a session_id."""


@command.command("list")
@spec_argument
@set_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_command(spec_path, overrides, as_json):
    """Every live session: id, turns, stored tokens, last use."""
    import time

    from ..frontdoor.sessions import list_sessions

    found = asyncio.run(list_sessions(load(spec_path, overrides)))
    if as_json:
        click.echo(json.dumps([s.public(with_messages=False) for s in found], indent=2))
        return
    if not found:
        click.echo("no sessions")
        return
    click.echo(f"{'id':<40} {'turns':>5} {'tokens':>7} {'idle':>8}")
    for s in found:
        click.echo(f"{s.id:<40} {s.turns:>5} {len(s.ids):>7} {time.time() - s.updated:>7.0f}s")


@command.command("show")
@spec_argument
@click.argument("session_id")
@set_option
def show_command(spec_path, session_id, overrides):
    """One session's messages and per-turn statistics, as JSON."""
    from ..errors import UsageError
    from ..frontdoor.sessions import read_session

    s = asyncio.run(read_session(load(spec_path, overrides), session_id))
    if s is None:
        raise UsageError(f"session '{session_id}' does not exist (or has expired); see `rtk sessions list {spec_path}`")
    click.echo(json.dumps(s.public(), indent=2, ensure_ascii=False))


@command.command("delete")
@spec_argument
@click.argument("session_id")
@set_option
def delete_command(spec_path, session_id, overrides):
    """Forget one session."""
    from ..errors import UsageError
    from ..frontdoor.sessions import delete_session

    if not asyncio.run(delete_session(load(spec_path, overrides), session_id)):
        raise UsageError(f"session '{session_id}' does not exist; see `rtk sessions list {spec_path}`")
    click.echo(f"deleted session '{session_id}'")
