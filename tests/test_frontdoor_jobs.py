"""Async jobs (toolkit/frontdoor/jobs.py): callback URL checks, signatures, and — through a real tritonserver
(a fake decoupled LLM) and real uvicorn servers on loopback — jobs that finish, callbacks retried with one
idempotency key, and a front door killed mid-job whose restart finishes the job."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from toolkit.frontdoor.jobs import check_callback_url, sign, verify
from toolkit.frontdoor.protocol import APIError

SECRET = "cb-secret-" + "9" * 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "url, why",
    [
        ("ftp://example.com/x", "scheme"),
        ("file:///etc/passwd", "scheme"),
        ("http://127.0.0.1:9/cb", "loopback"),
        ("http://localhost/cb", "loopback"),
        ("http://[::1]/cb", "loopback"),
        ("http://[::ffff:127.0.0.1]/cb", "IPv4-mapped loopback"),
        ("http://10.1.2.3/cb", "private"),
        ("http://192.168.0.10/cb", "private"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://[fe80::1]/cb", "link-local"),
        ("http://0.0.0.0/cb", "unspecified"),
        ("http://user:pw@93.184.216.34/cb", "credentials"),
    ],
)
def test_callback_urls_to_non_public_addresses_are_refused(url, why):
    with pytest.raises(APIError) as e:
        asyncio.run(check_callback_url(url, allow_private=False))
    assert e.value.status == 400 and e.value.param == "callback_url" and why in e.value.message


def test_public_and_explicitly_allowed_callback_urls_pass():
    asyncio.run(check_callback_url("https://93.184.216.34/hook", allow_private=False))  # a literal public address
    asyncio.run(check_callback_url("http://127.0.0.1:9/cb", allow_private=True))
    with pytest.raises(APIError, match="scheme"):
        asyncio.run(check_callback_url("gopher://127.0.0.1/", allow_private=True))


def test_signature_verifies_and_rejects_tampering_and_old_timestamps():
    body = b'{"id":"job-1"}'
    header = sign(SECRET, body)
    assert verify(SECRET, body, header)
    assert not verify(SECRET, body + b" ", header) and not verify("other", body, header)
    assert not verify(SECRET, body, sign(SECRET, body, int(time.time()) - 3600))
    assert not verify(SECRET, body, "garbage")


# -- through the front door -----------------------------------------------------------------------------------


class Receiver:
    """A callback endpoint on loopback (uvicorn): records each delivery, fails the first ``fail_first``."""

    def __init__(self, fail_first: int = 0):
        from starlette.applications import Starlette
        from starlette.responses import PlainTextResponse
        from starlette.routing import Route

        from toolkit.frontdoor import FrontDoorServer

        self.fail_first, self.got = fail_first, []

        async def hook(request):
            body = await request.body()
            self.got.append({"headers": dict(request.headers), "body": body, "at": time.time()})
            return (
                PlainTextResponse("no", status_code=500)
                if len(self.got) <= self.fail_first
                else PlainTextResponse("ok")
            )

        async def moved(request):
            self.got.append({"redirected": True})
            return PlainTextResponse("", status_code=307, headers={"Location": "/hook"})

        app = Starlette(routes=[Route("/hook", hook, methods=["POST"]), Route("/moved", moved, methods=["POST"])])
        self.server = FrontDoorServer(app, "127.0.0.1", free_port())
        self.url = self.server.url

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop()


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    from triton_helpers import running_server, write_fake_llm

    repo = tmp_path_factory.mktemp("jobs_repo")
    write_fake_llm(repo, "ensemble", ttft_ms=20, itl_ms=40)  # 30 tokens: about 1.2 s
    with running_server(repo) as server:
        yield server


def job_config(tmp_path, **jobs):
    from toolkit.frontdoor import FrontDoorConfig
    from toolkit.spec import JobsSpec

    spec = {
        "path": str(tmp_path / "jobs.sqlite"),
        "callback_secret": "env:RTK_TEST_CB_SECRET",
        "allow_private_callbacks": True,
        "poll_s": 0.1,
        "callback_backoff_s": 0.2,
        **jobs,
    }
    return FrontDoorConfig(model_name="fake", jobs=JobsSpec(**spec), max_seq_len=256, default_max_tokens=8)


def body(n=30, **kw):
    return {"model": "fake", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": n, **kw}


def wait_for(fn, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not (v := fn()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return v


@pytest.mark.integration
def test_a_job_finishes_and_its_callback_is_retried_with_one_idempotency_key(triton, tmp_path, monkeypatch):
    from toolkit.frontdoor import FrontDoorServer, create_app

    monkeypatch.setenv("RTK_TEST_CB_SECRET", SECRET)
    with (
        Receiver(fail_first=2) as rx,
        FrontDoorServer(create_app(job_config(tmp_path), triton.grpc_url), "127.0.0.1", free_port()) as fd,
    ):
        r = httpx.post(fd.url + "/v1/jobs", json=body(callback_url=rx.url + "/hook"))
        assert r.status_code == 202 and r.headers["location"] == f"/v1/jobs/{r.json()['id']}"
        jid = r.json()["id"]
        assert r.json()["status"] in ("queued", "running")
        done = wait_for(lambda: (j := httpx.get(f"{fd.url}/v1/jobs/{jid}").json())["status"] == "succeeded" and j)
        assert done["result"]["choices"][0]["finish_reason"] == "length"
        assert done["result"]["usage"]["completion_tokens"] == 30
        wait_for(lambda: len(rx.got) == 3)
        keys = {g["headers"]["idempotency-key"] for g in rx.got}
        assert keys == {f"{jid}:1"}
        assert [g["headers"]["x-rtk-delivery-attempt"] for g in rx.got] == ["1", "2", "3"]
        gaps = [b["at"] - a["at"] for a, b in zip(rx.got, rx.got[1:], strict=False)]
        assert 0.15 < gaps[0] and gaps[1] > 0.35 and gaps[1] > gaps[0]  # exponential: 0.2 s, then 0.4 s
        for g in rx.got:
            assert verify(SECRET, g["body"], g["headers"]["x-rtk-signature"])
            assert json.loads(g["body"])["result"] == done["result"]
        assert wait_for(lambda: httpx.get(f"{fd.url}/v1/jobs/{jid}").json()["callback"]["status"] == "delivered")
        metrics = httpx.get(fd.url + "/metrics").text
        for line in (
            "rtk_frontdoor_jobs_submitted_total 1",
            'rtk_frontdoor_job_runs_total{result="succeeded"} 1',
            'rtk_frontdoor_job_callbacks_total{result="retried"} 2',
            'rtk_frontdoor_job_callbacks_total{result="delivered"} 1',
            'rtk_frontdoor_job_callbacks_total{result="failed"} 0',
            "rtk_frontdoor_job_store_errors_total 0",
        ):
            assert line in metrics.splitlines(), line
        assert wait_for(lambda: 'rtk_frontdoor_jobs{state="succeeded"} 1' in httpx.get(fd.url + "/metrics").text)
        # A redirect is not followed: the delivery counts as failed (and is retried until it gives up).
        r = httpx.post(fd.url + "/v1/jobs", json=body(n=2, callback_url=rx.url + "/moved"))
        wait_for(lambda: sum(1 for g in rx.got if g.get("redirected")) >= 2)
        assert all("body" in g for g in rx.got if not g.get("redirected"))


@pytest.mark.integration
def test_bad_jobs_are_refused_with_the_field_named(triton, tmp_path, monkeypatch):
    from toolkit.frontdoor import FrontDoorServer, create_app

    monkeypatch.delenv("RTK_TEST_CB_SECRET", raising=False)
    cfg = job_config(tmp_path, allow_private_callbacks=False)
    with FrontDoorServer(create_app(cfg, triton.grpc_url), "127.0.0.1", free_port()) as fd:
        r = httpx.post(fd.url + "/v1/jobs", json=body(temperature=9))
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = httpx.post(fd.url + "/v1/jobs", json=body(callback_url="http://127.0.0.1:1/x"))
        assert r.status_code == 400 and "callback_secret" in r.json()["error"]["message"]  # no secret: no callbacks
        monkeypatch.setenv("RTK_TEST_CB_SECRET", SECRET)
    with FrontDoorServer(create_app(cfg, triton.grpc_url), "127.0.0.1", free_port()) as fd:
        r = httpx.post(fd.url + "/v1/jobs", json=body(callback_url="http://[::ffff:127.0.0.1]:1/x"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "callback_url"
        r = httpx.post(fd.url + "/v1/jobs", json=body(stream=True))
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        assert httpx.get(fd.url + "/v1/jobs/job-nope").status_code == 404


FRONT_DOOR_PROCESS = """
import sys
from toolkit.frontdoor import FrontDoorServer, create_app
sys.path.insert(0, {tests!r})
from test_frontdoor_jobs import job_config
from pathlib import Path
import time
fd = FrontDoorServer(create_app(job_config(Path({tmp!r})), {grpc!r}), "127.0.0.1", {port})
fd.start()
print("ready", flush=True)
while True:
    time.sleep(1)
