"""toolkit/triton/server.py against a real tritonserver (the bundled one on CPU hosts)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from triton_helpers import running_server, write_echo_model, write_python_model

from toolkit.errors import ServerError, UsageError
from toolkit.triton import server as server_module
from toolkit.triton.server import (
    TritonServer,
    find_tritonserver,
    free_ports,
    log_tail,
    prepare_bundled_backends,
    read_state,
    state_path,
    stop_detached,
)

pytestmark = pytest.mark.integration


def _listening_addresses(pid: int) -> set[str]:
    """Local addresses of the TCP sockets ``pid`` listens on (from /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A = LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            raw = bytes.fromhex(addr_hex)
            if family == socket.AF_INET:
                addr = socket.inet_ntop(family, raw[::-1])
            else:
                addr = socket.inet_ntop(family, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
            out.add(f"{addr.removeprefix('::ffff:')}:{int(port_hex, 16)}")  # v4-mapped = the v4 address
    return out


def test_bundled_backend_dir_is_symlinks_outside_site_packages(tmp_path):
    binary = find_tritonserver(cache_dir=tmp_path)
    if binary.kind != "bundled":
        pytest.skip(f"a {binary.kind} tritonserver is used here, not the bundled one")
    backends = next(a.split("=", 1)[1] for a in binary.args if a.startswith("--backend-directory="))
    stub = os.path.join(backends, "python", "triton_python_backend_stub")
    assert os.path.islink(stub)
    assert f"python_backend_stubs/{sys.version_info.major}.{sys.version_info.minor}/" in os.readlink(stub)
    assert "site-packages" not in backends
    assert binary.env["PATH"].startswith(os.path.dirname(sys.executable))
    # Preparing again reuses the same directory.
    assert prepare_bundled_backends(binary.path.parent.parent, tmp_path)[0] == __import__("pathlib").Path(backends)


def test_serves_a_python_model_on_loopback_and_stops_cleanly(tmp_path):
    repo = tmp_path / "repo"
    write_echo_model(repo)
    with running_server(repo) as srv:
        pid = srv.process.pid
        assert srv.is_ready() and srv.model_ready("echo") and not srv.model_ready("nope")
        # Every listening socket of the server is on 127.0.0.1, on the ports we asked for.  Readiness
        # does not wait for the last endpoint's listen() (CI once saw two of three), so poll briefly.
        want = {f"127.0.0.1:{p}" for p in (srv.http_port, srv.grpc_port, srv.metrics_port)}
        deadline = time.monotonic() + 5
        while _listening_addresses(pid) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _listening_addresses(pid) == want
        body = json.dumps({"inputs": [{"name": "IN", "shape": [3], "datatype": "INT32", "data": [1, 2, 3]}]}).encode()
        req = urllib.request.Request(f"{srv.http_url}/v2/models/echo/infer", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["outputs"][0]["data"] == [2, 4, 6]
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(srv.grpc_url)
        inp = grpcclient.InferInput("IN", [2], "INT32")
        inp.set_data_from_numpy(np.array([5, 7], dtype=np.int32))
        assert client.infer("echo", [inp]).as_numpy("OUT").tolist() == [10, 14]
        client.close()
        with urllib.request.urlopen(srv.metrics_url, timeout=5) as resp:
            assert b"nv_inference_request_success" in resp.read()
    assert srv.process.returncode == 0  # SIGTERM -> clean exit
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with socket.socket() as s:  # ports are free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", srv.http_port))


def test_a_server_niceness_covers_tritonserver_its_stubs_and_its_autogroup(tmp_path):
    repo = tmp_path / "repo"
    write_echo_model(repo)
    with running_server(repo, niceness=5) as srv:
        pid = srv.process.pid
        stubs = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        assert stubs, "the echo model's python stub"
        assert [os.getpriority(os.PRIO_PROCESS, p) for p in (pid, *stubs)] == [5] * (1 + len(stubs))
        group = Path(f"/proc/{pid}/autogroup")
        if group.exists():  # the session's share against other sessions (the front door, clients)
            assert group.read_text().split()[-1] == "5"
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the starter keeps its own


def test_broken_repository_fails_fast_with_the_log_tail(tmp_path):
    repo = tmp_path / "repo"
    write_python_model(
        repo, "broken", "class TritonPythonModel:\n    pass\n", 'name: "broken"\nbackend: "no_such_backend"\n'
    )
    t = time.monotonic()
    with pytest.raises(ServerError) as err:
        with TritonServer(repo, exit_timeout_s=1, ready_timeout_s=60):
            pass
    assert time.monotonic() - t < 30  # failed when the process exited, not at the timeout
    msg = str(err.value)
    assert "exited with code" in msg and "no_such_backend" in msg and str(repo.parent / ".rtk-triton") in msg


def test_the_log_tail_keeps_a_load_error_that_scrolled_out_of_it(tmp_path):
    """With several models, the lines of the server unloading the healthy ones pushed the failed model's
    reason out of the tail (an ensemble whose tensorrt_llm stub had a SyntaxError said only 'failed to load')."""
    log = tmp_path / "server.log"
    error = "E1205 16:29:11.477935 32535 model_lifecycle.cc:642] \"failed to load 'tensorrt_llm': SyntaxError\""
    unloading = [f'I1205 16:29:14.{i:06d} 32535 server.cc:345] "Timeout {i}: Found 3 live models"' for i in range(60)]
    log.write_text("\n".join(["I1205 loading: tensorrt_llm:1", error, *unloading, "error: creating server"]) + "\n")
    lines = log_tail(log, 30).splitlines()
    assert lines[0] == error and lines[1] == "..." and lines[-1] == "error: creating server"
    assert lines[2:] == [*unloading[-29:], "error: creating server"]
    log.write_text("\n".join([error, "error: creating server"]) + "\n")  # in the tail already: once
    assert log_tail(log, 30).splitlines() == [error, "error: creating server"]


def test_model_that_raises_at_load_is_reported(tmp_path):
    repo = tmp_path / "repo"
    bad = (
        "class TritonPythonModel:\n    def initialize(self, args):\n"
        "        raise RuntimeError('weights are missing here')\n"
    )
    write_python_model(
        repo,
        "bad",
        bad,
        'name: "bad"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [{name: "IN", data_type: TYPE_INT32, dims: [-1]}]\n'
        'output [{name: "OUT", data_type: TYPE_INT32, dims: [-1]}]\n',
    )
    with pytest.raises(ServerError, match="weights are missing here"):
        with TritonServer(repo, exit_timeout_s=1, ready_timeout_s=60):
            pass


def test_port_in_use_is_a_clear_error(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        http, metrics = free_ports(2)
        with pytest.raises(ServerError, match=f"grpc port {busy} .* already in use.*serving.grpc_port"):
            TritonServer(repo, http_port=http, grpc_port=busy, metrics_port=metrics).start()


def test_missing_repository_and_bad_binary_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="is not a directory"):
        TritonServer(tmp_path / "nope").start()
    with pytest.raises(UsageError, match="serving.tritonserver"):
        find_tritonserver(tmp_path / "not-a-binary")


def test_explicit_model_control_loads_only_named_models(tmp_path):
    repo = tmp_path / "repo"
    write_echo_model(repo, "a")
    write_echo_model(repo, "b")
    with running_server(repo, model_control_mode="explicit", load_models=["a"]) as srv:
        assert srv.model_ready("a") and not srv.model_ready("b")


def test_detached_server_outlives_its_starter_and_stops_from_state(tmp_path):
    repo = tmp_path / "repo"
    write_echo_model(repo)
    http, grpc, metrics = free_ports(3)
    # Start it from another Python process, which then exits: the server must keep running.
    code = (
        "import sys; from toolkit.triton.server import TritonServer; "
        f"st = TritonServer({str(repo)!r}, http_port={http}, grpc_port={grpc}, metrics_port={metrics}, "
        "exit_timeout_s=2)"
        ".start_detached(timeout=60, models=['echo']); print(st.pid)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.strip().splitlines()[-1])
    try:
        st = read_state(repo)
        assert st is not None and st.pid == pid and st.http_port == http
        with urllib.request.urlopen(f"{st.http_url}/v2/models/echo/ready", timeout=5) as resp:
            assert resp.status == 200
        # A second detached start on the same repository is refused while the first runs.
        with pytest.raises(ServerError, match="already serves"):
            TritonServer(repo).start_detached()
        stopped = stop_detached(repo, timeout=20)
        assert stopped is not None and stopped.pid == pid
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert not server_module.group_members(pid)  # its python stubs too (their shared memory goes with them)
        assert not state_path(repo).exists()
        assert stop_detached(repo) is None  # nothing left to stop
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def test_each_server_gets_its_own_python_backend_shm_prefix(tmp_path):
    """Two python-backend servers on one host must not share shared-memory region names."""
    (tmp_path / "repo").mkdir()
    a = TritonServer(tmp_path / "repo", http_port=18000, grpc_port=18001, metrics_port=18002)
    b = TritonServer(tmp_path / "repo", http_port=18010, grpc_port=18011, metrics_port=18012)

    def prefixes(server):
        return [x for x in server.command() if "shm-region-prefix-name" in x]

    assert prefixes(a) == ["--backend-config=python,shm-region-prefix-name=rtk18000_"]
    assert prefixes(b) == ["--backend-config=python,shm-region-prefix-name=rtk18010_"]
    b.extra_args.append("--backend-config=python,shm-region-prefix-name=mine_")
    assert prefixes(b) == ["--backend-config=python,shm-region-prefix-name=mine_"]  # a given one is kept, alone


def test_an_attached_server_is_stopped_when_its_starter_is_killed(tmp_path):
    """A server started (attached, from the main thread) by a process that is then SIGKILLed gets SIGTERM
    from the kernel and exits; its pid is tritonserver's own, not a wrapper's."""
    repo = tmp_path / "repo"
    write_echo_model(repo)
    code = (
        "import os, signal; from toolkit.triton.server import TritonServer; "
        f"s = TritonServer({str(repo)!r}, exit_timeout_s=2).start(); s.wait_ready(timeout=60, models=['echo']); "
        "print(s.process.pid, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd=os.getcwd())
    assert out.returncode == -9, out.stderr
    pid = int(out.stdout.strip().splitlines()[-1])
    try:
        deadline = time.monotonic() + 20
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists(), "tritonserver outlived the process that started it"
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def test_the_server_is_started_without_python_code_between_fork_and_exec(tmp_path, monkeypatch):
    """No ``preexec_fn``: Python run in the forked child runs grpcio's at-fork handlers there, which with a
    ``grpc.aio`` channel busy in another thread (the in-process front door) killed the child now and then
    before exec (CI saw tritonserver exit -11 / -7 with an empty log)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    seen = {}

    class Recorder:
        def __init__(self, cmd, **kwargs):
            seen.update(kwargs, cmd=cmd)
            self.pid = 0

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Recorder)
    TritonServer(repo).start()
    assert seen.get("preexec_fn") is None and seen["start_new_session"]
    assert seen["cmd"][:3] == [shutil.which("setpriv"), "--pdeathsig", "TERM"]
