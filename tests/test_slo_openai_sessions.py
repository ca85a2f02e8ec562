"""``rtk slo --transport openai`` and sessions (toolkit/slo/openai_transport.py): whether a server keeps sessions,
asked of rtk's real front door (with sessions on and off; no model is needed for that answer), and what each turn
of a conversation sends either way.  The whole multi-turn run through a front door and a real tritonserver is in
tests/test_frontdoor_sessions.py."""

from __future__ import annotations

import json
import socket

import pytest

from toolkit.slo.openai_transport import SESSION_PREFIX, OpenAITransport
from toolkit.slo.transport import ModelInfo, Payload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("enabled,tokenizer", [(True, True), (False, True), (True, False)])
def test_the_transport_asks_the_front_door_whether_it_keeps_sessions(
    tmp_path, smollm2_tokenizer_dir, enabled, tokenizer
):
    """Sessions on, off, and on for a repository without a tokenizer (where none can be made)."""
    from toolkit.frontdoor import FrontDoorConfig, FrontDoorServer, create_app
    from toolkit.spec import SessionsSpec

    cfg = FrontDoorConfig(
        model_name="m",
        sessions=SessionsSpec(enabled=enabled, path=str(tmp_path / "s.sqlite")),
        tokenizer_dir=smollm2_tokenizer_dir if tokenizer else None,
    )
    dead_triton = f"127.0.0.1:{free_port()}"  # the answer comes from the session store, not the model
    with FrontDoorServer(create_app(cfg, dead_triton), "127.0.0.1", free_port()) as fd:
        chat = OpenAITransport(fd.url, "m", "chat")
        assert chat._keeps_sessions() is (enabled and tokenizer)
    assert OpenAITransport(f"http://127.0.0.1:{free_port()}", "m", "chat")._keeps_sessions() is False  # no server


def test_a_turn_sends_only_its_message_with_the_session_id_when_the_server_keeps_sessions():
    t = OpenAITransport("http://127.0.0.1:1", "m", "chat")
    turn = Payload(text="first\nreply\nsecond", turn_text="second", conversation=3, output_tokens=4)
    single = Payload(text="only", turn_text="only", output_tokens=4)
    for sessions in (True, False):
        t.info = ModelInfo("m", "chat", 0, set(), set(), decoupled=True, sessions=sessions)
        body = json.loads(t.prepare("1", turn)[1])
        if sessions:
            assert body["messages"] == [{"role": "user", "content": "second"}]
            assert body["session_id"] == t.session_id(3) and body["session_id"].startswith(SESSION_PREFIX)
        else:
            assert body["messages"] == [{"role": "user", "content": "first\nreply\nsecond"}]
            assert "session_id" not in body
        assert "session_id" not in json.loads(t.prepare("2", single)[1])  # one turn: nothing to keep
    # Every run has its own conversations.
    assert OpenAITransport("http://127.0.0.1:1", "m", "chat").session_id(3) != t.session_id(3)
