"""Front-door parts that need no server: request validation, the cache key, the TTFT prediction, gauges."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from toolkit.frontdoor.admission import Estimator
from toolkit.frontdoor.protocol import (
    APIError,
    ContentFramer,
    GenRequest,
    chunk,
    logprob_items,
    logprobs_field,
    parse_request,
    sse,
)
from toolkit.frontdoor.tiers import Answer, MemoryCache, read_secret
from toolkit.frontdoor.triton import MetricsReader, TritonBackend, parse_gauges


def parse(body, kind="chat"):
    return parse_request(kind, body, served_model="m", max_seq_len=256, default_max_tokens=16)


def chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def test_defaults_and_text_parts():
    r = parse(
        chat(
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        )
    )
    assert r.max_tokens == 16 and r.temperature is None and r.deterministic
    assert r.messages[-1] == {"role": "user", "content": "ab"}


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 256}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"stop": ["a"] * 5}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"ttft_deadline_ms": -1}, "ttft_deadline_ms"),
        ({"tools": [{}]}, "tools"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_bad_values_name_the_field(kw, param):
    with pytest.raises(APIError) as info:
        parse(chat(**kw))
    assert info.value.status == 400 and info.value.param == param


def test_cache_key_is_exact_on_what_changes_the_answer():
    base = parse(chat(temperature=0))
    assert base.cache_key() == parse(chat()).cache_key()  # no temperature = greedy = temperature 0
    assert base.cache_key() == parse(chat(temperature=0, top_p=0.5)).cache_key()  # top_p is unused when greedy
    assert base.cache_key() != parse(chat(temperature=0, max_tokens=3)).cache_key()
    assert base.cache_key() != parse(chat(messages=[{"role": "user", "content": "hi!"}])).cache_key()
    seeded = parse(chat(temperature=0.8, seed=1))
    assert seeded.deterministic and seeded.cache_key() != parse(chat(temperature=0.8, seed=2)).cache_key()
    assert not parse(chat(temperature=0.8)).deterministic


def test_memory_cache_ttl_and_size():
    async def run():
        c = MemoryCache(ttl_s=0.05, max_entries=2)
        for k in "abc":
            await c.put(k, Answer(k))
        assert await c.get("a") is None and (await c.get("c")).text == "c"  # 'a' was the least recently used
        time.sleep(0.06)
        assert await c.get("c") is None

    asyncio.run(run())


def test_prediction_grows_with_the_work_ahead_and_waits_for_a_slot():
    e = Estimator(max_batch=2, step_s=0.02, prefill_s_per_token=0.001)
    idle = e.predict(100)
    assert idle.ttft_s == pytest.approx(0.02 + 0.1)
    e.admit("a", 50, e.predict(400))  # waiting for its first token: its prompt is ahead
    assert e.predict(100).tokens_ahead == 400 and e.predict(100).ttft_s > idle.ttft_s
    e.first_token("a")
    e.admit("b", 50, e.predict(10))
    e.first_token("b")
    full = e.predict(100)  # both slots decode: wait for the one with the fewest tokens left
    assert full.slot_wait_s == pytest.approx(50 * e.step_s)


def test_the_slot_wait_follows_how_long_answers_run():
    """Until MIN_LENGTH_SAMPLES answers have ended, a running request holds its slot for its max_tokens; after,
    for the median length of the answers that outlived its tokens so far (those cut at their max_tokens count
    as running on), never past its max_tokens."""
    from toolkit.frontdoor.admission import MIN_LENGTH_SAMPLES

    def estimator(ended: list[tuple[int, bool]]) -> Estimator:
        e = Estimator(max_batch=2, step_s=0.01, prefill_s_per_token=0.0, alpha=0.0)
        for i, (n, stopped) in enumerate(ended):
            e.admit(f"old{i}", 100, e.predict(1))
            e.finish(f"old{i}", n, stopped=stopped)
        for rid, seen in (("a", 5), ("b", 30)):  # both slots decode, with 5 and 30 tokens out of 100
            e.admit(rid, 100, e.predict(1))
            e.first_token(rid)
            e.token(rid, seen)
        return e

    few = [(20, True)] * (MIN_LENGTH_SAMPLES - 1)
    assert estimator(few).predict(1).slot_wait_s == pytest.approx((100 - 30) * 0.01)
    # Answers end at 20 or 40 tokens, three in four at 20: "a" (5 seen) is predicted to end at 20, the median of
    # all; "b" (30 seen) at 40, the median of those that outlived 30.  The sooner slot is b's, 10 tokens away.
    e = estimator([(20, True)] * 3 * MIN_LENGTH_SAMPLES + [(40, True)] * MIN_LENGTH_SAMPLES)
    assert e.tokens_left(e.inflight["a"]) == 20 - 5 and e.tokens_left(e.inflight["b"]) == 40 - 30
    assert e.predict(1).slot_wait_s == pytest.approx((40 - 30) * 0.01)
    e = estimator([(20, True), (40, True)] * MIN_LENGTH_SAMPLES)  # half at 40: the median of all is 40
    assert e.tokens_left(e.inflight["a"]) == 40 - 5
    # Every answer cut at its max_tokens: nothing is known about where they would end, so max_tokens stands.
    cut = estimator([(100, False)] * 2 * MIN_LENGTH_SAMPLES)
    assert cut.predict(1).slot_wait_s == pytest.approx((100 - 30) * 0.01)
    # A request longer than every answer seen runs to its max_tokens.
    short = estimator([(4, True)] * 2 * MIN_LENGTH_SAMPLES)
    assert short.predict(1).slot_wait_s == pytest.approx((100 - 30) * 0.01)
    # Cancelled answers are not samples; the window keeps the latest ones, in step with its sorted copy.
    e = estimator([(20, True)] * 300)
    e.finish("a")
    assert len(e.lengths) == 256 and e._lengths_sorted == sorted(e.lengths)
    for i in range(256):
        e._add_sorted(e.lengths, e._lengths_sorted, 50 + i % 7)
    assert e._lengths_sorted == sorted(e.lengths) and min(e.lengths) == 50


def test_requests_waiting_ahead_take_the_slots_in_turn_each_for_its_length():
    """Two slots decode with 10 and 30 tokens left; three requests wait ahead (max_tokens 5, 50, 5).  The first
    takes the slot free at 10 and frees it at 15, the second takes that one until 65, the third the one free at
    30 until 35: a new request starts at step 35 (the batch-by-batch count it replaced said 30 + 50)."""
    e = Estimator(max_batch=2, step_s=0.01, prefill_s_per_token=0.0, alpha=0.0)
    for rid, left in (("a", 10), ("b", 30)):
        e.admit(rid, 40, e.predict(1))
        e.first_token(rid)
        e.token(rid, 40 - left)
    for i, n in enumerate((5, 50, 5)):
        e.admit(f"w{i}", n, e.predict(1))
    p = e.predict(1)
    assert p.requests_ahead == 3 and p.slot_wait_s == pytest.approx(35 * 0.01)
    e.finish("w2")  # with two waiting: 10 -> 15 -> 65 and 30 (b's slot) is the new request's
    assert e.predict(1).slot_wait_s == pytest.approx(30 * 0.01)

    class Gauges:  # the engine holds a request of another client beyond ours: it waits ahead, its length unknown
        present, max_batch, active = True, 2, 6  # our 4, w2 (just ended: the gauge may still count it) and one

        def __init__(self):
            self.read_at = time.monotonic()

    # It takes the slot free at 10 for max_tokens (the longest of ours, 50) until 60; w0 the one free at 30 until
    # 35; w1 that one until 85: the new request starts at 60.
    assert e.predict(1, Gauges()).slot_wait_s == pytest.approx(60 * 0.01)


def test_a_chunked_prompt_beside_decoding_requests_takes_the_steps_their_rows_leave_it():
    """With chunked prompts an engine step holds ``max_num_tokens`` tokens, one per decoding request: a prompt
    arriving beside 7 of them gets 24 - 7 = 17 tokens a step, so 42 tokens take 3 steps (and half of the one
    running), however cheap the learned per-token prefill makes them look."""
    kw = dict(max_batch=8, step_s=0.04, prefill_s_per_token=0.0005, alpha=0.0)  # alpha 0: nothing learned here
    chunked, whole = Estimator(**kw, step_tokens=24), Estimator(**kw)
    idle = 0.04 + 42 * 0.0005
    assert chunked.predict(42).ttft_s == pytest.approx(idle)  # nobody decodes: the prompt runs whole
    for e in (chunked, whole):
        for i in range(7):
            e.admit(str(i), 32, e.predict(40))
            e.first_token(str(i))
    assert chunked.predict(42).ttft_s == pytest.approx(3.5 * 0.04)
    assert whole.predict(42).ttft_s == pytest.approx(idle)  # without chunking: the per-token model alone
    assert chunked.predict(4).ttft_s == pytest.approx(max(idle - 38 * 0.0005, 1.5 * 0.04))  # one step


def test_the_step_budget_comes_from_the_spec_only_when_prompts_are_chunked(tmp_path):
    from toolkit.frontdoor import create_app
    from toolkit.frontdoor.config import config_from
    from toolkit.spec import spec_from_dict

    def spec(**build):
        return spec_from_dict({"name": "p", "build": build, "serving": {"repository": str(tmp_path / "repo")}})

    cfg = config_from(spec(max_num_tokens=24))
    assert cfg.step_tokens == 24
    app = create_app(cfg, "grpc://127.0.0.1:1")
    assert app.state.frontdoor.replicas[0].estimator.step_tokens == 24
    whole = spec(max_num_tokens=2048, enable_chunked_context=False)
    assert config_from(whole).step_tokens is None


def test_the_prefix_cache_comes_from_the_spec_where_the_engine_reuses_blocks(tmp_path):
    from toolkit.frontdoor import create_app
    from toolkit.frontdoor.config import config_from
    from toolkit.spec import spec_from_dict

    def spec(**build):
        return spec_from_dict({"name": "p", "build": build, "serving": {"repository": str(tmp_path / "repo")}})

    cfg = config_from(spec(max_batch_size=4, max_input_len=128, max_seq_len=256, tokens_per_block=16))
    assert cfg.prefix_cache == (16, 4 * 16)  # the cpu engine's default pool: max_batch_size full sequences
    estimator = create_app(cfg, "grpc://127.0.0.1:1").state.frontdoor.replicas[0].estimator
    assert (estimator.prefix.tpb, estimator.prefix.capacity) == (16, 64)
    assert config_from(spec(tokens_per_block=16, kv_cache_blocks=200)).prefix_cache == (16, 200)
    assert config_from(spec(enable_kv_cache_reuse=False)).prefix_cache is None


def test_the_prefix_cache_counts_the_leading_full_blocks_it_holds_and_forgets_the_oldest():
    from toolkit.frontdoor.admission import PrefixCache

    cache = PrefixCache(tokens_per_block=4, capacity=5)
    system = list(range(100, 108))  # two full blocks
    cache.add(system + [1, 2, 3])  # its two full blocks; the partial third is not kept
    assert cache.cached_tokens(system + [7, 8, 9, 10, 11]) == 8
    assert cache.cached_tokens(system) == 4  # the last token must run: only (len - 1) // 4 blocks count
    assert cache.cached_tokens([100, 101, 102, 999] + system[4:] + [5]) == 0  # a block differs: the chain breaks
    assert cache.cached_tokens(system[4:] + system[:4] + [1]) == 0  # same tokens, other place: another key
    cache.add(list(range(200, 212)))  # three more blocks: 5 held, none evicted yet
    assert cache.cached_tokens(system + [1]) == 8
    cache.add(list(range(300, 304)))  # a sixth: the least recently used (the system prompt's first) goes
    assert cache.cached_tokens(system + [1]) == 0 and cache.cached_tokens(list(range(200, 213))) == 12


def test_the_prefix_cache_hashes_a_request_once_and_never_reuses_a_changed_prompts_chain(monkeypatch):
    from toolkit.frontdoor import admission

    cache = admission.PrefixCache(tokens_per_block=4, capacity=16)
    cache.add(list(range(12)))
    ids = list(range(8)) + [50, 51, 52, 53, 54]  # 3 full blocks, the first two held
    hashed = []
    monkeypatch.setattr(admission, "hash", lambda v: hashed.append(v) or hash(v), raising=False)
    assert cache.cached_tokens(ids) == 8  # the prediction
    cache.add(ids)  # the admission: the same list, its blocks are not hashed again
    assert len(hashed) == 3
    ids.append(55)  # a changed prompt (here: longer) is hashed anew
    assert cache.cached_tokens(ids) == 12 and len(hashed) == 6


def test_the_prefix_cache_counts_what_the_cpu_engine_reuses(tiny_llama_dir):
    """Against the real engine's block reuse (kv_cache.BlockManager through the scheduler): prompts sharing
    system prompts of several lengths, each sent once the one before it has finished; the front door's count
    of cached tokens equals the engine's reused blocks times the block size, for every prompt."""
    import random

    from toolkit.frontdoor.admission import PrefixCache
    from toolkit.runtime.engine import Engine, EngineConfig, GenerationRequest

    tpb = 16
    engine = Engine(
        tiny_llama_dir,
        EngineConfig(max_batch_size=2, max_seq_len=256, max_input_len=200, tokens_per_block=tpb, max_num_tokens=256),
    )
    mirror = PrefixCache(tpb, engine.blocks.num_blocks)
    rng = random.Random(0)
    systems = [[rng.randrange(100, 1000) for _ in range(n)] for n in (15, 16, 40, 47, 64)]
    counted, reused = [], []
    for _ in range(24):
        ids = rng.choice(systems) + [rng.randrange(100, 1000) for _ in range(rng.randrange(1, 40))]
        counted.append(mirror.cached_tokens(ids))
        rid = engine.add_request(GenerationRequest(ids, 3, end_id=-1))
        engine.step()
        reused.append(engine.request_stats(rid)["reused_blocks"] * tpb)
        mirror.add(ids)
        while engine.has_work():
            engine.step()
    assert counted == reused and sum(reused) > 0
    assert engine.blocks.evicted_total > 0  # the 32-block pool evicted on the way: the LRUs agree too


