"""Request outcomes (served / shed / failed / timed out) and how each enters the numbers and the verdict.

Hand-built records in nanoseconds (AIPerf style); no server, no sleeps.
"""

from __future__ import annotations

import json

import pytest

from toolkit.slo import outcome as O
from toolkit.slo.metrics import summarize
from toolkit.slo.records import RequestRecord
from toolkit.slo.verdict import FAIL, INCONCLUSIVE, PASS, evaluate
from toolkit.spec import Objective

MS = 1_000_000


def served(i, ttft=10.0, *, tokens=4, requested=4, tier=None, sched=None):
    s = (i * 10 if sched is None else sched) * MS
    chunks = [s + int((ttft + k) * MS) for k in range(tokens)]
    return RequestRecord(
        index=i,
        scheduled_ns=s,
        sent_ns=s,
        chunk_ns=chunks,
        chunk_tokens=[1] * tokens,
        final_ns=chunks[-1],
        requested_output_tokens=requested,
        tier=tier,
    )


def refused(i, after_ms=2.0, status=429):
    s = i * 10 * MS
    return RequestRecord(
        index=i,
        scheduled_ns=s,
        sent_ns=s,
        final_ns=s + int(after_ms * MS),
        error=f"HTTP {status}: busy",
        status=status,
        requested_output_tokens=4,
    )


def failed(i, status=None, after_ms=5.0):
    s = i * 10 * MS
    return RequestRecord(
        index=i,
        scheduled_ns=s,
        sent_ns=s,
        final_ns=s + int(after_ms * MS),
        error="boom",
        status=status,
        requested_output_tokens=4,
    )


def timed_out(i):
    s = i * 10 * MS
    return RequestRecord(
        index=i,
        scheduled_ns=s,
        sent_ns=s,
        final_ns=s + 2000 * MS,
        error="no final response",
        timed_out=True,
        requested_output_tokens=4,
    )


def test_the_four_outcomes():
    assert served(0).outcome == O.SERVED and served(0, tier=O.PRIMARY_TIER).outcome == O.SERVED
    assert served(0, tier="cache").outcome == O.SHED  # answered by a fallback tier
    assert refused(0, status=429).outcome == O.SHED and refused(0, status=503).outcome == O.SHED
    assert (
        failed(0).outcome == O.FAILED
        and failed(0, status=500).outcome == O.FAILED
        and failed(0, status=400).outcome == O.FAILED
    )
    assert timed_out(0).outcome == O.TIMED_OUT
    unfinished = RequestRecord(index=0, sent_ns=0)
    assert unfinished.outcome == O.TIMED_OUT
    assert json.loads(json.dumps(served(3).to_dict()))["outcome"] == "served"
    assert RequestRecord.from_dict(refused(1).to_dict()).outcome == O.SHED


def test_failed_and_timed_out_requests_count_at_the_timeout_so_a_p99_cannot_pass_by_losing_them():
    recs = [served(i, ttft=10) for i in range(98)] + [failed(98), timed_out(99)]
    s = summarize(recs, failure_ms=2000.0)
    assert s.outcomes == {"served": 98, "shed": 0, "failed": 1, "timed_out": 1} and s.failed == 2
    ttft, e2e = s.distributions["ttft"], s.distributions["e2e"]
    assert ttft.count == 100 and ttft.p99 == 2000.0 and ttft.p90 == pytest.approx(10)
    assert e2e.count == 100 and e2e.max == 2000.0
    assert s.distributions["itl"].requests == 98 and s.distributions["ttft_sent"].count == 98  # served only
    obj = [Objective(metric="ttft", stat="p99", max=50), Objective(metric="error_rate", max=0.05)]
    v = evaluate(obj, s)
    assert v.status == FAIL and [r.status for r in v.results] == [FAIL, PASS]
    # Without the failures the same p99 would have passed.
    assert evaluate(obj, summarize(recs[:98] + [served(98), served(99)])).status == PASS


