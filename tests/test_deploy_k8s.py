"""``rtk deploy k8s``: every manifest validates against Kubernetes' own schemas (built-in kinds, with
``kubernetes-validate``) or the published CRD schemas in tests/data/k8s/ (LeaderWorkerSet, PodMonitor,
PrometheusRule, KEDA ScaledObject); secrets stay references; a bad spec writes nothing.

No cluster is involved: what these tests cannot show (scheduling, the LWS controller, MPI over ssh,
Prometheus and the adapter answering) is listed in docs/deploy.md.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from toolkit.cli import cli
from toolkit.deploy import render
from toolkit.deploy.launch import pod_spec, triton_command
from toolkit.deploy.layout import KUBERNETES_VERSIONS, LWS_NAME_LABEL, LWS_WORKER_INDEX_LABEL
from toolkit.errors import SpecError
from toolkit.spec import load_spec, spec_from_dict
from toolkit.targets import TARGETS

EXAMPLES = Path(__file__).parent.parent / "examples"
CRDS = Path(__file__).parent / "data" / "k8s"
CRD_FILES = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
}
TOKEN = "hf_rtkTestSentinelToken0123456789"


def gpu_spec(**build) -> dict:
    return {
        "name": "llama-3.1-8b",
        "model": {"source": "hf:meta-llama/Llama-3.1-8B-Instruct"},
        "build": {"target": "trt-engine", "max_batch_size": 64, "max_num_tokens": 8192, **build},
    }


def with_deploy(data: dict, **deploy) -> dict:
    return {**data, "deploy": deploy}


CPU = yaml.safe_load((EXAMPLES / "smollm2-cpu.yaml").read_text())
CASES = {
    "cpu-hpa": CPU,
    "cpu-frontdoor-keda": {
        **with_deploy(CPU, autoscaling={"kind": "keda"}, secrets={"frontend_api_keys": "rtk-keys"}),
        "serving": {**CPU["serving"], "frontend": {"api_keys": "env:RTK_API_KEYS"}},
    },
    "trt-tp2-s3-keda": with_deploy(
        gpu_spec(tp_size=2),
        autoscaling={"kind": "keda", "target": 1.5},
        storage={"kind": "object-storage", "uri": "s3://models/llama", "credentials_secret": "s3-creds"},
        secrets={"hf_token": "hf-token", "image_pull": "ngc"},
    ),
    "trt-tp8pp2-lws-hpa": with_deploy(
        gpu_spec(tp_size=8, pp_size=2),
        secrets={"hf_token": "hf-token"},
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    ),
    "trt-lws-ratio-keda": with_deploy(
        gpu_spec(tp_size=4, pp_size=2),
        resources={"gpus_per_node": 4},
        autoscaling={"kind": "keda", "signal": "queue_compute_ratio"},
    ),
    "trt-instances-custom": {
        **with_deploy(
            gpu_spec(),
            autoscaling={"signal": "custom", "query": 'rtk_frontdoor_inflight{namespace="default"}', "target": 4},
        ),
        "serving": {"instance_count": 2},
    },
    "llmapi-none-gs": with_deploy(
        {
            **gpu_spec(tp_size=2),
            "build": {"target": "llmapi", "tp_size": 2, "max_num_tokens": 4096},
            "quantization": {"format": "int4_awq"},
        },
        autoscaling={"kind": "none"},
        replicas=3,
        storage={"kind": "object-storage", "uri": "gs://bucket/qwen"},
    ),
}


@pytest.fixture(scope="module")
def bundles():
    return {name: render(spec_from_dict(copy.deepcopy(data))) for name, data in CASES.items()}


# -- validators -----------------------------------------------------------------------------------


def _strict(schema):
    """A CRD's structural schema as the API server applies it with strict field validation."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("type") == "object" and "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRDS / CRD_FILES[(api_version, kind)]).read_text(), Loader=loader)
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    served = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    assert served, f"{kind} {version} is not served by the recorded CRD"
    return jsonschema.Draft7Validator(_strict(served[0]["schema"]["openAPIV3Schema"]))