def test_estimates_follow_the_measurements():
    e = Estimator(max_batch=8, step_s=0.05, prefill_s_per_token=0.002, alpha=1.0)
    e.admit("a", 10, e.predict(100))
    e.inflight["a"].arrival -= 0.5  # the first token came 0.5 s after arrival
    e.first_token("a")
    assert e.prefill_s_per_token == pytest.approx((0.5 - 0.05) / 100, rel=0.05)


def _served(e: Estimator, rid: str, measured_over_predicted: float, prompt: int = 10) -> None:
    """Admit ``rid`` and give it its first token at ``measured_over_predicted`` times its prediction."""
    p = e.predict(prompt)
    e.admit(rid, 4, p)
    e.inflight[rid].arrival -= p.ttft_s * measured_over_predicted  # the first token came that long after arrival
    e.first_token(rid)
    e.finish(rid)


def test_the_deadline_bound_is_the_prediction_times_its_recent_errors_quantile():
    from toolkit.frontdoor.admission import ERROR_WINDOW, MIN_ERROR_SAMPLES

    # alpha 0: the speed estimates stay put, so every prediction is the same and only the error moves
    e = Estimator(max_batch=8, step_s=0.02, prefill_s_per_token=0.001, alpha=0.0, quantile=0.9)
    for i in range(MIN_ERROR_SAMPLES - 1):
        _served(e, f"a{i}", 2.0)
    p = e.predict(10)
    assert e.margin() == 1.0 and p.bound_s == p.ttft_s  # too few first tokens yet: the prediction is the bound
    _served(e, "last", 2.0)
    p = e.predict(10)
    assert e.margin() == pytest.approx(2.0, rel=1e-3) and p.bound_s == pytest.approx(2.0 * p.ttft_s, rel=1e-3)
    # The quantile, not the mean or the worst: 9 in 10 at 1.1, 1 in 10 at 3.0 -> the 0.9 quantile is 1.1 and
    # the 0.95 one 3.0.
    for q, want in ((0.9, 1.1), (0.95, 3.0)):
        e = Estimator(max_batch=8, step_s=0.02, prefill_s_per_token=0.001, alpha=0.0, quantile=q)
        for i in range(100):
            _served(e, f"r{i}", 3.0 if i % 10 == 0 else 1.1)
        assert e.margin() == pytest.approx(want, rel=1e-3)
    # Never below the prediction: answers that came sooner than predicted leave the bound at the prediction.
    early = Estimator(max_batch=8, step_s=0.02, prefill_s_per_token=0.001, alpha=0.0, quantile=0.9)
    for i in range(2 * MIN_ERROR_SAMPLES):
        _served(early, f"r{i}", 0.5)
    assert early.margin() == 1.0
    # The window keeps the latest ERROR_WINDOW errors: once the engine keeps its predictions again, the margin
    # goes back to 1.
    for i in range(ERROR_WINDOW):
        _served(e, f"s{i}", 1.0)
    assert e.margin() == pytest.approx(1.0, rel=1e-3) and e._errors_sorted == sorted(e.errors)
    # Off: the prediction alone is checked.
    off = Estimator(max_batch=8, step_s=0.02, prefill_s_per_token=0.001, alpha=0.0, quantile=None)
    for i in range(2 * MIN_ERROR_SAMPLES):
        _served(off, f"r{i}", 2.0)
    assert off.margin() == 1.0 and off.predict(10).bound_s == off.predict(10).ttft_s


