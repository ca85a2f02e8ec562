"""``rtk serve --reload``: blue/green behind the front door, with real tritonservers on the tiny Llama.

The repository is rebuilt from another checkpoint (another seed: another greedy answer), so which model
answered is visible in the text; which server answered is read from each server's own request counter.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import httpx
import pytest
import yaml
from click.testing import CliRunner
from conftest import make_tiny_llama, spec_for
from triton_helpers import model_successes, pid_alive

from toolkit.cli import cli
from toolkit.errors import UsageError
from toolkit.slo.runner import Target
from toolkit.spec import load_spec
from toolkit.targets import build
from toolkit.triton import launch
from toolkit.triton.emit import emit
from toolkit.triton.server import ServerState, free_ports, read_state, read_states, state_path, write_states

BUILD = {"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 1024, "max_num_tokens": 64, "tokens_per_block": 16}
LONG = 900  # tokens: a stream that lasts seconds on the tiny model, so the swap happens during it
PROMPT = "Once upon a time"


def _spec(root: Path, checkpoint: Path, **serving):
    http, grpc, metrics, front = free_ports(4)
    return spec_for(
        "tiny-reload",
        checkpoint,
        quantization={"format": "none"},
        build=BUILD,
        serving={
            "repository": str(root / "repo"),
            "http_port": http,
            "grpc_port": grpc,
            "metrics_port": metrics,
            "default_max_tokens": 8,
            "frontend": {"port": front},
            **serving,
        },
    )


def _rebuild(spec, root: Path, checkpoint: Path) -> Path:
    """What `rtk build SPEC` does after the checkpoint changed: new engine and repository, each renamed into place."""
    hf = root / "quantized" / "hf"
    shutil.rmtree(hf, ignore_errors=True)
    shutil.copytree(checkpoint, hf)
    # force: without a quantize manifest the build's cache key is the files' sizes and mtimes (whole seconds),
    # which two tiny checkpoints written within one second share.
    engine = build(spec, root / "quantized", root / "engine", force=True).path
    return emit(spec, engine).path


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_dir, smollm2_tokenizer_dir):
    root = tmp_path_factory.mktemp("reload")
    spec = _spec(root, tiny_llama_dir)
    repo = _rebuild(spec, root, tiny_llama_dir)
    spec_path = root / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    other = make_tiny_llama(root / "seed1", smollm2_tokenizer_dir, seed=1)
    started = CliRunner().invoke(cli, ["serve", str(spec_path), "--detach", "--timeout", "300"])
    assert started.exit_code == 0, started.output
    try:
        yield dict(spec=spec, spec_path=spec_path, repo=repo, root=root, other=other, first=tiny_llama_dir)
    finally:
        launch.stop_all(spec_path)


def _complete(fd_url: str, max_tokens: int) -> dict:
    body = {"model": "tiny-reload", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(fd_url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _stream(fd_url: str, max_tokens: int, first: threading.Event, out: dict) -> None:
    body = {"model": "tiny-reload", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    text, reason = [], None
    try:
        with httpx.stream("POST", fd_url + "/v1/completions", json=body, timeout=300) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                c = json.loads(line[6:])
                assert "error" not in c, c
                choice = c["choices"][0]
                text.append(choice.get("text") or "")
                reason = choice.get("finish_reason") or reason
                first.set()
    finally:
        out.update(text="".join(text), finish_reason=reason)
        first.set()


def _successes(st: ServerState) -> int:
    """Requests this server's tensorrt_llm answered (the front door sends there; Triton's own count)."""
    return model_successes(st.http_url, "tensorrt_llm")


def _servers_of(repo: Path) -> list[int]:
    """Every tritonserver process on this host serving ``repo``."""
    flag = f"--model-repository={Path(repo).resolve()}".encode()
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if flag in p.joinpath("cmdline").read_bytes().split(b"\0"):
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


@pytest.mark.slow
@pytest.mark.integration
def test_a_broken_build_leaves_the_old_server_answering(served):
    old = read_state(served["repo"])
    before = _complete(old.frontdoor_url, 8)
    config = served["root"] / "engine" / "engine_config.json"
    good = config.read_text()
    broken = config.with_name(".engine_config.json.broken")
    broken.write_text(json.dumps({**json.loads(good), "format_from_the_future": 99}))
    broken.replace(config)  # as a build would: a new file, never the loaded one edited in place
    try:
        result = CliRunner().invoke(cli, ["serve", str(served["spec_path"]), "--reload", "--timeout", "300"])
    finally:
        config.write_text(good)
    assert result.exit_code == 4, result.output
    assert "keeps serving" in result.output and old.http_url in result.output
    assert read_states(served["repo"]) == [old]
    assert _servers_of(served["repo"]) == [old.pid]  # the new server was stopped
    assert _complete(old.frontdoor_url, 8)["text"] == before["text"]


@pytest.mark.slow
@pytest.mark.integration
def test_reload_swaps_servers_while_a_stream_finishes_on_the_old_one(served):
    old = read_state(served["repo"])
    fd = old.frontdoor_url
    before_long = _complete(fd, LONG)
    before = _complete(fd, 8)
    _rebuild(served["spec"], served["root"], served["other"])

    first, streamed, thread = threading.Event(), {}, None

    def start_stream(server):
        nonlocal thread
        assert server.http_port != old.http_port
        # It loaded at a lower CPU priority, and serves at the old one's (niceness, and the autogroup's).
        assert os.getpriority(os.PRIO_PGRP, server.process.pid) == os.getpriority(os.PRIO_PROCESS, old.pid)
        groups = [Path(f"/proc/{pid}/autogroup") for pid in (server.process.pid, old.pid)]
        if all(g.exists() for g in groups):
            assert groups[0].read_text().split()[-1] == groups[1].read_text().split()[-1]
        thread = threading.Thread(target=_stream, args=(fd, LONG, first, streamed), daemon=True)
        thread.start()
        assert first.wait(60), "no first token before the swap"

    result = launch.reload(served["spec_path"], ready_timeout_s=300, on_ready=start_stream)
    thread.join(120)
    # The stream in flight at the swap finished on the old server, with the old model's whole answer.
    assert result.in_flight == 1 and result.drained
    assert streamed["status"] == 200 and streamed["finish_reason"] == "length"
    assert streamed["text"] == before_long["text"]
    # The state file names the new server (same front door); the old tritonserver is gone.
    new = read_state(served["repo"])
    assert len(read_states(served["repo"])) == 1
    assert (new.pid, new.http_port) == (result.new.pid, result.new.http_port) != (old.pid, old.http_port)
    assert (new.frontdoor_pid, new.frontdoor_url) == (old.frontdoor_pid, old.frontdoor_url)
    assert not pid_alive(old.pid) and _servers_of(served["repo"]) == [new.pid]
    # A request after the swap is answered by the new server, with the rebuilt model.
    counted = _successes(new)
    after = _complete(fd, 8)
    assert _successes(new) == counted + 1
    assert after["text"] != before["text"]
    # `rtk slo SPEC` loads the new server; `rtk serve --stop` stops it (both through the state file).
    loaded = load_spec(served["spec_path"])
    assert Target.from_spec(loaded, loaded.slo).url == new.grpc_url != served["spec"].serving.grpc_url
    stopped = CliRunner().invoke(cli, ["serve", str(served["spec_path"]), "--stop"])
    assert stopped.exit_code == 0 and str(new.pid) in stopped.output, stopped.output
    assert not pid_alive(new.pid) and not state_path(served["repo"]).exists()


# -- refused before anything starts ------------------------------------------------------------------------------


def test_reload_flags_that_do_not_combine():
    runner = CliRunner()
    for extra in (["--detach"], ["--stop"], ["--http-port", "9000"], ["--replicas", "2"]):
        result = runner.invoke(cli, ["serve", ".", "--reload", *extra])
        assert result.exit_code == 2 and extra[0] in result.output, result.output


@pytest.fixture(scope="module")
def idle(tmp_path_factory, tiny_llama_dir):
    """A repository with no server running."""
    root = tmp_path_factory.mktemp("reload-idle")
    spec = _spec(root, tiny_llama_dir)
    repo = _rebuild(spec, root, tiny_llama_dir)
    spec_path = root / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return dict(repo=repo, spec_path=spec_path)


def test_reload_needs_a_running_server(idle):
    result = CliRunner().invoke(cli, ["serve", str(idle["spec_path"]), "--reload"])
    assert result.exit_code == 2 and "--detach" in result.output and "no detached server" in result.output


def test_reload_needs_the_front_door(idle):
    result = CliRunner().invoke(
        cli, ["serve", str(idle["spec_path"]), "--reload", "--set", "serving.frontend.enabled=false"]
    )
    assert result.exit_code == 2 and "serving.frontend.enabled is false" in result.output, result.output


def test_reload_refuses_replicas_and_an_unfinished_reload(idle):
    repo = idle["repo"]

    def state(pid, frontdoor_pid=None):
        return ServerState(pid, str(repo), "tritonserver", "127.0.0.1", 1, 2, 3, "log", 0.0, None, frontdoor_pid)

    try:
        write_states(repo, [state(1), state(2)])
        result = CliRunner().invoke(cli, ["serve", str(repo), "--reload"])
        assert result.exit_code == 2 and "2 replicas" in result.output, result.output
        write_states(repo, [state(1, 11), state(2, 11)])
        result = CliRunner().invoke(cli, ["serve", str(repo), "--reload"])
        assert result.exit_code == 2 and "interrupted" in result.output, result.output
    finally:
        state_path(repo).unlink()
    assert not _servers_of(repo)  # nothing was started


def _gpu_target(repo, target: str, **build) -> launch.ServeTarget:
    """A ServeTarget for a GPU target's repository (never started: only the refusals are checked)."""
    from toolkit.spec import BuildSpec, ServingSpec
    from toolkit.targets import TARGETS

    return launch.ServeTarget(
        repository=Path(repo),
        target=TARGETS[target],
        build=BuildSpec(target=target, **build),
        serving=ServingSpec(),
        engine_dir=None,
        models=[],
    )


def test_reload_refuses_a_multi_rank_deployment(idle):
    t = _gpu_target(idle["repo"], "trt-engine", tp_size=2)
    assert t.launch().uses_mpi
    with pytest.raises(UsageError, match="MPI with 2 rank"):
        launch._swappable(t, idle["repo"])


def test_reload_refuses_the_llmapi_target(idle):
    with pytest.raises(UsageError, match="no ensemble"):
        launch._swappable(_gpu_target(idle["repo"], "llmapi"), idle["repo"])
