"""The front door over the emitted cpu repository of the tiny Llama, served by a real tritonserver.

What only the real engine shows: the answer equals Triton's own, a client that leaves frees its KV
blocks in the engine, Triton's own overload refusal becomes 429 (never 400), and a prompt over the
window is a 400 naming the field.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
import time

import httpx
import pytest
from conftest import spec_for
from triton_helpers import model_successes, running_server

from toolkit.frontdoor import FrontDoorServer, create_app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BUILD = {"max_batch_size": 2, "max_input_len": 96, "max_seq_len": 160, "max_num_tokens": 64, "tokens_per_block": 16}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_dir):
    from toolkit.targets import build
    from toolkit.triton.emit import emit

    root = tmp_path_factory.mktemp("fd_engine")
    spec = spec_for(
        "tiny-fd",
        tiny_llama_dir,
        quantization={"format": "none"},
        build=BUILD,
        serving={
            "repository": str(root / "repo"),
            "context_policy": "reject",
            "default_max_tokens": 8,
            "max_queue_size": 1,
            "warmup": False,
        },
    )
    shutil.copytree(tiny_llama_dir, root / "quantized" / "hf")
    engine = build(spec, root / "quantized", root / "engine").path
    repo = emit(spec, engine).path
    with running_server(repo, ready_timeout_s=300) as triton:
        app = create_app(repo, triton.grpc_url, metrics_url=triton.metrics_url)
        with FrontDoorServer(app, "127.0.0.1", _port()) as fd:
            yield {"fd": fd.url, "triton": triton, "model": spec.name, "repo": repo, "app": app}


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gauge(metrics_url: str, name: str, label: str) -> int:
    text = httpx.get(metrics_url + "/metrics").text
    return sum(int(float(v)) for v in re.findall(rf'^{name}\{{[^}}]*="{label}"[^}}]*\}} (\S+)', text, re.M))


def test_the_answer_is_tritons_answer(served):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": served["model"], "messages": messages, "max_tokens": 8, "temperature": 0}
    r = httpx.post(served["fd"] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    direct = httpx.post(
        f"{served['triton'].http_url}/v2/models/ensemble/generate",
        timeout=60,
        json={
            "text_input": json.dumps(messages),
            "max_tokens": 8,
            "exclude_input_in_output": True,
            "return_num_input_tokens": True,
        },
    ).json()
    assert got["choices"][0]["message"]["content"] == direct["text_output"]
    assert got["usage"]["prompt_tokens"] == direct["num_input_tokens"]
    assert got["usage"]["completion_tokens"] == 8 and got["choices"][0]["finish_reason"] == "length"


def test_a_client_that_leaves_frees_its_kv_blocks(served):
    metrics = served["triton"].metrics_url
    lengths = served["app"].state.frontdoor.estimator.lengths
    samples = len(lengths)
    body = {
        "model": served["model"],
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 140,
        "stream": True,
    }
    with httpx.Client(timeout=60) as c, c.stream("POST", served["fd"] + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert _gauge(metrics, "nv_trt_llm_kv_cache_block_metrics", "used") > 0
                break
    deadline = time.monotonic() + 10
    while _gauge(metrics, "nv_trt_llm_kv_cache_block_metrics", "used") > 0:
        assert time.monotonic() < deadline, "the engine kept the KV blocks of a request whose client left"
        time.sleep(0.1)
    assert _gauge(metrics, "nv_trt_llm_request_metrics", "active") == 0
    assert len(lengths) == samples  # an answer cut short by its client says nothing of how long answers run


def test_answers_that_ran_to_their_end_are_the_admissions_samples_of_answer_length(served):
    """Admission predicts when a running request frees its batch slot from how long recent answers ran: one that
    stopped (here at a stop string) counts its tokens, one cut at its max_tokens counts as running on."""
    lengths = served["app"].state.frontdoor.estimator.lengths
    body = {"model": served["model"], "temperature": 0, "ignore_eos": True, "prompt": "The quick brown fox"}
    cut = httpx.post(served["fd"] + "/v1/completions", json={**body, "max_tokens": 16}, timeout=60).json()
    text = cut["choices"][0]["text"]
    assert cut["choices"][0]["finish_reason"] == "length" and lengths[-1] == math.inf
    # The same answer, stopped by a word of its middle (stop words match as tokens): it ends before its 16 tokens.
    samples = len(lengths)
    stop = " " + text.split()[3]
    stopped = httpx.post(served["fd"] + "/v1/completions", json={**body, "max_tokens": 16, "stop": [stop]}, timeout=60)
    got = stopped.json()
    assert got["choices"][0]["finish_reason"] == "stop" and got["usage"]["completion_tokens"] < 16, (text, got)
    assert list(lengths)[samples:] == [got["usage"]["completion_tokens"]]


def test_tritons_queue_full_is_429_never_400(served):
    # max_batch_size 2 + max_queue_size 1: the 4th simultaneous request is refused by the engine.
    body = {
        "model": served["model"],
        "messages": [{"role": "user", "content": "Count to a hundred."}],
        "max_tokens": 120,
        "ignore_eos": True,  # every request decodes all 120 tokens: the six overlap however early EOS comes
    }
    results = []
    start = threading.Barrier(6)
    # each thread's client made and connected before the barrier: the six requests leave together (a client
    # made after it took long enough on a loaded host that the first requests were answered before the last
    # was sent, and none was refused)
    clients = [httpx.Client(timeout=120) for _ in range(6)]
    for c in clients:
        assert c.get(served["fd"] + "/health").status_code == 200

    def one(client):
        start.wait(30)
        r = client.post(served["fd"] + "/v1/chat/completions", json=body)
        results.append((r.status_code, r.headers.get("retry-after"), r.headers.get("x-rtk-tier"), r.text))

    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for c in clients:
        c.close()
    statuses = sorted(s for s, *_ in results)
    assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}, results
    for status, retry, tier, text in results:
        if status == 429:
            assert int(retry) >= 1 and tier == "refused" and "queue" in json.loads(text)["error"]["message"]


def test_a_prompt_over_the_window_is_400_naming_messages(served):
    body = {"model": served["model"], "messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 8}
    r = httpx.post(served["fd"] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    ok = httpx.post(
        served["fd"] + "/v1/chat/completions",
        timeout=60,
        json={**body, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert ok.status_code == 200


def test_the_launch_starts_and_stops_the_front_door_with_the_server(served):
    """``launch.running`` (rtk chat, slo --serve) and the detached path (rtk serve --detach / --stop)."""
    import os

    from toolkit.triton import launch
    from toolkit.triton.server import read_state

    repo = served["repo"]
    with launch.running(repo, free_ports=True) as server:
        assert server.frontdoor_url and httpx.get(server.frontdoor_url + "/health").status_code == 200
        body = {"model": served["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(server.frontdoor_url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        url = server.frontdoor_url
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)

    state = launch.serve(repo, detach=True, free_ports=True)
    try:
        assert state.frontdoor_url and state.frontdoor_pid
        recorded = read_state(repo)
        assert (recorded.frontdoor_url, recorded.frontdoor_pid) == (state.frontdoor_url, state.frontdoor_pid)
        assert httpx.get(state.frontdoor_url + "/health", timeout=10).json()["ready"] is True
    finally:
        launch.stop(repo)
    assert read_state(repo) is None
    with pytest.raises(ProcessLookupError):
        os.kill(state.frontdoor_pid, 0)


def test_logprobs_are_the_engines_and_match_transformers(served, tiny_llama_dir):
    """logprobs through the front door are the engine's output_log_probs, one per generated token; the first
    token's (which depends on the prompt only: rtk's preprocessing renders the chat template and encodes it
    without special tokens) is what transformers computes.  Later tokens are not compared: this random tiny
    model's greedy continuation drifts between the engine's bf16 kernels and transformers'."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    n = 6
    body = {"model": served["model"], "messages": messages, "max_tokens": n, "logprobs": True, "ignore_eos": True}
    r = httpx.post(served["fd"] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    entries = got["choices"][0]["logprobs"]["content"]
    assert len(entries) == n == got["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in entries) == got["choices"][0]["message"]["content"]
    assert all(e["logprob"] <= 0 for e in entries)

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir, trust_remote_code=False)
    ids = tok.encode(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    assert len(ids) == got["usage"]["prompt_tokens"]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    first = int(torch.argmax(logp))
    assert entries[0]["token"] == tok.decode([first], skip_special_tokens=True)
    assert entries[0]["logprob"] == pytest.approx(float(logp[first]), abs=0.05)


def test_the_primary_path_answers_as_the_ensemble_does(served):
    """By default the front door sends token ids straight to ``tensorrt_llm`` (its own pre/postprocessing:
    toolkit/frontdoor/tokens.py); with ``primary_model: ensemble`` it sends text through the ensemble.  Both
    give the same answers, usage and log-probs for chat and plain prompts, stop strings and ignore_eos, and
    the default path leaves the ensemble's models idle."""
    from toolkit.frontdoor.config import config_from

    repo, triton, model = served["repo"], served["triton"], served["model"]
    via_ensemble = config_from(repo)
    assert via_ensemble.primary_model == "tensorrt_llm"
    via_ensemble.frontend.primary_model = "ensemble"
    assert via_ensemble.primary_model == "ensemble"
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    bodies = [
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 8}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 12, "ignore_eos": True, "logprobs": True}),
        ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 10, "ignore_eos": True}),
        ("/v1/completions", {"prompt": "One, two, three,", "max_tokens": 16, "stop": [","], "ignore_eos": True}),
    ]

    def answers(url: str) -> list[dict]:
        out = []
        for path, body in bodies:
            r = httpx.post(url + path, json={"model": model, "temperature": 0, **body}, timeout=60)
            assert r.status_code == 200, r.text
            got = r.json()
            choice = got["choices"][0]
            out.append(
                {
                    "text": choice.get("message", {}).get("content", choice.get("text")),
                    "finish": choice["finish_reason"],
                    "usage": got["usage"],
                    "logprobs": choice.get("logprobs"),
                }
            )
        return out

    before = {m: model_successes(triton.http_url, m) for m in ("postprocessing", "tensorrt_llm")}
    direct = answers(served["fd"])
    after = {m: model_successes(triton.http_url, m) for m in ("postprocessing", "tensorrt_llm")}
    assert after["postprocessing"] == before["postprocessing"], "the default path went through the ensemble"
    assert after["tensorrt_llm"] >= before["tensorrt_llm"] + len(bodies)

    with FrontDoorServer(create_app(via_ensemble, triton.grpc_url), "127.0.0.1", _port()) as fd:
        through_ensemble = answers(fd.url)
    assert model_successes(triton.http_url, "postprocessing") > after["postprocessing"]
    for (path, body), a, b in zip(bodies, direct, through_ensemble, strict=True):
        assert a["text"] == b["text"] and a["finish"] == b["finish"] and a["usage"] == b["usage"], (path, body, a, b)
        if body.get("logprobs"):
            got = [t["logprob"] for t in a["logprobs"]["content"]]
            want = [t["logprob"] for t in b["logprobs"]["content"]]
            assert len(got) == body["max_tokens"] and got == pytest.approx(want, abs=1e-6)