def test_a_request_of_ours_that_just_ended_is_not_counted_again_from_the_engines_gauge():
    """The engine's gauge is set every few tens of ms and read every 100 ms, so right after our request ends it
    may still count it: a closed loop's next request must not see it as another client's request ahead."""
    from toolkit.frontdoor.admission import GAUGE_LAG_S
    from toolkit.frontdoor.triton import EngineGauges

    e = Estimator(max_batch=8, step_s=0.02, prefill_s_per_token=0.001, mean_prompt=60)
    e.admit("a", 8, e.predict(40))
    e.first_token("a")
    e.finish("a")
    stale = EngineGauges(active=1, max_batch=8, present=True, read_at=time.monotonic())  # read just after it ended
    p = e.predict(40, stale)
    assert (p.requests_ahead, p.tokens_ahead) == (0, 0)
    other = EngineGauges(active=2, max_batch=8, present=True, read_at=time.monotonic())  # and one other client's
    assert e.predict(40, other).requests_ahead == 1 and e.predict(40, other).tokens_ahead == int(e.mean_prompt)
    e.ended[-1] -= 2 * GAUGE_LAG_S  # ended long before the read: the gauge's 1 is someone else's
    assert e.predict(40, stale).requests_ahead == 1


def test_gauges_are_summed_over_instances():
    text = """# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{instance="a",model="tensorrt_llm",request_type="active",version="1"} 3
nv_trt_llm_request_metrics{instance="b",model="tensorrt_llm",request_type="active",version="1"} 2
nv_trt_llm_request_metrics{instance="a",model="tensorrt_llm",request_type="max",version="1"} 8
nv_trt_llm_kv_cache_block_metrics{instance="a",kv_cache_block_type="free",model="tensorrt_llm",version="1"} 40
"""
    g = parse_gauges(text)
    assert g.present and g.active == 5 and g.max_batch == 8 and g.kv_free == 40


