"""Render every manifest for a spec, and write them atomically (nothing half-written on a bad spec)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .. import artifacts
from ..spec import Spec
from . import autoscaling, network, workload
from .image import DOCKERFILE, cpu_dockerfile, default_image
from .layout import KUBERNETES_VERSIONS, Layout, frontend_exposed, plan

MANIFEST_DIR = "k8s"


class _Dumper(yaml.SafeDumper):
    """Plain YAML: every object written out in full (no &anchors for repeated probe actions)."""

    def ignore_aliases(self, data) -> bool:
        return True


def dump(obj) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False)


ADAPTER_RULES = "prometheus-adapter-rules.yaml"


@dataclass
class Bundle:
    layout: Layout
    manifests: dict[str, dict] = field(default_factory=dict)  # k8s/<file> -> one Kubernetes object
    extra_files: dict[str, str] = field(default_factory=dict)  # other files (Dockerfile, adapter rules) -> text
    notes: list[str] = field(default_factory=list)

    def files(self) -> dict[str, str]:
        out = {f"{MANIFEST_DIR}/{n}": dump(obj) for n, obj in self.manifests.items()}
        return {**out, **self.extra_files}


def render(spec: Spec) -> Bundle:
    """Every object for ``spec.deploy``; raises SpecError (naming the field) before anything is written."""
    layout = plan(spec)
    b = Bundle(layout)
    cm = workload.config_map(spec, layout)
    if cm:
        b.manifests["00-configmap.yaml"] = cm
    kind = "leaderworkerset" if layout.multi_node else "deployment"
    b.manifests[f"10-{kind}.yaml"] = workload.workload(spec, layout)
    b.manifests["20-service.yaml"] = network.service(spec, layout)
    b.manifests["30-podmonitor.yaml"] = network.pod_monitor(spec, layout)
    a = spec.deploy.autoscaling
    if a.kind != "none":
        b.manifests["40-prometheusrule.yaml"] = autoscaling.prometheus_rule(spec, layout)
        if a.kind == "hpa":
            b.manifests["50-hpa.yaml"] = autoscaling.hpa(spec, layout)
            b.extra_files[ADAPTER_RULES] = dump(autoscaling.adapter_rules(spec, layout))
            b.notes.append(f"merge {ADAPTER_RULES} into prometheus-adapter's rules (Helm: rules.custom)")
        else:
            b.manifests["50-scaledobject.yaml"] = autoscaling.scaled_object(spec, layout)
    if layout.target == "cpu":
        b.extra_files[DOCKERFILE] = cpu_dockerfile()
        if not spec.deploy.image:
            b.notes.append(
                f"build and push the image from {DOCKERFILE}, then set deploy.image to its name "
                f"(the manifests say {default_image(spec)})"
            )
    if spec.serving.frontend.enabled and not frontend_exposed(spec):
        why = (
            "it runs in rtk's image (cpu target)"
            if layout.target != "cpu"
            else "set deploy.secrets.frontend_api_keys to expose it"
        )
        b.notes.append(f"the front door is not exposed: {why}")
    if layout.multi_node:
        b.notes.append(
            f"{layout.nodes} nodes per group: create the ssh Secret '{spec.deploy.secrets.ssh}' "
            "(docs/deploy.md) and install the LeaderWorkerSet controller"
        )
    return b


def default_output(spec: Spec) -> Path:
    return artifacts.default_output(spec, "build").parent / "deploy"


def write(spec: Spec, output: Path | str | None = None) -> tuple[Path, Bundle]:
    """Render, then write ``output`` (default ``engines/<name>/deploy``) atomically with a manifest."""
    bundle = render(spec)
    files = bundle.files()
    final = Path(output) if output else default_output(spec)
    section = spec.deploy.model_dump(mode="json")
    inputs = {
        "spec_name": spec.name,
        "target": spec.build.target,
        "world_size": bundle.layout.world_size,
        "kubernetes_versions": list(KUBERNETES_VERSIONS),
    }
    tools = artifacts.tool_versions()
    key = artifacts.stage_key("deploy", section, {**inputs, "files": artifacts.sha256_json(files)}, tools)
    with artifacts.atomic_stage("deploy", final, key, inputs=inputs, spec_section=section, tools=tools) as out:
        for rel, text in files.items():
            path = out.tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return final, bundle
