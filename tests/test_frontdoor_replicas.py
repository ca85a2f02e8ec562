"""One front door over several tritonservers (``rtk serve --replicas N``; toolkit/frontdoor/replicas.py).

Real tritonservers, each serving the fake streaming LLM (tests/triton_helpers.py) as its ``ensemble``;
Triton, its gRPC streams, its metrics, uvicorn and HTTP are real.  Which replica answered is read from each
server's own request counter (``nv_inference_request_success``), and from the front door's per-replica
series.  The routing rules themselves are checked without a server first.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from click.testing import CliRunner
from triton_helpers import pid_alive, running_server, write_fake_llm

from toolkit.frontdoor import FrontDoorConfig, FrontDoorServer, create_app
from toolkit.frontdoor.admission import Estimator
from toolkit.frontdoor.replicas import Replica, Router, replica_urls
from toolkit.spec import GuardSpec

MODEL = "fake"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout_s: float, what: str):
    """Poll ``condition`` until it returns a true value (returned) or ``timeout_s`` passes (fails naming ``what``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


# -- the routing rules, without a server ------------------------------------------------------------------------


class _Backend:
    """What the router reads of a replica's backend."""

    def __init__(self, ready: bool = True):
        self.ready, self.gauges = ready, None


def _router(*ready: bool) -> Router:
    return Router([Replica(str(i), _Backend(r), Estimator()) for i, r in enumerate(ready)])


def test_the_lowest_prediction_wins_ties_go_round_robin_and_unready_replicas_get_nothing():
    router = _router(True, True, True)
    assert [router.pick(10)[0].label for _ in range(6)] == ["0", "1", "2", "0", "1", "2"]  # equal: in turn
    router.replicas[1].estimator.prefill_s_per_token = 0.001  # faster prefill: the lowest prediction
    assert {router.pick(10)[0].label for _ in range(4)} == {"1"}
    router.replicas[1].backend.ready = False
    assert {router.pick(10)[0].label for _ in range(4)} == {"0", "2"}
    for r in router.replicas:
        r.backend.ready = False
    assert router.pick(10) is None and not router.any_ready()


def test_a_tie_never_goes_past_the_deadline_the_best_replica_meets():
    router = _router(True, True)
    router.replicas[0].estimator.prefill_s_per_token = 0.0019  # 0.0690 s against 0.0700 s at 10 tokens
    best = router.replicas[0].estimator.predict(10).ttft_s
    other = router.replicas[1].estimator.predict(10).ttft_s
    assert best < other <= best * 1.05 + 0.001  # a tie without a deadline: both get requests
    assert {router.pick(10)[0].label for _ in range(4)} == {"0", "1"}
    assert {router.pick(10, deadline_s=(best + other) / 2)[0].label for _ in range(4)} == {"0"}


def test_a_replica_whose_predictions_have_come_late_is_compared_by_its_widened_bound():
    """Equal predictions, but replica 0's recent first tokens came at twice its predictions: its bound (what the
    deadline is checked against) is twice replica 1's, so replica 1 gets the requests, not the two in turn."""
    from test_frontdoor_units import _served

    from toolkit.frontdoor.admission import MIN_ERROR_SAMPLES

    router = _router(True, True)
    late = router.replicas[0].estimator
    late.alpha = 0.0  # its speed estimates stay put: only its error moves
    for i in range(MIN_ERROR_SAMPLES):
        _served(late, f"r{i}", 2.0)
    assert late.predict(10).ttft_s == router.replicas[1].estimator.predict(10).ttft_s
    assert late.margin() == pytest.approx(2.0, rel=1e-3)
    assert {router.pick(10)[0].label for _ in range(4)} == {"1"}


def test_replica_addresses_are_checked_naming_the_field():
    assert replica_urls("h:1", "http://h:2/metrics") == [("h:1", "http://h:2/metrics")]
    assert replica_urls(["h:1", "h:3"], None) == [("h:1", None), ("h:3", None)]
    with pytest.raises(ValueError, match="metrics_url: give one per replica"):
        replica_urls(["h:1", "h:3"], ["http://h:2/metrics"])
    with pytest.raises(ValueError, match="triton_grpc_url: h:1 is listed twice"):
        replica_urls(["h:1", "grpc://h:1"], None)
    with pytest.raises(ValueError, match="triton_grpc_url"):
        replica_urls([], None)


def test_the_front_door_process_wants_one_metrics_url_per_replica(capsys):
    from toolkit.frontdoor.__main__ import main

    code = main(["repo", "--triton-grpc", "h:1", "--triton-grpc", "h:3", "--metrics-url", "http://h:2/metrics"])
    assert code == 2 and "--metrics-url: give one per --triton-grpc" in capsys.readouterr().err


# -- through real tritonservers ---------------------------------------------------------------------------------


def _server_repo(root: Path, name: str, **fake) -> Path:
    repo = root / name
    write_fake_llm(repo, "ensemble", **fake)
    return repo


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two fast replicas (first token after 50 ms) and a slow one (after 600 ms), for the module."""
    root = tmp_path_factory.mktemp("fd_replicas")
    with (
        running_server(_server_repo(root, "fast_a", ttft_ms=50, itl_ms=5)) as a,
        running_server(_server_repo(root, "fast_b", ttft_ms=50, itl_ms=5)) as b,
        running_server(_server_repo(root, "slow", ttft_ms=600, itl_ms=5)) as slow,
    ):
        yield {"a": a, "b": b, "slow": slow, "root": root}


def front_door(triton_servers, **guard) -> FrontDoorServer:
    cfg = FrontDoorConfig(model_name=MODEL, guard=GuardSpec(**guard), max_seq_len=8192, default_max_tokens=4)
    app = create_app(cfg, [s.grpc_url for s in triton_servers], metrics_url=[s.metrics_url for s in triton_servers])
    return FrontDoorServer(app, "127.0.0.1", free_port())


def triton_successes(server) -> int:
    """Requests the tritonserver's ``ensemble`` answered, by its own metrics."""
    text = httpx.get(server.metrics_url, timeout=10).text
    m = re.search(r'^nv_inference_request_success\{[^}]*model="ensemble"[^}]*\} (\d+)', text, re.MULTILINE)
    return int(m.group(1)) if m else 0


def triton_ended(server) -> int:
    """Requests of the tritonserver's ``ensemble`` that ended, answered or not, by its own metrics."""
    text = httpx.get(server.metrics_url, timeout=10).text
    pattern = r'^nv_inference_request_(?:success|failure)\{[^}]*model="ensemble"[^}]*\} (\d+)'
    return sum(int(n) for n in re.findall(pattern, text, re.MULTILINE))


def fd_metric(url: str, name: str, replica: str | None = None) -> float:
    series = name + (f'{{replica="{replica}"}}' if replica is not None else "")
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} is not in the front door's /metrics")


