"""rtk slo against a real tritonserver serving deterministic decoupled python models.

The fake LLMs (tests/triton_helpers.py) send token i of a request at ``ttft + i·itl`` after they
start it, so the true TTFT and inter-token gap are known.  Stated tolerances: p50 within −0.5/+10 ms
of the configured TTFT and −1/+3 ms of the configured ITL.  Tails are not compared with the
configured values: this 2-core host is shared with other test runs, and a load spike wakes the
fake model's own threads 100 ms late now and then (on a quiet host p90 is within +5 ms).  The
client's timing itself is checked against an independent clock instead: the server's own
timestamps of the same first and last tokens.  The schedule check is loosened here for the same
reason and tested on its own below.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner
from triton_helpers import running_server, write_fake_llm

from toolkit.cli import cli
from toolkit.errors import ServerError, UsageError
from toolkit.slo.runner import run_slo, search_slo, sweep_slo
from toolkit.spec import Objective, SLOSpec
from toolkit.triton.server import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTFT, ITL = 30.0, 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("slo") / "repo"
    write_fake_llm(repo, "ensemble", interface="ensemble", ttft_ms=TTFT, itl_ms=ITL)
    write_fake_llm(repo, "tensorrt_llm", interface="tensorrt_llm", ttft_ms=TTFT, itl_ms=ITL)
    write_fake_llm(repo, "stall_capped", serial=True, ttft_ms=5, itl_ms=2, stall_at_request=10, stall_ms=1000)
    write_fake_llm(repo, "stall_open", serial=True, ttft_ms=5, itl_ms=2, stall_at_request=10, stall_ms=1000)
    write_fake_llm(repo, "serial60", serial=True, ttft_ms=60, itl_ms=0)
    write_fake_llm(repo, "flaky", ttft_ms=5, itl_ms=2, fail_every=4)
    with running_server(repo) as srv:
        yield srv


def _slo(**kw) -> SLOSpec:
    base = dict(warmup_requests=3, input_tokens=12, output_tokens=6, max_schedule_lag_ms=500.0)
    return SLOSpec(**{**base, **kw})


def _url(srv, transport):
    return srv.grpc_url if transport == "grpc" else srv.http_url


def test_measured_ttft_and_itl_match_the_model_and_transports_agree(server):
    reports = {}
    for transport in ("grpc", "http"):
        slo = _slo(
            transport=transport,
            concurrency=2,
            num_requests=40,
            objectives=[
                Objective(metric="ttft", stat="p50", max=TTFT + 10),
                Objective(metric="itl", stat="p50", max=ITL + 3),
            ],
        )
        rep = run_slo(slo, _url(server, transport), metrics_url=server.metrics_url)
        reports[transport] = rep
        ttft, itl, srv_ttft = rep.dist("ttft"), rep.dist("itl"), rep.dist("server_ttft")
        assert rep.summary.succeeded == 40 and rep.summary.failed == 0
        assert TTFT - 0.5 <= ttft.p50 <= TTFT + 10, (transport, ttft)
        assert ITL - 1 <= itl.p50 <= ITL + 3, (transport, itl)
        # Independent reference: the server stamped the same first and last tokens on its own clock.
        # The client's first→last span of each request must match the server's.
        spans = sorted(
            abs(
                (r.last_token_ns - r.first_token_ns)
                - (r.server["last_token_time_ns"] - r.server["first_token_time_ns"])
            )
            / 1e6
            for r in rep.records
            if r.measured
        )
        assert spans[len(spans) // 2] < 2.0, (transport, spans)
        assert itl.count == 40 * 5  # 6 tokens, one per response: 5 gaps each
        # The server's own timestamps sit beside the client's: its TTFT is the configured one, and
        # the client's exceeds it by the time spent outside the server.
        assert TTFT - 0.5 <= srv_ttft.p50 <= TTFT + 10
        assert 0 < rep.dist("ttft_outside_server").p50 < 8
        assert rep.verdict.status == "PASS" and rep.exit_code == 0
        # Triton's /metrics counted exactly the requests sent (warm-up included).
        assert rep.server_metrics["per_model"]["ensemble"]["request_success"] == 43
        assert all(len(r.chunk_ns) == 6 and r.output_tokens == 6 for r in rep.records if r.measured)
    g, h = reports["grpc"], reports["http"]
    assert abs(g.dist("ttft").p50 - h.dist("ttft").p50) <= 3
    assert abs(g.dist("itl").p50 - h.dist("itl").p50) <= 1
    # Same seed, same prompts: both transports got the same text back for every request.
    assert [r.text for r in g.records] == [r.text for r in h.records]
    assert g.records[5].text.count("tok") == 6


def test_tensorrt_llm_endpoint_and_multi_turn_sessions_resend_history(server):
    slo = _slo(
        endpoint="tensorrt_llm",
        concurrency=2,
        num_requests=12,
        turns=3,
        input_tokens=10,
        output_tokens=4,
        warmup_requests=0,
    )
    rep = run_slo(slo, server.grpc_url)
    assert rep.summary.succeeded == 12
    by_session: dict[int, list] = {}
    for r in rep.records:
        by_session.setdefault(r.session, []).append(r)
        # The fake model's first id is 1000 + the prompt length it received: the whole history.
        assert r.output_ids[0] == 1000 + r.input_tokens
        assert set(r.server) == {
            "arrival_time_ns",
            "first_scheduled_time_ns",
            "first_token_time_ns",
            "last_token_time_ns",
        }
    full = [turns for turns in by_session.values() if len(turns) == 3]
    assert full, "no session completed its three turns"
    for turns in full:
        assert [t.turn for t in turns] == [0, 1, 2]
        assert [t.input_tokens for t in turns] == [10, 10 + 4 + 10, 10 + 4 + 10 + 4 + 10]
        assert turns[1].scheduled_ns == turns[0].final_ns  # the next turn is due when the last one ends
    http = run_slo(
        _slo(endpoint="tensorrt_llm", transport="http", concurrency=2, num_requests=6, output_tokens=4), server.http_url
    )
    assert http.summary.succeeded == 6 and all(r.output_ids[0] == 1000 + r.input_tokens for r in http.records)


def test_cli_gate_pass_fail_inconclusive_and_report_files(server, tmp_path):
    runner = CliRunner()

    def slo(*args, out):
        return runner.invoke(
            cli,
            [
                "slo",
                "--url",
                server.grpc_url,
                "--metrics-url",
                server.metrics_url,
                "-o",
                str(tmp_path / out),
                "--input-tokens",
                "12",
                "--output-tokens",
                "6",
                "--warmup-requests",
                "2",
                "--max-schedule-lag-ms",
                "500",
                *args,
            ],
        )

    ok = slo("--concurrency", "4", "--num-requests", "20", "--objective", f"ttft:p50<={TTFT + 30}", out="pass")
    assert ok.exit_code == 0, ok.output
    assert "verdict: PASS" in ok.output
    # Tightening the objective below what the model does flips the verdict and the exit code.
    bad = slo("--concurrency", "4", "--num-requests", "20", "--objective", f"ttft:p50<={TTFT / 2}", out="fail")
    assert bad.exit_code == 10, bad.output
    suite = ET.parse(tmp_path / "fail" / "junit.xml").getroot().find("testsuite")
    failure = suite.find("testcase/failure")
    assert suite.get("failures") == "1" and f"ttft p50 ≤ {TTFT / 2:g} ms" in failure.get("message")
    props = {p.get("name"): float(p.get("value")) for p in suite.find("properties") if p.get("name").endswith("_ms")}
    data = json.loads((tmp_path / "fail" / "report.json").read_text())
    assert props["ttft_p50_ms"] == pytest.approx(data["summary"]["distributions"]["ttft"]["p50"], abs=1e-3)
    assert TTFT - 0.5 <= props["ttft_p50_ms"] <= TTFT + 10
    assert len(data["records"]) == 22 and sum(r["phase"] == "measure" for r in data["records"]) == 20
    for png in ("latency.png", "ttft_over_time.png"):
        assert (tmp_path / "fail" / png).read_bytes()[:4] == b"\x89PNG"
    # 20 requests cannot support a p99.
    few = slo("--concurrency", "4", "--num-requests", "20", "--objective", f"ttft:p99<={TTFT + 100}", out="few")
    assert few.exit_code == 11, few.output
    assert "p99 needs at least 100" in " ".join(few.output.split())  # rich wraps lines


def test_stall_with_capped_client_shows_only_in_schedule_relative_latency(server):
    """Coordinated omission: a client that cannot send while the server is stalled.

    Requests are due every 40 ms; at most one is in flight; the server stalls 1 s on request 10.
    Timed from the send, almost every request looks fast; timed from when it was due, the ~25
    requests that came due during the stall waited up to a second, and the gate says so.
    """
    slo = _slo(
        request_rate=25,
        arrival="constant",
        max_inflight=1,
        num_requests=60,
        warmup_requests=0,
        output_tokens=3,
        model="stall_capped",
        objectives=[Objective(metric="ttft", stat="p90", max=100)],
    )
    rep = run_slo(slo, server.grpc_url)
    assert rep.summary.succeeded == 60
    assert rep.dist("ttft_sent").p50 < 50 and rep.dist("ttft_sent").p90 < 150
    assert rep.dist("ttft").p90 > 300 and rep.dist("schedule_lag").p90 > 300
    late = [r for r in rep.records if r.ttft_ms() > 300]
    assert len(late) >= 12
    assert rep.dist("client_lag").p50 < 5  # the waits were for the slot, not the client's own delay
    assert rep.verdict.schedule_ok and rep.verdict.status == "FAIL"


def test_stall_without_cap_queues_in_the_server_and_shows_in_server_stamps(server):
    slo = _slo(
        request_rate=25,
        arrival="constant",
        num_requests=60,
        warmup_requests=0,
        output_tokens=3,
        model="stall_open",
        objectives=[Objective(metric="ttft", stat="p90", max=100)],
    )
    rep = run_slo(slo, server.grpc_url)
    assert rep.summary.succeeded == 60
    assert rep.dist("schedule_lag").p90 < 50  # the client kept sending on time (the stall is 1000 ms)
    assert rep.dist("ttft").p90 > 300 and rep.dist("ttft_sent").p90 > 300
    assert rep.dist("server_queue").p90 > 300  # and the server's stamps say where the time went
    assert rep.verdict.status == "FAIL"


def _serial60_slo():
    """One request at a time, 60 ms each: E2E ≈ concurrency × 60 ms in a closed loop.  The bound leaves 50 ms for a
    busy host at concurrency 2; concurrency 3 (≈180 ms) can only miss it."""
    return _slo(
        model="serial60",
        output_tokens=1,
        num_requests=12,
        warmup_requests=2,
        objectives=[Objective(metric="e2e", stat="p50", max=170)],
    )


def test_search_finds_the_highest_concurrency_meeting_the_objective(server):
    rep = search_slo(_serial60_slo(), server.grpc_url, kind="concurrency", start=1, limit=8)
    assert rep.best == 2, [(p.plan.value, p.dist("e2e").p50) for p in rep.points]
    assert [p.plan.value for p in rep.points] == [1, 2, 3, 4]
    assert rep.status == "PASS" and rep.exit_code == 0
    assert 115 <= next(p for p in rep.points if p.plan.value == 2).dist("e2e").p50 <= 170


def test_search_looks_below_a_start_that_misses(server):
    # The same bound from concurrency 4 (≈240 ms: a miss): the search halves to 2 (a pass), then bisects to 3.
    rep = search_slo(_serial60_slo(), server.grpc_url, kind="concurrency", start=4, limit=8)
    assert rep.best == 2, [(p.plan.value, p.dist("e2e").p50) for p in rep.points]
    assert [p.plan.value for p in rep.points] == [2, 3, 4]
    assert rep.status == "PASS" and not rep.notes


def test_search_does_not_look_below_an_inconclusive_start(server):
    # 12 requests cannot give a p99 (INCONCLUSIVE at any load): one point, and the search says so.
    slo = _serial60_slo().model_copy(update={"objectives": [Objective(metric="e2e", stat="p99", max=170)]})
    rep = search_slo(slo, server.grpc_url, kind="concurrency", start=4, limit=8)
    assert [p.plan.value for p in rep.points] == [4] and rep.best is None
    assert rep.points[0].verdict.status == "INCONCLUSIVE" and "missed" in rep.notes[0]


def test_sweep_over_rates_writes_the_throughput_latency_plot(server, tmp_path):
    from toolkit.slo.report import write_sweep

    slo = _slo(
        num_requests=10,
        warmup_requests=1,
        arrival="constant",
        objectives=[Objective(metric="ttft", stat="p50", max=200)],
    )
    sweep = sweep_slo(slo, server.grpc_url, kind="rate", values=[5, 20])
    assert [p.plan.rate for p in sweep.points] == [5, 20]
    tput = [p.summary.aggregates["request_throughput"] for p in sweep.points]
    assert tput[0] < tput[1]
    paths = write_sweep(sweep, tmp_path / "sweep")
    assert paths["sweep_plot"].read_bytes()[:4] == b"\x89PNG"
    assert len(ET.parse(paths["junit"]).getroot().findall("testsuite")) == 2


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_failed_requests_are_counted_and_fail_the_gate(server, transport):
    slo = _slo(
        transport=transport,
        model="flaky",
        concurrency=2,
        num_requests=20,
        warmup_requests=0,
        objectives=[Objective(metric="ttft", stat="p50", max=200)],
    )
    rep = run_slo(slo, _url(server, transport))
    assert rep.summary.failed == 5 and rep.summary.aggregates["error_rate"] == pytest.approx(0.25)
    assert all("fails on purpose" in r.error for r in rep.records if not r.ok)
    assert rep.verdict.status == "FAIL"  # implied error_rate ≤ 0
    allowed = run_slo(
        slo.model_copy(update={"objectives": [*slo.objectives, Objective(metric="error_rate", max=0.3)]}),
        _url(server, transport),
    )
    assert allowed.verdict.status == "PASS"


def test_open_loop_duration_and_gamma_arrivals_keep_the_schedule(server):
    slo = _slo(
        request_rate=40,
        arrival="gamma",
        burstiness=0.5,
        num_requests=None,
        duration_s=1.0,
        warmup_requests=0,
        output_tokens=2,
    )
    rep = run_slo(slo, server.grpc_url)
    meas = [r for r in rep.records if r.measured]
    t0 = min(r.scheduled_ns for r in meas)
    assert 15 <= len(meas) <= 70
    assert max(r.scheduled_ns - t0 for r in meas) < 1e9
    assert rep.dist("schedule_lag").p50 < 5
    # The same records judged with an impossible lag bound: the client "could not keep the schedule".
    from toolkit.slo.runner import schedule_check
    from toolkit.slo.verdict import evaluate

    ok, msg, lag = schedule_check(rep.records, max_lag_ms=1e-4)
    assert not ok and lag > 1e-4 and "slo.max_schedule_lag_ms" in msg
    assert (
        evaluate(
            [Objective(metric="ttft", stat="p50", max=1e6)], rep.summary, schedule_ok=ok, schedule_message=msg
        ).status
        == "INCONCLUSIVE"
    )


def test_unreachable_server_and_wrong_interface_are_clear_errors(server):
    port = free_ports(1)[0]
    with pytest.raises(ServerError, match="cannot reach tritonserver over gRPC"):
        run_slo(_slo(concurrency=1, num_requests=1), f"127.0.0.1:{port}")
    with pytest.raises(ServerError, match="cannot reach tritonserver over HTTP"):
        run_slo(_slo(transport="http", concurrency=1, num_requests=1), f"http://127.0.0.1:{port}")
    res = CliRunner().invoke(
        cli,
        [
            "slo",
            "--url",
            f"127.0.0.1:{port}",
            "--concurrency",
            "1",
            "--num-requests",
            "1",
            "--objective",
            "ttft:p50<=1",
        ],
    )
    assert res.exit_code == 4, res.output
    with pytest.raises(UsageError, match="does not have the tensorrt_llm interface"):
        run_slo(_slo(endpoint="tensorrt_llm", model="ensemble", concurrency=1, num_requests=1), server.grpc_url)
    with pytest.raises(UsageError, match="model 'nope' is not ready"):
        run_slo(_slo(model="nope", concurrency=1, num_requests=1), server.grpc_url)
