"""toolkit/triton/launch.py: every way of serving reads how to launch from the repository's manifest.

The fast tests write the manifest an emit leaves (``rtk-manifest.json`` with the spec sections) for
GPU specs, since a GPU repository cannot be served here; the launch they resolve is what tritonserver
would be started with.  The slow test serves the tiny model for ``rtk slo --serve``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from conftest import spec_for

from toolkit.artifacts import MANIFEST
from toolkit.cli import cli
from toolkit.errors import UsageError
from toolkit.spec import spec_from_dict
from toolkit.triton import launch
from toolkit.triton.emit import REPOSITORY_FORMAT, SERVER_ONLY_FIELDS
from toolkit.triton.server import TritonBinary


def emitted_repo(root: Path, target: str = "trt-engine", *, fmt: int | None = REPOSITORY_FORMAT, **sections) -> Path:
    """A repository directory with the manifest emit writes for this spec (models are not needed to resolve it)."""
    data = {"name": "g", "build": {"target": target}}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    spec = spec_from_dict(data)
    repo = root / "repo"
    repo.mkdir(parents=True)
    manifest = {
        "complete": True,
        "stage": "emit",
        "target": target,
        "models": ["tensorrt_llm"],
        "files": {},
        "rtk_version": "0.1.0",
        "inputs": {"engine_dir": str(root / "engine")},
        "spec": {
            "name": "g",
            "build": spec.build.model_dump(),
            "serving": spec.serving.model_dump(exclude=SERVER_ONLY_FIELDS),
        },
    }
    if fmt is not None:
        manifest["repository_format"] = fmt
    (repo / MANIFEST).write_text(json.dumps(manifest))
    return repo


def command_of(repo: Path) -> tuple[list[str], dict]:
    server = launch.make_server(launch.resolve(repo))
    server._binary = TritonBinary(path=Path("tritonserver"), kind="configured")
    return server.command(), server.environment()


def test_a_repository_served_by_its_path_launches_its_ranks_under_mpirun(tmp_path):
    argv, _ = command_of(emitted_repo(tmp_path, build={"tp_size": 2}))
    assert argv[0] == "mpirun" and argv.count("tritonserver") == 2 and "--load-model=tensorrt_llm" in argv


def test_several_instances_on_one_gpu_each_run_in_orchestrator_mode(tmp_path):
    argv, env = command_of(emitted_repo(tmp_path, serving={"instance_count": 2}))
    assert argv[0] == "tritonserver" and env["TRTLLM_ORCHESTRATOR"] == "1"
    assert "--cuda-memory-pool-byte-size=1:0" in argv and "--disable-auto-complete-config" in argv


@pytest.mark.parametrize("target, niceness", [("cpu", 5), ("trt-engine", 0)])
def test_a_repository_served_by_its_path_gets_its_targets_server_niceness(tmp_path, target, niceness):
    # the manifest records no server-only field, so the target's default applies
    assert launch.make_server(launch.resolve(emitted_repo(tmp_path, target))).niceness == niceness


def test_a_repository_from_an_older_rtk_is_refused_with_what_to_rerun(tmp_path):
    repo = emitted_repo(tmp_path, "cpu", fmt=None)  # written before repository_format existed
    with pytest.raises(UsageError, match=r"repository format 1.*Re-run `rtk emit SPEC`"):
        launch.resolve(repo)


def test_server_only_settings_need_no_new_emit_but_repository_settings_do(tmp_path):
    repo = emitted_repo(tmp_path, "cpu")
    spec = {"name": "g", "serving": {"repository": str(repo)}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**spec, "serving": {**spec["serving"], "http_port": 9100, "grpc_port": 9101}}))
    t = launch.resolve(path)
    assert (t.serving.http_port, t.serving.grpc_port) == (9100, 9101)
    path.write_text(yaml.safe_dump({**spec, "serving": {**spec["serving"], "server_niceness": 2}}))
    assert launch.make_server(launch.resolve(path)).niceness == 2
    path.write_text(yaml.safe_dump({**spec, "serving": {**spec["serving"], "default_max_tokens": 7}}))
    with pytest.raises(UsageError, match="other serving settings"):
        launch.resolve(path)


@pytest.mark.slow
@pytest.mark.integration
def test_rtk_slo_serve_starts_the_server_as_rtk_serve_does(tmp_path, tiny_llama_dir):
    from toolkit.targets import build
    from toolkit.triton.emit import emit

    spec = spec_for(
        "tiny-slo",
        tiny_llama_dir,
        quantization={"format": "none"},
        build={
            "max_batch_size": 2,
            "max_input_len": 64,
            "max_seq_len": 128,
            "max_num_tokens": 64,
            "tokens_per_block": 16,
        },
        serving={"repository": str(tmp_path / "repo"), "default_max_tokens": 16},
    )
    shutil.copytree(tiny_llama_dir, tmp_path / "quantized" / "hf")
    emit(spec, build(spec, tmp_path / "quantized", tmp_path / "engine").path)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    r = CliRunner().invoke(
        cli,
        [
            "slo",
            str(spec_path),
            "--serve",
            "--concurrency",
            "1",
            "--num-requests",
            "3",
            "--warmup-requests",
            "0",
            "--input-tokens",
            "8",
            "--output-tokens",
            "4",
            "--max-schedule-lag-ms",
            "1000",
            "-o",
            str(tmp_path / "report"),
            "--no-plots",
            "--objective",
            "ttft:p50<=60000",
        ],
    )
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["summary"]["succeeded"] == 3
