"""`rtk slo` options as library functions (toolkit/slo/options.py) and the command's parsing (CliRunner, no server)."""

from __future__ import annotations

import pytest

from toolkit.errors import SpecError, UsageError
from toolkit.slo.options import apply_options, load_objectives, parse_objective, parse_values, validate_slo, with_load
from toolkit.spec import SLOSpec


def test_objective_shorthand():
    o = parse_objective("ttft:p99<=300")
    assert (o.metric, o.stat, o.max, o.min) == ("ttft", "p99", 300, None)
    o = parse_objective("e2e:p99.9 <= 2000")
    assert (o.metric, o.stat, o.max) == ("e2e", "p99.9", 2000)
    o = parse_objective("attainment>=0.99")
    assert (o.metric, o.stat, o.min) == ("attainment", "value", 0.99)
    o = parse_objective("refusal_latency:p99<=50")
    assert (o.metric, o.stat, o.max) == ("refusal_latency", "p99", 50)
    with pytest.raises(UsageError, match="METRIC"):
        parse_objective("ttft p99 300")
    with pytest.raises(UsageError, match="'shed_rate<=5'.*fraction between 0 and 1"):
        parse_objective("shed_rate<=5")
    with pytest.raises(UsageError, match="'latency:p99<=5'.*'metric'.*'ttft'"):
        parse_objective("latency:p99<=5")


def test_objectives_file(tmp_path):
    p = tmp_path / "o.yaml"
    p.write_text("objectives:\n  - {metric: ttft, stat: p99, max: 300}\n  - {metric: shed_rate, max: 0.1}\n")
    assert [o.metric for o in load_objectives(p)] == ["ttft", "shed_rate"]
    p.write_text("- {metric: ttft, stat: p99, max: 300}\n- {metric: ttft, stat: p99}\n")
    with pytest.raises(UsageError, match="objective 2: .*exactly one of 'max' or 'min'"):
        load_objectives(p)
    with pytest.raises(UsageError, match="does not exist"):
        load_objectives(tmp_path / "missing.yaml")


@pytest.mark.xfail(strict=True, reason="toolkit.spec._spec_error cuts a message without a field at its first ': ' "
                   "(fixed with the next shared edit of spec.py)")
def test_an_objective_without_its_stat_says_so(tmp_path):
    with pytest.raises(UsageError, match="'ttft<=300'.*give a stat"):
        parse_objective("ttft<=300")
    p = tmp_path / "o.yaml"
    p.write_text("- {metric: ttft, max: 1}\n")
    with pytest.raises(UsageError, match="objective 1: .*give a stat"):
        load_objectives(p)


def test_a_given_load_replaces_the_other_kind():
    base = SLOSpec(concurrency=4).model_dump()
    slo = validate_slo(apply_options(base, {"request_rate": 2.5, "arrival": None}))
    assert (slo.request_rate, slo.concurrency) == (2.5, None)
    back = with_load(slo, "concurrency", 3)
    assert (back.request_rate, back.concurrency) == (None, 3)
    assert with_load(back, "rate", 8).request_rate == 8.0
    with pytest.raises(SpecError, match="not both"):
        validate_slo(apply_options(base, {"request_rate": 1, "concurrency": 2}))


def test_a_new_transport_takes_its_own_interface_unless_one_is_given():
    grpc = SLOSpec(endpoint="tensorrt_llm").model_dump()
    assert validate_slo(apply_options(grpc, {"transport": "openai"})).endpoint == "chat"
    assert validate_slo(apply_options(grpc, {"transport": "openai", "endpoint": "completions"})).endpoint == "completions"
    assert validate_slo(apply_options(grpc, {"transport": "http"})).endpoint == "tensorrt_llm"
    openai = SLOSpec(transport="openai", endpoint="completions").model_dump()
    assert validate_slo(apply_options(openai, {"transport": "grpc"})).endpoint == "ensemble"
    with pytest.raises(SpecError, match="field 'slo.endpoint'.*needs transport openai"):
        validate_slo(apply_options(openai, {"transport": "grpc", "endpoint": "chat"}))


def test_bad_values_name_the_field():
    with pytest.raises(SpecError, match="field 'slo.concurrency'"):
        validate_slo({"concurrency": 0})
    with pytest.raises(SpecError, match="field 'slo.arrival': got 'steady'"):
        validate_slo({"arrival": "steady"})
    assert parse_values("1, 2,4") == [1.0, 2.0, 4.0]
    for bad in ("1,x", "", "0,2"):
        with pytest.raises(UsageError, match="--values"):
            parse_values(bad)
