"""``rtk serve --replicas N``: N real tritonservers of one cpu repository on one host, each on its own
ports, recorded in one state file and stopped together (the tiny Llama, the bundled tritonserver)."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest
from click.testing import CliRunner
from conftest import spec_for
from triton_helpers import pid_alive

from toolkit.cli import cli
from toolkit.targets import build
from toolkit.triton.emit import emit
from toolkit.triton.server import free_ports, read_state, read_states, state_path

BUILD = {"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 64, "tokens_per_block": 16}


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("replicas")
    spec = spec_for(
        "tiny",
        tiny_llama_dir,
        quantization={"format": "none"},
        build=BUILD,
        # the front door over the replicas on a free port, not the default 8080 that another process may hold
        serving={"repository": str(root / "repo"), "default_max_tokens": 4, "frontend": {"port": free_ports(1)[0]}},
    )
    shutil.copytree(tiny_llama_dir, root / "quantized" / "hf")
    engine = build(spec, root / "quantized", root / "engine").path
    return emit(spec, engine).path


def _generate(http_url: str) -> str:
    body = json.dumps({"text_input": "hello", "max_tokens": 4, "stream": True}).encode()
    req = urllib.request.Request(
        f"{http_url}/v2/models/ensemble/generate_stream", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        return resp.read().decode()


def test_replicas_need_their_own_ports(repo):
    result = CliRunner().invoke(cli, ["serve", str(repo), "--replicas", "2", "--http-port", "8000", "--detach"])
    assert result.exit_code == 2, result.output
    assert "--http-port" in result.output
    assert read_state(repo) is None


def test_replicas_are_for_the_cpu_target(repo):
    """A GPU target's server owns its GPUs: several on one host are refused (before anything starts)."""
    from pathlib import Path

    from toolkit.errors import UsageError
    from toolkit.spec import BuildSpec, ServingSpec
    from toolkit.targets import TARGETS
    from toolkit.triton import launch

    t = launch.ServeTarget(
        repository=Path(repo),
        target=TARGETS["trt-engine"],
        build=BuildSpec(target="trt-engine"),
        serving=ServingSpec(),
        engine_dir=None,
        models=[],
    )
    with pytest.raises(UsageError, match="instance_count"):
        launch.make_replicas(t, 2)
    cpu = launch.resolve(repo)
    servers = launch.make_replicas(cpu, 3)
    ports = [p for s in servers for p in (s.http_port, s.grpc_port, s.metrics_port)]
    assert len(set(ports)) == 9
    prefixes = [a for s in servers for a in s.extra_args if "shm-region-prefix-name" in a]
    assert len(set(prefixes)) == 3


@pytest.mark.slow
@pytest.mark.integration
def test_two_replicas_serve_and_stop_together(repo):
    runner = CliRunner()
    result = runner.invoke(cli, ["serve", str(repo), "--replicas", "2", "--detach", "--timeout", "300"])
    try:
        assert result.exit_code == 0, result.output
        states = read_states(repo)
        assert len(states) == 2
        assert len({st.pid for st in states}) == 2
        ports = [p for st in states for p in (st.http_port, st.grpc_port, st.metrics_port)]
        assert len(set(ports)) == 6
        assert json.loads(state_path(repo).read_text())["replicas"][1]["pid"] == states[1].pid
        for st in states:
            assert f"pid {st.pid}" in result.output and st.http_url in result.output
            assert pid_alive(st.pid)
            assert '"text_output"' in _generate(st.http_url)
            metrics = urllib.request.urlopen(st.metrics_url, timeout=10).read().decode()
            assert "nv_trt_llm_request_metrics{" in metrics  # each replica exports the autoscaling signal
        # A second start is refused while the replicas run.
        again = runner.invoke(cli, ["serve", str(repo), "--detach", "--timeout", "60"])
        assert again.exit_code == 4 and "already serves" in again.output
    finally:
        stopped = runner.invoke(cli, ["serve", str(repo), "--stop"])
    assert stopped.exit_code == 0, stopped.output
    assert all(str(st.pid) in stopped.output for st in states)
    assert not any(pid_alive(st.pid) for st in states)
    assert read_states(repo) == [] and not state_path(repo).exists()


def test_run_dir_moves_state_and_logs_off_the_repository(tmp_path, monkeypatch):
    """In a pod the repository's volume is read-only: RTK_RUN_DIR takes the state file and the logs."""
    from toolkit.triton.server import TritonServer

    repo = tmp_path / "models" / "triton_repo" / "tiny"
    repo.mkdir(parents=True)
    monkeypatch.delenv("RTK_RUN_DIR", raising=False)
    assert state_path(repo) == repo.parent / ".rtk-triton" / "tiny.json"
    monkeypatch.setenv("RTK_RUN_DIR", str(tmp_path / "run"))
    assert state_path(repo) == tmp_path / "run" / "tiny.json"
    server = TritonServer(repo, http_port=18000, grpc_port=18001, metrics_port=18002)
    assert server.log_path == tmp_path / "run" / "tiny-18000.log"