def chat(url: str, text: str = "hello there") -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def chats(url: str, n: int) -> list[httpx.Response]:
    """``n`` requests sent at once."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: chat(url, f"question {i}"), range(n)))


def assert_answered(responses: list[httpx.Response]) -> None:
    for r in responses:
        assert r.status_code == 200, r.text
        assert r.headers["x-rtk-tier"] == "primary" and r.json()["choices"][0]["message"]["content"]


def counts(servers_: list) -> list[int]:
    return [triton_successes(s) for s in servers_]


def wait_for_counts(servers_: list, before: list[int], total: int) -> list[int]:
    """Each server's new requests once ``total`` have been counted (Triton counts a request when it is released,
    a moment after its final response)."""

    def added():
        now = [c - b for c, b in zip(counts(servers_), before, strict=True)]
        return now if sum(now) >= total else None

    got = wait_until(added, 10, f"{total} requests in the replicas' Triton metrics")
    assert sum(got) == total, got
    return got


@pytest.mark.integration
def test_requests_are_spread_over_two_replicas(servers):
    a, b = servers["a"], servers["b"]
    with front_door([a, b]) as fd:
        health = httpx.get(fd.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["replicas_ready"] == 2, health.text
        before = counts([a, b])
        responses = chats(fd.url, 8) + chats(fd.url, 8)
        assert_answered(responses)
        on_a, on_b = wait_for_counts([a, b], before, 16)
        # Concurrent requests wait on the replica they went to, so the next one predicts lower on the other.
        assert on_a >= 3 and on_b >= 3, (on_a, on_b)
        assert fd_metric(fd.url, "rtk_frontdoor_replica_requests_total", "0") == on_a
        assert fd_metric(fd.url, "rtk_frontdoor_replica_requests_total", "1") == on_b
        assert fd_metric(fd.url, "rtk_frontdoor_inflight") == 0
        assert fd_metric(fd.url, "rtk_frontdoor_triton_ready") == 1


@pytest.mark.integration
def test_the_replica_with_the_lower_predicted_ttft_gets_the_requests(servers):
    """The slow replica is listed first, so the first request (equal predictions: round robin) goes to it; once
    its first token took 600 ms its prediction is higher and the fast replica takes the requests."""
    slow, fast = servers["slow"], servers["a"]
    with front_door([slow, fast]) as fd:
        before = counts([slow, fast])
        assert_answered([chat(fd.url, f"question {i}") for i in range(10)])
        on_slow, on_fast = wait_for_counts([slow, fast], before, 10)
        assert on_slow <= 2 and on_fast >= 8, (on_slow, on_fast)
        slow_prefill = fd_metric(fd.url, "rtk_frontdoor_replica_prefill_seconds_per_token", "0")
        fast_prefill = fd_metric(fd.url, "rtk_frontdoor_replica_prefill_seconds_per_token", "1")
        assert slow_prefill > fast_prefill


@pytest.mark.integration
def test_a_client_that_leaves_cancels_its_request_on_the_replica_it_went_to(servers):
    """8000 tokens at 5 ms each would take 40 s: the replica ends the request within seconds only because the
    front door cancelled it there."""
    a, b = servers["a"], servers["b"]
    with front_door([a, b]) as fd:
        before = [triton_ended(a), triton_ended(b)]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 8000, "stream": True}
        with (
            httpx.Client(base_url=fd.url, timeout=30) as c,
            c.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # leave after the first token

        def ended():
            now = [triton_ended(a) - before[0], triton_ended(b) - before[1]]
            return now if sum(now) else None

        assert sorted(wait_until(ended, 10, "the replica to end the request")) == [0, 1]
        wait_until(lambda: fd_metric(fd.url, "rtk_frontdoor_cancelled_total") == 1, 10, "the cancellation count")
        assert fd_metric(fd.url, "rtk_frontdoor_replica_inflight", "0") == 0
        assert fd_metric(fd.url, "rtk_frontdoor_replica_inflight", "1") == 0


@pytest.mark.integration
def test_a_stopped_replica_gets_nothing_and_health_counts_the_ready_ones(servers):
    a = servers["a"]
    with running_server(_server_repo(servers["root"], "doomed", ttft_ms=50, itl_ms=5)) as doomed:
        with front_door([a, doomed]) as fd:
            before = counts([a, doomed])
            assert_answered(chats(fd.url, 8))
            assert all(wait_for_counts([a, doomed], before, 8)), "both replicas take requests while ready"
            # SIGTERM: Triton reports not ready while it shuts down; the front door then closes its idle streams
            # to it, so it exits by itself (it waits for open streams, and would be killed after 12 s).
            assert doomed.stop() == 0

            def one_ready():
                h = httpx.get(fd.url + "/health", timeout=10)
                return h if h.json()["replicas_ready"] == 1 else None

            health = wait_until(one_ready, 10, "/health to count one ready replica")
            body = health.json()
            assert health.status_code == 200 and body["ready"] is True and body["reason"] == "1 of 2 replicas ready"
            assert [r["ready"] for r in body["replicas"]] == [True, False] and body["replicas"][1]["reason"]
            assert fd_metric(fd.url, "rtk_frontdoor_replica_ready", "1") == 0
            assert fd_metric(fd.url, "rtk_frontdoor_replica_ready", "0") == 1
            assert fd_metric(fd.url, "rtk_frontdoor_triton_ready") == 1

            routed = fd_metric(fd.url, "rtk_frontdoor_replica_requests_total", "1")
            on_a = triton_successes(a)
            assert_answered(chats(fd.url, 4) + [chat(fd.url) for _ in range(4)])
            wait_until(lambda: triton_successes(a) - on_a >= 8, 10, "8 more requests on the live replica")
            assert triton_successes(a) - on_a == 8
            assert fd_metric(fd.url, "rtk_frontdoor_replica_requests_total", "1") == routed  # nothing was sent


@pytest.mark.integration
def test_a_replica_that_dies_between_health_checks_costs_no_request(servers):
    """Health is read every 10 s here, so the front door learns that the replica is gone from the requests
    sent to it: each one goes to the live replica instead, and the dead one is marked not ready at once."""
    a = servers["a"]
    with running_server(_server_repo(servers["root"], "dies", ttft_ms=50, itl_ms=5)) as dies:
        with front_door([a, dies], metrics_poll_ms=10_000) as fd:
            before = counts([a, dies])
            assert_answered(chats(fd.url, 8))
            assert all(wait_for_counts([a, dies], before, 8)), "both replicas take requests while ready"
            os.killpg(dies.process.pid, signal.SIGKILL)  # tritonserver and its python stubs, at once
            dies.process.wait()
            # At once, so that some go to the dead replica (one waiting on the live replica predicts later).
            assert_answered(chats(fd.url, 8))
            assert fd_metric(fd.url, "rtk_frontdoor_replica_unreachable_total", "1") >= 1
            assert fd_metric(fd.url, "rtk_frontdoor_replica_ready", "1") == 0
            health = httpx.get(fd.url + "/health", timeout=10).json()
            assert health["replicas_ready"] == 1 and "could not be reached" in health["replicas"][1]["reason"]


def test_health_is_503_and_requests_are_refused_when_no_replica_is_ready():
    """Two addresses nobody listens on: the front door starts, says why it cannot serve, and refuses (503)."""
    from types import SimpleNamespace

    dead = [SimpleNamespace(grpc_url=f"127.0.0.1:{free_port()}", metrics_url=None) for _ in range(2)]
    with front_door(dead) as fd:
        health = httpx.get(fd.url + "/health", timeout=10)
        body = health.json()
        assert health.status_code == 503 and body["ready"] is False and body["replicas_ready"] == 0
        assert body["reason"].startswith("no replica is ready (replica 0: ")
        r = chat(fd.url)
        assert r.status_code == 503 and r.headers["x-rtk-tier"] == "refused" and "Retry-After" in r.headers
        assert "no replica is ready" in r.json()["error"]["message"]
        assert fd_metric(fd.url, "rtk_frontdoor_triton_ready") == 0


# -- rtk serve --replicas 2 --detach ------------------------------------------------------------------------------


def tiny_spec(root: Path) -> Path:
    """A spec whose emitted cpu repository holds the fake LLM as its ``ensemble``, with the manifest an emit
    leaves, so ``rtk serve`` starts it as it starts a built one (no engine to build)."""
    from toolkit.artifacts import MANIFEST
    from toolkit.spec import spec_from_dict
    from toolkit.triton.emit import REPOSITORY_FORMAT, SERVER_ONLY_FIELDS

    repo = _server_repo(root, "repo", ttft_ms=5, itl_ms=5)
    data = {
        "name": "tiny-replicas",
        "build": {"target": "cpu"},
        "serving": {"repository": str(repo), "warmup": False, "frontend": {"port": free_port(), "model_name": MODEL}},
    }
    spec = spec_from_dict(data)
    manifest = {
        "complete": True,
        "stage": "emit",
        "target": "cpu",
        "repository_format": REPOSITORY_FORMAT,
        "models": ["ensemble"],
        "files": {},
        "rtk_version": "0.1.0",
        "inputs": {},
        "spec": {
            "name": spec.name,
            "build": spec.build.model_dump(),
            "serving": spec.serving.model_dump(exclude=SERVER_ONLY_FIELDS),
        },
    }
    (repo / MANIFEST).write_text(json.dumps(manifest))
    path = root / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.integration
def test_rtk_serve_replicas_detached_records_and_stops_one_front_door(tmp_path):
    from toolkit.cli import cli
    from toolkit.triton.server import read_state, read_states, state_path

    spec = tiny_spec(tmp_path)
    repo = tmp_path / "repo"
    runner = CliRunner()
    result = runner.invoke(cli, ["serve", str(spec), "--replicas", "2", "--detach", "--timeout", "120"])
    states = read_states(repo)
    try:
        assert result.exit_code == 0, result.output
        assert len(states) == 2 and states[0].frontdoor_pid and states[0].frontdoor_url
        assert states[1].frontdoor_pid is None  # one front door, recorded once
        assert read_state(repo).frontdoor_url == states[0].frontdoor_url  # where rtk chat / slo look
        fd = states[0].frontdoor_url
        assert f"front door (pid {states[0].frontdoor_pid}): OpenAI {fd}/v1 over 2 replicas" in result.output
        health = httpx.get(fd + "/health", timeout=10).json()
        assert health["ready"] is True and health["replicas_ready"] == 2, health
        before = counts(states)
        assert_answered(chats(fd, 4))
        assert sum(wait_for_counts(states, before, 4)) == 4
        # Hot reload swaps one server behind its front door; replicas are refused before anything starts.
        reload = runner.invoke(cli, ["serve", str(spec), "--reload"])
        assert reload.exit_code == 2 and "2 replicas" in reload.output and "--replicas 2" in reload.output
    finally:
        stopped = runner.invoke(cli, ["serve", str(spec), "--stop"])
    assert stopped.exit_code == 0, stopped.output
    assert f"front door (pid {states[0].frontdoor_pid})" in stopped.output
    assert not any(pid_alive(pid) for pid in [states[0].frontdoor_pid, *(st.pid for st in states)])
    assert not state_path(repo).exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(fd + "/health", timeout=2)


@pytest.mark.integration
def test_rtk_serve_replicas_in_the_foreground_serves_through_one_front_door_until_stopped(tmp_path):
    import queue
    import subprocess
    import sys
    import threading

    spec = tiny_spec(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit.cli", "serve", str(spec), "--replicas", "2", "--timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any("over 2 replicas" in line for line in seen):
            try:
                seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail("rtk serve --replicas 2 was not ready within 120 s:\n" + "".join(seen))
        out = "".join(seen)
        assert out.count("ready: replica ") == 2, out
        url = re.search(r"OpenAI (\S+)/v1 over 2 replicas", out).group(1)
        replica_urls_ = re.findall(r"ready: replica \d: HTTP (\S+)", out)
        assert httpx.get(url + "/health", timeout=10).json()["replicas_ready"] == 2
        assert_answered(chats(url, 2))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("rtk serve --replicas 2 did not stop within 60 s of SIGTERM")
    assert proc.returncode == 0
    for gone in [url + "/health", *(u + "/v2/health/ready" for u in replica_urls_)]:
        with pytest.raises(httpx.HTTPError):
            httpx.get(gone, timeout=2)