def test_shed_requests_enter_shed_rate_and_goodput_not_the_served_latencies():
    recs = [served(i, ttft=10) for i in range(8)] + [refused(8, after_ms=3), refused(9, after_ms=7, status=503)]
    s = summarize(recs, {"ttft": 50})
    a = s.aggregates
    assert s.outcomes["shed"] == 2 and s.failed == 0
    assert a["shed_rate"] == pytest.approx(0.2) and a["error_rate"] == 0.0 and a["fallback_rate"] == 0.0
    assert s.distributions["ttft"].count == 8 and s.distributions["ttft"].max == pytest.approx(10)
    assert s.good == 8 and a["attainment"] == pytest.approx(0.8)  # shed requests are misses
    assert a["goodput"] == pytest.approx(8 / s.aggregates["duration"])
    ref = s.distributions["refusal_latency"]
    assert (ref.count, ref.min, ref.max) == (2, pytest.approx(3), pytest.approx(7))
    objs = [Objective(metric="refusal_latency", stat="max", max=5), Objective(metric="shed_rate", max=0.1)]
    v = evaluate(objs, s)
    assert [r.status for r in v.results] == [FAIL, FAIL, PASS]  # + implied error_rate ≤ 0 passes
    assert (
        evaluate(
            [Objective(metric="refusal_latency", stat="max", max=10), Objective(metric="shed_rate", max=0.2)], s
        ).status
        == PASS
    )


def test_fallback_tiers_are_shed_and_counted_per_tier():
    recs = [served(i, tier="primary") for i in range(6)] + [
        served(6, tier="cache"),
        served(7, tier="int4-awq"),
        served(8, tier="cache"),
        refused(9),
    ]
    s = summarize(recs)
    assert s.tiers == {"primary": 6, "cache": 2, "int4-awq": 1}
    assert s.aggregates["fallback_rate"] == pytest.approx(0.3) and s.aggregates["shed_rate"] == pytest.approx(0.4)
    assert s.succeeded == 6 and s.distributions["ttft"].count == 6
    assert evaluate([Objective(metric="fallback_rate", max=0.25)], s).status == FAIL


def test_every_request_shed_is_a_failure_not_inconclusive():
    s = summarize([refused(i) for i in range(5)])
    v = evaluate([Objective(metric="ttft", stat="p50", max=100)], s)
    assert v.status == FAIL and "no request was served (5 shed)" in v.results[0].message


def test_client_lag_casts_doubt_on_latencies_but_not_on_errors():
    ok_then_failed = [served(i) for i in range(90)] + [failed(90 + i) for i in range(10)]
    s = summarize(ok_then_failed)
    lagging = dict(schedule_ok=False, schedule_message="client send lag p99 9 ms > 5 ms")
    v = evaluate([Objective(metric="ttft", stat="p50", max=50), Objective(metric="error_rate", max=0.01)], s, **lagging)
    assert v.status == FAIL and v.exit_code == 10
    assert any("could not keep the schedule" in r for r in v.reasons)
    # A latency FAIL under the same lag is only doubt.
    slow = summarize([served(i, ttft=80) for i in range(100)])
    assert evaluate([Objective(metric="ttft", stat="p50", max=50)], slow, **lagging).status == INCONCLUSIVE
    assert evaluate([Objective(metric="ttft", stat="p50", max=50)], slow).status == FAIL