def validate(obj: dict, k8s_version: str) -> None:
    """Raise if ``obj`` is not a valid object of its kind (CRDs: their schema; metadata: ObjectMeta)."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_FILES:
        crd_validator(*key).validate(obj)
        # The CRD schema leaves metadata open; check it as the API server does (ObjectMeta, strict).
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, k8s_version, strict=True
        )
    else:
        kubernetes_validate.validate(obj, k8s_version, strict=True)


# -- every manifest is valid ----------------------------------------------------------------------


@pytest.mark.parametrize("k8s_version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_validates(bundles, case, k8s_version):
    bundle = bundles[case]
    kinds = set()
    for name, obj in bundle.manifests.items():
        validate(obj, k8s_version)
        kinds.add(obj["kind"])
        # What is written is what was validated.
        assert yaml.safe_load(bundle.files()[f"k8s/{name}"]) == obj
    assert {"Service", "PodMonitor"} <= kinds
    assert ("LeaderWorkerSet" in kinds) == bundle.layout.multi_node
    assert ("Deployment" in kinds) != bundle.layout.multi_node


def test_all_kinds_are_covered(bundles):
    kinds = {o["kind"] for b in bundles.values() for o in b.manifests.values()}
    assert kinds == {
        "ConfigMap",
        "Deployment",
        "LeaderWorkerSet",
        "Service",
        "PodMonitor",
        "PrometheusRule",
        "HorizontalPodAutoscaler",
        "ScaledObject",
    }


@pytest.mark.parametrize(
    "kind, breakage",
    [
        ("Deployment", lambda o: o["spec"]["template"]["spec"]["containers"][0].update(startupprobe={})),
        ("Deployment", lambda o: o["spec"].update(replicas="two")),
        ("Service", lambda o: o["spec"]["ports"][0].update(port="http")),
        ("HorizontalPodAutoscaler", lambda o: o["spec"]["metrics"][0]["pods"]["target"].update(averagevalue="2")),
        ("LeaderWorkerSet", lambda o: o["spec"]["leaderWorkerTemplate"].update(sise=2)),
        (
            "LeaderWorkerSet",
            lambda o: o["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0].update(
                ports=[{"containerPort": "http"}]
            ),
        ),
        ("PodMonitor", lambda o: o["spec"]["podMetricsEndpoints"][0].update(scheme="tcp")),
        ("PrometheusRule", lambda o: o["spec"]["groups"][0]["rules"][0].pop("expr")),
        ("ScaledObject", lambda o: o["spec"].update(minReplicaCount="one")),
        ("ScaledObject", lambda o: o["metadata"]["labels"].update(replicas=2)),  # label values are strings
    ],
)
def test_validators_reject_broken_manifests(bundles, kind, breakage):
    """The validation above can fail: an unknown (misspelt) field or a wrong type is caught for each kind.
    (Schemas do not carry the API server's value checks: port ranges, name syntax, enum values.)"""
    obj = next(copy.deepcopy(o) for b in bundles.values() for o in b.manifests.values() if o["kind"] == kind)
    validate(obj, KUBERNETES_VERSIONS[-1])
    breakage(obj)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(obj, KUBERNETES_VERSIONS[-1])


# -- what the manifests say -----------------------------------------------------------------------


def _objects(bundle, kind):
    return [o for o in bundle.manifests.values() if o["kind"] == kind]


def _pod_templates(bundle):
    """(role, pod template) for every pod the workload creates."""
    (w,) = _objects(bundle, "Deployment") or _objects(bundle, "LeaderWorkerSet")
    if w["kind"] == "Deployment":
        return [("server", w["spec"]["template"])]
    lwt = w["spec"]["leaderWorkerTemplate"]
    return [("leader", lwt["leaderTemplate"]), ("worker", lwt["workerTemplate"])]


@pytest.mark.parametrize(
    "case, gpus_per_pod, pods_per_replica",
    [
        ("cpu-hpa", 0, 1),
        ("trt-tp2-s3-keda", 2, 1),
        ("trt-instances-custom", 1, 1),
        ("llmapi-none-gs", 2, 1),
        ("trt-tp8pp2-lws-hpa", 8, 2),
        ("trt-lws-ratio-keda", 4, 2),
    ],
)
def test_gpu_requests_equal_world_size(bundles, case, gpus_per_pod, pods_per_replica):
    bundle = bundles[case]
    spec = spec_from_dict(copy.deepcopy(CASES[case]))
    world = spec.build.world_size if spec.build.target != "cpu" else 0
    assert gpus_per_pod * pods_per_replica == world
    templates = _pod_templates(bundle)
    assert len(templates) == (2 if pods_per_replica > 1 else 1)
    for _, t in templates:
        (c,) = t["spec"]["containers"]
        res = c["resources"]
        if gpus_per_pod:
            assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == str(gpus_per_pod)
        else:
            assert not any("gpu" in k for k in {**res["requests"], **res["limits"]})
    if pods_per_replica > 1:
        (lws,) = _objects(bundle, "LeaderWorkerSet")
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == pods_per_replica


@pytest.mark.parametrize("case", ["trt-tp8pp2-lws-hpa", "trt-lws-ratio-keda"])
def test_multi_node_service_and_podmonitor_select_only_leaders(bundles, case):
    bundle = bundles[case]
    (lws,) = _objects(bundle, "LeaderWorkerSet")
    leader_only = {LWS_NAME_LABEL: lws["metadata"]["name"], LWS_WORKER_INDEX_LABEL: "0"}
    (svc,) = _objects(bundle, "Service")
    (pm,) = _objects(bundle, "PodMonitor")
    assert svc["spec"]["selector"] == leader_only
    assert pm["spec"]["selector"] == {"matchLabels": leader_only}
    # Not the LWS controller's own headless Service (named like the set).
    assert svc["metadata"]["name"] != lws["metadata"]["name"]
    # Only the leader serves: it has the HTTP/metrics ports the Service and PodMonitor name; workers run sshd.
    leader, worker = (t["spec"]["containers"][0] for _, t in _pod_templates(bundle))
    assert {p["name"] for p in leader["ports"]} >= {p["targetPort"] for p in svc["spec"]["ports"]} | {"metrics"}
    assert {p["name"] for p in worker["ports"]} == {"ssh"}
    assert "startupProbe" in leader and "startupProbe" not in worker


def test_single_node_selectors_match_the_pods(bundles):
    for name, bundle in bundles.items():
        if bundle.layout.multi_node:
            continue
        (dep,) = _objects(bundle, "Deployment")
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        for selector in (
            dep["spec"]["selector"]["matchLabels"],
            _objects(bundle, "Service")[0]["spec"]["selector"],
            _objects(bundle, "PodMonitor")[0]["spec"]["selector"]["matchLabels"],
        ):
            assert selector.items() <= pod_labels.items(), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_probes(bundles, case):
    spec = spec_from_dict(copy.deepcopy(CASES[case]))
    _, template = _pod_templates(bundles[case])[0]
    (c,) = template["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    start, ready, live = c["startupProbe"], c["readinessProbe"], c["livenessProbe"]
    assert start["httpGet"] == ready["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert live["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert named["http"] == spec.serving.http_port
    # The engine gets startup_timeout_s to load and warm before liveness may restart it.
    assert start["periodSeconds"] * start["failureThreshold"] >= spec.deploy.startup_timeout_s
    assert live["periodSeconds"] * live["failureThreshold"] < spec.deploy.startup_timeout_s


def test_leader_runs_rtks_mpi_launch_over_the_group(bundles):
    spec = spec_from_dict(copy.deepcopy(CASES["trt-tp8pp2-lws-hpa"]))
    leader = _pod_templates(bundles["trt-tp8pp2-lws-hpa"])[0][1]["spec"]["containers"][0]
    assert leader["command"][:2] == ["bash", "-c"]
    script = leader["command"][2]
    argv, _ = triton_command(pod_spec(spec))
    assert argv[:2] == ["mpirun", "--allow-run-as-root"] and argv.count(":") == spec.build.world_size - 1
    ranks = " ".join(argv[2:])  # rtk's own rank commands, unchanged
    assert ranks in script.replace("'", "")
    assert '--host "$RTK_MPI_HOSTS"' in script and "LWS_LEADER_ADDRESS" in script and "LWS_GROUP_SIZE" in script
    assert "--model-repository=/models/triton_repo/llama-3.1-8b" in script
    assert "--http-address=0.0.0.0" in script
    worker = _pod_templates(bundles["trt-tp8pp2-lws-hpa"])[1][1]["spec"]["containers"][0]
    assert "sshd" in worker["command"][2]


@pytest.mark.parametrize("case", ["trt-tp2-s3-keda", "trt-tp8pp2-lws-hpa"])
def test_gpu_pod_starts_the_server_at_the_specs_niceness(case):
    """GPU targets default to niceness 0 (the command as is); a spec's own niceness starts the server (or the leader's
    mpirun) under ``nice``, as rtk serve sets it after the start."""

    def server(spec):
        (c,) = [c for c in _pod_templates(render(spec))[0][1]["spec"]["containers"] if c["name"] == "server"]
        return c

    data = copy.deepcopy(CASES[case])
    c = server(spec_from_dict(data))
    assert "nice" not in c["command"][:1] and "nice -n" not in " ".join(c["command"])
    data.setdefault("serving", {})["server_niceness"] = 3
    spec = spec_from_dict(data)
    c = server(spec)
    argv, _ = triton_command(pod_spec(spec))
    if c["command"][:2] == ["bash", "-c"]:  # a multi-node leader: exec nice -n 3 mpirun ...
        assert "\nexec nice -n 3 mpirun " in c["command"][2]
    else:
        assert c["command"] == ["nice", "-n", "3", *argv]


@pytest.mark.parametrize("case", ["trt-tp2-s3-keda", "trt-tp8pp2-lws-hpa", "trt-instances-custom", "llmapi-none-gs"])
def test_pod_command_is_the_one_rtk_serve_runs(case):
    """The pod runs what ``rtk serve`` would run for the same repository (toolkit.triton.launch.make_server),
    with the NGC image's binary."""
    from toolkit.triton import launch
    from toolkit.triton.server import TritonBinary

    spec = pod_spec(spec_from_dict(copy.deepcopy(CASES[case])))
    t = launch.ServeTarget(
        repository=Path(spec.serving.repository),
        target=TARGETS[spec.build.target],
        build=spec.build,
        serving=spec.serving,
        engine_dir=None,
        models=[],
    )
    server = launch.make_server(t)
    server._binary = TritonBinary(Path("/opt/tritonserver/bin/tritonserver"), "system")  # the NGC image's
    server.launch = dataclasses.replace(server.launch, allow_run_as_root=True)  # NGC containers run as root
    argv, env = triton_command(spec)
    assert argv == server.command()
    assert env == dict(server.launch.env)


def test_cpu_pod_serves_the_spec_from_its_configmap(bundles):
    bundle = bundles["cpu-hpa"]
    (cm,) = _objects(bundle, "ConfigMap")
    served = spec_from_dict(yaml.safe_load(cm["data"]["spec.yaml"]))
    assert served.serving.host == "0.0.0.0" and served.serving.repository == "/models/triton_repo/smollm2-cpu"
    assert served.serving.frontend.host == "127.0.0.1"  # not exposed without its keys from a Secret
    # rtk serve in the pod ranks tritonserver below its front door, as on a host (the cpu target's default).
    assert served.serving.server_niceness == TARGETS["cpu"].default_server_niceness > 0
    (c,) = _pod_templates(bundle)[0][1]["spec"]["containers"]
    assert c["command"][:3] == ["rtk", "serve", "/etc/rtk/spec.yaml"]
    # rtk serve writes its log and state to a writable emptyDir, not beside the (read-only) repository.
    assert {"name": "RTK_RUN_DIR", "value": "/var/run/rtk"} in c["env"]
    assert {"name": "rtk-run", "mountPath": "/var/run/rtk"} in c["volumeMounts"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert "frontend" not in {p["name"] for p in c["ports"]}
    assert "Dockerfile" in bundle.extra_files and "FROM python:3.11" in bundle.extra_files["Dockerfile"]


def test_front_door_exposed_with_keys_from_a_secret(bundles):
    bundle = bundles["cpu-frontdoor-keda"]
    (svc,) = _objects(bundle, "Service")
    assert {"name": "frontend", "port": 8080, "targetPort": "frontend", "protocol": "TCP"} in svc["spec"]["ports"]
    (c,) = _pod_templates(bundle)[0][1]["spec"]["containers"]
    ref = {"secretKeyRef": {"name": "rtk-keys", "key": "RTK_API_KEYS"}}
    assert {"name": "RTK_API_KEYS", "valueFrom": ref} in c["env"]
    served = spec_from_dict(yaml.safe_load(_objects(bundle, "ConfigMap")[0]["data"]["spec.yaml"]))
    assert served.serving.frontend.host == "0.0.0.0" and served.serving.frontend.api_keys == "env:RTK_API_KEYS"
    (pm,) = _objects(bundle, "PodMonitor")
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics", "frontend"]


def test_gpu_default_image_is_the_ngc_container(bundles):
    from toolkit.targets import NGC_CONTAINER

    (c,) = _pod_templates(bundles["trt-tp2-s3-keda"])[0][1]["spec"]["containers"]
    assert c["image"] == NGC_CONTAINER


def test_object_storage_copies_before_the_server_starts(bundles):
    t = _pod_templates(bundles["trt-tp2-s3-keda"])[0][1]["spec"]
    (init,) = t["initContainers"]
    assert init["command"][-2:] == ["s3://models/llama", "/models"]
    assert init["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert {"name": "models", "emptyDir": {"sizeLimit": "200Gi"}} in t["volumes"]


@pytest.mark.parametrize("case", ["cpu-hpa", "trt-tp8pp2-lws-hpa", "trt-instances-custom"])
def test_hpa_metric_is_the_recorded_signal(bundles, case):
    bundle = bundles[case]
    (rule,) = _objects(bundle, "PrometheusRule")
    (hpa,) = _objects(bundle, "HorizontalPodAutoscaler")
    (pm,) = _objects(bundle, "PodMonitor")
    (recorded,) = rule["spec"]["groups"][0]["rules"]
    adapter = yaml.safe_load(bundle.extra_files["prometheus-adapter-rules.yaml"])["rules"][0]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert adapter["name"] == {"matches": f"^{recorded['record']}$", "as": metric}
    assert adapter["seriesQuery"].startswith(recorded["record"] + "{")
    if CASES[case].get("deploy", {}).get("autoscaling", {}).get("signal") != "custom":
        # The recording reads only this deployment's scrape job (the Prometheus Operator's <namespace>/<PodMonitor>).
        assert f'job="{pm["metadata"]["namespace"]}/{pm["metadata"]["name"]}"' in recorded["expr"]
    target = hpa["spec"]["scaleTargetRef"]
    assert target["kind"] == ("LeaderWorkerSet" if bundle.layout.multi_node else "Deployment")
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 30
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_default_signal_is_waiting_requests(bundles):
    (rule,) = _objects(bundles["cpu-hpa"], "PrometheusRule")
    assert "nv_trt_llm_request_metrics{" in rule["spec"]["groups"][0]["rules"][0]["expr"]
    assert 'request_type="waiting"' in rule["spec"]["groups"][0]["rules"][0]["expr"]


def test_keda_queries_the_recorded_signal(bundles):
    bundle = bundles["trt-tp2-s3-keda"]
    (so,) = _objects(bundle, "ScaledObject")
    (rule,) = _objects(bundle, "PrometheusRule")
    (recorded,) = rule["spec"]["groups"][0]["rules"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1.5"
    assert recorded["record"] in trigger["metadata"]["query"]
    assert f'rtk_deployment="{recorded["labels"]["rtk_deployment"]}"' in trigger["metadata"]["query"]
    hpa_behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert hpa_behavior["scaleDown"]["stabilizationWindowSeconds"] == 300


# -- secrets and bad input through the CLI ---------------------------------------------------------


def _run(tmp_path, monkeypatch, data, *args):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    return CliRunner().invoke(cli, ["deploy", "k8s", str(spec), *args])


def test_hf_token_is_only_a_secret_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    data = CASES["trt-tp8pp2-lws-hpa"]
    result = _run(tmp_path, monkeypatch, data, "-o", "out")
    assert result.exit_code == 0, result.output
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert files
    for p in files:
        assert TOKEN not in p.read_text(), p
    assert TOKEN not in result.output
    ref = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}}
    lws = yaml.safe_load((tmp_path / "out" / "k8s" / "10-leaderworkerset.yaml").read_text())
    for role in ("leaderTemplate", "workerTemplate"):
        env = lws["spec"]["leaderWorkerTemplate"][role]["spec"]["containers"][0]["env"]
        assert ref in env and all("value" not in e for e in env if e["name"] == "HF_TOKEN")
    manifest = json.loads((tmp_path / "out" / "rtk-manifest.json").read_text())
    assert manifest["complete"] and "k8s/10-leaderworkerset.yaml" in manifest["files"]


@pytest.mark.parametrize(
    "deploy, build, field",
    [
        ({"autoscaling": {"min_replicas": 5, "max_replicas": 2}}, {}, "deploy.autoscaling.max_replicas"),
        ({"storage": {"kind": "object-storage", "uri": "ftp://x/y"}}, {}, "deploy.storage.uri"),
        (
            {"resources": {"gpus_per_node": 3}},
            {"tp_size": 4},
            "deploy.resources.gpus_per_node",
        ),  # 4 ranks on 3-GPU nodes
        ({"resources": {"gpus_per_node": 2}}, {"target": "llmapi", "tp_size": 4}, "deploy.resources.gpus_per_node"),
        ({}, {"target": "llmapi"}, "deploy.autoscaling.signal"),  # llmapi exports no nv_trt_llm_request_metrics
        (
            {"secrets": {"frontend_api_keys": "keys"}},
            {"target": "cpu", "max_num_tokens": 512},
            "serving.frontend.api_keys",
        ),
    ],
)
def test_bad_spec_exits_2_naming_the_field_and_writes_nothing(tmp_path, monkeypatch, deploy, build, field):
    data = gpu_spec(**build)
    if data["build"]["target"] == "llmapi":
        data["quantization"] = {"format": "int4_awq"}
    if data["build"]["target"] == "cpu":
        data = {"name": "small", "deploy": deploy}
    data["deploy"] = deploy
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.yaml").write_text("an earlier render\n")
    result = _run(tmp_path, monkeypatch, data, "-o", str(out))
    assert result.exit_code == 2, result.output
    assert f"'{field}'" in result.output
    assert sorted(p.name for p in tmp_path.rglob("*") if p.name != "spec.yaml") == ["keep.yaml", "out"]


def test_output_is_replaced_atomically(tmp_path, monkeypatch):
    first = _run(tmp_path, monkeypatch, CPU, "-o", "out")
    assert first.exit_code == 0, first.output
    (tmp_path / "out" / "stale.yaml").write_text("from an older render\n")
    second = _run(tmp_path, monkeypatch, with_deploy(CPU, autoscaling={"kind": "keda"}), "-o", "out")
    assert second.exit_code == 0, second.output
    names = sorted(p.name for p in (tmp_path / "out" / "k8s").iterdir())
    assert "50-scaledobject.yaml" in names and "50-hpa.yaml" not in names
    assert not (tmp_path / "out" / "stale.yaml").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_examples_render(tmp_path):
    for path in sorted(EXAMPLES.glob("*.yaml")):
        spec = load_spec(path)
        if spec.build.target == "llmapi":  # its Triton model exports no waiting-requests gauge
            with pytest.raises(SpecError, match="deploy.autoscaling.signal"):
                render(spec)
            continue
        bundle = render(spec)
        for obj in bundle.manifests.values():
            validate(obj, KUBERNETES_VERSIONS[-1])


def test_replicas_belong_to_the_autoscaler_when_there_is_one(bundles):
    (dep,) = _objects(bundles["llmapi-none-gs"], "Deployment")
    assert dep["spec"]["replicas"] == 3
    for name in ("cpu-hpa", "trt-tp2-s3-keda"):  # kubectl apply must not reset the count the HPA chose
        (dep,) = _objects(bundles[name], "Deployment")
        assert "replicas" not in dep["spec"]
    (hpa,) = _objects(bundles["cpu-hpa"], "HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)


def test_startup_threshold_rounds_up():
    spec = spec_from_dict({**CPU, "deploy": {"startup_timeout_s": 605}})
    (c,) = _pod_templates(render(spec))[0][1]["spec"]["containers"]
    assert c["startupProbe"]["failureThreshold"] == math.ceil(605 / 10)
