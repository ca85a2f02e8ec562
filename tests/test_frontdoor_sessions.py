"""Sessions (toolkit/frontdoor/sessions.py): the stores (SQLite; Redis against a real redis-server), the token
ids kept across turns with the embedded model's real tokenizer and chat template, and — slow — whole turns
through the front door over the emitted cpu repository of the tiny Llama served by a real tritonserver."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import time

import httpx
import pytest

from toolkit.frontdoor.protocol import APIError, GenRequest
from toolkit.frontdoor.sessions import (
    RedisSessions,
    Session,
    SessionManager,
    SQLiteSessions,
    owner_of,
    session_id_of,
)
from toolkit.frontdoor.tokens import ChatTokens
from toolkit.spec import SessionsSpec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- stores ---------------------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "redis"])
def store_factory(request, tmp_path):
    if request.param == "sqlite":
        return lambda ttl_s: SQLiteSessions(tmp_path / "s.sqlite", ttl_s)
    url = request.getfixturevalue("redis_url")

    import redis

    redis.from_url(url).flushdb()
    return lambda ttl_s: RedisSessions(url, ttl_s)


def test_store_roundtrip_list_delete_and_ttl(store_factory):
    async def go():
        store = store_factory(60)
        a = Session("a", owner=owner_of("key-a"), ids=[1, 2, 3], text="x", messages=[{"role": "user", "content": "é"}])
        b = Session("b", owner=owner_of("key-b"))
        await store.put(a)
        await store.put(b)
        got = await store.get("a")
        assert got == a
        assert [s.id for s in await store.list(owner_of("key-a"))] == ["a"]
        assert sorted(s.id for s in await store.list(None)) == ["a", "b"]
        assert await store.delete("a") and await store.get("a") is None and not await store.delete("a")
        await store.close()
        # A session is forgotten ttl_s after its last turn.
        short = store_factory(0.3)
        await short.put(Session("c", updated=time.time()))
        assert await short.get("c") is not None
        await asyncio.sleep(0.5)
        assert await short.get("c") is None and "c" not in [s.id for s in await short.list(None)]
        await short.close()

    asyncio.run(go())


def test_sqlite_store_survives_a_new_process_state(tmp_path):
    async def go():
        first = SQLiteSessions(tmp_path / "s.sqlite", 60)
        await first.put(Session("kept", ids=[5, 6]))
        await first.close()
        second = SQLiteSessions(tmp_path / "s.sqlite", 60)
        assert (await second.get("kept")).ids == [5, 6]
        await second.close()

    asyncio.run(go())


def test_a_turn_lease_is_held_by_one_request_renewed_by_it_and_lapses(store_factory):
    async def go():
        store = store_factory(60)
        assert await store.acquire("s", "req-a", 30)
        assert not await store.acquire("s", "req-b", 30)  # another request (or front door): busy
        assert await store.acquire("s", "req-a", 30)  # the holder renews it
        await store.release("s", "req-b")  # only the holder releases
        assert not await store.acquire("s", "req-b", 30)
        await store.release("s", "req-a")
        assert await store.acquire("s", "req-b", 0.2)
        assert await store.acquire("other", "req-a", 30)  # leases are per session
        await asyncio.sleep(0.4)
        assert await store.acquire("s", "req-c", 30)  # a holder that died: its lease lapsed
        await store.close()

    asyncio.run(go())


def test_session_id_is_validated_and_the_owner_is_a_hash():
    assert session_id_of({"session_id": "chat-1.a:b"}) == "chat-1.a:b"
    for bad_id in ("", "-x", "a b", "x" * 200, 7):
        with pytest.raises(APIError) as e:
            session_id_of({"session_id": bad_id})
        assert e.value.param == "session_id"
    assert owner_of(None) == "" and len(owner_of("sk-secret")) == 16 and "secret" not in owner_of("sk-secret")


# -- token ids across turns (real tokenizer, no server) --------------------------------------------------------


@pytest.fixture(scope="module")
def tokens(smollm2_tokenizer_dir):
    return ChatTokens(smollm2_tokenizer_dir)


def manager(tmp_path, tokens, **spec):
    store = SQLiteSessions(tmp_path / "m.sqlite", 60)
    return SessionManager(SessionsSpec(**spec), store, tokens, window=400, max_seq_len=512)


def chat(text, max_tokens=16):
    return GenRequest(kind="chat", model="m", messages=[{"role": "user", "content": text}], max_tokens=max_tokens)


def test_the_next_turn_starts_with_the_exact_ids_the_engine_saw(tmp_path, tokens):
    async def go():
        m = manager(tmp_path, tokens)
        t1 = await m.begin(chat("Hi there"), "s", "")
        assert t1.reused_ids == 0 and t1.prompt_ids == tokens.encode(
            tokens.render([{"role": "user", "content": "Hi there"}], generation_prompt=True)
        )
        # Generated ids whose decoding re-tokenises differently (" Hel" + "lo" vs " Hello"): kept as generated.
        gen = tokens.encode(" Hel") + tokens.encode("lo") + [tokens.end_id]
        reply = tokens.tok.decode(gen, skip_special_tokens=True)
        assert tokens.encode(reply) != gen[:-1]
        s = await m.commit(t1, gen, reply, {})
        assert s.ids[: len(t1.prompt_ids) + len(gen) - 1] == t1.prompt_ids + gen[:-1]
        t2 = await m.begin(chat("And now?"), "s", "")
        assert t2.reused_ids == len(s.ids) and t2.prompt_ids[: len(s.ids)] == s.ids
        # The new turn's tail is what the template renders for the new message.
        full = tokens.render(s.messages + [{"role": "user", "content": "And now?"}], generation_prompt=True)
        assert t2.prompt_text == full and tokens.tok.decode(t2.prompt_ids) == full
        # exact_ids off: the history is re-tokenised from its text (the stored ids are not reused).
        m2 = SessionManager(SessionsSpec(exact_ids=False), m.store, tokens, window=400, max_seq_len=512)
        t3 = await m2.begin(chat("And now?"), "s", "")
        assert t3.reused_ids == 0 and t3.prompt_ids != t2.prompt_ids
        await m.store.close()

    asyncio.run(go())


def test_turns_that_do_not_fit_drop_the_oldest_and_the_size_cap_holds(tmp_path, tokens):
    async def go():
        m = manager(tmp_path, tokens)
        sys = GenRequest(
            kind="chat",
            model="m",
            max_tokens=16,
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "word " * 60}],
        )
        t = await m.begin(sys, "w", "")
        await m.commit(t, tokens.encode(" ok"), " ok", {})
        for i in range(6):
            t = await m.begin(chat(f"turn {i} " + "word " * 60), "w", "")
            assert len(t.prompt_ids) <= 400 and t.history[0]["role"] == "system"
            # What was dropped (for window_policy summarize): whole turns, oldest first, never the system prompt.
            assert len(t.dropped_messages) == 2 * t.dropped
            assert [m["role"] for m in t.dropped_messages] == ["user", "assistant"] * t.dropped
            s = await m.commit(t, tokens.encode(" ok"), " ok", {})
        system = {"role": "system", "content": "Be brief.", "tokens": len(tokens.encode("Be brief."))}
        assert s.dropped_turns > 0 and s.messages[0] == system
        with pytest.raises(APIError) as e:
            await m.begin(chat("word " * 600), "w", "")
        assert e.value.param == "messages"
        capped = SessionManager(SessionsSpec(max_tokens=150), m.store, tokens, window=400, max_seq_len=512)
        t = await capped.begin(chat("again " * 30), "w", "")
        s = await capped.commit(t, tokens.encode(" ok"), " ok", {})
        assert len(s.ids) <= 150 and s.messages[-1]["content"] == " ok"
        # Another owner cannot continue it.
        with pytest.raises(APIError) as e:
            await m.begin(chat("hi"), "w", owner_of("other"))
        assert e.value.status == 404
        await m.store.close()

    asyncio.run(go())


def test_context_policy_summarize_summarizes_sessions_and_truncates_the_rest(tmp_path, tokens):
    from toolkit.frontdoor.config import config_from
    from toolkit.spec import spec_from_dict
    from toolkit.triton.models.rtk_text import encode_prompt

    def spec(**serving):
        return spec_from_dict({"name": "p", "serving": {"repository": str(tmp_path / "repo"), **serving}})

    assert config_from(spec(context_policy="summarize")).sessions.window_policy == "summarize"
    assert config_from(spec()).sessions.window_policy == "truncate_oldest"
    named = spec(context_policy="summarize", sessions={"window_policy": "truncate_oldest"})
    assert config_from(named).sessions.window_policy == "truncate_oldest"  # the sessions' own setting wins
    # Requests without a session (the ensemble's preprocessing): the oldest turns are dropped.
    chat = [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "ok"}]
    chat.append({"role": "user", "content": "last"})
    ids, dropped = encode_prompt(tokens.tok, json.dumps(chat), window=60, policy="summarize")
    assert dropped == 1 and len(ids) <= 60


def test_a_reply_that_breaks_the_content_filter_is_not_stored(tmp_path, tokens):
    from toolkit.frontdoor.filter import Rules
    from toolkit.spec import FilterSpec

    m = SessionManager(
        SessionsSpec(),
        SQLiteSessions(tmp_path / "f.sqlite", 60),
        tokens,
        window=400,
        max_seq_len=512,
        rules=Rules.from_spec(FilterSpec(keywords=["open sesame"])),
    )
    assert asyncio.run(m.allowed("the door opens"))
    assert not asyncio.run(m.allowed("say OPEN\u200b Sesame"))


# -- whole turns through the front door and the real engine ------------------------------------------------

BUILD = {"max_batch_size": 2, "max_input_len": 256, "max_seq_len": 320, "max_num_tokens": 128, "tokens_per_block": 8}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_dir):
    from conftest import spec_for
    from triton_helpers import running_server

    from toolkit.targets import build
    from toolkit.triton.emit import emit

    root = tmp_path_factory.mktemp("sessions_engine")
    spec = spec_for(
        "tiny-sessions",
        tiny_llama_dir,
        quantization={"format": "none"},
        build=BUILD,
        serving={"repository": str(root / "repo"), "default_max_tokens": 8, "warmup": False},
    )
    shutil.copytree(tiny_llama_dir, root / "quantized" / "hf")
    engine = build(spec, root / "quantized", root / "engine").path
    repo = emit(spec, engine).path
    with running_server(repo, ready_timeout_s=300) as triton:
        yield {"repo": repo, "triton": triton, "model": spec.name, "db": root / "sessions.sqlite"}


def front_door(served, monkeypatch, guard=None):
    from toolkit.frontdoor import FrontDoorServer, create_app
    from toolkit.frontdoor.config import config_from

    monkeypatch.setenv("RTK_TEST_SESSION_KEYS", "key-alice,key-bob")
    monkeypatch.setenv("RTK_TEST_SESSION_ADMIN", "key-admin")
    cfg = config_from(served["repo"])
    cfg.guard = guard or cfg.guard
    cfg.frontend = cfg.frontend.model_copy(update={"api_keys": "env:RTK_TEST_SESSION_KEYS"})
    cfg.sessions = SessionsSpec(path=str(served["db"]), admin_key="env:RTK_TEST_SESSION_ADMIN")
    app = create_app(cfg, served["triton"].grpc_url, metrics_url=served["triton"].metrics_url)
    return FrontDoorServer(app, "127.0.0.1", free_port())


def turn(fd, served, text, *, key="key-alice", sid="s1", stream=False):
    body = {
        "model": served["model"],
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }
    if sid:
        body["session_id"] = sid
    h = {"Authorization": f"Bearer {key}"} if key else {}
    if not stream:
        r = httpx.post(fd.url + "/v1/chat/completions", json=body, headers=h, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["server-timing"].startswith("frontdoor;dur=")  # a turn's head is timed too
        return r.json()["choices"][0]["message"]["content"]
    with httpx.Client(timeout=120) as c, c.stream("POST", fd.url + "/v1/chat/completions", json=body, headers=h) as r:
        assert r.status_code == 200 and r.headers["server-timing"].startswith("frontdoor;dur=")
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


@pytest.mark.slow
@pytest.mark.integration
def test_session_turns_reuse_the_engines_kv_blocks_and_survive_a_front_door_restart(served, monkeypatch):
    alice = {"Authorization": "Bearer key-alice"}
    with front_door(served, monkeypatch) as fd:
        first = turn(fd, served, "What is the capital of France?")
        # The session path (token ids to tensorrt_llm, detokenised here) answers what the ensemble answers.
        assert first == turn(fd, served, "What is the capital of France?", sid=None)
        second = turn(fd, served, "And of Spain?", stream=True)
        s = httpx.get(fd.url + "/v1/sessions/s1", headers=alice).json()
        assert s["turns"] == 2 and [m["role"] for m in s["messages"]] == ["user", "assistant"] * 2
        assert [m["content"] for m in s["messages"][1::2]] == [first, second]
        t1, t2 = s["stats"]
        assert t1["reused_ids"] == 0 and t2["reused_ids"] >= t1["prompt_tokens"] + t1["completion_tokens"]
        # The engine found the first turn's blocks (prompt and generated tokens) for the second prompt.
        assert t2["kv_reused_blocks"] * BUILD["tokens_per_block"] >= t1["prompt_tokens"]
    with front_door(served, monkeypatch) as fd:  # a new front door: the conversation is in SQLite
        turn(fd, served, "And of Italy?")
        s = httpx.get(fd.url + "/v1/sessions/s1", headers=alice).json()
        assert s["turns"] == 3 and s["stats"][2]["reused_ids"] > s["stats"][1]["prompt_tokens"]
        assert s["stats"][2]["kv_reused_blocks"] > t2["kv_reused_blocks"]


@pytest.mark.slow
@pytest.mark.integration
def test_others_sessions_need_the_admin_key(served, monkeypatch):
    bob, admin = {"Authorization": "Bearer key-bob"}, {"Authorization": "Bearer key-admin"}
    with front_door(served, monkeypatch) as fd:
        turn(fd, served, "Hello", sid="alice-only")
        assert httpx.get(fd.url + "/v1/sessions/alice-only", headers=bob).status_code == 404
        assert httpx.delete(fd.url + "/v1/sessions/alice-only", headers=bob).status_code == 404
        mine = httpx.get(fd.url + "/v1/sessions", headers=bob).json()["data"]
        assert "alice-only" not in [s["id"] for s in mine]
        r = httpx.get(fd.url + "/v1/sessions?all=1", headers=bob)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert httpx.get(fd.url + "/v1/sessions").status_code == 401  # API keys are configured
        # Bob cannot continue it either.
        r = httpx.post(
            fd.url + "/v1/chat/completions",
            headers=bob,
            timeout=60,
            json={
                "model": served["model"],
                "messages": [{"role": "user", "content": "hi"}],
                "session_id": "alice-only",
            },
        )
        assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"
        listed = httpx.get(fd.url + "/v1/sessions?all=1", headers=admin).json()["data"]
        assert "alice-only" in [s["id"] for s in listed]
        read = httpx.get(fd.url + "/v1/sessions/alice-only", headers=admin).json()
        assert read["messages"][0]["content"] == "Hello"
        assert httpx.delete(fd.url + "/v1/sessions/alice-only", headers=admin).json()["deleted"] is True
        assert httpx.get(fd.url + "/v1/sessions/alice-only", headers=admin).status_code == 404


def test_rtk_sessions_lists_shows_and_deletes(tmp_path):
    from click.testing import CliRunner

    from toolkit.cli import cli

    db = tmp_path / "cli.sqlite"
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"name: cli-sessions\nmodel: {{source: builtin:smollm2-135m-instruct}}\nserving: {{sessions: {{path: {db}}}}}\n"
    )
    runner = CliRunner()
    r = runner.invoke(cli, ["sessions", "list", str(spec)])
    assert r.exit_code == 2 and "no sessions yet" in r.output

    async def seed():
        store = SQLiteSessions(db, 86_400)
        await store.put(
            Session(
                "chat-7",
                owner=owner_of("someone"),
                ids=[1, 2, 3],
                turns=1,
                messages=[{"role": "user", "content": "bonjour", "tokens": 2}],
            )
        )
        await store.close()

    asyncio.run(seed())
    r = runner.invoke(cli, ["sessions", "list", str(spec)])
    assert r.exit_code == 0 and "chat-7" in r.output, r.output
    r = runner.invoke(cli, ["sessions", "show", str(spec), "chat-7"])
    assert r.exit_code == 0 and json.loads(r.output)["messages"][0]["content"] == "bonjour"
    r = runner.invoke(cli, ["sessions", "delete", str(spec), "chat-7"])
    assert r.exit_code == 0 and "deleted" in r.output
    r = runner.invoke(cli, ["sessions", "show", str(spec), "chat-7"])
    assert r.exit_code == 2 and "does not exist" in r.output


@pytest.mark.slow
@pytest.mark.integration
def test_summarize_replaces_dropped_turns_with_the_models_summary(served, monkeypatch):
    from toolkit.frontdoor import FrontDoorServer, create_app
    from toolkit.frontdoor.config import config_from
    from toolkit.frontdoor.sessions import SUMMARY_PREFIX

    cfg = config_from(served["repo"])
    cfg.sessions = SessionsSpec(path=str(served["db"]), window_policy="summarize", summary_max_tokens=16)
    with FrontDoorServer(create_app(cfg, served["triton"].grpc_url), "127.0.0.1", free_port()) as fd:
        long = "tell me about the harbour and its boats " * 10  # about 80 tokens a turn: the third overflows
        for i in range(3):
            turn(fd, served, f"{i}: {long}", key="", sid="summed")
        s = wait_for_session(fd, "summed", lambda s: any(m.get("summary") for m in s["messages"]))
        note = s["messages"][0]
        assert note["role"] == "system" and note["content"].startswith(SUMMARY_PREFIX)
        assert s["dropped_turns"] >= 1 and s["messages"][1]["content"].startswith(("1:", "2:"))
        turn(fd, served, "and the lighthouse?", key="", sid="summed")  # the next prompt carries the summary
        s = httpx.get(fd.url + "/v1/sessions/summed").json()
        assert s["turns"] == 4 and s["messages"][0].get("summary")
        assert s["stats"][-1]["reused_ids"] == 0  # the summary changed the history: re-rendered once


def wait_for_session(fd, sid, ok, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        s = httpx.get(f"{fd.url}/v1/sessions/{sid}").json()
        if ok(s):
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.integration
def test_rtk_slo_multi_turn_over_openai_goes_through_sessions(served, monkeypatch):
    """Each turn sends only its new user message with the conversation's session_id; the front door supplies the
    history (stored, and counted in the next turn's prompt tokens); the report is the usual per-turn one."""
    from toolkit.slo import run_slo
    from toolkit.slo.openai_transport import SESSION_PREFIX
    from toolkit.slo.records import ARRIVAL, FIRST_TOKEN
    from toolkit.slo.workload import HFTokenizer, SyntheticWorkload, find_tokenizer_dir

    monkeypatch.setenv("OPENAI_API_KEY", "key-bob")
    slo = {
        "transport": "openai",
        "turns": 3,
        "concurrency": 2,
        "num_requests": 6,
        "warmup_requests": 0,
        "input_tokens": 12,
        "output_tokens": 4,
        "seed": 7,
    }
    with front_door(served, monkeypatch) as fd:
        report = run_slo(slo, fd.url, repository=served["repo"])
        assert report.summary.failed == 0 and sorted(r.turn for r in report.records if r.measured) == [0, 0, 1, 1, 2, 2]
        # The front door's Server-Timing is each turn's server-side TTFT, inside what the client measured.
        timed = [(r.server_ms(ARRIVAL, FIRST_TOKEN), r.ttft_ms(from_sent=True)) for r in report.records if r.measured]
        assert all(s is not None and 0 < s <= t for s, t in timed), timed
        assert any("keeps sessions" in n for n in report.notes), report.notes
        mine = httpx.get(fd.url + "/v1/sessions", headers={"Authorization": "Bearer key-bob"}).json()["data"]
        runs = {s["id"].rsplit("-", 1)[0] for s in mine if s["id"].startswith(SESSION_PREFIX)}
        assert len(runs) == 1, runs  # one run: its conversations share a fresh tag
        work = SyntheticWorkload(
            input_tokens=12,
            input_std=0,
            output_tokens=4,
            output_std=0,
            turns=3,
            seed=7,
            tokenizer=HFTokenizer(find_tokenizer_dir(served["repo"])),
        )
        tag = runs.pop()
        for conversation in (0, 1):
            s = httpx.get(f"{fd.url}/v1/sessions/{tag}-{conversation}", headers={"Authorization": "Bearer key-bob"})
            s = s.json()
            assert s["turns"] == 3 and [m["role"] for m in s["messages"]] == ["user", "assistant"] * 3
            # Only the new user text was sent: the stored user messages are the workload's turns, not histories.
            assert [m["content"] for m in s["messages"][0::2]] == [t.text for t in work.session(conversation).turns]
            prompts = [t["prompt_tokens"] for t in s["stats"]]
            assert prompts[0] < prompts[1] < prompts[2] and s["stats"][2]["reused_ids"] > prompts[1]
        # What the front door answers in usage.prompt_tokens is the prompt with the history.
        r = httpx.post(
            fd.url + "/v1/chat/completions",
            headers={"Authorization": "Bearer key-bob"},
            timeout=120,
            json={
                "model": served["model"],
                "messages": [{"role": "user", "content": "and?"}],
                "max_tokens": 2,
                "session_id": f"{tag}-1",
            },
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > prompts[2] + 4


@pytest.mark.slow
@pytest.mark.integration
def test_a_second_turn_while_one_runs_is_refused_with_409_and_counted(served, monkeypatch):
    alice, bob = {"Authorization": "Bearer key-alice"}, {"Authorization": "Bearer key-bob"}

    async def hold(token):  # another front door on the same store is answering a turn of "busy"
        store = SQLiteSessions(served["db"], 60)
        assert await store.acquire("busy", token, 30)
        await store.close()

    async def release(token):
        store = SQLiteSessions(served["db"], 60)
        await store.release("busy", token)
        await store.close()

    with front_door(served, monkeypatch) as fd:
        turn(fd, served, "Hello", sid="busy")
        asyncio.run(hold("elsewhere"))
        body = {"model": served["model"], "messages": [{"role": "user", "content": "again"}], "session_id": "busy"}
        r = httpx.post(fd.url + "/v1/chat/completions", json=body, headers=alice, timeout=60)
        assert r.status_code == 409 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "session_busy" and r.json()["error"]["param"] == "session_id"
        # Another key learns nothing from the busy session: 404, as for a missing one.
        assert httpx.post(fd.url + "/v1/chat/completions", json=body, headers=bob, timeout=60).status_code == 404
        asyncio.run(release("elsewhere"))
        turn(fd, served, "again", sid="busy")
        s = httpx.get(fd.url + "/v1/sessions/busy", headers=alice).json()
        assert s["turns"] == 2 and [m["content"] for m in s["messages"][0::2]] == ["Hello", "again"]
        metrics = httpx.get(fd.url + "/metrics").text
        assert 'rtk_frontdoor_session_turns_total{result="busy"} 1' in metrics
        assert 'rtk_frontdoor_session_turns_total{result="stored"} 2' in metrics
        assert "rtk_frontdoor_sessions_active 0" in metrics  # every lease was released
        assert 'rtk_frontdoor_session_store_errors_total{op="get"} 0' in metrics


@pytest.mark.slow
@pytest.mark.integration
def test_admission_counts_what_a_session_turn_prefills(served, monkeypatch):
    """A session turn's prediction counts its prompt ids past the ones kept from the session (which the engine
    finds in its prefix cache): a turn refused for its deadline names as many as the same turn, served, sent
    and did not reuse."""
    alice = {"Authorization": "Bearer key-alice"}
    with front_door(served, monkeypatch) as fd:
        turn(fd, served, "What is the capital of France?", sid="counted")
        body = {
            "model": served["model"],
            "messages": [{"role": "user", "content": "And of Spain? Answer in one word."}],
            "max_tokens": 8,
            "session_id": "counted",
        }
        late = {**alice, "x-rtk-ttft-deadline-ms": "0.001"}
        r = httpx.post(fd.url + "/v1/chat/completions", json=body, headers=late, timeout=60)
        assert r.status_code == 429 and r.headers["x-rtk-tier"] == "refused", r.text
        said = re.search(r"for (\d+) prompt tokens to prefill \((\d+) in all, (\d+) kept", r.json()["error"]["message"])
        assert said is not None, r.json()
        r = httpx.post(fd.url + "/v1/chat/completions", json=body, headers=alice, timeout=120)
        assert r.status_code == 200, r.text
        s = httpx.get(fd.url + "/v1/sessions/counted", headers=alice).json()
        assert s["turns"] == 2  # the refused turn was not stored
        sent = s["stats"][1]
        assert sent["reused_ids"] > 0
        assert [int(x) for x in said.groups()] == [
            sent["prompt_tokens"] - sent["reused_ids"],
            sent["prompt_tokens"],
            sent["reused_ids"],
        ]


@pytest.mark.slow
@pytest.mark.integration
def test_a_fallback_deployment_gets_the_history_and_its_answer_is_the_turn(served, monkeypatch):
    from toolkit.frontdoor import FrontDoorServer, create_app
    from toolkit.frontdoor.config import config_from
    from toolkit.spec import GuardSpec

    alice = {"Authorization": "Bearer key-alice"}
    # The fallback: another front door on the same Triton, with sessions off (a session_id sent there is a 400).
    other = config_from(served["repo"])
    other.sessions = SessionsSpec(enabled=False)
    with FrontDoorServer(create_app(other, served["triton"].grpc_url), "127.0.0.1", free_port()) as backup:
        guard = GuardSpec(fallbacks=[{"kind": "deployment", "name": "backup", "url": backup.url + "/v1"}])
        with front_door(served, monkeypatch, guard) as fd:
            first = turn(fd, served, "What is the capital of France?", sid="fb")
            body = {
                "model": served["model"],
                "messages": [{"role": "user", "content": "And of Spain?"}],
                "max_tokens": 8,
                "temperature": 0,
                "session_id": "fb",
            }
            # The engine is predicted to take 100 s for the first token, over the 10 s deadline: fall back.
            estimator = fd.app.state.frontdoor.estimator
            step_s, estimator.step_s = estimator.step_s, 100.0
            late = {**alice, "x-rtk-ttft-deadline-ms": "10000"}
            r = httpx.post(fd.url + "/v1/chat/completions", json=body, headers=late, timeout=60)
            estimator.step_s = step_s
            assert r.status_code == 200 and r.headers["x-rtk-tier"] == "backup", r.text
            s = httpx.get(fd.url + "/v1/sessions/fb", headers=alice).json()
            t1, t2 = s["stats"]
            # The backup saw the first turn: its prompt is longer than the first turn's prompt and reply.
            assert r.json()["usage"]["prompt_tokens"] >= t1["prompt_tokens"] + t1["completion_tokens"]
            assert s["turns"] == 2 and t2["tier"] == "backup"
            assert [m["content"] for m in s["messages"]] == [
                "What is the capital of France?",
                first,
                "And of Spain?",
                r.json()["choices"][0]["message"]["content"],
            ]
            turn(fd, served, "And of Italy?", sid="fb")  # back on the engine, with all of it
            s = httpx.get(fd.url + "/v1/sessions/fb", headers=alice).json()
            assert s["turns"] == 3 and s["stats"][2]["reused_ids"] > t2["prompt_tokens"]