def test_under_client_lag_a_latency_fail_the_servers_own_clock_confirms_stands():
    """A late client sends and reads late; it cannot stretch the server's arrival -> first token."""
    from toolkit.slo.records import ARRIVAL, FIRST_TOKEN, LAST_TOKEN

    def with_server(i, server_ttft):
        r = served(i, ttft=80)
        t0 = 10**12 + i * 10 * MS  # the server's clock: another origin than the client's
        r.server = {ARRIVAL: t0, FIRST_TOKEN: t0 + int(server_ttft * MS), LAST_TOKEN: t0 + int((server_ttft + 3) * MS)}
        return r

    lagging = dict(schedule_ok=False, schedule_message="client send lag p99 9 ms > 5 ms")
    p99 = [Objective(metric="ttft", stat="p99", max=50)]
    slow_server = summarize([with_server(i, 75) for i in range(100)])
    v = evaluate(p99, slow_server, **lagging)
    assert v.status == FAIL and "server's own time stamps give 75" in v.results[0].message
    e2e = evaluate([Objective(metric="e2e", stat="p50", max=60)], slow_server, **lagging)
    assert e2e.status == FAIL
    # The client read late, the server was fast: doubt, as before.
    fast_server = summarize([with_server(i, 20) for i in range(100)])
    assert evaluate(p99, fast_server, **lagging).status == INCONCLUSIVE
    # Too few server stamps for a p99: doubt.
    few = summarize([with_server(i, 75) for i in range(50)] + [served(50 + i, ttft=80) for i in range(50)])
    assert evaluate(p99, few, **lagging).status == INCONCLUSIVE
    # ITL has no server-side twin: doubt.
    itl = evaluate([Objective(metric="itl", stat="p50", max=0.5)], slow_server, **lagging)
    assert itl.status == INCONCLUSIVE


def test_short_responses_are_counted_and_an_objective_fails_on_them():
    recs = [served(i, tokens=8, requested=8) for i in range(9)] + [served(9, tokens=3, requested=8)]
    s = summarize(recs)
    assert s.short == 1 and s.aggregates["short_output_rate"] == pytest.approx(0.1)
    assert evaluate([Objective(metric="short_output_rate", max=0.0)], s).status == FAIL
    assert evaluate([Objective(metric="short_output_rate", max=0.1)], s).status == PASS
    # Outcome objectives stand under client lag too.
    assert evaluate([Objective(metric="short_output_rate", max=0.0)], s, schedule_ok=False).status == FAIL


def test_objective_names_come_from_the_metrics_registry():
    from toolkit.slo.metrics import AGGREGATES, OBJECTIVE_METRICS, REQUEST_METRICS
    from toolkit.spec import SLOSpec

    for tag in OBJECTIVE_METRICS:
        assert tag in REQUEST_METRICS or tag in AGGREGATES
    assert {"shed_rate", "fallback_rate", "refusal_latency", "short_output_rate"} <= set(OBJECTIVE_METRICS)
    assert "duration" not in OBJECTIVE_METRICS and "client_lag" not in OBJECTIVE_METRICS
    from toolkit.errors import SpecError
    from toolkit.spec import spec_from_dict

    with pytest.raises(SpecError, match="fraction between 0 and 1"):
        spec_from_dict({"name": "x", "slo": {"objectives": [{"metric": "shed_rate", "max": 5}]}})
    with pytest.raises(SpecError, match="slo.objectives.0.metric"):
        spec_from_dict({"name": "x", "slo": {"objectives": [{"metric": "latency", "max": 5}]}})
    assert SLOSpec(transport="openai").endpoint == "chat"
    with pytest.raises(SpecError, match="slo.endpoint.*with transport openai use chat or completions"):
        spec_from_dict({"name": "x", "slo": {"transport": "openai", "endpoint": "ensemble"}})


# -- OpenAI-compatible streams (decoding only; the transport is tested against a server) -------------


def test_openai_chunks_usage_and_tier_decode_into_the_record():
    from toolkit.slo.openai_transport import HEADER_TIER
    from toolkit.slo.transport import ModelInfo, finish_record

    info = ModelInfo(name="m", interface="chat", max_batch_size=0, inputs=set(), outputs=set())
    rec = RequestRecord(index=0, scheduled_ns=0, sent_ns=0, requested_output_tokens=5)

    def chunk(delta):
        return json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode()

    rec.raw = [
        (1 * MS, {HEADER_TIER: "cache"}),
        (2 * MS, chunk({"role": "assistant"})),
        (3 * MS, chunk({"content": "Hel"})),
        (5 * MS, chunk({"content": "lo"})),
        (6 * MS, json.dumps({"choices": [], "usage": {"completion_tokens": 5}, "rtk_tier": "cache"}).encode()),
    ]
    rec.final_ns = 7 * MS
    finish_record(rec, info, "openai")
    assert rec.chunk_ns == [3 * MS, 5 * MS] and rec.chunk_tokens == [1, 4]  # the server's count: 5 tokens
    assert rec.text == "Hello" and rec.tier == "cache" and rec.outcome == O.SHED
    assert rec.ttft_ms() == pytest.approx(3) and rec.tpot_ms() == pytest.approx(2 / 4)

    comp = ModelInfo(name="m", interface="completions", max_batch_size=0, inputs=set(), outputs=set())
    r2 = RequestRecord(index=1, requested_output_tokens=2, final_ns=9)
    r2.raw = [
        (4, json.dumps({"choices": [{"text": "a"}]}).encode()),
        (8, json.dumps({"choices": [{"text": "b"}]}).encode()),
    ]
    finish_record(r2, comp, "openai")
    assert r2.text == "ab" and r2.chunk_tokens == [1, 1] and r2.outcome == O.SERVED and r2.tier is None


