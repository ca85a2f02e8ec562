"""rtk slo beyond one connection, against real tritonservers serving the deterministic fake LLM
(tests/triton_helpers.py): the OpenAI-compatible transport through rtk's real front door
(toolkit/frontdoor), several URLs, several worker processes under one schedule, reports merged
from several clients, and ``--check-metric``.  Tolerances as in test_slo_triton.py: medians only,
on a shared 2-core host.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from triton_helpers import processes_naming, running_server, write_fake_llm

from toolkit.slo.metrics import Distribution
from toolkit.slo.runner import merge_reports, run_slo
from toolkit.spec import Objective, SLOSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTFT, ITL = 30.0, 10.0


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    repo = tmp_path_factory.mktemp("scaleout-a") / "repo"
    write_fake_llm(repo, "ensemble", ttft_ms=TTFT, itl_ms=ITL, max_batch_size=16)
    # One request at a time, 50 ms a token: the front door's admission refuses what would queue too long.
    write_fake_llm(repo, "slow", ttft_ms=50, itl_ms=50, serial=True, max_batch_size=1)
    with running_server(repo) as srv:
        yield srv


@contextlib.contextmanager
def front_door(triton, *, model="ensemble", max_batch_size=16, guard=None):
    """rtk's front door (toolkit/frontdoor) over ``triton``, on a free loopback port."""
    from toolkit.frontdoor import FrontDoorConfig, FrontDoorServer, create_app
    from toolkit.spec import FrontendSpec, GuardSpec

    cfg = FrontDoorConfig(
        model_name="fake",
        frontend=FrontendSpec(),
        guard=GuardSpec(**(guard or {})),
        triton_model=model,
        max_batch_size=max_batch_size,
        max_seq_len=256,
        default_max_tokens=8,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with FrontDoorServer(create_app(cfg, triton.grpc_url, metrics_url=triton.metrics_url), "127.0.0.1", port) as fd:
        yield fd.url


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """A replica that serves one request at a time (60 ms each): it queues under concurrency."""
    repo = tmp_path_factory.mktemp("scaleout-b") / "repo"
    write_fake_llm(repo, "ensemble", serial=True, ttft_ms=55, itl_ms=1, max_batch_size=16)
    with running_server(repo) as srv:
        yield srv


def _slo(**kw) -> SLOSpec:
    return SLOSpec(**{"warmup_requests": 2, "input_tokens": 12, "output_tokens": 6, "max_schedule_lag_ms": 500.0, **kw})


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_openai_transport_measures_the_model_timing_and_names_the_tier(fast, endpoint):
    with front_door(fast) as url:
        rep = run_slo(
            _slo(
                transport="openai",
                endpoint=endpoint,
                concurrency=2,
                num_requests=30,
                objectives=[Objective(metric="ttft", stat="p50", max=TTFT + 20)],
            ),
            url,
        )
    assert rep.target.model == "fake" and rep.summary.outcomes == {"served": 30, "shed": 0, "failed": 0, "timed_out": 0}
    assert TTFT - 0.5 <= rep.dist("ttft").p50 <= TTFT + 15, rep.dist("ttft")
    assert ITL - 1 <= rep.dist("itl").p50 <= ITL + 3, rep.dist("itl")
    assert all(r.output_tokens == 6 and r.text.count("tok") == 6 for r in rep.records if r.measured)
    assert rep.summary.tiers == {"primary": 30} and rep.summary.short == 0
    assert rep.verdict.status == "PASS"


def test_openai_refusals_are_shed_not_errors_and_fast(fast):
    # 20 requests/s at a model that serves 5/s: the front door refuses what cannot start within 300 ms.
    with front_door(fast, model="slow", max_batch_size=1, guard={"ttft_deadline_ms": 300}) as url:
        slo = _slo(
            transport="openai",
            request_rate=20,
            arrival="constant",
            num_requests=40,
            warmup_requests=0,
            output_tokens=4,
            objectives=[
                Objective(metric="refusal_latency", stat="p90", max=100),
                Objective(metric="shed_rate", max=0.05),
            ],
        )
        rep = run_slo(slo, url)
    out = rep.summary.outcomes
    assert out["shed"] >= 10 and out["served"] >= 2 and out["failed"] == out["timed_out"] == 0, (
        out,
        rep.summary.errors,
    )
    assert all(r.status == 429 for r in rep.records if r.outcome == "shed")
    assert rep.summary.aggregates["error_rate"] == 0 and rep.dist("ttft").requests == out["served"]
    assert rep.dist("refusal_latency").count == out["shed"] and rep.dist("refusal_latency").p50 < 50
    by = {r.objective["metric"]: r.status for r in rep.verdict.results}
    assert by == {"refusal_latency": "PASS", "shed_rate": "FAIL", "error_rate": "PASS"}
    assert rep.verdict.status == "FAIL"


def test_openai_answers_from_a_fallback_tier_are_counted_per_tier(fast):
    guard = {"ttft_deadline_ms": 300, "fallbacks": [{"kind": "rule", "name": "busy", "template": "busy, try later"}]}
    with front_door(fast, model="slow", max_batch_size=1, guard=guard) as url:
        slo = _slo(
            transport="openai",
            request_rate=20,
            arrival="constant",
            num_requests=40,
            warmup_requests=0,
            output_tokens=4,
            objectives=[Objective(metric="fallback_rate", max=0.05)],
        )
        rep = run_slo(slo, url)
    tiers, out = rep.summary.tiers, rep.summary.outcomes
    assert set(tiers) == {"primary", "busy"} and tiers["busy"] >= 10, tiers
    assert out["served"] == tiers["primary"] and out["shed"] == tiers["busy"] and out["failed"] == 0
    assert rep.summary.aggregates["fallback_rate"] == pytest.approx(tiers["busy"] / 40)
    assert rep.verdict.status == "FAIL"  # fallback_rate ≤ 5 % missed


def test_several_urls_round_robin_and_least_loaded(fast, serial):
    slo = _slo(concurrency=6, num_requests=60, output_tokens=3, warmup_requests=0)
    rr = run_slo(slo, [fast.grpc_url, serial.grpc_url], balance="round_robin")
    assert rr.summary.succeeded == 60
    counts = list(rr.client["replicas"].values())
    assert abs(counts[0] - counts[1]) <= 1, counts  # every other request
    ll = run_slo(slo, [fast.grpc_url, serial.grpc_url], balance="least_loaded")
    counts = list(ll.client["replicas"].values())
    assert ll.summary.succeeded == 60 and counts[0] > 2 * counts[1], (
        counts
    )  # the serial replica queues, so it gets fewer
    assert ll.dist("e2e").p50 < rr.dist("e2e").p50


def test_workers_share_one_schedule(fast):
    slo = _slo(request_rate=50, arrival="poisson", num_requests=60, warmup_requests=2, output_tokens=3, seed=7)
    one = run_slo(slo, fast.grpc_url)
    two = run_slo(slo, fast.grpc_url, workers=2)
    assert two.client["workers"] == 2 and two.summary.succeeded == 60
    measured = lambda rep: [r for r in rep.records if r.measured]  # noqa: E731
    assert {r.worker for r in measured(two)} == {0, 1}
    # The same arrival times from the schedule's start, and the same prompts, however many processes send them.
    offsets = lambda rep: sorted(r.scheduled_ns - rep.client["t0_ns"] for r in measured(rep))  # noqa: E731
    assert offsets(one) == offsets(two)
    assert sorted((r.session, r.text) for r in measured(one)) == sorted((r.session, r.text) for r in measured(two))
    # Percentiles come from the pooled raw samples of both workers.
    pooled = Distribution.of([r.ttft_ms() for r in measured(two)])
    assert two.dist("ttft").p90 == pooled.p90
    assert TTFT - 0.5 <= two.dist("ttft").p50 <= TTFT + 15


def test_reports_of_two_clients_with_a_shared_start_merge(fast, tmp_path):
    from toolkit.slo.report import write_report

    start = time.time() + 3.0
    reports = {}

    def client(name, seed):
        slo = _slo(request_rate=20, arrival="constant", num_requests=20, warmup_requests=1, output_tokens=3, seed=seed)
        reports[name] = run_slo(slo, fast.grpc_url, start_at=start)

    threads = [threading.Thread(target=client, args=(n, s)) for n, s in (("a", 1), ("b", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    paths = [write_report(reports[n], tmp_path / n, plots=False)["json"] for n in ("a", "b")]
    merged = merge_reports(paths)
    assert merged.summary.measured == 40 and merged.summary.succeeded == 40
    firsts = sorted(r.scheduled_ns for r in merged.records if r.measured)
    assert firsts[1] - firsts[0] < 20e6  # both schedules began at the shared start (to the host clocks' agreement)
    pooled = [r.ttft_ms() for n in ("a", "b") for r in reports[n].records if r.measured]
    assert merged.dist("ttft").p90 == pytest.approx(Distribution.of(pooled).p90)
    assert merged.summary.aggregates["request_throughput"] == pytest.approx(40 / merged.summary.aggregates["duration"])
    assert (
        1.6
        <= merged.summary.aggregates["request_throughput"] / reports["a"].summary.aggregates["request_throughput"]
        <= 2.4
    )


def test_check_metric_fails_on_a_signal_that_stays_at_zero(fast):
    # A signal that cannot move under this load: the failure counter of a model that fails nothing.  (Triton's
    # pending-request gauge, the real case of triton-inference-server/server#6494, stays at zero for decoupled
    # models only as long as no request waits for a running execute; on a slow host one sometimes does.)
    # The execution counter rises with the load.
    failures = 'nv_inference_request_failure{model="ensemble"}'
    execs = 'nv_inference_exec_count{model="ensemble"}'
    slo = _slo(
        concurrency=4, num_requests=40, output_tokens=4, objectives=[Objective(metric="ttft", stat="p50", max=1000)]
    )
    rep = run_slo(slo, fast.grpc_url, metrics_url=fast.metrics_url, check_metrics=[failures, execs])
    by = {r.objective["metric"]: r for r in rep.verdict.results}
    assert rep.summary.failed == 0
    assert by[failures].status == "FAIL" and "stayed at 0" in by[failures].message, by[failures]
    assert by[execs].status == "PASS" and by[execs].observed >= 40
    assert rep.verdict.status == "FAIL" and rep.exit_code == 10
    missing = run_slo(slo, fast.grpc_url, metrics_url=fast.metrics_url, check_metrics=["nv_trt_llm_request_metrics"])
    assert "not exported" in missing.verdict.results[-1].message and missing.verdict.status == "FAIL"


def test_a_replica_that_dies_mid_run_fails_only_its_requests_and_at_once(fast, tmp_path):
    """The gRPC stream to a killed server breaks: its requests in flight fail with the reason at once
    (not at slo.request_timeout_s), it gets no more, and the other replica serves the rest."""
    repo = tmp_path / "repo"
    write_fake_llm(repo, "ensemble", ttft_ms=TTFT, itl_ms=ITL, max_batch_size=16)
    slo = _slo(concurrency=4, num_requests=120, output_tokens=12, warmup_requests=0, request_timeout_s=60)
    with running_server(repo) as doomed:
        killer = threading.Timer(1.0, doomed.process.kill)
        killer.start()
        t = time.monotonic()
        rep = run_slo(slo, [doomed.grpc_url, fast.grpc_url], balance="round_robin")
        took = time.monotonic() - t
        killer.join()
    # The killed server's python stub outlives it until the server's clean-up kills its process group.
    assert not processes_naming(repo), "a python stub of the killed server was left running"
    assert rep.summary.failed >= 1 and rep.summary.succeeded + rep.summary.failed == 120, rep.summary
    assert all("gRPC stream broke" in e for e in rep.summary.errors), rep.summary.errors
    assert took < 30, took  # nothing waited for the 60 s request timeout
    counts = rep.client["replicas"]
    assert counts[fast.grpc_url] > counts[doomed.grpc_url], counts  # the dead replica got no more
