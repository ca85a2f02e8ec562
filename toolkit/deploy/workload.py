"""The pods: a Deployment (one pod per replica) or a LeaderWorkerSet (a leader+workers group per replica)."""

from __future__ import annotations

import math

from ..spec import Spec
from ..triton.server import RUN_DIR_ENV
from .image import default_image
from .launch import SPEC_FILE, SPEC_MOUNT, SSH_SECRET_MOUNT, server_command, spec_yaml, worker_command
from .layout import LWS_API, SSH_PORT, Layout, frontend_exposed, frontend_key_variable, ports

MODELS_VOLUME = "models"
SHM_VOLUME = "dshm"
SPEC_VOLUME = "rtk-spec"
SSH_VOLUME = "mpi-ssh"
RUN_VOLUME = "rtk-run"
RUN_MOUNT = "/var/run/rtk"  # rtk serve's log and state (RTK_RUN_DIR): the repository's volume may be read-only
STARTUP_PERIOD_S = 10
COPY_TOOLS = {  # object storage scheme -> (default image, copy command)
    "s3": ("amazon/aws-cli:2.27.0", ["aws", "s3", "sync", "--only-show-errors"]),
    "gs": ("google/cloud-sdk:slim", ["gcloud", "storage", "rsync", "--recursive"]),
}


def config_map(spec: Spec, layout: Layout) -> dict | None:
    """The cpu target's in-pod spec (``rtk serve`` reads it); GPU targets need none."""
    if layout.target != "cpu":
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(f"{layout.name}-spec", layout),
        "data": {SPEC_FILE: spec_yaml(spec)},
    }


def deployment(spec: Spec, layout: Layout) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(layout.name, layout),
        "spec": {
            **_replicas(spec),
            "selector": {"matchLabels": layout.pod_selector},
            # A replacement loads its engine before the old pod goes: never below the serving capacity.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": {**layout.labels, **layout.pod_selector}},
                "spec": _pod(spec, layout, leader=True),
            },
        },
    }


def leader_worker_set(spec: Spec, layout: Layout) -> dict:
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": _meta(layout.name, layout),
        "spec": {
            **_replicas(spec),
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": layout.nodes,
                # A failed pod breaks the MPI job: restart the whole group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {"labels": {**layout.labels, "app.kubernetes.io/component": "leader"}},
                    "spec": _pod(spec, layout, leader=True),
                },
                "workerTemplate": {
                    "metadata": {"labels": {**layout.labels, "app.kubernetes.io/component": "worker"}},
                    "spec": _pod(spec, layout, leader=False),
                },
            },
        },
    }


def workload(spec: Spec, layout: Layout) -> dict:
    return leader_worker_set(spec, layout) if layout.multi_node else deployment(spec, layout)


# -- pod --------------------------------------------------------------------------------------


def _pod(spec: Spec, layout: Layout, *, leader: bool) -> dict:
    d = spec.deploy
    pod: dict = {
        "containers": [_server_container(spec, layout) if leader else _worker_container(spec, layout)],
        "volumes": _volumes(spec, layout),
        # Streams in flight finish before the pod goes (Triton drains on SIGTERM).
        "terminationGracePeriodSeconds": 120,
        "enableServiceLinks": False,
    }
    init = _copy_container(spec)
    if init:
        pod["initContainers"] = [init]
    if d.node_selector:
        pod["nodeSelector"] = dict(d.node_selector)
    if d.secrets.image_pull:
        pod["imagePullSecrets"] = [{"name": d.secrets.image_pull}]
    if layout.gpus_per_pod:
        pod["tolerations"] = [{"key": d.resources.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}]
    if layout.target == "cpu":
        pod["securityContext"] = {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000}
    return pod


def _server_container(spec: Spec, layout: Layout) -> dict:
    command, env = server_command(spec, layout)
    if layout.target == "cpu":
        env = {**env, RUN_DIR_ENV: RUN_MOUNT}
    exposed = frontend_exposed(spec)
    c = {
        "name": "server",
        "image": default_image(spec),
        "command": command,
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports(spec, frontend=exposed)],
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())] + _secret_env(spec),
        "resources": _resources(spec, layout),
        "volumeMounts": _mounts(spec, layout),
        **_probes(spec),
    }
    if layout.multi_node:
        c["ports"].append({"name": "ssh", "containerPort": SSH_PORT, "protocol": "TCP"})
    if not c["env"]:
        del c["env"]
    return c