@pytest.mark.parametrize(
    "value, ms",
    [
        ("frontdoor;dur=12.5", 12.5),
        ('cdn-cache;desc="HIT", frontdoor;desc="rtk";dur=3', 3.0),
        ("frontdoor; DUR = 0.25", 0.25),
        ("db;dur=7", None),  # another component's time is not the front door's
        ("frontdoor", None),
        ("frontdoor;dur=fast", None),
        ("", None),
        (None, None),
    ],
)
def test_server_timing_header_gives_the_front_doors_own_time(value, ms):
    assert O.server_timing_ms(value) == ms


def test_a_timed_head_becomes_the_records_server_ttft():
    from toolkit.slo.metrics import REQUEST_METRICS
    from toolkit.slo.openai_transport import HEADER_AT, HEADER_SERVER_MS, HEADER_TIER
    from toolkit.slo.transport import ModelInfo, finish_record

    info = ModelInfo(name="m", interface="chat", max_batch_size=0, inputs=set(), outputs=set())
    rec = RequestRecord(index=0, scheduled_ns=0, sent_ns=1 * MS, requested_output_tokens=2)
    rec.raw = [
        (9 * MS, {HEADER_TIER: "primary", HEADER_SERVER_MS: 6.5, HEADER_AT: 9 * MS}),
        (9 * MS, json.dumps({"choices": [{"index": 0, "delta": {"content": "a"}}]}).encode()),
        (12 * MS, json.dumps({"choices": [{"index": 0, "delta": {"content": "b"}}]}).encode()),
    ]
    rec.final_ns = 13 * MS
    finish_record(rec, info, "openai")
    assert rec.ttft_ms(from_sent=True) == pytest.approx(8)
    assert REQUEST_METRICS["server_ttft"].values(rec) == [pytest.approx(6.5)]
    assert REQUEST_METRICS["ttft_outside_server"].values(rec) == [pytest.approx(1.5)]  # network, queue, client
    untimed = RequestRecord(index=1, scheduled_ns=0, sent_ns=0, requested_output_tokens=1, final_ns=5 * MS)
    untimed.raw = [(2 * MS, {HEADER_TIER: "primary", HEADER_SERVER_MS: None, HEADER_AT: 2 * MS})]
    finish_record(untimed, info, "openai")
    assert untimed.server == {}


def test_reports_show_outcomes_and_tiers(tmp_path):
    from toolkit.slo.loadgen import LoadPlan
    from toolkit.slo.report import markdown, outcome_line
    from toolkit.slo.runner import SLOReport, Target
    from toolkit.spec import SLOSpec

    recs = [served(i, tier="primary") for i in range(7)] + [served(7, tier="cache"), refused(8), timed_out(9)]
    s = summarize(recs, failure_ms=2000.0)
    objs = [Objective(metric="shed_rate", max=0.5)]
    rep = SLOReport(
        target=Target(url="http://127.0.0.1:1", transport="openai", model="m", endpoint="chat"),
        plan=LoadPlan(concurrency=1, num_requests=10),
        slo=SLOSpec(objectives=objs),
        summary=s,
        verdict=evaluate(objs, s),
        records=recs,
        started_unix=1.7e9,
        workload={
            "kind": "synthetic",
            "tokenizer": "words",
            "input_tokens": 1,
            "input_tokens_stddev": 0,
            "output_tokens": 4,
            "output_tokens_stddev": 0,
            "turns": 1,
            "seed": 0,
            "warmup_requests": 0,
        },
    )
    assert outcome_line(rep) == "10 measured: 7 served, 2 shed, 0 failed, 1 timed out; tiers: cache 1, primary 7"
    md = markdown(rep)
    assert "| cache | 1 |" in md and "count as 2000 ms (the request timeout)" in md
    assert "shed (refused 429/503 or answered by a fallback tier) / measured | 20.00 %" in md
    assert rep.verdict.status == FAIL  # the timed-out request fails the implied error_rate ≤ 0