GAUGE_TEXT = 'nv_trt_llm_request_metrics{instance="a",request_type="active"} 3\n'


def test_the_metrics_reader_keeps_its_connection_and_reads_every_body_framing():
    """Content-Length (kept alive), chunked, close-delimited, a kept connection the server closed, a 500."""

    async def run():
        connections, answers = [], []
        body = GAUGE_TEXT.encode()

        async def serve(reader, writer):
            connections.append(writer)
            while (await reader.readline()).startswith(b"GET "):
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                how = answers.pop(0)
                if how == "length":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                elif how == "chunked":
                    a, b = body[: len(body) // 2], body[len(body) // 2 :]
                    chunks = b"%x\r\n%s\r\n%x;ext=1\r\n%s\r\n0\r\n\r\n" % (len(a), a, len(b), b)
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
                elif how == "error":
                    writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\nno")
                else:  # "close": no length, the body ends with the connection
                    writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body)
                    await writer.drain()
                    writer.close()
                    return
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        m = MetricsReader(f"http://127.0.0.1:{port}/metrics", timeout_s=5)
        try:
            for how in ("length", "chunked", "length"):
                answers.append(how)
                assert await m.text() == GAUGE_TEXT
            assert len(connections) == 1  # kept alive
            answers.append("close")
            assert await m.text() == GAUGE_TEXT
            answers.append("length")
            assert await m.text() == GAUGE_TEXT and len(connections) == 2
            connections[-1].close()  # the server drops the kept connection: the next read opens a new one
            await asyncio.sleep(0.05)
            answers.append("length")
            assert await m.text() == GAUGE_TEXT and len(connections) == 3
            answers.append("error")
            with pytest.raises(OSError, match="500"):
                await m.text()
            b = TritonBackend("127.0.0.1:1", metrics_url=f"http://127.0.0.1:{port}")
            answers.append("length")
            await b.read_gauges()
            assert b.gauges.present and b.gauges.active == 3
            await b.close()
        finally:
            m.close()
            server.close()

    asyncio.run(run())


