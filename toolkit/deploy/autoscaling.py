"""Autoscaling: the signal (a Prometheus recording rule per serving pod), then an HPA through
prometheus-adapter or a KEDA ScaledObject, both with scale-up and scale-down stabilisation windows.

Why ``waiting_requests`` is the default (docs/deploy.md): a decoupled LLM model's ``execute``
returns as soon as it has queued the request, so Triton's queue and compute durations measure that
hand-off, and the queue:compute ratio stays near zero (ensemble) or moves little (the model itself)
however long requests wait in the engine (measured in docs/deploy.md).  The
engine's own gauge of waiting requests, ``nv_trt_llm_request_metrics{request_type="waiting"}``,
is exported by TensorRT-LLM's backend (NVIDIA/TensorRT-LLM
triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc,
0d5352f) and by rtk's cpu model, and rises exactly when requests queue for a batch slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecError
from ..spec import Spec
from .layout import LWS_API, Layout
from .network import scrape_job

DEPLOYMENT_LABEL = "rtk_deployment"  # put on the recorded series so KEDA's query picks this deployment's pods


@dataclass(frozen=True)
class Signal:
    record: str  # the recorded series, one per (namespace, pod)
    metric: str  # its name in the custom metrics API (prometheus-adapter) and for the HPA
    expr: str  # PromQL over the PodMonitor's targets
    default_target: float


def signal(spec: Spec, layout: Layout) -> Signal:
    a = spec.deploy.autoscaling
    job = f'job="{scrape_job(layout)}"'
    if a.signal == "waiting_requests":
        if layout.target == "llmapi":
            raise SpecError(
                "the llmapi target's Triton model exports no nv_trt_llm_request_metrics; use "
                "signal: custom with the front door's queue metric",
                field="deploy.autoscaling.signal",
            )
        return Signal(
            "namespace_pod:nv_trt_llm_waiting_requests:sum",
            "rtk_waiting_requests",
            f'sum by (namespace, pod) (nv_trt_llm_request_metrics{{{job}, request_type="waiting"}})',
            2.0,
        )
    if a.signal == "queue_compute_ratio":
        queue = f"sum by (namespace, pod) (rate(nv_inference_queue_duration_us{{{job}}}[1m]))"
        compute = f"sum by (namespace, pod) (rate(nv_inference_compute_infer_duration_us{{{job}}}[1m]))"
        return Signal(
            "namespace_pod:nv_inference_queue_compute:ratio",
            "rtk_queue_compute_ratio",
            f"{queue} / clamp_min({compute}, 1)",
            1.0,
        )
    return Signal(
        "namespace_pod:rtk_autoscaling_signal:custom", "rtk_custom_signal", f"sum by (namespace, pod) ({a.query})", 1.0
    )


def target_value(spec: Spec, sig: Signal) -> float:
    return spec.deploy.autoscaling.target if spec.deploy.autoscaling.target is not None else sig.default_target


def quantity(value: float) -> str:
    """A Kubernetes quantity for ``value``: '2', or milli-units ('1500m') when fractional."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def prometheus_rule(spec: Spec, layout: Layout) -> dict:
    sig = signal(spec, layout)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": layout.name,
            "namespace": layout.namespace,
            "labels": {**layout.labels, **spec.deploy.autoscaling.prometheus_labels},
        },
        "spec": {
            "groups": [
                {
                    "name": f"{layout.name}.autoscaling",
                    "interval": "15s",
                    "rules": [{"record": sig.record, "expr": sig.expr, "labels": {DEPLOYMENT_LABEL: layout.name}}],
                }
            ]
        },
    }


def _scale_target(layout: Layout) -> dict:
    if layout.multi_node:
        return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "name": layout.name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": layout.name}


def _behavior(spec: Spec) -> dict:
    a = spec.deploy.autoscaling
    return {
        # Up: at most one replica (a pod or a whole group) a minute; each loads its engine for minutes.
        "scaleUp": {
            "stabilizationWindowSeconds": a.scale_up_stabilization_s,
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": a.scale_down_stabilization_s,
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
        },
    }


def hpa(spec: Spec, layout: Layout) -> dict:
    a, sig = spec.deploy.autoscaling, signal(spec, layout)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": layout.name, "namespace": layout.namespace, "labels": dict(layout.labels)},
        "spec": {
            "scaleTargetRef": _scale_target(layout),
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            # Pods metric: averaged over the scale target's pods (a LeaderWorkerSet's scale selector is its leaders).
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": sig.metric},
                        "target": {"type": "AverageValue", "averageValue": quantity(target_value(spec, sig))},
                    },
                }
            ],
            "behavior": _behavior(spec),
        },
    }


def adapter_rules(spec: Spec, layout: Layout) -> dict:
    """prometheus-adapter configuration that serves the recorded series as the HPA's per-pod metric.
    Merge ``rules`` into the adapter's config (the Helm chart's ``rules.custom``)."""
    sig = signal(spec, layout)
    return {
        "rules": [
            {
                "seriesQuery": f'{sig.record}{{namespace!="",pod!=""}}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                "name": {"matches": f"^{sig.record}$", "as": sig.metric},
                "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
            }
        ]
    }


def scaled_object(spec: Spec, layout: Layout) -> dict:
    a, sig = spec.deploy.autoscaling, signal(spec, layout)
    query = f'sum({sig.record}{{namespace="{layout.namespace}", {DEPLOYMENT_LABEL}="{layout.name}"}})'
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": layout.name, "namespace": layout.namespace, "labels": dict(layout.labels)},
        "spec": {
            "scaleTargetRef": _scale_target(layout),
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "pollingInterval": 15,
            "cooldownPeriod": a.scale_down_stabilization_s,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(spec)}},
            # AverageValue: the query's total is divided by the replicas, as the HPA's Pods metric is.
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": a.prometheus_url,
                        "query": query,
                        "threshold": f"{target_value(spec, sig):g}",
                    },
                }
            ],
        },
    }