# -- gRPC responses (decoding only; the transport is tested against a server in test_slo_triton.py) ----------


def test_grpc_responses_decode_into_the_record():
    """Text, ids and server stamps from raw responses after the run; the last response with stamps gives them all."""
    import struct

    import numpy as np
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

    from toolkit.slo.records import SERVER_STAMPS
    from toolkit.slo.transport import ModelInfo, bytes_elements, decode_grpc, finish_record

    def response(output=None, stamps=None, final=False):
        resp = service_pb2.ModelInferResponse(model_name="m", id="7")
        for name, datatype, shape, raw in [*([output] if output else []), *(stamps or [])]:
            resp.outputs.add(name=name, datatype=datatype, shape=shape)
            resp.raw_output_contents.append(raw)
        resp.parameters["triton_final_response"].bool_param = final
        return resp

    def stamps(*values):
        return [(n, "INT64", [1, 1], struct.pack("<q", v)) for n, v in zip(SERVER_STAMPS, values, strict=True)]

    def text(s):
        return ("text_output", "BYTES", [1, 1], struct.pack("<I", len(s.encode())) + s.encode())

    for items in ([], [b""], [b"a", "é".encode(), b"xyz\x00"]):
        raw = serialize_byte_tensor(np.array(items, dtype=object)).item() if items else b""
        assert bytes_elements(raw) == list(deserialize_bytes_tensor(raw))
    with pytest.raises(ValueError, match="runs past"):
        bytes_elements(struct.pack("<I", 9) + b"short")

    ens = ModelInfo(name="m", interface="ensemble", max_batch_size=0, inputs=set(), outputs=set())
    rec = RequestRecord(index=7, scheduled_ns=0, sent_ns=0, requested_output_tokens=2, final_ns=9 * MS)
    rec.raw = [
        (3 * MS, response(text("Hel"), stamps(100, 110, 120, 0))),
        (5 * MS, response(text("lo é"), stamps(100, 110, 120, 150))),
        (9 * MS, response(final=True)),  # an empty final response: no tokens, no stamps
    ]
    finish_record(rec, ens, "grpc")
    assert rec.text == "Hello é" and rec.chunk_ns == [3 * MS, 5 * MS] and rec.chunk_tokens == [1, 1]
    assert rec.server == dict(zip(SERVER_STAMPS, (100, 110, 120, 150), strict=True)) and rec.outcome == O.SERVED

    trt = ModelInfo(name="m", interface="tensorrt_llm", max_batch_size=0, inputs=set(), outputs=set())
    ids = ("output_ids", "INT32", [1, 1, 3], struct.pack("<3i", 5, 6, 7) + struct.pack("<2i", 8, 9))  # beam 2 dropped
    d = decode_grpc(trt, response(ids, stamps(1, 2, 3, 4)))
    assert d.tokens == 3 and d.ids == [5, 6, 7] and d.stamps[SERVER_STAMPS[3]] == 4

    bad = RequestRecord(index=8, requested_output_tokens=1, final_ns=2)
    bad.raw = [(1, response(("text_output", "BYTES", [1, 1], struct.pack("<I", 9) + b"short")))]
    finish_record(bad, ens, "grpc")
    assert bad.error.startswith("unreadable response: BYTES element of 9 bytes") and bad.outcome == O.FAILED