def test_secrets_come_from_env_or_file(tmp_path, monkeypatch):
    monkeypatch.setenv("K", "a, b")
    (tmp_path / "keys").write_text("c\n\nd\n")
    assert read_secret("env:K") == ["a", "b"] and read_secret(f"file:{tmp_path / 'keys'}") == ["c", "d"]


def test_a_spec_deployment_tier_finds_the_running_front_door_of_that_spec(tmp_path):
    import yaml

    from toolkit.frontdoor.app import _frontdoor_of_spec
    from toolkit.triton.server import ServerState, write_states

    repo = tmp_path / "repo"
    spec = tmp_path / "small.yaml"
    spec.write_text(yaml.safe_dump({"name": "small", "serving": {"repository": str(repo)}}))
    with pytest.raises(LookupError, match="not running"):
        _frontdoor_of_spec(str(spec))
    state = ServerState(
        pid=1,
        repository=str(repo),
        binary="tritonserver",
        host="127.0.0.1",
        http_port=1,
        grpc_port=2,
        metrics_port=3,
        log_path="x.log",
        started_unix=0.0,
        frontdoor_url="http://127.0.0.1:9",
        frontdoor_pid=2,
    )
    write_states(repo, [state])
    assert _frontdoor_of_spec(str(spec)) == "http://127.0.0.1:9/v1"


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("text", ["plain", ' "quoted" \\ back\nslash', "ünïcødé 世界 🙂", "\x00\x1f", ""])
def test_content_framer_is_byte_identical_to_the_general_chunk(kind, text):
    req = GenRequest(kind=kind, model='m "odd" ü', messages=[{"role": "user", "content": "x"}], prompt="x")
    assert ContentFramer(req)(text) == sse(chunk(req, text))


def test_an_llmapi_repository_is_fronted_through_its_one_model_with_the_checkpoint_tokenizer(tmp_path):
    import json

    from toolkit.artifacts import MANIFEST
    from toolkit.frontdoor.config import config_from

    ckpt = tmp_path / "engine" / "hf"
    ckpt.mkdir(parents=True)
    (ckpt / "tokenizer_config.json").write_text("{}")
    repo = tmp_path / "repo"
    (repo / "tensorrt_llm" / "1").mkdir(parents=True)
    (repo / "tensorrt_llm" / "1" / "model.yaml").write_text(f"model: {ckpt}\nbackend: pytorch\n")
    (repo / MANIFEST).write_text(json.dumps({"complete": True, "target": "llmapi", "spec": {"name": "x"}}))
    cfg = config_from(repo)
    assert cfg.triton_model == "tensorrt_llm" and cfg.tokenizer_dir == ckpt
    (repo / MANIFEST).write_text(json.dumps({"complete": True, "target": "cpu", "spec": {"name": "x"}}))
    assert config_from(repo).triton_model == "ensemble"


