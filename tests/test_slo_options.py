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
    with pytest.raises(SpecError, match="field 'slo.request_rate'.*not both"):
        validate_slo(apply_options(base, {"request_rate": 1, "concurrency": 2}))


def test_a_new_transport_takes_its_own_interface_unless_one_is_given():
    grpc = SLOSpec(endpoint="tensorrt_llm").model_dump()
    assert validate_slo(apply_options(grpc, {"transport": "openai"})).endpoint == "chat"
    assert (
        validate_slo(apply_options(grpc, {"transport": "openai", "endpoint": "completions"})).endpoint == "completions"
    )
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


# -- the command: option parsing only (CliRunner; the library calls are replaced by recorders) --------

MS = 1_000_000


def _report(slo, status_ttft_ms=10.0):
    """A real SLOReport from hand-built records, for the command to print and write."""
    from toolkit.slo.loadgen import LoadPlan
    from toolkit.slo.records import RequestRecord
    from toolkit.slo.runner import SLOReport, Target, judge

    recs = [
        RequestRecord(
            index=i,
            scheduled_ns=i * 10 * MS,
            sent_ns=i * 10 * MS,
            chunk_ns=[int((i * 10 + status_ttft_ms) * MS)],
            chunk_tokens=[1],
            final_ns=int((i * 10 + status_ttft_ms) * MS),
            requested_output_tokens=1,
        )
        for i in range(4)
    ]
    summary, verdict, notes = judge(recs, slo, list(slo.objectives))
    return SLOReport(
        target=Target(url="127.0.0.1:1"),
        plan=LoadPlan(concurrency=1, num_requests=4),
        slo=slo,
        workload={
            "kind": "synthetic",
            "tokenizer": "words",
            "input_tokens": 1,
            "input_tokens_stddev": 0,
            "output_tokens": 1,
            "output_tokens_stddev": 0,
            "turns": 1,
            "seed": 0,
            "warmup_requests": 0,
        },
        summary=summary,
        verdict=verdict,
        records=recs,
        started_unix=1.7e9,
        wall_s=0.1,
        notes=notes,
        client={"t0_ns": 0, "t0_unix": 1.7e9},
    )


@pytest.fixture
def calls(monkeypatch):
    from toolkit.slo import runner

    seen = []

    def fake_run(config, url=None, **kw):
        slo = config.slo if hasattr(config, "slo") else config
        seen.append(("run", slo, url, kw))
        return _report(slo)

    def fake_merge(paths, objectives=None):
        seen.append(("merge", paths, objectives))
        return _report(SLOSpec(objectives=objectives or []))

    monkeypatch.setattr(runner, "run_slo", fake_run)
    monkeypatch.setattr(runner, "merge_reports", fake_merge)
    return seen


def _rtk(tmp_path, *args):
    from click.testing import CliRunner

    from toolkit.cli import cli

    return CliRunner().invoke(cli, ["slo", *args, "-o", str(tmp_path / "out"), "--no-plots"])


def test_cli_options_reach_the_library(tmp_path, calls):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nslo:\n  concurrency: 4\n  objectives: [{metric: ttft, stat: p50, max: 1}]\n")
    res = _rtk(
        tmp_path,
        str(spec),
        "--request-rate",
        "2.5",
        "--arrival",
        "constant",
        "--objective",
        "ttft:p50<=50",
        "--url",
        "127.0.0.1:1",
        "--url",
        "127.0.0.1:2",
        "--balance",
        "least_loaded",
        "--workers",
        "3",
        "--check-metric",
        'nv_trt_llm_request_metrics{request_type="waiting"}',
        "--start-at",
        "1790000000",
    )
    assert res.exit_code == 0, res.output
    kind, slo, url, kw = calls[0]
    assert (slo.request_rate, slo.concurrency, slo.arrival) == (2.5, None, "constant")
    assert [(o.metric, o.max) for o in slo.objectives] == [("ttft", 50)]  # --objective replaced the spec's
    assert url == ["127.0.0.1:1", "127.0.0.1:2"]
    assert kw["balance"] == "least_loaded" and kw["workers"] == 3 and kw["start_at"] == 1790000000.0
    assert kw["check_metrics"] == ['nv_trt_llm_request_metrics{request_type="waiting"}']
    assert (tmp_path / "out" / "report.json").is_file()


def test_cli_exit_code_is_the_verdicts(tmp_path, calls):
    res = _rtk(tmp_path, "--url", "127.0.0.1:1", "--objective", "ttft:max<=5")  # the recorded run's TTFT is 10 ms
    assert res.exit_code == 10, res.output
    assert calls[0][1].transport == "grpc" and calls[0][2] == "127.0.0.1:1"


def test_cli_transport_openai_takes_the_chat_interface(tmp_path, calls):
    res = _rtk(tmp_path, "--transport", "openai", "--url", "http://127.0.0.1:1", "--objective", "shed_rate<=0.1")
    assert res.exit_code == 0, res.output
    assert (calls[0][1].transport, calls[0][1].endpoint) == ("openai", "chat")


def test_cli_merge(tmp_path, calls):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text("{}")
    b.write_text("{}")
    res = _rtk(tmp_path, "--merge", str(a), "--merge", str(b), "--objective", "ttft:p50<=50")
    assert res.exit_code == 0, res.output
    assert calls[0][0] == "merge" and [str(p) for p in calls[0][1]] == [str(a), str(b)]
    bad = _rtk(tmp_path, "--merge", str(a), "--url", "127.0.0.1:1")
    assert bad.exit_code == 2 and "--merge combines existing reports" in bad.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--objective", "ttft p99 300"], "METRIC[:STAT]<=VALUE"),
        (["--objective", "shed_rate<=3"], "fraction between 0 and 1"),
        (["--objective", "ttft<=300"], "give a stat"),
        (["--arrival", "steady"], "'steady' is not one of"),
        (["--workers", "0"], "--workers"),
        (["--sweep", "rate"], "--sweep needs --values"),
        (["--sweep", "rate", "--values", "1,x"], "not a comma-separated list"),
        (["--sweep", "rate", "--search", "rate", "--values", "1"], "either --sweep or --search"),
        (["--set", "slo.seed=1"], "--set needs a SPEC"),
        (["--transport", "grpc", "--endpoint", "chat"], "field 'slo.endpoint'"),
        (["--concurrency", "0"], "field 'slo.concurrency'"),
        (["--check-metric", "bad metric{"], "--check-metric"),
    ],
)
def test_cli_bad_options_exit_2_and_say_what_to_change(tmp_path, args, message):
    # Refused before any connection: nothing listens on port 9, and a connection attempt would exit 4.
    res = _rtk(tmp_path, "--url", "127.0.0.1:9", *args)
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output
    assert not (tmp_path / "out").exists()  # nothing half-written
