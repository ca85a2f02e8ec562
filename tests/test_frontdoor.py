"""The front door (toolkit/frontdoor) against a real tritonserver serving fake decoupled LLMs.

The fakes (tests/triton_helpers.py) stand in for the engine only: Triton, its gRPC stream, uvicorn,
HTTP and Redis are real.  These tests check behaviour (statuses, Retry-After, the tier that
answered, a refusal before any token, cancellation); timing belongs to scripts/bench_overload.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from triton_helpers import model_config_text, running_server, write_fake_llm, write_python_model

from toolkit.frontdoor import FrontDoorConfig, FrontDoorServer, create_app
from toolkit.spec import CacheSpec, FrontendSpec, GuardSpec

pytestmark = [pytest.mark.integration]

MODEL = "fake"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    repo = tmp_path_factory.mktemp("fd_repo")
    write_fake_llm(repo, "ensemble", ttft_ms=10, itl_ms=5)
    # One request at a time, 50 ms a token: a second request waits for the first to finish.
    write_fake_llm(repo, "slow", ttft_ms=50, itl_ms=50, serial=True, max_batch_size=1)
    # The first token comes late (for deadline misses after admission).
    write_fake_llm(repo, "late", ttft_ms=3000, itl_ms=5)
    # Every second request's first token comes 300 ms later (for the admission's margin from its error).
    write_fake_llm(repo, "jumpy", ttft_ms=20, itl_ms=5, stall_every=2, stall_ms=300)
    write_fake_llmapi(repo, "tensorrt_llm")
    write_fake_logprobs(repo, "lp_ensemble")
    with running_server(repo) as server:
        yield server


# A FAKE of TensorRT-LLM's llmapi model (it needs a GPU and TensorRT-LLM): it declares rtk's llmapi
# interface (toolkit/triton/gpu_models.py, upstream's config.pbtxt) and answers with the inputs it was
# given, as JSON, streamed the way upstream's model.py streams: each response carries the whole text so far
# (CompletionOutput.text), the last one with the FINAL flag and, when asked, finish_reason.
FAKE_LLMAPI_PY = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            seen = {}
            for t in r.inputs():
                v = t.as_numpy()
                seen[t.name()] = [x.decode() if isinstance(x, bytes) else x.item() for x in v.reshape(-1)]
                seen[t.name() + ".shape"] = list(v.shape)
            text = json.dumps(seen, sort_keys=True)
            want_reason = bool(seen.get("return_finish_reason", [False])[0])
            cuts = [len(text) // 3, 2 * len(text) // 3, len(text)]
            for i, cut in enumerate(cuts):
                last = i == len(cuts) - 1
                outs = [pb_utils.Tensor("text_output", np.array([text[:cut].encode()], dtype=np.object_))]
                if want_reason:
                    reason = "length" if last else "None"
                    outs.append(pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)))
                sender.send(pb_utils.InferenceResponse(outs), flags=FINAL if last else 0)
        return None
"""


def write_fake_llmapi(repo, name):
    from toolkit.triton.gpu_models import LLMAPI_INPUTS, LLMAPI_OUTPUTS

    def rows(tensors, inputs):
        return [(t.name, t.dtype, t.dims, t.optional) if inputs else (t.name, t.dtype, t.dims) for t in tensors]

    cfg = model_config_text(name, rows(LLMAPI_INPUTS, True), rows(LLMAPI_OUTPUTS, False), decoupled=True)
    return write_python_model(repo, name, FAKE_LLMAPI_PY, cfg)


# A FAKE engine behind the ensemble's interface with TensorRT-LLM's return_log_probs / output_log_probs:
# tokens " a", "" (a character still incomplete), "é", " c"; token i has log-prob -(i + 1) / 4.
FAKE_LOGPROBS_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
TOKENS = [" a", "", "\u00e9", " c"]

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            lp = pb_utils.get_input_tensor_by_name(r, "return_log_probs")
            want = lp is not None and bool(lp.as_numpy().reshape(-1)[0])
            for i, tok in enumerate(TOKENS):
                outs = [pb_utils.Tensor("text_output", np.array([tok.encode()], dtype=np.object_))]
                if want:
                    outs.append(pb_utils.Tensor("output_log_probs", np.full((1, 1, 1), -(i + 1) / 4, np.float32)))
                sender.send(pb_utils.InferenceResponse(outs))
            sender.send(flags=FINAL)
        return None
