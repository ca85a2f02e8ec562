"""Kubernetes manifests rendered from the spec (``rtk deploy k8s``; docs/deploy.md).

Pure functions from a :class:`~toolkit.spec.Spec` to plain dicts, one module per concern:
``layout`` (names, labels, ports, single vs multi-node), ``launch`` (the command each pod runs),
``workload`` (Deployment or LeaderWorkerSet with probes, storage, secrets), ``network``
(Service, PodMonitor), ``autoscaling`` (the signal, PrometheusRule, HPA or KEDA), ``image``
(image defaults and the cpu target's Dockerfile) and ``render`` (all of it, written atomically).
"""

from .render import Bundle, render, write

__all__ = ["Bundle", "render", "write"]
