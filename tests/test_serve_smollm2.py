"""The embedded SmolLM2-135M-Instruct, FP8, built for the cpu target and served by `rtk serve` in the foreground.

The README's promise: a chat question streamed through the real tritonserver gets a sensible
answer.  The server runs with ``context_policy: reject``, so an over-long conversation is refused
with a clear error while the server keeps answering.  Ctrl-C (SIGINT) stops it cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from toolkit.client import chat_messages, generate, stream_chat
from toolkit.errors import ServerError
from toolkit.spec import load_spec
from toolkit.targets import build
from toolkit.triton.emit import emit
from toolkit.triton.server import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_fp8_dir):
    root = tmp_path_factory.mktemp("smollm2-serve")
    http, grpc, metrics = free_ports(3)
    spec_path = root / "smollm2-cpu.yaml"
    spec_path.write_text(
        yaml.safe_dump(
            {
                "name": "smollm2-cpu",
                "model": {"source": "builtin:smollm2-135m-instruct"},
                "quantization": {"format": "fp8"},
                "build": {
                    "target": "cpu",
                    "max_batch_size": 4,
                    "max_input_len": 256,
                    "max_seq_len": 512,
                    "max_num_tokens": 256,
                },
                "serving": {
                    "repository": str(root / "repo"),
                    "http_port": http,
                    "grpc_port": grpc,
                    "metrics_port": metrics,
                    "context_policy": "reject",
                },
            }
        )
    )
    spec = load_spec(spec_path)
    engine = build(spec, smollm2_fp8_dir, root / "engine").path
    emit(spec, engine)
    # A process started in the background by a non-interactive shell (`pytest ... &`) has SIGINT ignored,
    # and its children inherit that, so rtk serve would ignore the Ctrl-C this module sends.  It gets
    # the disposition a terminal gives it instead: a handled SIGINT becomes the default in the child.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "toolkit.cli", "serve", str(spec_path), "--timeout", "300"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready:"):
                break
        else:
            pytest.fail("rtk serve exited before it was ready:\n" + "".join(lines))
        ready_line = lines[-1]
        # keep reading what it prints: a pipe nobody reads fills up and blocks the server's next write
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        yield dict(grpc=f"127.0.0.1:{grpc}", spec_path=spec_path, proc=proc, ready_line=ready_line, output=lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_the_capital_of_france_is_paris_streamed_token_by_token(server):
    result = generate(server["grpc"], chat_messages(QUESTION), max_tokens=48)
    assert "Paris" in result.text, result.text
    assert len(result.chunks) >= 5 and "".join(result.chunks) == result.text
    assert result.num_output_tokens >= len(result.chunks) - 1
    assert result.dropped_turns == 0
    assert "127.0.0.1" in server["ready_line"]


def test_rtk_chat_prints_the_answer(server):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit.cli",
            "chat",
            str(server["spec_path"]),
            QUESTION,
            "--url",
            server["grpc"],
            "--no-build",
            "--model",
            "tensorrt_llm_bls",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_a_conversation_over_the_window_is_refused_and_the_server_keeps_serving(server):
    history = []
    for i in range(12):
        history += [
            {"role": "user", "content": f"Tell me fact number {i} about the Moon in detail."},
            {"role": "assistant", "content": "The Moon is Earth's only natural satellite. " * 4},
        ]
    with pytest.raises(ServerError, match="context_policy: truncate_oldest"):
        generate(server["grpc"], chat_messages(QUESTION, history=history), max_tokens=16)
    again = stream_chat(server["grpc"], QUESTION, max_tokens=32, out=open(os.devnull, "w"))
    assert "Paris" in again.text


def stuck_report(pid: int) -> str:
    """Where a process that does not stop is: it and its descendants, and py-spy's stacks of the Python ones."""
    import shutil

    rows = subprocess.run(["ps", "-eo", "pid=,ppid=,stat=,etime=,args="], capture_output=True, text=True).stdout
    procs = [r.split(None, 4) for r in rows.splitlines() if len(r.split(None, 4)) == 5]
    family, grew = {str(pid)}, True
    while grew:
        more = {r[0] for r in procs if r[1] in family} - family
        family |= more
        grew = bool(more)
    mine = [r for r in procs if r[0] in family]
    report = "\nthe process and its descendants (pid ppid stat elapsed command; ignored and blocked signals):\n"
    for r in mine:
        try:
            status = Path(f"/proc/{r[0]}/status").read_text().splitlines()
            masks = [x for x in status if x.startswith(("SigIgn", "SigBlk"))]
        except OSError:
            masks = []
        report += " ".join(r)[:200] + "  " + " ".join(m.replace("\t", " ") for m in masks) + "\n"
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if spy is None:
        return report + "\n(py-spy is not installed: no stacks)"
    for r in mine:
        if "python" in r[4]:
            dump = subprocess.run([spy, "dump", "--pid", r[0]], capture_output=True, text=True, timeout=30)
            report += f"\npy-spy dump {r[0]}:\n{dump.stdout or dump.stderr}"
    return report


def test_ctrl_c_stops_rtk_serve_and_its_tritonserver(server):
    proc = server["proc"]
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert children, "rtk serve should have a tritonserver child"
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(
            "rtk serve did not stop within 60 s of SIGINT; its output:\n"
            + "".join(server["output"][-40:])
            + stuck_report(proc.pid)
        )
    assert code == 0, "".join(server["output"][-40:])
    time.sleep(0.5)
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    with pytest.raises(ServerError):
        generate(server["grpc"], json.dumps([{"role": "user", "content": "hi"}]), max_tokens=2, timeout_s=5)
