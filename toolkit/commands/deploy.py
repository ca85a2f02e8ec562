from __future__ import annotations

from pathlib import Path

import click

from . import load, set_option, spec_argument


@click.group("deploy")
def command() -> None:
    """Render deployment artifacts from a spec (docs/deploy.md)."""


@command.command("k8s")
@spec_argument
@set_option
@click.option(
    "--output",
    "-o",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output directory (default: engines/<name>/deploy); replaced atomically.",
)
def k8s(spec_path, overrides, output):
    """Kubernetes manifests: Deployment or LeaderWorkerSet, Service, PodMonitor, autoscaling."""
    from ..deploy import write

    spec = load(spec_path, overrides)
    path, bundle = write(spec, output)
    shape = f"LeaderWorkerSet of {bundle.layout.nodes} pods per replica" if bundle.layout.multi_node else "Deployment"
    click.echo(f"wrote {path}/ ({shape}; apply with: kubectl apply -f {path}/k8s/)")
    for note in bundle.notes:
        click.echo(f"note: {note}", err=True)
