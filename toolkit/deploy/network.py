"""How requests and Prometheus reach the serving pods: a Service and a PodMonitor, leaders only."""

from __future__ import annotations

from ..spec import Spec
from .layout import Layout, frontend_exposed, ports

SCRAPE_INTERVAL = "15s"


def service(spec: Spec, layout: Layout) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": layout.service_name, "namespace": layout.namespace, "labels": dict(layout.labels)},
        "spec": {
            "type": spec.deploy.service_type,
            "selector": dict(layout.pod_selector),
            "ports": [
                {"name": n, "port": p, "targetPort": n, "protocol": "TCP"}
                for n, p in ports(spec, frontend=frontend_exposed(spec))
            ],
        },
    }


def pod_monitor(spec: Spec, layout: Layout) -> dict:
    """Scrape Triton's /metrics on each serving pod (the group's leader: workers serve no endpoint),
    and the front door's own /metrics (``rtk_frontdoor_*``) where it is exposed."""
    endpoints = [{"port": "metrics", "path": "/metrics", "interval": SCRAPE_INTERVAL}]
    if frontend_exposed(spec):
        endpoints.append({"port": "frontend", "path": "/metrics", "interval": SCRAPE_INTERVAL})
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {
            "name": layout.name,
            "namespace": layout.namespace,
            "labels": {**layout.labels, **spec.deploy.autoscaling.prometheus_labels},
        },
        "spec": {
            "selector": {"matchLabels": dict(layout.pod_selector)},
            "podMetricsEndpoints": endpoints,
        },
    }


def scrape_job(layout: Layout) -> str:
    """The ``job`` label the Prometheus Operator gives a PodMonitor's targets: ``<namespace>/<name>``
    (prometheus-operator/prometheus-operator pkg/prometheus/promcfg.go, 6adcebc)."""
    return f"{layout.namespace}/{layout.name}"