"""


@pytest.mark.integration
def test_a_front_door_killed_mid_job_finishes_it_after_a_restart(triton, tmp_path):
    tests = os.path.dirname(__file__)
    port = free_port()
    env = {**os.environ, "RTK_TEST_CB_SECRET": SECRET}

    def start():
        code = FRONT_DOOR_PROCESS.format(tests=tests, tmp=str(tmp_path), grpc=triton.grpc_url, port=port)
        p = subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        line = p.stdout.readline()
        assert "ready" in line, line + p.stdout.read()
        threading.Thread(target=p.stdout.read, daemon=True).start()
        return p

    with Receiver(fail_first=1) as rx:
        first = start()
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/jobs", json=body(n=60, callback_url=rx.url + "/hook"))
            jid = r.json()["id"]
            wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/v1/jobs/{jid}").json()["status"] == "running")
            time.sleep(0.3)
        finally:
            first.send_signal(signal.SIGKILL)  # no shutdown code runs
            first.wait(10)
        assert rx.got == []
        second = start()
        try:
            done = wait_for(
                lambda: (
                    (j := httpx.get(f"http://127.0.0.1:{port}/v1/jobs/{jid}").json())["status"] == "succeeded" and j
                ),
                timeout_s=60,
            )
            assert done["runs"] == 2 and done["result"]["usage"]["completion_tokens"] == 60
            wait_for(lambda: len(rx.got) == 2)  # the first delivery failed and was retried
            assert {g["headers"]["idempotency-key"] for g in rx.got} == {f"{jid}:2"}
            assert verify(SECRET, rx.got[0]["body"], rx.got[0]["headers"]["x-rtk-signature"])
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(10)
