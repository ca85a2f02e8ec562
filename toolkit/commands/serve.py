from __future__ import annotations

from pathlib import Path

import click

from . import set_option


@click.command("serve")
@click.argument("source", metavar="SPEC|REPOSITORY", type=click.Path(exists=True, path_type=Path))
@set_option
@click.option("--host", default=None, help="Address to bind (default: serving.host, 127.0.0.1).")
@click.option("--http-port", type=int, default=None, help="Default: serving.http_port (8000).")
@click.option("--grpc-port", type=int, default=None, help="Default: serving.grpc_port (8001).")
@click.option("--metrics-port", type=int, default=None, help="Default: serving.metrics_port (8002).")
@click.option("--detach", is_flag=True, help="Start in the background and return once ready; stop with --stop.")
@click.option("--stop", "stop_", is_flag=True, help="Stop the background server of SPEC|REPOSITORY.")
@click.option(
    "--reload",
    "reload_",
    is_flag=True,
    help="After a rebuild: start a second server on the repository as it is now, send new requests to it through "
    "the front door while the old one finishes its streams, then stop the old one (docs/guard.md).",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    help="--reload: seconds the old server may take to finish its streams before it is stopped.",
)
@click.option(
    "--timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds to wait for the models to be ready and warm.",
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="cpu target: this many tritonservers of the repository, each on its own free ports, behind one "
    "front door that sends each request to the replica with the lowest predicted time to first token; "
    "they start, are recorded and stop together.",
)
def command(
    source,
    overrides,
    host,
    http_port,
    grpc_port,
    metrics_port,
    detach,
    stop_,
    reload_,
    drain_timeout,
    timeout,
    replicas,
):
    """Serve an emitted repository with tritonserver until Ctrl-C (or in the background with --detach)."""
    from ..errors import UsageError
    from ..triton import launch

    if reload_:
        flags = {"--detach": detach, "--stop": stop_, "--replicas": replicas > 1, "--host": host}
        flags.update({"--http-port": http_port, "--grpc-port": grpc_port, "--metrics-port": metrics_port})
        given = [flag for flag, value in flags.items() if value]
        if given:
            raise UsageError(f"--reload keeps the running server's front door and picks free ports; drop {given[0]}")
        r = launch.reload(source, overrides=overrides, ready_timeout_s=timeout, drain_timeout_s=drain_timeout)
        s = r.seconds
        click.echo(
            f"reloaded: new requests go to tritonserver pid {r.new.pid} (gRPC {r.new.grpc_url}) behind "
            f"{r.new.frontdoor_url}/v1; {r.in_flight} in flight finished on pid {r.old.pid}, which is stopped "
            f"(start {s['start']:.1f} s, swap {s['swap']:.2f} s, drain {s['drain']:.1f} s, stop {s['stop']:.1f} s)"
        )
        if not r.drained:
            click.echo(
                f"warning: the old server still had requests after --drain-timeout {drain_timeout:.0f} s; "
                "they were ended when it stopped",
                err=True,
            )
        return
    if stop_:
        states = launch.stop_all(source, overrides)
        pids = ", ".join(str(st.pid) for st in states)
        fronts = ", ".join(str(st.frontdoor_pid) for st in states if st.frontdoor_pid)
        front = f" and its front door (pid {fronts})" if fronts else ""
        click.echo(f"stopped tritonserver (pid {pids}){front}" if states else "no background tritonserver was running")
        return
    ports = dict(
        host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, ready_timeout_s=timeout
    )

    started = []

    def ready(server):
        if replicas == 1:
            front = f"  OpenAI {server.frontdoor_url}/v1" if server.frontdoor_url else ""
            click.echo(
                f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}{front}"
                "  (Ctrl-C stops)"
            )
            return
        started.append(server)
        click.echo(
            f"ready: replica {len(started) - 1}: HTTP {server.http_url}  gRPC {server.grpc_url}  "
            f"metrics {server.metrics_url}"
        )
        if len(started) == replicas:
            front = f"OpenAI {server.frontdoor_url}/v1 over {replicas} replicas" if server.frontdoor_url else ""
            click.echo(f"ready: {front or f'{replicas} replicas, no front door'}  (Ctrl-C stops)")

    state = launch.serve(source, overrides=overrides, detach=detach, on_ready=ready, replicas=replicas, **ports)
    if detach:
        states = state if isinstance(state, list) else [state]
        if len(states) == 1:
            st = states[0]
            front = f"  OpenAI {st.frontdoor_url}/v1" if st.frontdoor_url else ""
            click.echo(
                f"ready in the background (pid {st.pid}): HTTP {st.http_url}  gRPC {st.grpc_url}  "
                f"metrics {st.metrics_url}{front}; log {st.log_path}"
            )
        else:
            for i, st in enumerate(states):
                click.echo(
                    f"ready in the background: replica {i} (pid {st.pid}): HTTP {st.http_url}  gRPC {st.grpc_url}  "
                    f"metrics {st.metrics_url}; log {st.log_path}"
                )
            first = states[0]
            if first.frontdoor_url:
                click.echo(
                    f"front door (pid {first.frontdoor_pid}): OpenAI {first.frontdoor_url}/v1 over {len(states)} "
                    "replicas"
                )
        click.echo(f"stop with: rtk serve --stop {source}")
