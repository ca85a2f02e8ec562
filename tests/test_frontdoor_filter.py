"""The content filter (toolkit/frontdoor/filter.py): the matching rules on their own, then through the front
door over a real tritonserver (a fake decoupled LLM that streams a fixed text; the classifier is a real
Triton python model)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from toolkit.frontdoor.filter import FilterHit, Rules, normalise
from toolkit.spec import FilterSpec


def rules(**kw) -> Rules:
    return Rules.from_spec(FilterSpec(**kw))


def run_stream(r: Rules, pieces: list[str]) -> tuple[str, str | None, list[str]]:
    """(joined released text, the rule hit or None, the released pieces)."""

    async def go():
        f = r.stream()
        out = []
        try:
            for p in pieces:
                out.append(await f.push(p))
            out.append(await f.finish())
        except FilterHit as hit:
            return "".join(out), hit.rule, out
        return "".join(out), None, out

    return asyncio.run(go())


# -- normalisation ------------------------------------------------------------------------------------


def test_normalise_nfkc_casefold_format_characters_and_spaces():
    assert normalise("ＢＡＤ Ｗｏｒｄ") == "bad word"  # fullwidth (NFKC)
    assert normalise("STRASSE") == normalise("Straße") == "strasse"  # case folding, not lower()
    assert normalise("ﬁre") == "fire"  # ligature
    assert normalise("b\u200bo\u00adm\u200db") == "bomb"  # zero-width space, soft hyphen, joiner
    assert normalise("bad \n\t  word") == "bad word"
    assert normalise("cafe\u0301") == "café"  # composed
    assert normalise("pаypal") != "paypal"  # Cyrillic 'а': no confusables mapping


def test_spec_refuses_bad_patterns_and_empty_keywords():
    with pytest.raises(ValueError, match=r"patterns\[1\]"):
        FilterSpec(patterns=["ok", "(unclosed"])
    with pytest.raises(ValueError, match="empty text"):
        FilterSpec(patterns=["x*"])
    with pytest.raises(ValueError, match=r"keywords\[0\]"):
        FilterSpec(keywords=["  "])
    assert Rules.from_spec(FilterSpec()) is None


# -- the stream ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pieces",
    [
        ["The secret ", "code is ", "open sesame", " ok"],
        ["The secret code is op", "en ses", "ame ok"],
        ["The secret code is o", "p", "e", "n", " ", "s", "e", "s", "a", "m", "e"],  # ends with it
        ["The secret code is OPEN ", " SESAME!"],  # case and a doubled space
        ["The secret code is Ｏｐｅｎ ｓｅ", "ｓａｍｅ"],  # fullwidth
        ["The secret code is op\u200ben se", "s\u00adame."],  # zero-width space and soft hyphen
    ],
)
def test_a_phrase_split_across_tokens_never_leaves(pieces):
    text, hit, out = run_stream(rules(keywords=["open sesame"]), pieces)
    assert hit == "keywords"
    assert "".join(pieces).startswith(text)  # what left is the text before, unchanged
    assert "open" not in normalise(text) and "ses" not in normalise(text)


def test_combining_mark_in_the_next_token_is_caught():
    # "café" with the accent arriving as its own token: NFKC composes it before matching.
    text, hit, _ = run_stream(rules(keywords=["café noir"]), ["un cafe", "\u0301", " noir s'il vous plait"])
    assert hit == "keywords" and "noir" not in text


def test_patterns_with_word_boundaries_wait_for_the_next_token():
    r = rules(patterns=[r"\bass\b"])
    assert run_stream(r, ["a cl", "ass", "ic"])[1] is None  # 'classic': no word boundary
    assert run_stream(r, ["we ass", "ume"])[1] is None  # 'ass' at the end waited for 'ume'
    assert run_stream(r, ["an ", "ass", " !"])[1] == "patterns[0]"
    assert run_stream(r, ["an ", "ass"])[1] == "patterns[0]"  # at the very end of the answer


def test_a_pattern_hit_names_the_pattern_and_holds_back_the_match():
    r = rules(patterns=[r"\d{3}-\d{2}-\d{4}"], hold_back_chars=16)
    text, hit, _ = run_stream(r, ["my number is ", "123", "-45", "-67", "89", " thanks"])
    assert hit == "patterns[0]" and "123" not in text


def test_a_filter_that_never_matches_leaves_the_output_byte_identical():
    rng = random.Random(7)
    alphabet = "abc XYZ\u00e9e\u0301\u200b\u00df\uff21\n\t  .,!ﬁ🙂한국어"
    r = rules(keywords=["forbidden phrase", "verboten"], patterns=[r"\bq{5}\b"], hold_back_chars=12)
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 30))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]
        joined, hit, out = run_stream(r, pieces)
        assert hit is None and joined == text and joined.encode() == text.encode()


def test_output_is_held_back_by_the_window_only():
    r = rules(keywords=["zzzz"], hold_back_chars=8)
    _, _, out = run_stream(r, ["abcd"] * 6)
    # 8 characters (+1 open cluster) stay held while the stream runs; the rest flows as it comes.
    assert out == ["", "", "abc", "dabc", "dabc", "dabc", "dabcdabcd"]


def test_input_check_names_the_rule():
    r = rules(keywords=["open sesame"])

    async def go(text):
        await r.check_text(text)

    asyncio.run(go("nothing here"))
    with pytest.raises(FilterHit, match="keywords"):
        asyncio.run(go("please OPEN\u200b SESAME"))


def test_the_classifier_gates_release():
    calls = []

    async def classify(text):
        calls.append(text)
        return 0.9 if "poison" in text else 0.1

    spec = FilterSpec(classifier={"model": "clf", "threshold": 0.5, "every_chars": 10}, hold_back_chars=4)
    r = Rules.from_spec(spec, classify)
    text, hit, out = run_stream(r, ["hello there ", "this is fine ", "and more fine text"])
    assert hit is None and text == "hello there this is fine and more fine text" and calls
    text, hit, _ = run_stream(r, ["hello there ", "this is poi", "son and more"])
    assert hit == "classifier" and "poi" not in text
    assert any("poison" in c for c in calls)  # the classifier's windows overlap across releases


# -- through the front door ---------------------------------------------------------------------------------

CLASSIFIER_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy().reshape(-1)[0].decode()
            score = 1.0 if "tok1010" in text else 0.0
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("score", np.array([[score]], dtype=np.float32))]))
        return out
"""


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    from triton_helpers import model_config_text, running_server, write_fake_llm, write_python_model

    repo = tmp_path_factory.mktemp("filter_repo")
    write_fake_llm(repo, "ensemble", ttft_ms=5, itl_ms=2)
    cfg = model_config_text("classifier", [("text_input", "STRING", [1])], [("score", "FP32", [1])], max_batch_size=4)
    write_python_model(repo, "classifier", CLASSIFIER_PY, cfg)
    with running_server(repo) as server:
        yield server