def test_admission_counts_the_prompt_ids_the_primary_path_sends(served):
    """On the default path the front door tokenises before admission, so the prediction counts the very ids it
    sends (the chat template's own tokens included): a request refused for its deadline names as many prompt
    tokens as the same request is billed when it is served."""
    body = {
        "model": served["model"],
        "messages": [{"role": "user", "content": "Name three rivers of Europe, briefly."}],
        "max_tokens": 4,
    }
    r = httpx.post(served["fd"] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    billed = r.json()["usage"]["prompt_tokens"]
    r = httpx.post(
        served["fd"] + "/v1/chat/completions", json=body, headers={"x-rtk-ttft-deadline-ms": "0.001"}, timeout=60
    )
    assert r.status_code == 429 and r.headers["x-rtk-tier"] == "refused", r.text
    # The same prompt again: its leading full blocks are in the engine's prefix cache, and the message says so.
    pattern = r"for (\d+) prompt tokens(?: to prefill \((\d+) in all, (\d+) in the engine's prefix cache\))?"
    counted = re.search(pattern, r.json()["error"]["message"])
    assert counted is not None and int(counted.group(2) or counted.group(1)) == billed, (r.json(), billed)


def test_admission_counts_out_the_prefix_the_engine_has_cached(served, tiny_llama_dir):
    """A prompt that shares its system prompt with one served before is predicted for what the engine prefills:
    the refusal names the prompt's tokens in all, those in the engine's prefix cache (the full 16-token blocks
    the two prompts share) and the rest."""
    from transformers import AutoTokenizer

    system = "You answer questions about the rivers, mountains and cities of Europe in one short sentence."

    def messages(question):
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    first = {"model": served["model"], "messages": messages("Name a long river."), "max_tokens": 2}
    r = httpx.post(served["fd"] + "/v1/chat/completions", json=first, timeout=60)
    assert r.status_code == 200, r.text
    second = {**first, "messages": messages("Which mountain is the highest?")}
    r = httpx.post(
        served["fd"] + "/v1/chat/completions", json=second, headers={"x-rtk-ttft-deadline-ms": "0.001"}, timeout=60
    )
    assert r.status_code == 429, r.text
    message = r.json()["error"]["message"]
    pattern = r"for (\d+) prompt tokens to prefill \((\d+) in all, (\d+) in the engine's prefix cache\)"
    found = re.search(pattern, message)
    assert found is not None, message
    to_prefill, total, cached = map(int, found.groups())

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir, trust_remote_code=False)

    def ids(body):
        text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    a, b = ids(first), ids(second)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    tpb = BUILD["tokens_per_block"]
    assert total == len(b) and cached == min(shared // tpb, (len(b) - 1) // tpb) * tpb > 0
    assert to_prefill == total - cached
