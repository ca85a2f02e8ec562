"""The spec's ``deploy`` section: defaults, and every bad value refused with the field named."""

from __future__ import annotations

import pytest

from toolkit.errors import SpecError
from toolkit.spec import spec_from_dict


def test_defaults():
    d = spec_from_dict({"name": "m"}).deploy
    assert (d.namespace, d.replicas, d.storage.kind, d.storage.mount_path) == ("default", 1, "pvc", "/models")
    assert (d.autoscaling.kind, d.autoscaling.signal) == ("hpa", "waiting_requests")
    assert d.autoscaling.scale_down_stabilization_s > d.autoscaling.scale_up_stabilization_s
    assert d.secrets.hf_token is None and d.image is None


@pytest.mark.parametrize(
    "deploy, field, hint",
    [
        ({"namespace": "Prod_NS"}, "deploy.namespace", "Kubernetes name"),
        ({"replicas": -1}, "deploy.replicas", "greater than or equal"),
        ({"resources": {"memory": "lots"}}, "deploy.resources.memory", "quantity"),
        ({"resources": {"gpus_per_node": 0}}, "deploy.resources.gpus_per_node", "greater than or equal"),
        ({"storage": {"kind": "object-storage"}}, "deploy.storage.uri", "s3://"),
        ({"storage": {"kind": "object-storage", "uri": "http://bucket/x"}}, "deploy.storage.uri", "s3://"),
        ({"storage": {"uri": "s3://bucket/x"}}, "deploy.storage.uri", "object-storage"),
        ({"storage": {"mount_path": "models"}}, "deploy.storage.mount_path", "absolute"),
        ({"autoscaling": {"kind": "vpa"}}, "deploy.autoscaling.kind", "'hpa'"),
        (
            {"autoscaling": {"min_replicas": 3, "max_replicas": 2}},
            "deploy.autoscaling.max_replicas",
            "below min_replicas",
        ),
        ({"autoscaling": {"signal": "custom"}}, "deploy.autoscaling.query", "custom"),
        ({"autoscaling": {"target": 0}}, "deploy.autoscaling.target", "greater than 0"),
        ({"secrets": {"hf_token": "hf_abcdefSECRET"}}, "deploy.secrets.hf_token", "name of a Secret"),
        ({"startup_timeout_s": 5}, "deploy.startup_timeout_s", "greater than or equal"),
        ({"replica": 2}, "deploy.replica", "unknown field"),
    ],
)
def test_bad_values_name_the_field(deploy, field, hint):
    with pytest.raises(SpecError) as exc:
        spec_from_dict({"name": "m", "deploy": deploy})
    assert exc.value.field == field, str(exc.value)
    assert hint in str(exc.value)
    assert "SECRET" not in str(exc.value)  # a token pasted where a Secret's name belongs is not echoed