def front_door(triton, flt: dict, **guard):
    import socket

    from toolkit.frontdoor import FrontDoorConfig, FrontDoorServer, create_app
    from toolkit.spec import GuardSpec

    cfg = FrontDoorConfig(model_name="fake", filter=FilterSpec(**flt), guard=GuardSpec(**guard), max_seq_len=256)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return FrontDoorServer(create_app(cfg, triton.grpc_url, metrics_url=triton.metrics_url), "127.0.0.1", port)


# The fake LLM answers a prompt of w words with " tok{1000+w}", " tok{1001+w}", ... one token per response;
# the chat below is sent as a JSON list of 5 words.
PROMPT = "hello there"
ANSWER = [f" tok{1005 + i}" for i in range(12)]


def ask(fd, *, stream: bool, content: str = PROMPT, max_tokens: int = 12):
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if not stream:
        r = httpx.post(fd.url + "/v1/chat/completions", json=body, timeout=30)
        return r, r.json()
    with httpx.Client(timeout=30) as c, c.stream("POST", fd.url + "/v1/chat/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return r, events


def streamed_text(events) -> tuple[str, str | None]:
    chunks = [e for e in events if e.get("choices")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    return text, chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.integration
def test_front_door_stops_a_phrase_split_across_tokens(triton):
    with front_door(triton, {"keywords": ["TOK1007  Tok1008"]}) as fd:
        r, events = ask(fd, stream=True)
        text, reason = streamed_text(events)
        assert r.status_code == 200 and reason == "content_filter"
        assert "tok1007" not in text and "tok1008" not in text and "".join(ANSWER).startswith(text)
        r, body = ask(fd, stream=False)
        assert body["choices"][0]["finish_reason"] == "content_filter"
        assert "tok1007" not in body["choices"][0]["message"]["content"]
        m = httpx.get(fd.url + "/metrics").text
        assert 'rtk_frontdoor_filtered_total{where="output",rule="keywords"} 2' in m
        assert "rtk_frontdoor_inflight 0" in m  # the Triton requests were ended


@pytest.mark.integration
def test_front_door_refuses_filtered_input_before_it_reaches_the_model(triton):
    with front_door(triton, {"patterns": [r"\bdrop\s+table\b"]}) as fd:
        r, body = ask(fd, stream=True, content="please ＤＲＯＰ\u200b   TABLE users")
        assert r.status_code == 400
        r, body = ask(fd, stream=False, content="please ＤＲＯＰ\u200b   TABLE users")
        assert r.status_code == 400
        err = body["error"]
        assert err["code"] == "content_filter" and err["param"] == "messages[0].content"
        m = httpx.get(fd.url + "/metrics").text
        assert 'rtk_frontdoor_filtered_total{where="input",rule="patterns[0]"} 2' in m
        assert "\nrtk_frontdoor_requests_total{" not in m  # nothing was answered: no compute spent
        assert ask(fd, stream=False, content="drop tables")[0].status_code == 200


@pytest.mark.integration
def test_a_filter_that_never_matches_leaves_the_streamed_text_byte_identical(triton):
    with front_door(triton, {}) as plain, front_door(triton, {"keywords": ["never said"], "hold_back_chars": 20}) as fd:
        _, ref = ask(plain, stream=True)
        _, got = ask(fd, stream=True)
        ref_text, ref_reason = streamed_text(ref)
        text, reason = streamed_text(got)
        assert text.encode() == ref_text.encode() == "".join(ANSWER).encode() and reason == ref_reason == "length"
        # Held back: fewer, later chunks, same bytes.
        assert len([e for e in got if e.get("choices")]) < len([e for e in ref if e.get("choices")])


@pytest.mark.integration
def test_a_classifier_model_in_the_repository_stops_the_stream(triton):
    flt = {"classifier": {"model": "classifier", "threshold": 0.5, "every_chars": 8}, "hold_back_chars": 8}
    with front_door(triton, flt) as fd:
        r, events = ask(fd, stream=True)
        text, reason = streamed_text(events)
        assert reason == "content_filter" and "tok1010" not in text and text.startswith(" tok1005")
        r, events = ask(fd, stream=True, max_tokens=5)  # tok1004..tok1008: the classifier passes it
        assert streamed_text(events) == ("".join(ANSWER[:5]), "length")
        r, body = ask(fd, stream=False, content="say tok1010 please")
        assert r.status_code == 400 and body["error"]["code"] == "content_filter"
