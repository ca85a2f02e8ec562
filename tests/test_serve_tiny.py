"""The emitted cpu repository served by a real tritonserver (the bundled one), on the tiny Llama.

One server for the module, started the way ``rtk serve --detach`` starts it and stopped the way
``rtk serve --stop`` stops it.  Token streams are compared with rtk's CPU engine run in this
process on the same checkpoint (greedy), text with the tokenizer's decoding of the same ids.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import threading
import time
import urllib.request

import numpy as np
import pytest

from toolkit.targets import build
from toolkit.triton.server import free_ports, read_state
from toolkit.triton import launch
from toolkit.triton.emit import emit

from conftest import spec_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BUILD = {"max_batch_size": 4, "max_input_len": 200, "max_seq_len": 256, "max_num_tokens": 64, "tokens_per_block": 16}
MAX_SEQ = BUILD["max_seq_len"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("served")
    http, grpc, metrics = free_ports(3)
    spec = spec_for("tiny", tiny_llama_dir, quantization={"format": "none"}, build=BUILD,
                    serving={"repository": str(root / "repo"), "http_port": http, "grpc_port": grpc, "metrics_port": metrics,
                             "context_policy": "truncate_oldest", "default_max_tokens": 16, "max_queue_size": 4})
    shutil.copytree(tiny_llama_dir, root / "quantized" / "hf")
    engine = build(spec, root / "quantized", root / "engine").path
    repo = emit(spec, engine).path
    state = launch.serve(repo, detach=True, ready_timeout_s=300)
    try:
        assert read_state(repo).pid == state.pid
        yield dict(spec=spec, repo=repo, engine=engine, grpc=state.grpc_url, http=state.http_url,
                   metrics=state.metrics_url, tokenizer_dir=tiny_llama_dir)
    finally:
        assert launch.stop(repo) is not None
        assert read_state(repo) is None


@pytest.fixture(scope="module")
def reference_engine(served):
    from toolkit.targets.cpu import load_engine

    return load_engine(served["engine"])


@pytest.fixture(scope="module")
def tokenizer(served):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served["tokenizer_dir"])


# -- a small gRPC streaming helper ----------------------------------------------------------------

def tensor(name, value, dtype):
    import tritonclient.grpc as g

    arr = np.asarray(value)
    if arr.ndim == 0:
        arr = arr.reshape(1, 1)
    elif arr.ndim == 1:
        arr = arr.reshape(1, -1)
    t = g.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def llm_inputs(ids, n, streaming=True, **extra):
    """tensorrt_llm inputs; end_id -1 (no end token: the random tiny model would stop at random)."""
    ins = [tensor("input_ids", np.array(ids, dtype=np.int32), "INT32"),
           tensor("input_lengths", np.int32(len(ids)), "INT32"),
           tensor("request_output_len", np.int32(n), "INT32"),
           tensor("end_id", np.int32(-1), "INT32"),
           tensor("streaming", np.bool_(streaming), "BOOL"),
           tensor("return_perf_metrics", np.bool_(True), "BOOL")]
    types = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32)}
    for k, v in extra.items():
        dt, np_t = types[type(v)]
        ins.append(tensor(k, np_t(v), dt))
    return ins


def text_inputs(text, max_tokens, stream=True):
    return [tensor("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
            tensor("max_tokens", np.int32(max_tokens), "INT32"),
            tensor("stream", np.bool_(stream), "BOOL"),
            tensor("end_id", np.int32(-1), "INT32"),
            tensor("exclude_input_in_output", np.bool_(True), "BOOL")]


class Stream:
    """One gRPC stream; ``send`` a request, then ``responses()`` until the final one."""

    def __init__(self, url):
        import tritonclient.grpc as g

        self.client = g.InferenceServerClient(url)
        self.q = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error, time.time_ns())))

    def send(self, model, inputs, request_id=""):
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        return self

    def next(self, timeout=60):
        return self.q.get(timeout=timeout)

    def responses(self, timeout=60):
        """All responses of one request: (outputs dict, error, arrival ns, final)."""
        out = []
        while True:
            result, error, at = self.next(timeout)
            if error is not None:
                out.append(({}, error, at, True))
                return out
            r = result.get_response()
            outs = {o.name: result.as_numpy(o.name) for o in r.outputs}
            final = r.parameters["triton_final_response"].bool_param
            out.append((outs, None, at, final))
            if final:
                return out

    def close(self, cancel=False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def run(url, model, inputs, **kw):
    s = Stream(url).send(model, inputs, **kw)
    try:
        return s.responses()
    finally:
        s.close()


def tokens_of(responses):
    return [int(t) for outs, _, _, _ in responses if "output_ids" in outs for t in outs["output_ids"].reshape(-1)]


def text_of(responses):
    return "".join(b"".join(outs["text_output"].reshape(-1)).decode() for outs, _, _, _ in responses if "text_output" in outs)


def kv_used(served) -> tuple[float, float]:
    txt = urllib.request.urlopen(served["metrics"], timeout=5).read().decode()
    used = float(re.search(r'nv_trt_llm_kv_cache_block_metrics\{[^}]*kv_cache_block_type="used"[^}]*\} (\S+)', txt).group(1))
    active = float(re.search(r'nv_trt_llm_request_metrics\{[^}]*request_type="active"[^}]*\} (\S+)', txt).group(1))
    return used, active


def wait_idle(served, timeout=10.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if kv_used(served) == (0.0, 0.0):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"KV blocks still in use after {timeout} s: {kv_used(served)}")


PROMPT = [1, 510, 3458, 282, 4649, 314]


def generate_here(engine, ids, n):
    from toolkit.runtime.engine import GenerationRequest

    return engine.generate(GenerationRequest(prompt_ids=list(ids), max_new_tokens=n, end_id=-1))


# -- tests ------------------------------------------------------------------------------------------

def test_grpc_streams_the_engine_tokens_one_response_each(served, reference_engine):
    responses = run(served["grpc"], "tensorrt_llm", llm_inputs(PROMPT, 12))
    data = [r for r in responses if "output_ids" in r[0]]
    assert len(data) == 12 and all(r[0]["output_ids"].size == 1 for r in data)
    assert [r[3] for r in responses].count(True) == 1 and responses[-1][3]
    assert tokens_of(responses) == generate_here(reference_engine, PROMPT, 12)
    first = data[0][0]
    assert first["first_token_time_ns"].item() >= first["first_scheduled_time_ns"].item() >= first["arrival_time_ns"].item() > 0
    last = data[-1][0]
    assert last["last_token_time_ns"].item() >= first["first_token_time_ns"].item()
    # preceding_ids: the prompt tail, then the previously streamed tokens
    assert data[0][0]["preceding_ids"].reshape(-1).tolist() == PROMPT
    assert data[3][0]["preceding_ids"].reshape(-1).tolist()[-3:] == tokens_of(responses)[:3]


def test_non_streaming_returns_prompt_and_answer_like_the_cpp_backend(served, reference_engine):
    ins = llm_inputs(PROMPT, 5, streaming=False, return_num_input_tokens=True, return_num_output_tokens=True)
    responses = run(served["grpc"], "tensorrt_llm", ins)
    data = [r for r in responses if "output_ids" in r[0]]
    assert len(data) == 1
    assert tokens_of(responses) == PROMPT + generate_here(reference_engine, PROMPT, 5)
    assert data[0][0]["num_input_tokens"].item() == len(PROMPT) and data[0][0]["num_output_tokens"].item() == 5


def test_ensemble_streams_text_chunks_that_join_to_the_decoded_answer(served, tokenizer):
    chat = json.dumps([{"role": "user", "content": "What is the capital of France?"}])
    streamed = run(served["grpc"], "ensemble", text_inputs(chat, 16))
    assert len([r for r in streamed if r[0].get("text_output") is not None]) >= 8
    assert streamed[-1][3] and all(r[1] is None for r in streamed)
    whole = run(served["grpc"], "ensemble", text_inputs(chat, 16, stream=False))
    assert len(whole) == 1 or (len(whole) == 2 and not whole[1][0])
    assert text_of(streamed) == text_of(whole) and text_of(whole)
    assert "\ufffd" not in text_of(streamed) or "\ufffd" in text_of(whole)


def test_http_generate_stream_sends_server_sent_events(served):
    body = json.dumps({"text_input": "The capital of France is", "max_tokens": 10, "stream": True, "end_id": -1,
                       "exclude_input_in_output": True, "return_num_output_tokens": True}).encode()
    req = urllib.request.Request(served["http"] + "/v2/models/ensemble/generate_stream", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers.get("Content-Type", "").startswith("text/event-stream")
        events = [json.loads(line[len(b"data: "):]) for line in resp.read().splitlines() if line.startswith(b"data: ")]
    assert len(events) >= 10 and all("error" not in e for e in events)
    assert [e["num_output_tokens"] for e in events[:10]] == list(range(1, 11))
    whole = json.loads(urllib.request.urlopen(urllib.request.Request(
        served["http"] + "/v2/models/ensemble/generate", method="POST",
        data=json.dumps({"text_input": "The capital of France is", "max_tokens": 10, "end_id": -1, "exclude_input_in_output": True}).encode()),
        timeout=60).read())
    assert "".join(e["text_output"] for e in events) == whole["text_output"]


def test_concurrent_requests_are_batched_in_flight_and_get_their_solo_tokens(served):
    prompts = [PROMPT, [1, 42, 43, 44], [1, 900, 901, 902, 903, 904, 905], [1, 7] * 5]
    n = 80
    solo = [tokens_of(run(served["grpc"], "tensorrt_llm", llm_inputs(p, n))) for p in prompts]  # one at a time
    streams = [Stream(served["grpc"]) for _ in prompts]  # connected before the clock starts
    results = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def one(i):
        start.wait()
        results[i] = streams[i].send("tensorrt_llm", llm_inputs(prompts[i], n)).responses()
        streams[i].close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    spans = []
    for i, responses in enumerate(results):
        assert tokens_of(responses) == solo[i], f"request {i} got other tokens when batched"
        last = [r for r in responses if "output_ids" in r[0]][-1][0]
        spans.append((last["first_scheduled_time_ns"].item(), last["last_token_time_ns"].item()))
    latest_start = max(s for s, _ in spans)
    earliest_end = min(e for _, e in spans)
    assert latest_start < earliest_end, f"the requests did not run at the same time: {spans}"
    wait_idle(served)


def test_many_short_concurrent_streams_all_complete_and_the_server_stays_up(served):
    """8 streams x 6 requests: final sends racing the cancellation watcher once crashed tritonserver
    (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled, seen at this load with the real model)."""
    failures = []

    def worker(k):
        for i in range(6):
            responses = run(served["grpc"], "tensorrt_llm", llm_inputs([1, 50 + k, 60 + i], 24))
            if responses[-1][1] is not None or len(tokens_of(responses)) != 24:
                failures.append((k, i, responses[-1][1]))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert failures == []
    wait_idle(served)


@pytest.mark.parametrize("model", ["tensorrt_llm", "ensemble", "tensorrt_llm_bls"])
def test_a_cancelled_stream_frees_its_kv_blocks(served, model):
    if model == "tensorrt_llm":
        ins = llm_inputs(PROMPT, MAX_SEQ - len(PROMPT))
    else:
        ins = text_inputs("Tell me a long story.", 200)
    wait_idle(served)
    s = Stream(served["grpc"]).send(model, ins)
    for _ in range(3):
        result, error, _ = s.next()
        assert error is None
    deadline = time.monotonic() + 2
    while kv_used(served) == (0.0, 0.0) and time.monotonic() < deadline:  # the gauges update every 50 ms
        time.sleep(0.02)
    used, active = kv_used(served)
    assert used >= 1 and active == 1
    s.close(cancel=True)
    assert wait_idle(served, timeout=5.0) < 5.0


def test_stop_input_cancels_the_request_with_that_id(served):
    s = Stream(served["grpc"]).send("tensorrt_llm", llm_inputs(PROMPT, MAX_SEQ - len(PROMPT)), request_id="ask-1")
    s.next()
    stop = run(served["grpc"], "tensorrt_llm", llm_inputs([1], 1, stop=True), request_id="ask-1")
    assert stop[-1][1] is None
    rest = s.responses()
    s.close()
    assert rest[-1][3] and len(tokens_of(rest)) < MAX_SEQ - len(PROMPT) - 1
    wait_idle(served)


def test_bad_requests_get_clear_errors_while_others_are_served(served, reference_engine):
    long = Stream(served["grpc"]).send("tensorrt_llm", llm_inputs(PROMPT, 40))
    bad = {
        "ensemble-empty": ("ensemble", text_inputs("", 8), "text_input is empty"),
        "ensemble-max_tokens": ("ensemble", text_inputs("hello", 10_000), "max_tokens 10000 is over the engine limit"),
        "llm-max_tokens": ("tensorrt_llm", llm_inputs(PROMPT, MAX_SEQ), "exceeds max_seq_len"),
        "llm-beam": ("tensorrt_llm", llm_inputs(PROMPT, 4, beam_width=2), "beam_width 2 is not supported"),
        "bls-empty": ("tensorrt_llm_bls", text_inputs(" ", 8), "text_input is empty"),
    }
    for name, (model, ins, message) in bad.items():
        responses = run(served["grpc"], model, ins)
        error = responses[-1][1]
        assert error is not None and message in str(error), (name, error)
    good = long.responses()
    long.close()
    assert all(r[1] is None for r in good)
    assert tokens_of(good) == generate_here(reference_engine, PROMPT, 40)


def test_requests_beyond_the_batch_and_queue_are_refused_and_the_rest_served(served):
    """max_batch_size 4 + max_queue_size 4: of 11 long requests at once, some are refused with
    UNAVAILABLE ("Exceeds maximum queue size") and every other one completes."""
    streams = [Stream(served["grpc"]) for _ in range(11)]
    for s in streams:
        s.send("tensorrt_llm", llm_inputs(PROMPT, 120))
    outcomes = []
    for s in streams:
        outcomes.append(s.responses())
        s.close()
    refused = [r[-1][1] for r in outcomes if r[-1][1] is not None]
    served_ok = [r for r in outcomes if r[-1][1] is None]
    assert refused and all("Exceeds maximum queue size" in str(e) for e in refused), refused
    assert len(served_ok) >= 8 and all(len(tokens_of(r)) == 120 for r in served_ok)
    wait_idle(served)


def test_a_long_conversation_drops_its_oldest_turns_and_says_so(served, tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(8):
        msgs += [{"role": "user", "content": f"question {i} " + "word " * 12}, {"role": "assistant", "content": f"answer {i} " + "word " * 12}]
    msgs.append({"role": "user", "content": "last question?"})
    for model in ("ensemble", "tensorrt_llm_bls"):
        responses = run(served["grpc"], model, text_inputs(json.dumps(msgs), 8))
        assert responses[-1][1] is None, responses[-1][1]
        dropped = {int(r[0]["dropped_turns"].item()) for r in responses if "dropped_turns" in r[0]}
        assert len(dropped) == 1 and dropped.pop() >= 1, model


def test_postprocessing_model_decodes_split_characters_whole(served, tokenizer):
    """The served postprocessing model, fed one token at a time with PRECEDING_IDS as the cpu model sends them."""
    import tritonclient.grpc as g

    text = "Paris 🙂 東京 café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    client = g.InferenceServerClient(served["grpc"])
    chunks = []
    for k in range(len(ids)):
        ins = [tensor("TOKENS_BATCH", np.array([[[ids[k]]]], dtype=np.int32), "INT32"),
               tensor("SEQUENCE_LENGTH", np.array([1], dtype=np.int32), "INT32"),
               tensor("PRECEDING_IDS", np.array(ids[max(0, k - 8):k], dtype=np.int32), "INT32")]
        if k == 0:
            ins = ins[:2]  # nothing precedes the first token
        out = client.infer("postprocessing", ins)
        chunks.append(out.as_numpy("OUTPUT").reshape(-1)[0].decode("utf-8"))
    client.close()
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