@pytest.mark.parametrize(
    ("kind", "extra", "want"),
    [
        ("chat", {"logprobs": True}, True),
        ("chat", {"logprobs": True, "top_logprobs": 0}, True),
        ("chat", {}, False),
        ("completion", {"logprobs": 0}, True),
        ("completion", {}, False),
    ],
)
def test_logprobs_asked_for(kind, extra, want):
    body = chat(**extra) if kind == "chat" else {"model": "m", "prompt": "p", **extra}
    req = parse(body, kind)
    assert req.logprobs is want
    assert req.deterministic is not want  # an answer with log-probs is not served from the cache


@pytest.mark.parametrize(
    ("kind", "extra", "param"),
    [
        ("chat", {"logprobs": 1}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("completion", {"logprobs": 2}, "logprobs"),
        ("completion", {"logprobs": True}, "logprobs"),
        ("chat", {"logprobs": True, "session_id": "s1"}, "logprobs"),
    ],
)
def test_logprobs_that_cannot_be_served_are_refused_naming_the_field(kind, extra, param):
    body = chat(**extra) if kind == "chat" else {"model": "m", "prompt": "p", **extra}
    with pytest.raises(APIError) as e:
        parse(body, kind)
    assert e.value.status == 400 and e.value.param == param


def test_logprob_fields_follow_openai_shapes():
    items = logprob_items("é", [-0.5, -0.25]) + logprob_items(" b", [float("-inf")])
    assert items == [("", -0.5), ("é", -0.25), (" b", -9999.0)]
    chat_req = GenRequest(kind="chat", model="m")
    assert logprobs_field(chat_req, items)["content"][1] == {
        "token": "é",
        "logprob": -0.25,
        "bytes": [0xC3, 0xA9],
        "top_logprobs": [],
    }
    cmpl = logprobs_field(GenRequest(kind="completion", model="m"), items, offset=5)
    assert cmpl == {
        "tokens": ["", "é", " b"],
        "token_logprobs": [-0.5, -0.25, -9999.0],
        "top_logprobs": None,
        "text_offset": [5, 5, 6],
    }


@pytest.mark.parametrize("interface", ["ensemble", "llmapi"])
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 2**63 - 5, "stop": ["\n\n", "ünïcode"]},
        {"temperature": 1.3, "presence_penalty": -0.25, "frequency_penalty": 1.1, "max_tokens": 7},
    ],
)
def test_triton_request_tensors_match_tritonclients_numpy_serialisation(interface, batched, extra):
    """The gRPC request is built without numpy; every input must be what tritonclient's InferInput makes of
    the same numpy array (dtype, shape, raw bytes)."""
    import numpy as np
    from tritonclient.grpc import InferInput

    from toolkit.frontdoor.triton import LLMAPI_MARK, TritonBackend

    backend = TritonBackend("127.0.0.1:1")
    backend.batched = batched
    if interface == "llmapi":
        backend.interface = "llmapi"
        backend.inputs = {
            "text_input",
            "streaming",
            LLMAPI_MARK,
            "return_finish_reason",
            *(f"sampling_param_{n}" for n in ("temperature", "top_p", "top_k", "seed", "stop")),
            *(f"sampling_param_{n}_penalty" for n in ("presence", "frequency")),
        }
        backend.outputs = {"text_output", "finish_reason"}
    else:
        backend.inputs = {
            "text_input",
            "max_tokens",
            "stream",
            "exclude_input_in_output",
            "return_num_input_tokens",
            "return_num_output_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop_words",
            "end_id",
            "presence_penalty",
            "frequency_penalty",
        }
        backend.outputs = {"text_output", "num_input_tokens", "num_output_tokens"}
    body = {"model": "m", "messages": [{"role": "user", "content": 'héllo "there"\n'}], **extra}
    if interface == "ensemble":
        body["ignore_eos"] = True
    req = parse_request("chat", body, served_model="m", max_seq_len=4096, default_max_tokens=16)
    if interface == "llmapi":
        req.rendered = "<|user|>héllo<|assistant|>"
    msg = backend.build(req)

    types = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}
    values = {  # each input's values, as the numpy-based builder made them
        "text_input": [req.text_input().encode()],
        "max_tokens": [req.max_tokens],
        "sampling_param_max_tokens": [req.max_tokens],
        "temperature": [req.temperature],
        "sampling_param_temperature": [req.temperature],
        "top_p": [req.top_p],
        "sampling_param_top_p": [req.top_p],
        "top_k": [req.top_k],
        "sampling_param_top_k": [req.top_k],
        "seed": [req.seed],
        "sampling_param_seed": [req.seed],
        "stop_words": [s.encode() for s in req.stop],
        "sampling_param_stop": [s.encode() for s in req.stop],
        "end_id": [-1],
        "presence_penalty": [req.presence_penalty],
        "sampling_param_presence_penalty": [req.presence_penalty],
        "frequency_penalty": [req.frequency_penalty],
        "sampling_param_frequency_penalty": [req.frequency_penalty],
    }
    seen = set()
    assert len(msg.inputs) == len(msg.raw_input_contents)
    for tensor, raw in zip(msg.inputs, msg.raw_input_contents, strict=True):
        arr = np.array(values.get(tensor.name, [True]), dtype=types[tensor.datatype])
        if interface == "ensemble" and tensor.name not in ("stop_words",):
            arr = arr.reshape(1)  # a scalar input
        elif interface == "ensemble":
            arr = arr.reshape(-1)  # the ensemble's stop_words has dims [-1] (toolkit/triton/config.py)
        if batched:
            arr = arr[np.newaxis, ...]
        ref = InferInput(tensor.name, list(arr.shape), tensor.datatype)
        ref.set_data_from_numpy(arr)
        assert list(tensor.shape) == list(arr.shape), tensor.name
        assert raw == ref._raw_content, tensor.name
        seen.add(tensor.name)
    assert "text_input" in seen and ("stop" not in extra or {"stop_words", "sampling_param_stop"} & seen)