def _worker_container(spec: Spec, layout: Layout) -> dict:
    probe = {"tcpSocket": {"port": SSH_PORT}, "periodSeconds": 10}
    c = {
        "name": "worker",
        "image": default_image(spec),
        "command": worker_command(),
        "ports": [{"name": "ssh", "containerPort": SSH_PORT, "protocol": "TCP"}],
        "resources": _resources(spec, layout),
        "volumeMounts": _mounts(spec, layout),
        "readinessProbe": {**probe, "failureThreshold": 3},
        "livenessProbe": {**probe, "failureThreshold": 6},
    }
    env = _secret_env(spec)
    if env:
        c["env"] = env
    return c


def _probes(spec: Spec) -> dict:
    """startupProbe covers the engine's load and warm-up; after it, readiness and liveness take over."""
    ready = {"httpGet": {"path": "/v2/health/ready", "port": "http"}}
    live = {"httpGet": {"path": "/v2/health/live", "port": "http"}}
    return {
        "startupProbe": {
            **ready,
            "periodSeconds": STARTUP_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(spec.deploy.startup_timeout_s / STARTUP_PERIOD_S),
        },
        "readinessProbe": {**ready, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        "livenessProbe": {**live, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def _resources(spec: Spec, layout: Layout) -> dict:
    r = spec.deploy.resources
    requests = {"cpu": r.cpu, "memory": r.memory}
    limits = {"memory": r.memory}
    if layout.gpus_per_pod:
        requests[r.gpu_resource] = limits[r.gpu_resource] = str(layout.gpus_per_pod)
    else:
        limits["cpu"] = r.cpu
    return {"requests": requests, "limits": limits}


def _secret_env(spec: Spec) -> list[dict]:
    """Secrets enter the pod as references only; their values are never rendered."""
    s = spec.deploy.secrets
    env = []
    if s.hf_token:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": s.hf_token, "key": "HF_TOKEN"}}})
    if frontend_exposed(spec):
        var = frontend_key_variable(spec)
        env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": s.frontend_api_keys, "key": var}}})
    return env


# -- storage ----------------------------------------------------------------------------------


def _volumes(spec: Spec, layout: Layout) -> list[dict]:
    st, r = spec.deploy.storage, spec.deploy.resources
    if st.kind == "pvc":
        models = {
            "name": MODELS_VOLUME,
            "persistentVolumeClaim": {"claimName": st.claim_name or f"{layout.name}-models", "readOnly": st.read_only},
        }
    else:
        models = {"name": MODELS_VOLUME, "emptyDir": {"sizeLimit": st.cache_size}}
    vols = [models, {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": r.shm_size}}]
    if layout.target == "cpu":
        vols.append({"name": SPEC_VOLUME, "configMap": {"name": f"{layout.name}-spec"}})
        vols.append({"name": RUN_VOLUME, "emptyDir": {}})
    if layout.multi_node:
        vols.append({"name": SSH_VOLUME, "secret": {"secretName": spec.deploy.secrets.ssh, "defaultMode": 0o400}})
    return vols


def _mounts(spec: Spec, layout: Layout) -> list[dict]:
    st = spec.deploy.storage
    m = [
        {"name": MODELS_VOLUME, "mountPath": st.mount_path, "readOnly": st.kind == "pvc" and st.read_only},
        {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
    ]
    if layout.target == "cpu":
        m.append({"name": SPEC_VOLUME, "mountPath": SPEC_MOUNT, "readOnly": True})
        m.append({"name": RUN_VOLUME, "mountPath": RUN_MOUNT})
    if layout.multi_node:
        m.append({"name": SSH_VOLUME, "mountPath": SSH_SECRET_MOUNT, "readOnly": True})
    return m


def _copy_container(spec: Spec) -> dict | None:
    """object-storage: copy the bucket prefix into the pod's emptyDir before the server starts."""
    st = spec.deploy.storage
    if st.kind != "object-storage":
        return None
    scheme = st.uri.split("://", 1)[0]
    image, tool = COPY_TOOLS[scheme]
    c = {
        "name": "fetch-models",
        "image": st.copy_image or image,
        "command": [*tool, st.uri.rstrip("/"), st.mount_path],
        "volumeMounts": [{"name": MODELS_VOLUME, "mountPath": st.mount_path}],
    }
    if st.credentials_secret:
        c["envFrom"] = [{"secretRef": {"name": st.credentials_secret}}]
    return c


# -- helpers ----------------------------------------------------------------------------------


def _replicas(spec: Spec) -> dict:
    """``replicas`` only without autoscaling: with it, re-applying the manifests must not reset the HPA's count."""
    return {"replicas": spec.deploy.replicas} if spec.deploy.autoscaling.kind == "none" else {}


def _meta(name: str, layout: Layout) -> dict:
    return {"name": name, "namespace": layout.namespace, "labels": dict(layout.labels)}
