"""The load generator's closed loop: a freed slot's next session is sent by the transport's reader.

The transport here is an in-process stand-in (a thread that answers each request after a few
milliseconds, as a reader thread would deliver a server's responses): what is under test is the
generator's bookkeeping across its two threads, which the end-to-end runs through tritonserver
(tests/test_slo_triton.py) cover only as totals.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import pytest

from toolkit.slo.loadgen import LoadGenerator, LoadPlan
from toolkit.slo.transport import ModelInfo, Payload, Transport, finish_record, now_ns
from toolkit.slo.workload import Session, Turn


class ThreadServer(Transport):
    """Answers every request from one thread ("the reader"): ``tokens`` responses ``gap_s`` apart.
    A prompt containing FAIL gets an error instead.  Records which thread handed each request over."""

    name = "http"

    def __init__(self, tokens: int = 2, gap_s: float = 0.002):
        super().__init__("inproc", "ensemble", "ensemble")
        self.info = ModelInfo("ensemble", "ensemble", 8, {"text_input", "max_tokens", "stream"}, {"text_output"})
        self.tokens, self.gap_s = tokens, gap_s
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.submitted_by: dict[str, str] = {}
        self.prompts: dict[str, str] = {}

    def open(self, on_response, on_error) -> None:
        self.thread = threading.Thread(target=self._serve, args=(on_response, on_error), name="reader", daemon=True)
        self.thread.start()

    def prepare(self, rid: str, payload: Payload):
        return rid, payload.text

    def submit(self, prepared) -> None:
        rid, text = prepared
        self.submitted_by[rid] = threading.current_thread().name
        self.prompts[rid] = text
        self.inbox.put((time.monotonic() + self.gap_s, rid, text, 0))

    def _serve(self, on_response, on_error) -> None:
        pending: list = []
        while True:
            while True:
                try:
                    item = self.inbox.get(timeout=0.001 if pending else None)
                except queue.Empty:
                    break
                if item is None:
                    return
                pending.append(item)
            pending.sort()
            while pending and pending[0][0] <= time.monotonic():
                _, rid, text, k = pending.pop(0)
                if "FAIL" in text:
                    on_error(rid, now_ns(), "refused")
                    continue
                last = k + 1 == self.tokens
                body = json.dumps({"text_output": f"r{rid}t{k} "}).encode()
                on_response(rid, now_ns(), body, False)
                if last:
                    on_response(rid, now_ns(), None, True)
                else:
                    self.inbox.put((time.monotonic() + self.gap_s, rid, text, k + 1))

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join(timeout=5)


class Scripted:
    """Sessions of ``turns`` turns; session 3's first turn fails when ``fail_three``."""

    def __init__(self, turns: int = 1, fail_three: bool = False):
        self.turns, self.fail_three = turns, fail_three
        self.made: list[int] = []

    def session(self, index: int) -> Session:
        self.made.append(index)
        first = "FAIL" if self.fail_three and index == 3 else f"s{index}"
        texts = [first] + [f"s{index}-turn{k}" for k in range(1, self.turns)]
        return Session(index, [Turn(t, None, 1, 2) for t in texts])


def _run(workload, concurrency: int, n: int | None, duration_s: float | None = None, **server):
    srv = ThreadServer(**server)
    gen = LoadGenerator(srv, workload, request_timeout_s=10)
    srv.open(gen.on_response, gen.on_error)
    try:
        records = gen.run(LoadPlan(concurrency=concurrency, num_requests=n, duration_s=duration_s))
    finally:
        srv.close()
    for r in records:
        if r.raw:  # a turn with a follow-up was decoded already, for its reply
            finish_record(r, srv.info, srv.name)
    return records, srv


def _max_in_flight(records) -> int:
    events = sorted([(r.sent_ns, 1) for r in records] + [(r.final_ns, -1) for r in records])
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def test_closed_loop_refills_each_freed_slot_from_the_reader_thread():
    records, srv = _run(Scripted(), concurrency=3, n=30, gap_s=0.01)
    assert len(records) == 30 and all(r.ok for r in records)
    assert sorted(r.session for r in records) == list(range(30))
    assert _max_in_flight(records) <= 3
    first, rest = records[:3], records[3:]
    assert {srv.submitted_by[str(r.index)] for r in first} == {"MainThread"}
    # Every later request went out from the reader, in the slot the request before it freed:
    # scheduled (and released) at that request's final response, each final used once.
    assert {srv.submitted_by[str(r.index)] for r in rest} == {"reader"}
    finals = sorted(r.final_ns for r in records)
    assert all(r.scheduled_ns == r.released_ns for r in rest)
    assert len({r.released_ns for r in rest}) == len(rest) and {r.released_ns for r in rest} <= set(finals)
    assert all(r.sent_ns >= r.released_ns for r in rest)


def test_next_turns_carry_the_reply_and_the_quota_is_exact():
    workload = Scripted(turns=2)
    records, srv = _run(workload, concurrency=2, n=11)
    assert len(records) == 11 and all(r.ok for r in records)
    by_session: dict[int, list] = {}
    for r in records:
        by_session.setdefault(r.session, []).append(r)
    for s, recs in by_session.items():
        assert [r.turn for r in recs] == list(range(len(recs)))
        if len(recs) == 2:  # the second turn sent the first one's reply as history
            reply = f"r{recs[0].index}t0 r{recs[0].index}t1 "
            assert srv.prompts[str(recs[1].index)] == f"s{s}\n{reply}\ns{s}-turn1"
    # 11 requests in 2-turn sessions: five whole sessions and one cut short by the quota.
    assert sorted(len(v) for v in by_session.values()) == [1, 2, 2, 2, 2, 2]
    assert _max_in_flight(records) <= 2


def test_a_failed_turn_ends_its_session_and_the_slot_goes_on():
    records, srv = _run(Scripted(turns=2, fail_three=True), concurrency=2, n=12)
    assert len(records) == 12
    failed = [r for r in records if r.error]
    assert [(r.session, r.turn) for r in failed] == [(3, 0)]
    assert not any(r.session == 3 and r.turn == 1 for r in records)
    assert _max_in_flight(records) <= 2


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_timed_run_sends_nothing_after_its_end_and_keeps_no_unsent_spare(concurrency):
    records, _ = _run(Scripted(), concurrency=concurrency, n=None, duration_s=0.3)
    assert records and all(r.sent_ns is not None and r.ok for r in records)
    end = min(r.scheduled_ns for r in records) + int(0.3e9)
    assert all(r.scheduled_ns < end for r in records)
    assert len({r.index for r in records}) == len(records)
