"""Metric math, verdict rules, arrivals, workloads and reports on hand-built request records (ns)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from toolkit.errors import UsageError
from toolkit.slo.metrics import Distribution, percentile, summarize
from toolkit.slo.records import RequestRecord
from toolkit.slo.schedule import arrival_offsets
from toolkit.slo.verdict import (
    EXIT_CODES,
    FAIL,
    INCONCLUSIVE,
    PASS,
    evaluate,
    required_samples,
)
from toolkit.spec import Objective, SLOSpec, spec_from_dict

MS = 1_000_000


def rec(
    i,
    *,
    sched=0,
    sent=None,
    chunks=(),
    final=None,
    tokens=None,
    error=None,
    phase="measure",
    released=None,
    server=None,
):
    """A record with times in ms relative to 0 (stored as ns)."""
    chunk_ns = [int(c * MS) for c in chunks]
    return RequestRecord(
        index=i,
        phase=phase,
        scheduled_ns=int(sched * MS),
        sent_ns=int((sched if sent is None else sent) * MS),
        released_ns=None if released is None else int(released * MS),
        chunk_ns=chunk_ns,
        chunk_tokens=list(tokens) if tokens is not None else [1] * len(chunk_ns),
        final_ns=int(final * MS) if final is not None else (chunk_ns[-1] if chunk_ns else None),
        error=error,
        server=server or {},
    )


# -- per-request definitions ---------------------------------------------------------------------


def test_request_times_from_schedule_and_from_send():
    r = rec(0, sched=100, sent=130, chunks=[180, 190, 205, 215], final=216)
    assert r.ttft_ms() == pytest.approx(80)  # first token − scheduled
    assert r.ttft_ms(from_sent=True) == pytest.approx(50)  # first token − sent
    assert r.e2e_ms() == pytest.approx(116)
    assert r.e2e_ms(from_sent=True) == pytest.approx(86)
    assert r.itl_ms() == pytest.approx([10, 15, 10])
    assert r.tpot_ms() == pytest.approx((215 - 180) / 3)
    assert r.schedule_lag_ms() == pytest.approx(30)
    assert r.client_lag_ms() == pytest.approx(30)  # no slot wait: all of it is the client's


def test_slot_wait_is_not_client_lag():
    r = rec(0, sched=0, released=400, sent=400.5, chunks=[420, 430])
    assert r.schedule_lag_ms() == pytest.approx(400.5)
    assert r.client_lag_ms() == pytest.approx(0.5)


def test_tpot_counts_tokens_not_chunks_and_is_undefined_for_one_token():
    r = rec(0, chunks=[10, 20], tokens=[1, 4])  # 5 tokens: (20-10)/(5-1)
    assert r.tpot_ms() == pytest.approx(2.5)
    assert rec(1, chunks=[10]).tpot_ms() is None


def test_server_stamps_are_used_only_as_differences():
    base = 1_700_000_000_000_000_000  # epoch ns on the server's clock, unrelated to the client's
    r = rec(
        0,
        chunks=[50],
        server={
            "arrival_time_ns": base,
            "first_scheduled_time_ns": base + 3 * MS,
            "first_token_time_ns": base + 40 * MS,
            "last_token_time_ns": base + 40 * MS,
        },
    )
    assert r.server_ms("arrival_time_ns", "first_scheduled_time_ns") == pytest.approx(3)
    assert r.server_ms("arrival_time_ns", "first_token_time_ns") == pytest.approx(40)
    s = summarize([r])
    assert s.distributions["ttft_outside_server"].p50 == pytest.approx(50 - 40)


# -- percentiles ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 10, 99, 100, 101, 1000, 1234])
def test_nearest_rank_percentile_is_the_smallest_value_covering_q(n):
    from bisect import bisect_right
    from fractions import Fraction

    rng = np.random.default_rng(n)
    v = sorted(rng.lognormal(3, 1, n).tolist())
    for q in ("0.5", "0.9", "0.95", "0.99", "0.999", "1"):
        # Definition, in exact arithmetic: the smallest sample x with #(samples ≤ x) / n ≥ q.
        want = next(x for x in v if Fraction(bisect_right(v, x), n) >= Fraction(q))
        assert percentile(v, float(q)) == want
    if n >= 10:  # and numpy's inverted_cdf agrees where q·n is not on a float boundary
        assert percentile(v, 0.9) == np.percentile(v, 90, method="inverted_cdf")


def test_p99_of_100_samples_is_the_99th_value():
    v = list(range(1, 101))
    d = Distribution.of(v)
    assert (d.p50, d.p90, d.p99, d.p999, d.max, d.mean) == (50, 90, 99, 100, 100, 50.5)


# -- aggregates ------------------------------------------------------------------------------------


def _run_records():
    # 4 measured requests over 1 s, one failed; one warm-up request that must not count.
    return [
        rec(0, phase="warmup", sched=-500, chunks=[-400, -390]),
        rec(1, sched=0, chunks=[100, 110, 120], final=121),  # ttft 100, e2e 121
        rec(2, sched=250, chunks=[300, 320], final=321),  # ttft 50, e2e 71
        rec(3, sched=500, chunks=[900, 950, 1000], final=1000),  # ttft 400, e2e 500
        rec(4, sched=750, error="boom", final=760),
    ]


def test_throughput_error_rate_goodput_and_attainment():
    s = summarize(_run_records(), goodput_bounds={"ttft": 200})
    assert (s.measured, s.succeeded, s.failed) == (4, 3, 1)
    agg = s.aggregates
    assert agg["duration"] == pytest.approx(1.0)  # first scheduled (0) to last response (1000 ms)
    assert agg["request_throughput"] == pytest.approx(3.0)
    assert agg["output_token_throughput"] == pytest.approx(8.0)
    assert agg["error_rate"] == pytest.approx(0.25)
    assert s.good == 2  # requests 1 and 2; 3 is too slow, 4 failed
    assert agg["attainment"] == pytest.approx(0.5)
    assert agg["goodput"] == pytest.approx(2.0)
    assert s.errors == {"boom": 1}
    # The failed request enters TTFT and E2E at the request timeout (120 s by default), not at all in ITL.
    assert s.distributions["ttft"].count == 4 and s.distributions["ttft"].max == pytest.approx(120_000)
    assert sorted(s.distributions["ttft"].__dict__[k] for k in ("min", "p50")) == pytest.approx([50, 100])
    assert s.distributions["itl"].count == 2 + 1 + 2 and s.distributions["itl"].requests == 3


def test_goodput_bounds_must_be_per_request_metrics():
    with pytest.raises(ValueError, match="cannot bound a single request"):
        summarize(_run_records(), goodput_bounds={"itl": 5})


# -- verdict ---------------------------------------------------------------------------------------


def _uniform(n, ttft_ms=10.0):
    return [rec(i, sched=i * 10, chunks=[i * 10 + ttft_ms, i * 10 + ttft_ms + 1]) for i in range(n)]


def test_required_samples_follow_the_percentile():
    assert [
        required_samples(Objective(metric="ttft", stat=s, max=1)) for s in ("p50", "p90", "p95", "p99", "p99.9", "max")
    ] == [2, 10, 20, 100, 1000, 1]
    assert required_samples(Objective(metric="attainment", min=0.99)) == 100


def test_p99_needs_100_requests():
    obj = [Objective(metric="ttft", stat="p99", max=50)]
    v99 = evaluate(obj, summarize(_uniform(99)))
    assert v99.status == INCONCLUSIVE and v99.exit_code == 11
    assert "p99 needs at least 100" in " ".join(v99.reasons)
    v100 = evaluate(obj, summarize(_uniform(100)))
    assert v100.status == PASS and v100.exit_code == 0


def test_a_missed_objective_fails_and_max_needs_one_sample():
    v = evaluate([Objective(metric="ttft", stat="max", max=5)], summarize(_uniform(3)))
    assert v.status == FAIL and v.exit_code == 10


def test_failed_requests_fail_the_gate_unless_allowed():
    recs = _uniform(100) + [rec(200, sched=5, error="queue full", final=6)]
    obj = [Objective(metric="ttft", stat="p50", max=50)]
    v = evaluate(obj, summarize(recs))
    assert v.status == FAIL and any(r.implicit and r.status == FAIL for r in v.results)
    v = evaluate(obj + [Objective(metric="error_rate", max=0.01)], summarize(recs))
    assert v.status == PASS


def test_no_successful_request_is_a_failure_not_inconclusive():
    recs = [rec(i, error="refused", final=1) for i in range(5)]
    v = evaluate(
        [Objective(metric="ttft", stat="p50", max=50), Objective(metric="error_rate", max=1.0)], summarize(recs)
    )
    assert v.status == FAIL


def test_client_that_could_not_keep_the_schedule_makes_it_inconclusive():
    v = evaluate(
        [Objective(metric="ttft", stat="p50", max=50)],
        summarize(_uniform(10)),
        schedule_ok=False,
        schedule_message="lag 9 ms",
    )
    assert v.status == INCONCLUSIVE and "could not keep the schedule" in v.reasons[0]


def test_no_objectives_is_inconclusive():
    assert evaluate([], summarize(_uniform(10))).status == INCONCLUSIVE


def test_exit_codes_are_distinct_and_match_the_cli_docs():
    from toolkit import cli

    assert EXIT_CODES == {PASS: 0, FAIL: 10, INCONCLUSIVE: 11}
    assert "FAIL (10), INCONCLUSIVE (11)" in cli.__doc__


def test_throughput_minimum():
    s = summarize(_run_records())
    assert (
        evaluate(
            [Objective(metric="output_token_throughput", min=10), Objective(metric="error_rate", max=0.5)], s
        ).status
        == FAIL
    )
    assert (
        evaluate(
            [Objective(metric="output_token_throughput", min=5), Objective(metric="error_rate", max=0.5)], s
        ).status
        == PASS
    )


# -- objectives in the spec and on the command line -------------------------------------------------


def test_spec_objective_rules_name_the_problem():
    from toolkit.errors import SpecError

    with pytest.raises(SpecError, match="give a stat"):
        spec_from_dict({"name": "x", "slo": {"objectives": [{"metric": "ttft", "max": 300}]}})
    with pytest.raises(SpecError, match="fraction between 0 and 1"):
        spec_from_dict({"name": "x", "slo": {"objectives": [{"metric": "attainment", "min": 99}]}})
    with pytest.raises(SpecError, match="one number for the run"):
        spec_from_dict({"name": "x", "slo": {"objectives": [{"metric": "error_rate", "stat": "p99", "max": 0.1}]}})


# -- arrivals ---------------------------------------------------------------------------------------


def _gaps(kind, rate, n=20000, **kw):
    it = arrival_offsets(kind, rate, **kw)
    t = np.array([next(it) for _ in range(n)], dtype=np.float64) / 1e9
    return np.diff(t)


def test_constant_arrivals_are_exact():
    g = _gaps("constant", 50.0, n=100)
    assert np.allclose(g, 0.02, atol=1e-9)


@pytest.mark.parametrize("kind,shape,cv", [("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5)])
def test_random_arrivals_have_the_rate_and_burstiness(kind, shape, cv):
    g = _gaps(kind, 40.0, burstiness=shape, seed=3)
    assert g.mean() == pytest.approx(1 / 40, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.08)  # gamma: CV = 1/sqrt(shape)


def test_arrivals_are_reproducible_from_the_seed():
    a = [next(x) for x in [arrival_offsets("poisson", 10, seed=7)] for _ in range(50)]
    b = [next(x) for x in [arrival_offsets("poisson", 10, seed=7)] for _ in range(50)]
    c = [next(x) for x in [arrival_offsets("poisson", 10, seed=8)] for _ in range(50)]
    assert a == b and a != c


# -- workloads --------------------------------------------------------------------------------------


def test_synthetic_workload_is_reproducible_and_follows_the_lengths():
    from toolkit.slo.workload import SyntheticWorkload

    w = SyntheticWorkload(input_tokens=40, input_std=10, output_tokens=20, output_std=5, seed=1, turns=2)
    a, b = w.session(3), w.session(3)
    assert a == b and w.session(4) != a and len(a.turns) == 2
    ins = [w.session(i).turns[0].input_tokens for i in range(400)]
    outs = [w.session(i).turns[0].output_tokens for i in range(400)]
    assert np.mean(ins) == pytest.approx(40, abs=2) and np.std(ins) == pytest.approx(10, rel=0.2)
    assert np.mean(outs) == pytest.approx(20, abs=1) and min(outs) >= 1
    assert len(a.turns[0].text.split()) == a.turns[0].input_tokens  # words without a model tokenizer


@pytest.mark.slow  # the tokenizer fixture reads the embedded GGUF (10-20 s on 2 busy cores)
def test_synthetic_prompts_have_exact_token_counts_with_the_model_tokenizer(smollm2_tokenizer_dir):
    from toolkit.slo.workload import HFTokenizer, SyntheticWorkload

    tok = HFTokenizer(smollm2_tokenizer_dir)
    ids_w = SyntheticWorkload(input_tokens=64, input_std=0, output_tokens=8, output_std=0, tokenizer=tok, want_ids=True)
    assert all(len(ids_w.session(i).turns[0].ids) == 64 for i in range(20))
    text_w = SyntheticWorkload(input_tokens=64, input_std=0, output_tokens=8, output_std=0, tokenizer=tok)
    for i in range(20):
        t = text_w.session(i).turns[0]
        assert t.input_tokens == len(tok.encode(t.text))
        assert abs(t.input_tokens - 64) <= 2  # decode→encode may merge a token at the cut


def test_jsonl_dataset_rows_and_errors(tmp_path):
    from toolkit.slo.workload import JsonlWorkload

    p = tmp_path / "d.jsonl"
    p.write_text(
        '{"text": "hello there", "output_tokens": 5}\n\n{"turns": ["a b", {"text": "c", "output_tokens": 3}]}\n'
    )
    w = JsonlWorkload(p, output_tokens=9)
    assert [(t.text, t.output_tokens) for t in w.session(0).turns] == [("hello there", 5)]
    assert [(t.text, t.output_tokens) for t in w.session(1).turns] == [("a b", 9), ("c", 3)]
    assert w.session(2).turns[0].text == "hello there"  # cycles
    p.write_text('{"text": "ok"}\n{"txt": 1}\n')
    with pytest.raises(UsageError, match=r"d.jsonl:2: no prompt"):
        JsonlWorkload(p, output_tokens=9)
    p.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(UsageError, match=r"d.jsonl:2: not valid JSON"):
        JsonlWorkload(p, output_tokens=9)
    with pytest.raises(UsageError, match="pass a tokenizer"):
        p.write_text('{"text": "ok"}\n')
        JsonlWorkload(p, output_tokens=9, want_ids=True)


# -- Triton /metrics -------------------------------------------------------------------------------


def test_prometheus_counters_become_deltas():
    from toolkit.slo import server_metrics as sm

    before = sm.parse_prometheus(
        '# TYPE nv_inference_request_success counter\nnv_inference_request_success{model="ensemble",version="1"} 10\n'
        "# TYPE nv_inference_queue_duration_us counter\n"
        'nv_inference_queue_duration_us{model="ensemble",version="1"} 1000\n'
        "# TYPE nv_cpu_utilization gauge\nnv_cpu_utilization 0.5\n"
    )
    after = sm.parse_prometheus(
        '# TYPE nv_inference_request_success counter\nnv_inference_request_success{version="1",model="ensemble"} 30\n'
        "# TYPE nv_inference_queue_duration_us counter\n"
        'nv_inference_queue_duration_us{model="ensemble",version="1"} 5000\n'
        "# TYPE nv_cpu_utilization gauge\nnv_cpu_utilization 0.75\n"
    )
    d = sm.diff(before, after)
    assert d["counters"]['nv_inference_request_success{model="ensemble",version="1"}'] == 20
    assert d["gauges"]["nv_cpu_utilization"] == 0.75
    pm = sm.per_model(d)["ensemble"]
    assert pm["request_success"] == 20 and pm["avg_queue_duration_us"] == 200
    assert sm.diff(None, after) == {}


def test_a_lost_metrics_read_is_retried():
    """A server that resets the first connection (as a loaded tritonserver's /metrics can time out) still
    gives the run its counters; one that never answers gives None."""
    import http.server
    import socket
    import threading

    from toolkit.slo import server_metrics as sm

    body = b'# TYPE nv_inference_count counter\nnv_inference_count{model="ensemble",version="1"} 7\n'
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            if len(seen) == 1:  # drop the first read without an answer
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        samples, types = sm.scrape(url, timeout=2.0)
        assert samples['nv_inference_count{model="ensemble",version="1"}'] == 7 and len(seen) == 2
        seen.clear()
        assert sm.scrape(url, timeout=2.0, attempts=1) is None and len(seen) == 1
    finally:
        server.shutdown()
        server.server_close()


# -- reports ----------------------------------------------------------------------------------------


def _report(records, objectives):
    from toolkit.slo.loadgen import LoadPlan
    from toolkit.slo.runner import SLOReport, Target

    slo = SLOSpec(objectives=objectives, concurrency=2)
    s = summarize(records)
    v = evaluate(objectives, s)
    return SLOReport(
        target=Target(url="127.0.0.1:1"),
        plan=LoadPlan(concurrency=2, num_requests=len(records)),
        slo=slo,
        workload={
            "kind": "synthetic",
            "tokenizer": "words",
            "input_tokens": 1,
            "input_tokens_stddev": 0,
            "output_tokens": 2,
            "output_tokens_stddev": 0,
            "turns": 1,
            "seed": 0,
            "warmup_requests": 0,
        },
        summary=s,
        verdict=v,
        records=records,
        started_unix=1.7e9,
        wall_s=1.0,
    )


def test_reports_hold_the_numbers(tmp_path):
    from toolkit.slo.report import markdown, write_report

    recs = _uniform(20, ttft_ms=12.0)
    rep = _report(recs, [Objective(metric="ttft", stat="p50", max=10), Objective(metric="itl", stat="p90", max=5)])
    assert rep.verdict.status == FAIL
    paths = write_report(rep, tmp_path / "r")
    data = json.loads(paths["json"].read_text())
    assert len(data["records"]) == 20 and data["records"][0]["chunk_ns"] == [12 * MS, 13 * MS]
    assert data["verdict"]["status"] == FAIL and data["summary"]["distributions"]["ttft"]["p50"] == pytest.approx(12)
    suite = ET.parse(paths["junit"]).getroot().find("testsuite")
    assert suite.get("failures") == "1" and suite.get("tests") == "4"  # 2 objectives + implied error rate + schedule
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert float(props["ttft_p50_ms"]) == pytest.approx(12)
    for key in ("latency_plot", "ttft_plot"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| ttft p50 ≤ 10 ms | 12 | 20 (2) | FAIL |" in markdown(rep)
    assert (tmp_path / "r" / "rtk-manifest.json").is_file() and not list(tmp_path.glob(".r.tmp-*"))


def test_a_failed_report_write_leaves_nothing_behind(tmp_path, monkeypatch):
    from toolkit.slo import report as R

    rep = _report(_uniform(5), [Objective(metric="ttft", stat="p50", max=50)])
    monkeypatch.setattr(R, "plot_latency", lambda *a: (_ for _ in ()).throw(RuntimeError("disk full")))
    with pytest.raises(RuntimeError):
        R.write_report(rep, tmp_path / "r")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "wave_ttft, concurrency, noted",
    [
        ((900, 1000, 1100, 1200), 4, True),  # the four sent together miss: named, with p99 without them
        ((300, 300, 300, 300), 4, False),  # the misses are elsewhere: nothing to say
        ((900, 1000, 1100, 1200), None, False),  # an open loop has no opening wave
    ],
)
def test_a_failed_ttft_percentile_says_how_much_the_closed_loops_opening_wave_makes(wave_ttft, concurrency, noted):
    from toolkit.slo.runner import judge

    load = {"concurrency": concurrency} if concurrency else {"request_rate": 4.0}
    slo = SLOSpec(num_requests=120, objectives=[{"metric": "ttft", "stat": "p99", "max": 680}], **load)
    ttfts = list(wave_ttft) + [300 + (i % 30) * 10 for i in range(116)]  # steady: 300-590 ms
    if not noted and concurrency:
        ttfts[50], ttfts[90] = 700, 720  # the misses come later
    recs = [
        rec(i, sched=i * 250 if i >= 4 else 0, chunks=[(i * 250 if i >= 4 else 0) + t]) for i, t in enumerate(ttfts)
    ]
    summary, verdict, notes = judge(recs, slo, list(slo.objectives))
    assert verdict.status == FAIL  # the note never changes the verdict
    wave = [n for n in notes if "closed loop sends together" in n]
    if noted:
        assert wave == [
            "ttft p99: 4 of the 4 requests over 680 ms are among the first 4, which the closed loop sends "
            f"together; without them ttft p99 is {percentile(sorted(ttfts[4:]), 0.99):.1f} ms "
            "(the verdict counts them)"
        ]
        assert percentile(sorted(ttfts[4:]), 0.99) == 590
    else:
        assert wave == []
