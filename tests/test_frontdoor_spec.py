"""The front door's spec sections: serving.frontend, serving.guard, serving.cache."""

from __future__ import annotations

import pytest

from toolkit.errors import SpecError
from toolkit.spec import spec_from_dict


def spec(**serving):
    return spec_from_dict({"name": "fd", "serving": serving})


def test_defaults_are_on_and_on_loopback():
    s = spec().serving
    assert s.frontend.enabled and s.frontend.host == "127.0.0.1" and s.frontend.api_keys is None
    assert s.guard.ttft_deadline_ms is None and s.guard.fallbacks == []
    assert s.cache.url is None


def test_a_full_chain_validates():
    s = spec(
        guard={
            "ttft_deadline_ms": 250,
            "fallbacks": [
                {"kind": "cache"},
                {"kind": "deployment", "url": "http://127.0.0.1:9000/v1", "api_key": "env:SMALL_KEY"},
                {"kind": "rule", "template": "Busy; try again in a moment."},
            ],
        }
    ).serving
    assert [t.label for t in s.guard.fallbacks] == ["cache", "deployment", "rule"]


@pytest.mark.parametrize(
    "serving, field, words",
    [
        ({"frontend": {"host": "0.0.0.0"}}, "serving.frontend.api_keys", "beyond loopback"),
        ({"frontend": {"api_keys": "sk-not-a-source"}}, "serving.frontend.api_keys", "env:VARIABLE"),
        ({"frontend": {"port": 8001}}, "serving.frontend.port", "Triton's ports"),
        ({"guard": {"fallbacks": [{"kind": "rule"}]}}, "serving.guard.fallbacks.0", "template"),
        ({"guard": {"fallbacks": [{"kind": "deployment"}]}}, "serving.guard.fallbacks.0", "exactly one of 'url'"),
        (
            {"guard": {"fallbacks": [{"kind": "cache", "url": "http://x"}]}},
            "serving.guard.fallbacks.0",
            "belong to a 'deployment'",
        ),
        (
            {"guard": {"fallbacks": [{"kind": "rule", "template": "x"}, {"kind": "cache"}]}},
            "serving.guard.fallbacks",
            "put it last",
        ),
        ({"guard": {"ttft_deadline_ms": 0}}, "serving.guard.ttft_deadline_ms", "greater than 0"),
    ],
)
def test_bad_settings_name_the_field(serving, field, words):
    with pytest.raises(SpecError) as info:
        spec(**serving)
    assert field in str(info.value) and words in str(info.value)


def test_non_loopback_with_keys_is_allowed():
    assert spec(frontend={"host": "0.0.0.0", "api_keys": "file:/run/secrets/keys"}).serving.frontend.host == "0.0.0.0"