def test_the_token_id_request_uses_tensorrt_llms_own_inputs(smollm2_tokenizer_dir):
    """The primary path's request to ``tensorrt_llm`` (toolkit/frontdoor/tokens.py), with every feature set,
    names only inputs and outputs of TensorRT-LLM's own model (its C++ backend's config, recorded in
    tests/data/trtllm_1_2_1_triton_models.json) with their dtypes, and shapes of its dims plus the batch
    dimension; the values are the request's."""
    import json
    from pathlib import Path

    import numpy as np

    from toolkit.frontdoor.tokens import ChatTokens, ids_request

    cpp = json.loads((Path(__file__).parent / "data/trtllm_1_2_1_triton_models.json").read_text())["cpp"]
    backend = TritonBackend("127.0.0.1:1", "tensorrt_llm")
    backend.inputs, backend.outputs = set(cpp["inputs"]), set(cpp["outputs"])
    tokens = ChatTokens(smollm2_tokenizer_dir)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 11,
        "stop": ["\n\n", "END"],
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "logprobs": True,
        "ignore_eos": True,
        "max_tokens": 7,
    }
    req = parse_request("chat", body, served_model="m", max_seq_len=4096, default_max_tokens=16)
    ids = [1, 2, 3, 4]
    msg = ids_request(backend, req, ids, tokens, ("kv_cache_reused_blocks",))
    dtypes = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}
    got = {}
    for tensor, raw in zip(msg.inputs, msg.raw_input_contents, strict=True):
        upstream_type, dims = cpp["inputs"][tensor.name]
        assert upstream_type == f"TYPE_{tensor.datatype}", tensor.name
        assert len(tensor.shape) == len(dims) + 1 and tensor.shape[0] == 1, (tensor.name, tensor.shape, dims)
        assert all(d == -1 or d == s for d, s in zip(dims, tensor.shape[1:], strict=True)), tensor.name
        got[tensor.name] = np.frombuffer(raw, dtype=dtypes[tensor.datatype]).reshape(tuple(tensor.shape))
    assert got["input_ids"].tolist() == [ids] and got["input_lengths"].tolist() == [[4]]
    assert got["request_output_len"].tolist() == [[7]] and got["end_id"].tolist() == [[-1]]
    assert got["pad_id"].tolist() == [[tokens.pad_id]] and got["seed"].tolist() == [[11]]
    assert got["runtime_top_k"].tolist() == [[5]] and got["temperature"].item() == pytest.approx(0.7)
    assert got["runtime_top_p"].item() == pytest.approx(0.9)
    assert got["presence_penalty"].tolist() == [[0.5]] and got["frequency_penalty"].tolist() == [[0.25]]
    words = got["stop_words_list"][0]
    want = [tokens.encode("\n\n"), tokens.encode("END")]
    assert words[0, : sum(map(len, want))].tolist() == want[0] + want[1]
    assert words[1, :2].tolist() == [len(want[0]), len(want[0]) + len(want[1])]
    for flag in ("streaming", "exclude_input_in_output", "return_log_probs", "return_perf_metrics"):
        assert got[flag].tolist() == [[True]], flag
    asked = {o.name for o in msg.outputs}
    assert asked == {"output_ids", "sequence_length", "output_log_probs", "kv_cache_reused_blocks"}
    assert asked <= set(cpp["outputs"])


