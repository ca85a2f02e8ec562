"""Names, labels, ports and the single- vs multi-node decision every manifest shares."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .. import __version__
from ..errors import SpecError
from ..spec import Spec

# Kubernetes versions the manifests are validated against (tests/test_deploy_k8s.py).
KUBERNETES_VERSIONS = ("1.31", "1.37")
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # set by the LWS controller on every pod
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on the leader
SSH_PORT = 2222
MAX_NAME = 40  # LeaderWorkerSet pods are <name>-<group>-<worker>; hostnames stay within 63


def resource_name(spec: Spec) -> str:
    """``spec.name`` as a DNS-1123 label (lower case, '.' and '_' become '-')."""
    name = re.sub(r"[._]+", "-", spec.name.lower()).strip("-")
    if not name or len(name) > MAX_NAME or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
        raise SpecError(
            f"'{spec.name}' cannot name Kubernetes objects (it becomes '{name}'); use at most {MAX_NAME} "
            "letters, digits and '-', starting and ending with a letter or digit",
            field="name",
        )
    return name


@dataclass(frozen=True)
class Layout:
    """What the manifests are made of: one pod per replica, or a leader+workers group per replica."""

    name: str
    namespace: str
    target: str
    world_size: int
    gpus_per_pod: int  # 0 on the cpu target
    nodes: int  # pods per replica: 1, or the LeaderWorkerSet group size

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def service_name(self) -> str:
        """The LeaderWorkerSet controller owns a headless Service named like the set; ours is the leaders'."""
        return f"{self.name}-leader" if self.multi_node else self.name

    @property
    def labels(self) -> dict[str, str]:
        """Labels on every object (Kubernetes' recommended ``app.kubernetes.io/*``)."""
        return {
            "app.kubernetes.io/name": self.name,
            "app.kubernetes.io/instance": self.name,
            "app.kubernetes.io/component": "inference-server",
            "app.kubernetes.io/part-of": "rtk",
            "app.kubernetes.io/managed-by": "rtk",
            "app.kubernetes.io/version": __version__,
        }

    @property
    def pod_selector(self) -> dict[str, str]:
        """Pods that serve requests and export the metrics: every pod, or only each group's leader."""
        if self.multi_node:
            return {LWS_NAME_LABEL: self.name, LWS_WORKER_INDEX_LABEL: "0"}
        return {"app.kubernetes.io/name": self.name, "app.kubernetes.io/instance": self.name}


def plan(spec: Spec) -> Layout:
    """Decide the shape of the deployment; a spec it cannot serve raises SpecError naming the field."""
    d, b = spec.deploy, spec.build
    name = resource_name(spec)
    if b.target == "cpu":
        return Layout(name, d.namespace, b.target, 1, 0, 1)
    world, per_node = b.world_size, d.resources.gpus_per_node
    if world <= per_node:
        return Layout(name, d.namespace, b.target, world, world, 1)
    if b.target == "llmapi":
        raise SpecError(
            f"world size {world} spans nodes of {per_node} GPUs; rtk renders multi-node groups only for "
            "the trt-engine target (its MPI launch). Use trt-engine, or raise "
            "deploy.resources.gpus_per_node",
            field="deploy.resources.gpus_per_node",
        )
    if world % per_node:
        raise SpecError(
            f"world size {world} (tp {b.tp_size} x pp {b.pp_size}) is not a multiple of {per_node}; "
            "every node of a group runs the same number of ranks",
            field="deploy.resources.gpus_per_node",
        )
    return Layout(name, d.namespace, b.target, world, per_node, math.ceil(world / per_node))


def ports(spec: Spec, *, frontend: bool) -> list[tuple[str, int]]:
    """(name, port) the serving container listens on; the front door only when it is exposed."""
    s = spec.serving
    out = [("http", s.http_port), ("grpc", s.grpc_port), ("metrics", s.metrics_port)]
    if frontend:
        out.append(("frontend", s.frontend.port))
    return out


def frontend_exposed(spec: Spec) -> bool:
    """The front door runs in rtk's image (cpu target) and leaves loopback only with its API keys from a Secret."""
    f = spec.serving.frontend
    return spec.build.target == "cpu" and f.enabled and spec.deploy.secrets.frontend_api_keys is not None


def frontend_key_variable(spec: Spec) -> str:
    """The environment variable ``serving.frontend.api_keys`` names (``env:VARIABLE``)."""
    source = spec.serving.frontend.api_keys or ""
    if not source.startswith("env:"):
        raise SpecError(
            "deploy.secrets.frontend_api_keys gives the keys as an environment variable from a Secret; set "
            "serving.frontend.api_keys: env:VARIABLE (the Secret's key is VARIABLE)",
            field="serving.frontend.api_keys",
        )
    return source[4:]