"""


def write_fake_logprobs(repo, name):
    inputs = [
        ("text_input", "STRING", [1]),
        ("max_tokens", "INT32", [1]),
        ("stream", "BOOL", [1], True),
        ("return_log_probs", "BOOL", [1], True),
    ]
    outputs = [("text_output", "STRING", [-1]), ("output_log_probs", "FP32", [-1, -1])]
    cfg = model_config_text(name, inputs, outputs, max_batch_size=8, decoupled=True)
    return write_python_model(repo, name, FAKE_LOGPROBS_PY, cfg)


def front_door(
    triton,
    *,
    model="ensemble",
    guard=None,
    cache=None,
    frontend=None,
    max_batch_size=8,
    grpc_url=None,
    tokenizer_dir=None,
):
    cfg = FrontDoorConfig(
        model_name=MODEL,
        frontend=FrontendSpec(**(frontend or {})),
        guard=GuardSpec(**(guard or {})),
        cache=CacheSpec(**(cache or {})),
        triton_model=model,
        max_batch_size=max_batch_size,
        max_seq_len=256,
        default_max_tokens=8,
        tokenizer_dir=tokenizer_dir,
    )
    app = create_app(cfg, grpc_url or triton.grpc_url, metrics_url=triton.metrics_url)
    return FrontDoorServer(app, "127.0.0.1", free_port())


def frontdoor_ms(headers) -> float:
    """The front door's own time to the response's head, from its ``Server-Timing: frontdoor;dur=<ms>``."""
    from toolkit.slo.outcome import server_timing_ms

    value = headers["server-timing"]
    assert value.startswith("frontdoor;dur=")
    return server_timing_ms(value)


def chat_body(text="hello there", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, **kw}


def fake_answer(text_input: str, n: int) -> list[str]:
    """What the fake LLM answers: token i of a prompt of w words is 'tok{1000 + w + i}'."""
    w = len(text_input.split())
    return [f"tok{1000 + (w + i) % 1000}" for i in range(n)]


def chat_answer(text="hello there", n=4) -> list[str]:
    return fake_answer(json.dumps([{"role": "user", "content": text}]), n)


def sse_events(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture(scope="module")
def plain(triton):
    with front_door(triton) as fd:
        yield fd


# -- the OpenAI surface -------------------------------------------------------------------------------


def test_models_and_health(plain):
    c = httpx.Client(base_url=plain.url)
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL]
    h = c.get("/health")
    assert h.status_code == 200 and h.json()["ready"] is True
    assert c.get("/health/live").status_code == 200


def _not_found_count(c: httpx.Client) -> int:
    line = 'rtk_frontdoor_errors_total{status="404",reason="not_found"} '
    return sum(int(x[len(line) :]) for x in c.get("/metrics").text.splitlines() if x.startswith(line))


def test_an_unknown_path_or_method_is_an_openai_error(plain):
    c = httpx.Client(base_url=plain.url)
    before = _not_found_count(c)
    r = c.post("/v1/embeddings", json={"input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    assert "POST /v1/embeddings" in r.json()["error"]["message"]
    r = c.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST" and "POST" in r.json()["error"]["message"]
    assert _not_found_count(c) == before + 1
    assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_chat_streams_with_usage_and_tier(plain):
    sent = time.perf_counter()
    with (
        httpx.Client(base_url=plain.url) as c,
        c.stream(
            "POST", "/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True})
        ) as r,
    ):
        head_ms = (time.perf_counter() - sent) * 1e3
        assert r.status_code == 200 and r.headers["x-rtk-tier"] == "primary"
        # The stream's head goes with its first token: the front door's time includes the fake's 10 ms.
        assert 10 <= frontdoor_ms(r.headers) <= head_ms
        assert r.headers["content-type"].startswith("text/event-stream")
        assert float(r.headers["x-rtk-predicted-ttft-ms"]) > 0  # what admission predicted
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in chunks)
    assert text.split() == chat_answer()
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["rtk_tier"] == "primary"
    assert events[-2]["usage"]["completion_tokens"] == 4 and events[-2]["choices"] == []


def test_completion_without_streaming(plain):
    sent = time.perf_counter()
    r = httpx.post(plain.url + "/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 3})
    took_ms = (time.perf_counter() - sent) * 1e3
    assert r.status_code == 200, r.text
    assert 10 + 2 * 5 <= frontdoor_ms(r.headers) <= took_ms  # the whole answer came before the head
    body = r.json()
    assert body["object"] == "text_completion" and body["rtk_tier"] == "primary"
    assert body["choices"][0]["text"].split() == fake_answer("a b c", 3)  # a plain prompt is sent as is
    assert body["usage"]["completion_tokens"] == 3 and r.headers["x-rtk-tier"] == "primary"
    assert float(r.headers["x-rtk-predicted-ttft-ms"]) > 0


def test_rtk_slo_over_openai_reads_the_front_doors_own_ttft(plain, tmp_path):
    from toolkit.slo import run_slo

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"text": f"hello {i}"}) + "\n" for i in range(4)))
    slo = {"transport": "openai", "concurrency": 1, "num_requests": 4, "warmup_requests": 0}
    report = run_slo(slo | {"dataset": str(data), "output_tokens": 3}, plain.url)
    server = report.dist("server_ttft")
    assert report.summary.succeeded == 4 and server.count == 4
    assert server.min >= 10  # the fake's first token comes after 10 ms, and the head with it
    assert report.dist("ttft_outside_server").min >= 0  # the client's TTFT from its send holds the front door's


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (chat_body() | {"model": "other"}, "model"),
        (chat_body() | {"messages": []}, "messages"),
        (chat_body() | {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            chat_body() | {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
            "messages[1].role",
        ),
        (b'{"model": "fake", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
        (chat_body(temperature=-1), "temperature"),
        (chat_body(top_p=0), "top_p"),
        (chat_body(n=2), "n"),
        (chat_body(max_tokens=10_000), "max_tokens"),
        (chat_body(seed=-3), "seed"),
        (chat_body(logprobs=True), "logprobs"),
        (chat_body(stop="x"), "stop"),  # the fake model has no stop_words input: refused, not ignored
        (chat_body(temperature=0.7), "temperature"),  # nor a temperature input
    ],
)
def test_bad_input_is_400_naming_the_field_and_the_server_keeps_serving(plain, body, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(plain.url + "/v1/chat/completions", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == 400, r.text
    assert frontdoor_ms(r.headers) >= 0
    err = r.json()["error"]
    assert err["param"] == param and err["message"]
    if param:
        assert param in err["message"]
    ok = httpx.post(plain.url + "/v1/chat/completions", json=chat_body())
    assert ok.status_code == 200


# -- admission and fallbacks ------------------------------------------------------------------------------


def _occupy(fd, n_tokens=40):
    """Start a long streamed request on the 'slow' model; returns once its first token arrived."""
    got_first = threading.Event()
    done = threading.Event()

    def run():
        with (
            httpx.Client(base_url=fd.url, timeout=60) as c,
            c.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=n_tokens, stream=True)) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got_first.set()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert got_first.wait(30)
    return done


def test_a_request_that_cannot_meet_its_deadline_is_refused_429_before_any_token(triton):
    with front_door(triton, model="slow", max_batch_size=1, guard={"ttft_deadline_ms": 300, "retry_after_s": 2}) as fd:
        done = _occupy(fd)
        sent = time.perf_counter()
        with (
            httpx.Client(base_url=fd.url) as c,
            c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r,
        ):
            status, headers, raw = r.status_code, r.headers, r.read()
        took_ms = (time.perf_counter() - sent) * 1e3
        assert status == 429
        assert int(headers["retry-after"]) >= 2 and headers["x-rtk-tier"] == "refused"
        assert 0 <= frontdoor_ms(headers) <= took_ms
        err = json.loads(raw)["error"]  # a JSON error, not a stream: no token was sent
        assert err["code"] == "overloaded" and "deadline" in err["message"]
        # A request with a generous deadline of its own (header) is admitted and served.
        r = httpx.post(
            fd.url + "/v1/chat/completions", json=chat_body(), headers={"x-rtk-ttft-deadline-ms": "60000"}, timeout=60
        )
        assert r.status_code == 200 and r.headers["x-rtk-tier"] == "primary"
        metrics = httpx.get(fd.url + "/metrics").text
        assert 'rtk_frontdoor_refusals_total{status="429",reason="predicted_late"} 1' in metrics
        assert done.wait(30)


def _refusal(c: httpx.Client, deadline_ms: float) -> tuple[int, str]:
    r = c.post("/v1/chat/completions", json=chat_body(), headers={"x-rtk-ttft-deadline-ms": f"{deadline_ms:g}"})
    return r.status_code, (r.json().get("error") or {}).get("message", "")


def test_admission_checks_the_deadline_against_the_prediction_widened_by_its_recent_error(triton):
    """The fake's first tokens alternate between 20 and 320 ms, so the estimator's prediction (a typical TTFT)
    is short by ~2x on every second request.  Once enough first tokens have shown that, a deadline between the
    prediction and the prediction times its error's 0.9 quantile is refused; without the margin
    (``prediction_quantile: null``) the same kind of deadline is admitted."""
    import re

    from toolkit.frontdoor.admission import MIN_ERROR_SAMPLES

    def predicted(message: str) -> tuple[float, float | None]:
        m = re.search(r"first token is (\d+) ms(?: \((\d+) ms with the recent predictions' error\))?", message)
        assert m, message
        return float(m[1]), float(m[2]) if m[2] else None

    for quantile in (0.9, None):
        with (
            front_door(triton, model="jumpy", guard={"prediction_quantile": quantile}) as fd,
            httpx.Client(base_url=fd.url, timeout=30) as c,
        ):
            for _ in range(MIN_ERROR_SAMPLES + 4 if quantile else 6):
                assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
            margin = float(re.search(r"^rtk_frontdoor_prediction_margin (\S+)$", c.get("/metrics").text, re.M)[1])
            status, message = _refusal(c, 1)  # no state changes while requests are refused: the same prediction
            assert status == 429
            raw, bound = predicted(message)
            if quantile:
                assert margin > 1.5 and bound is not None and bound > 1.5 * raw
                assert _refusal(c, (raw + bound) / 2)[0] == 429  # the prediction meets it, the bound does not
                assert _refusal(c, 1.2 * bound)[0] == 200
            else:
                assert margin == 1.0 and bound is None
                assert _refusal(c, 1.2 * raw + 1)[0] == 200


def test_bad_deadline_header_is_400(plain):
    r = httpx.post(plain.url + "/v1/chat/completions", json=chat_body(), headers={"x-rtk-ttft-deadline-ms": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-rtk-ttft-deadline-ms"


def test_fallback_to_another_deployment_then_to_a_rule(triton):
    # The occupied 'slow' model frees up in ~4 s (80 tokens, 50 ms each), far past the deadline; the deadline
    # leaves the fallback deployment time for its first byte on a loaded 2-core host (300 ms was missed once in
    # CI: its first request also asks the deployment for its model list, and the rule answered)
    guard = {"ttft_deadline_ms": 1000}
    with front_door(triton) as small:
        tiers = [
            {"kind": "deployment", "name": "small", "url": small.url + "/v1"},
            {"kind": "rule", "template": "busy ({model})"},
        ]
        guard["fallbacks"] = tiers
        with front_door(triton, model="slow", max_batch_size=1, guard=guard) as fd:
            done = _occupy(fd, n_tokens=80)
            with (
                httpx.Client(base_url=fd.url) as c,
                c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r,
            ):
                assert r.status_code == 200 and r.headers["x-rtk-tier"] == "small"
                events = sse_events(r)
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
            assert text.split() == chat_answer()  # the fast model's answer
            assert next(e for e in events[:-1] if e["choices"][0]["finish_reason"])["rtk_tier"] == "small"
            r = httpx.post(fd.url + "/v1/chat/completions", json=chat_body())  # non-streaming, same tier
            assert r.status_code == 200 and r.json()["rtk_tier"] == "small"
            assert done.wait(30)
    # The deployment is gone now: the rule answers.
    with front_door(triton, model="slow", max_batch_size=1, guard=guard) as fd:
        done = _occupy(fd, n_tokens=80)
        r = httpx.post(fd.url + "/v1/chat/completions", json=chat_body())
        assert r.status_code == 200 and r.headers["x-rtk-tier"] == "rule"
        assert r.json()["choices"][0]["message"]["content"] == f"busy ({MODEL})"
        assert 'rtk_frontdoor_requests_total{endpoint="chat",tier="rule"} 1' in httpx.get(fd.url + "/metrics").text
        assert done.wait(30)


def test_a_first_token_later_than_the_deadline_switches_to_the_fallback_and_cancels(triton):
    guard = {"ttft_deadline_ms": 400, "fallbacks": [{"kind": "rule", "template": "later"}]}
    with front_door(triton, model="late", guard=guard) as fd:
        r = httpx.post(fd.url + "/v1/chat/completions", json=chat_body(), timeout=30)
        assert r.status_code == 200 and r.headers["x-rtk-tier"] == "rule"
        m = httpx.get(fd.url + "/metrics").text
        assert "rtk_frontdoor_deadline_misses_total 1" in m and "rtk_frontdoor_inflight 0" in m


def test_unhealthy_triton_is_503_with_retry_after(triton):
    dead = f"127.0.0.1:{free_port()}"
    with front_door(triton, grpc_url=dead, guard={"retry_after_s": 3}) as fd:
        h = httpx.get(fd.url + "/health")
        assert h.status_code == 503 and h.json()["ready"] is False
        r = httpx.post(fd.url + "/v1/chat/completions", json=chat_body())
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "unavailable"


def test_client_disconnect_cancels_the_triton_request(triton):
    with front_door(triton, model="slow", max_batch_size=1) as fd:
        with (
            httpx.Client(base_url=fd.url, timeout=30) as c,
            c.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=200, stream=True)) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # leave after the first token
        deadline = time.monotonic() + 10
        while "rtk_frontdoor_cancelled_total 1" not in (m := httpx.get(fd.url + "/metrics").text):
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        # The serial model is free again long before 200 tokens x 50 ms: the next request is answered at once.
        t = time.monotonic()
        r = httpx.post(fd.url + "/v1/chat/completions", json=chat_body(max_tokens=2), timeout=30)
        assert r.status_code == 200 and time.monotonic() - t < 5


# -- the cache -------------------------------------------------------------------------------------------


def _cache_roundtrip(fd):
    first = httpx.post(fd.url + "/v1/chat/completions", json=chat_body("cache me", temperature=0))
    again = httpx.post(fd.url + "/v1/chat/completions", json=chat_body("cache me", temperature=0))
    assert first.headers["x-rtk-tier"] == "primary" and again.headers["x-rtk-tier"] == "cache"
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    other = httpx.post(fd.url + "/v1/chat/completions", json=chat_body("cache me", temperature=0, max_tokens=3))
    assert other.headers["x-rtk-tier"] == "primary"  # another parameter: another entry
    seeded = httpx.post(fd.url + "/v1/chat/completions", json=chat_body("not cached"))
    assert seeded.headers["x-rtk-tier"] == "primary"


def test_in_process_cache_answers_a_repeated_deterministic_request(triton):
    with front_door(triton, guard={"fallbacks": [{"kind": "cache"}]}) as fd:
        _cache_roundtrip(fd)
        with (
            httpx.Client(base_url=fd.url) as c,
            c.stream("POST", "/v1/chat/completions", json=chat_body("cache me", temperature=0, stream=True)) as r,
        ):
            assert r.headers["x-rtk-tier"] == "cache"
            events = sse_events(r)
        assert events[-2]["rtk_tier"] == "cache" and events[-1] == "[DONE]"


def test_cache_entries_expire(triton):
    with front_door(triton, guard={"fallbacks": [{"kind": "cache"}]}, cache={"ttl_s": 0.3}) as fd:
        body = chat_body("short lived", temperature=0)
        assert httpx.post(fd.url + "/v1/chat/completions", json=body).headers["x-rtk-tier"] == "primary"
        assert httpx.post(fd.url + "/v1/chat/completions", json=body).headers["x-rtk-tier"] == "cache"
        time.sleep(0.5)
        assert httpx.post(fd.url + "/v1/chat/completions", json=body).headers["x-rtk-tier"] == "primary"


def test_redis_cache_is_shared_between_front_doors(triton, redis_url):
    kw = {"guard": {"fallbacks": [{"kind": "cache"}]}, "cache": {"url": redis_url, "ttl_s": 60}}
    with front_door(triton, **kw) as fd:
        _cache_roundtrip(fd)
    with front_door(triton, **kw) as other:  # a new process-local state; the answer is in Redis
        r = httpx.post(other.url + "/v1/chat/completions", json=chat_body("cache me", temperature=0))
        assert r.headers["x-rtk-tier"] == "cache"


# -- API keys ----------------------------------------------------------------------------------------------


def test_api_keys_are_required_when_configured_and_never_logged(triton, monkeypatch, caplog):
    secret = "sk-test-" + "7" * 24
    monkeypatch.setenv("RTK_TEST_KEYS", f"other-key, {secret}")
    with caplog.at_level("DEBUG"), front_door(triton, frontend={"api_keys": "env:RTK_TEST_KEYS"}) as fd:
        assert httpx.post(fd.url + "/v1/chat/completions", json=chat_body()).status_code == 401
        wrong = httpx.post(fd.url + "/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.post(
            fd.url + "/v1/chat/completions", json=chat_body(), headers={"Authorization": f"Bearer {secret}"}
        )
        assert ok.status_code == 200
        assert httpx.get(fd.url + "/health").status_code == 200  # probes need no key
    assert secret not in caplog.text


# -- the llmapi target's one model (a fake: see FAKE_LLMAPI_PY) ------------------------------------------


def test_llmapi_chat_is_rendered_with_the_template_and_mapped_to_sampling_params(triton, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there?"}]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 5,
        "stop": ["END", "\n\n"],
        "presence_penalty": 0.5,
        "stream": True,
    }
    with front_door(triton, model="tensorrt_llm", tokenizer_dir=smollm2_tokenizer_dir) as fd:
        with httpx.Client(timeout=30) as c, c.stream("POST", fd.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            events = sse_events(r)
    deltas = [e["choices"][0]["delta"].get("content") for e in events[:-1] if e["choices"]]
    seen = json.loads("".join(d for d in deltas if d))  # the deltas join to the fake's text exactly once
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir, trust_remote_code=False)
    assert seen["text_input"] == [tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)]
    assert seen["text_input.shape"] == [1]  # max_batch_size 0: no batch dimension
    assert seen["streaming"] == [True]
    assert seen["sampling_param_max_tokens"] == [7]
    assert seen["sampling_param_temperature"] == [pytest.approx(0.7)]
    assert seen["sampling_param_top_p"] == [pytest.approx(0.9)]
    assert seen["sampling_param_seed"] == [5]
    assert seen["sampling_param_stop"] == ["END", "\n\n"]
    assert seen["sampling_param_presence_penalty"] == [pytest.approx(0.5)]
    assert "sampling_param_top_k" not in seen and "sampling_param_frequency_penalty" not in seen
    assert events[-2]["choices"][0]["finish_reason"] == "length"  # the model's finish_reason
    assert events[-1] == "[DONE]"


def test_llmapi_completion_prompt_as_is_and_what_it_cannot_do_is_400(triton, smollm2_tokenizer_dir):
    with front_door(triton, model="tensorrt_llm", tokenizer_dir=smollm2_tokenizer_dir) as fd:
        c = httpx.Client(base_url=fd.url, timeout=30)
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 3})
        assert r.status_code == 200, r.text
        seen = json.loads(r.json()["choices"][0]["text"])
        assert seen["text_input"] == ["Once upon"]
        assert "sampling_param_temperature" not in seen  # the LLM API's default sampling
        for extra, param in (({"ignore_eos": True}, "ignore_eos"), ({"logprobs": 0}, "logprobs")):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_llmapi_chat_without_a_chat_template_is_400_naming_messages(triton):
    with front_door(triton, model="tensorrt_llm") as fd:
        r = httpx.post(fd.url + "/v1/chat/completions", json=chat_body(), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


# -- logprobs --------------------------------------------------------------------------------------------


def test_logprobs_are_passed_through_streamed_and_whole(triton):
    with front_door(triton, model="lp_ensemble") as fd, httpx.Client(base_url=fd.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=chat_body(logprobs=True, stream=True)) as r:
            assert r.status_code == 200, r.read()
            events = sse_events(r)
        content = [e["choices"][0] for e in events[:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
        entries = [x for ch in content for x in ch["logprobs"]["content"]]
        # The token whose character is completed later carries no text; its log-prob still comes, in order.
        assert [(x["token"], x["logprob"]) for x in entries] == [(" a", -0.25), ("", -0.5), ("é", -0.75), (" c", -1.0)]
        assert entries[2]["bytes"] == list("é".encode())
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "p", "logprobs": 0})
        lp = r.json()["choices"][0]["logprobs"]
        assert r.json()["choices"][0]["text"] == " aé c"
        assert lp["tokens"] == [" a", "", "é", " c"] and lp["token_logprobs"] == [-0.25, -0.5, -0.75, -1.0]
        assert lp["text_offset"] == [0, 2, 2, 3]
        r = c.post("/v1/chat/completions", json=chat_body())
        assert r.json()["choices"][0]["logprobs"] is None  # not asked for: not sent


def test_logprobs_where_the_deployment_cannot_are_400_naming_the_field(plain):
    c = httpx.Client(base_url=plain.url, timeout=30)
    for body, param in (
        (chat_body(logprobs=True), "logprobs"),  # this fake declares no return_log_probs
        (chat_body(logprobs=True, top_logprobs=2), "top_logprobs"),
        ({"model": MODEL, "prompt": "p", "logprobs": 3}, "logprobs"),
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = c.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_a_kept_stream_serves_the_next_request_and_a_cancelled_one_is_not_kept(plain):
    fd = plain.app.state.frontdoor
    c = httpx.Client(base_url=plain.url, timeout=30)
    for _ in range(3):
        assert c.post("/v1/chat/completions", json=chat_body()).json()["choices"][0]["message"]["content"]
    opened = fd.backend.pool.opened
    for _ in range(3):  # one after another: each reuses the call the previous one left
        r = c.post("/v1/chat/completions", json=chat_body("reuse me"))
        assert r.json()["choices"][0]["message"]["content"] == "".join(f" {t}" for t in chat_answer("reuse me"))
    assert fd.backend.pool.opened == opened


def test_the_front_door_runs_on_uvloop_where_it_is_installed(plain):
    """uvloop is one of rtk's dependencies on Linux: the front door's loop (and grpc.aio's Triton streams on it)
    is uvloop's, as measured in docs/guard-measurements.md ("uvloop under the front door")."""
    import uvloop  # a dependency wherever tritonserver runs (Linux)

    assert isinstance(plain.loop, uvloop.Loop), type(plain.loop)
    # and it serves on it: a streamed answer through Triton's gRPC stream
    with (
        httpx.Client(base_url=plain.url) as c,
        c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r,
    ):
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(r)[:-1] if e["choices"])
    assert text.split() == chat_answer()
