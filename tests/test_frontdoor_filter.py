"""The content filter (toolkit/frontdoor/filter.py): the matching rules on their own, then through the front
door over a real tritonserver (a fake decoupled LLM that streams a fixed text; the classifier is a real
Triton python model)."""

from __future__ import annotations

import asyncio
import random

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