def test_the_primary_path_tokenises_chat_with_the_template_and_a_completion_prompt_as_plain_text(
    smollm2_tokenizer_dir,
):
    """``PromptRules.prompt_ids``: a chat's checked messages go through the chat template (the ids
    ``preprocessing`` makes of the same chat sent as JSON), and a completion's prompt is plain text even when
    it looks like a JSON chat (what /v1/completions means; the ensemble's text interface cannot tell)."""
    import json

    from toolkit.frontdoor.tokens import ChatTokens, PromptRules
    from toolkit.triton.models import rtk_text

    tokens = ChatTokens(smollm2_tokenizer_dir)
    rules = PromptRules(tokens, max_input_len=512, max_seq_len=1024, context_policy="reject")
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Capital of France?"}]
    chat = parse_request(
        "chat", {"model": "m", "messages": messages}, served_model="m", max_seq_len=1024, default_max_tokens=8
    )
    as_preprocessing = rtk_text.encode_prompt(tokens.tok, json.dumps(messages), window=504, policy="reject")[0]
    assert rules.prompt_ids(chat) == as_preprocessing
    assert tokens.tok.decode(as_preprocessing).endswith("<|im_start|>assistant\n")
    looks_like_chat = json.dumps(messages)
    completion = parse_request(
        "completion",
        {"model": "m", "prompt": looks_like_chat},
        served_model="m",
        max_seq_len=1024,
        default_max_tokens=8,
    )
    assert rules.prompt_ids(completion) == tokens.tok.encode(looks_like_chat)
    with pytest.raises(APIError) as err:  # over the window: the same 400 naming the field as preprocessing's
        rules.prompt_ids(
            parse_request(
                "completion",
                {"model": "m", "prompt": "word " * 600, "max_tokens": 8},
                served_model="m",
                max_seq_len=1024,
                default_max_tokens=8,
            )
        )
    assert err.value.status == 400 and err.value.param == "prompt"


def test_a_chat_the_template_refuses_is_a_400_naming_messages_on_every_path(smollm2_tokenizer_dir):
    """Chat templates refuse some conversations with ``raise_exception`` (roles that must alternate, a system
    message they do not take).  That is the request's fault: a 400 naming ``messages`` from the front door's
    own tokenising (the primary path, sessions), and a refusal from ``preprocessing`` that the front door maps
    to the same 400 (the ensemble path), not a failed model."""
    from toolkit.frontdoor.tokens import ChatTokens, PromptRules
    from toolkit.frontdoor.triton import TritonRefused, classify_refusal
    from toolkit.triton.models import rtk_text

    tokens = ChatTokens(smollm2_tokenizer_dir)
    refusal = "Conversation roles must alternate user/assistant/user/assistant"
    tokens.tok.chat_template = "{{ raise_exception('" + refusal + "') }}"
    rules = PromptRules(tokens, max_input_len=512, max_seq_len=1024, context_policy="reject")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]}
    req = parse_request("chat", body, served_model="m", max_seq_len=1024, default_max_tokens=8)
    for call in (lambda: rules.prompt_ids(req), lambda: tokens.render(req.messages, generation_prompt=True)):
        with pytest.raises(APIError) as err:
            call()
        assert err.value.status == 400 and err.value.param == "messages" and refusal in str(err.value)
    with pytest.raises(rtk_text.PromptError) as err:  # what preprocessing answers, and how the front door maps it
        rtk_text.encode_prompt(tokens.tok, req.text_input(), window=504, policy="reject")
    mapped = classify_refusal(TritonRefused(str(err.value), overload=False), req)
    assert mapped.status == 400 and mapped.param == "messages" and refusal in str(mapped)


def test_ids_text_streams_a_long_answer_as_its_whole_decoding(smollm2_tokenizer_dir):
    """``IdsText`` turns each response's ids into text against the few ids before them: a long answer of
    multi-byte text, one or three ids a response, joins to the decoding of all its ids, and ``generated``
    keeps every id."""
    from types import SimpleNamespace

    import numpy as np

    from toolkit.frontdoor.tokens import ChatTokens, IdsText

    tokens = ChatTokens(smollm2_tokenizer_dir)
    answer = "Paris 🙂 東京 café, ñandú; " * 40
    ids = tokens.tok.encode(answer, add_special_tokens=False)
    prompt = tokens.tok.encode("Say it:", add_special_tokens=False)
    for step in (1, 3):
        stream = IdsText(tokens, prompt)
        pieces = []
        for i in range(0, len(ids), step):
            chunk = np.array(ids[i : i + step], dtype="<i4").tobytes()
            text, _ = stream.text([SimpleNamespace(name="output_ids")], [chunk])
            pieces.append(text)
        assert "".join(pieces) == answer and stream.generated == ids
        assert all("\ufffd" not in p for p in pieces)
