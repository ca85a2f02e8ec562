"""The load generator: one thread that sends every request when it is due.

* **Open loop** (``rate``): new sessions are due at the arrival process's times, whether or not
  earlier requests have finished.  With ``max_inflight`` a due request waits for a free slot; its
  latencies still count from when it was *due*, so the wait shows (this is what exposes
  coordinated omission).
* **Closed loop** (``concurrency``): ``C`` users each send their next request the moment their
  previous one finishes; that moment is the next request's scheduled time.
* **Sessions**: turn k+1 of a session is due when turn k finishes and carries its history.

Each request's wire form is built before it is due; at the due time the thread only stamps
``sent_ns`` and hands it to the transport.  Responses are timestamped by the transport's reader
thread and queued back here; the wait for the next due time is a timed wait on that queue.

In a closed loop the next *new* session of every slot is built ahead too (``_Run.spares``), and the
transport's reader sends it itself, the moment it reads the final response that frees the slot
(``_Run.relay``): no hand-off to this thread, whose wake-up on a 2-core host busy with the server
under test took 0.65-1.3 ms at the median and up to 14 ms at p99 (the client's send lag; docs/slo.md).
A session's next turn depends on the reply, so it still goes from this thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .records import RequestRecord
from .schedule import arrival_offsets
from .transport import Payload, Transport, finish_record, now_ns
from .workload import Session

log = logging.getLogger(__name__)

WARMUP_SESSION_BASE = 1_000_000  # warm-up prompts come from another part of the seed space


@dataclass
class LoadPlan:
    concurrency: int | None = None
    rate: float | None = None
    arrival: str = "poisson"
    burstiness: float = 1.0
    max_inflight: int | None = None
    num_requests: int | None = 100
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self):
        if self.concurrency is not None and self.rate is not None:
            raise ValueError("a load is either a concurrency (closed loop) or a rate (open loop), not both")
        if self.concurrency is None and self.rate is None:
            self.concurrency = 1
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("a load needs num_requests or duration_s")

    @property
    def kind(self) -> str:
        return "rate" if self.rate is not None else "concurrency"

    @property
    def value(self) -> float:
        return self.rate if self.rate is not None else float(self.concurrency)

    def describe(self) -> str:
        stop = []
        if self.num_requests:
            stop.append(f"{self.num_requests} requests")
        if self.duration_s:
            stop.append(f"{self.duration_s:g} s")
        if self.kind == "rate":
            shape = f", burstiness {self.burstiness:g}" if self.arrival == "gamma" else ""
            cap = f", at most {self.max_inflight} in flight" if self.max_inflight else ""
            return f"open loop {self.rate:g} req/s ({self.arrival}{shape}{cap}), {' or '.join(stop)}"
        return f"closed loop, concurrency {self.concurrency}, {' or '.join(stop)}"


@dataclass(order=True)
class _Due:
    due: int
    seq: int
    rec: RequestRecord = field(compare=False)
    prepared: Any = field(compare=False)
    state: _SessionState = field(compare=False)


@dataclass
class _SessionState:
    session: Session
    turn: int = 0
    text_parts: list[str] = field(default_factory=list)  # user texts and replies so far
    ids: list[int] = field(default_factory=list)  # prompt + reply ids so far
    tokens: int = 0  # history length in tokens


class LoadGenerator:
    def __init__(
        self,
        transport: Transport,
        workload,
        *,
        request_timeout_s: float = 120.0,
        progress: Callable[[int, int | None], None] | None = None,
    ):
        self.transport = transport
        self.workload = workload
        self.request_timeout_ns = int(request_timeout_s * 1e9)
        self.progress = progress
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: dict[str, RequestRecord] = {}
        self._broken: str | None = None
        self._next_index = 0
        self._seen: set[str] = set()  # ids of every request sent
        self.unmatched_errors: list[str] = []  # error responses whose request id matched none sent
        self.last_t0: int | None = None  # the start of the latest run's schedule
        self._lock = threading.Lock()  # the run's state, shared with the reader's relay
        self._relay: _Run | None = None  # the closed-loop run whose slots the reader refills

    # -- transport callbacks (reader threads) ---------------------------------------------------
    def on_response(self, rid: str, t: int, payload: Any, final: bool) -> None:
        rec = self._inflight.get(rid)
        if rec is None:
            return
        if payload is not None:
            rec.raw.append((t, payload))
        if final:
            rec.final_ns = t
            if self._relay is not None:
                self._relay.relay(rid, t)
            self._events.put(rid)

    def on_error(self, rid: str | None, t: int, message: str, status: int | None = None) -> None:
        if rid is None:  # the connection itself failed: every request in flight is lost
            self._broken = message
            self._events.put(None)
            return
        rec = self._inflight.get(rid)
        if rec is None:
            if rid not in self._seen:
                self.unmatched_errors.append(message)
            return
        rec.error = message
        rec.status = status
        rec.final_ns = t
        if self._relay is not None:
            self._relay.relay(rid, t)
        self._events.put(rid)

    # -- building requests -----------------------------------------------------------------------
    def _make(self, state: _SessionState, phase: str, due: int, seq: int) -> _Due:
        turn = state.session.turns[state.turn]
        rec = RequestRecord(
            index=self._next_index,
            phase=phase,
            session=state.session.index,
            turn=state.turn,
            scheduled_ns=due,
            requested_output_tokens=turn.output_tokens,
            input_tokens=state.tokens + turn.input_tokens,
        )
        self._next_index += 1
        if turn.ids is not None:
            payload = Payload(ids=state.ids + turn.ids, output_tokens=turn.output_tokens)
        else:
            payload = Payload(
                text="\n".join([*state.text_parts, turn.text]),
                output_tokens=turn.output_tokens,
                turn_text=turn.text,
                conversation=state.session.index if len(state.session.turns) > 1 else None,
            )
        return _Due(due, seq, rec, self.transport.prepare(str(rec.index), payload), state)

    def _follow_up(self, item: _Due) -> _SessionState | None:
        """The session's state for its next turn, or None when it has no more turns."""
        st = item.state
        if st.turn + 1 >= len(st.session.turns) or not item.rec.ok:
            return None
        rec = item.rec
        finish_record(rec, self.transport.info, self.transport.name)  # the reply is part of the history
        turn = st.session.turns[st.turn]
        if turn.ids is not None:
            st.ids = st.ids + turn.ids + (rec.output_ids or [])
        else:
            st.text_parts = [*st.text_parts, turn.text, rec.text or ""]
        st.tokens += turn.input_tokens + rec.output_tokens
        st.turn += 1
        return st

    # -- the loop ----------------------------------------------------------------------------------
    def run(
        self, plan: LoadPlan, phase: str = "measure", *, t0: int | None = None, partition: tuple[int, int] = (0, 1)
    ) -> list[RequestRecord]:
        """Send the plan's requests; returns their records (raw responses still to decode).

        ``t0``: the schedule's start (``now_ns`` clock; default: now).  ``partition = (k, n)``: this
        generator is worker k of n sharing one schedule: it sends arrivals k, k+n, … (open loop), or
        closed-loop slots and requests k, k+n, …; sessions keep their global numbers, so the
        prompts do not depend on n.
        """
        run = _Run(self, plan, phase, t0, partition)
        self.last_t0 = run.t0
        try:
            return run.loop()
        finally:
            self._relay = None

    def send(self, item: _Due, released: int) -> None:
        rec = item.rec
        rec.released_ns = released
        self._seen.add(str(rec.index))
        self._inflight[str(rec.index)] = rec
        rec.sent_ns = now_ns()
        self.transport.submit(item.prepared)


class _Run:
    """The state of one :meth:`LoadGenerator.run`."""

    def __init__(
        self, gen: LoadGenerator, plan: LoadPlan, phase: str, t0: int | None = None, partition: tuple[int, int] = (0, 1)
    ):
        self.gen, self.plan, self.phase = gen, plan, phase
        k, n = self.k, self.n = partition
        self.records: list[RequestRecord] = []
        self.heap: list[_Due] = []
        self.held: deque[_Due] = deque()  # due, waiting for a max_inflight slot
        self.items: dict[str, _Due] = {}
        self.seq = itertools.count()
        self.session_ids = itertools.count((WARMUP_SESSION_BASE if phase == "warmup" else 0) + k, n)
        self.arrival_no = 0  # open loop: global number of the next arrival
        # This worker's share: closed-loop slots and request quota, open-loop max_inflight.
        self.quota = len(range(k, plan.num_requests, n)) if plan.num_requests is not None else None
        self.slots = len(range(k, plan.concurrency, n)) if plan.kind == "concurrency" else 0
        self.max_inflight = len(range(k, plan.max_inflight, n)) if plan.max_inflight else None
        self.created = 0
        self.done = 0
        self.t0 = t0 if t0 is not None else now_ns() + 2_000_000  # ahead, so the first requests are prepared in time
        self.end_ns = self.t0 + int(plan.duration_s * 1e9) if plan.duration_s else None
        self.arrivals = (
            arrival_offsets(plan.arrival, plan.rate, burstiness=plan.burstiness, seed=plan.seed)
            if plan.kind == "rate"
            else None
        )
        self.arrival_item: _Due | None = None  # the latest arrival; the next is prepared when it goes
        # Closed loop: new sessions built ahead, one per slot, sent by the reader (relay); the ids of
        # the requests whose slot the reader has refilled wait here for this thread's bookkeeping.
        self.spares: deque[_Due] = deque()
        self.relayed: set[str] = set()

    def may_create(self, due: int) -> bool:
        return (
            (self.quota is None or self.created < self.quota)
            and (self.end_ns is None or due < self.end_ns)
            and self.gen._broken is None
        )

    def push(self, state: _SessionState, due: int) -> _Due:
        item = self.gen._make(state, self.phase, due, next(self.seq))
        self.count(item)
        heapq.heappush(self.heap, item)
        return item

    def count(self, item: _Due) -> None:
        self.created += 1
        self.records.append(item.rec)
        self.items[str(item.rec.index)] = item

    def new_session(self, due: int) -> _Due:
        if not self.spares:
            return self.push(_SessionState(self.gen.workload.session(next(self.session_ids))), due)
        item = self.spares.popleft()
        item.due = item.rec.scheduled_ns = due
        self.count(item)
        heapq.heappush(self.heap, item)
        return item

    def build_spares(self) -> None:
        """Closed loop: build the next new session of every slot ahead, as far as the quota reaches."""
        while len(self.spares) < self.slots and (self.quota is None or self.created + len(self.spares) < self.quota):
            state = _SessionState(self.gen.workload.session(next(self.session_ids)))
            self.spares.append(self.gen._make(state, self.phase, 0, next(self.seq)))

    def relay(self, rid: str, t: int) -> None:
        """The reader's side: request ``rid`` ended at ``t``; when its session is over, send a spare
        new session in its slot now (the loop thread would first have to wake up)."""
        item = self.items.get(rid)
        if item is None or not self.spares:
            return
        st = item.state
        if st.turn + 1 < len(st.session.turns) and item.rec.error is None:
            return  # its next turn carries the reply: built by the loop thread
        with self.gen._lock:
            if not self.spares or rid in self.relayed or rid not in self.gen._inflight or not self.may_create(t):
                return
            spare = self.spares.popleft()
            spare.due = spare.rec.scheduled_ns = t
            self.count(spare)
            self.relayed.add(rid)
            self.gen.send(spare, t)

    def next_arrival(self) -> None:
        """Prepare this worker's next arrival (every n-th of the shared schedule)."""
        while True:
            i, self.arrival_no = self.arrival_no, self.arrival_no + 1
            due = self.t0 + next(self.arrivals)
            if i % self.n == self.k:
                break
        self.arrival_item = self.new_session(due) if self.may_create(due) else None

    def finished(self, item: _Due, t: int) -> None:
        """A request ended at ``t``: free its slot and schedule what follows it (due at ``t``)."""
        if self.held:
            self.gen.send(self.held.popleft(), t)
        rid = str(item.rec.index)
        if rid in self.relayed:  # the reader has sent the slot's next session already
            self.relayed.discard(rid)
            return
        state = self.gen._follow_up(item)
        if state is not None and self.may_create(t):
            self.push(state, t)
        elif state is None and self.plan.kind == "concurrency" and self.may_create(t):
            self.new_session(t)

    def fail_all(self, message: str) -> None:
        t = now_ns()
        for rec in list(self.gen._inflight.values()):
            rec.error, rec.final_ns = message, t
        self.gen._inflight.clear()
        for item in [*self.heap, *self.held]:
            item.rec.error, item.rec.final_ns = f"not sent: {message}", t
        self.heap.clear()
        self.held.clear()
        self.arrival_item = None

    def loop(self) -> list[RequestRecord]:
        gen, plan, inflight, lock = self.gen, self.plan, self.gen._inflight, self.gen._lock
        if self.arrivals is not None:
            self.next_arrival()
        else:
            for _ in range(self.slots):
                if self.may_create(self.t0):
                    self.new_session(self.t0)
            gen._relay = self
        while True:
            now = now_ns()
            with lock:
                # Send what is due (or park it while the max_inflight slots are taken).
                while self.heap and self.heap[0].due <= now:
                    item = heapq.heappop(self.heap)
                    if self.max_inflight and len(inflight) >= self.max_inflight:
                        self.held.append(item)
                    else:
                        gen.send(item, item.due)
                    if item is self.arrival_item:
                        self.next_arrival()  # after the send: prepared now, long before it is due
                    now = now_ns()
                # Requests that never finished.
                while inflight:
                    rid, rec = next(iter(inflight.items()))
                    if now - rec.sent_ns < gen.request_timeout_ns:
                        break
                    rec.error = f"no final response within {gen.request_timeout_ns / 1e9:g} s (slo.request_timeout_s)"
                    rec.timed_out = True
                    rec.final_ns = now
                    del inflight[rid]
                    self.finished(self.items.pop(rid), now)
                if gen._broken is not None:
                    self.fail_all(gen._broken)
                if not self.heap and not self.held and not inflight:
                    break
            if self.slots and not self.heap:  # closed loop, nothing due: build the spares now
                self.build_spares()
                now = now_ns()
            wait = (self.heap[0].due - now) / 1e9 if self.heap else 0.1
            try:
                ev = gen._events.get(timeout=min(max(wait, 0.0), 0.1))
            except queue.Empty:
                continue
            while True:
                with lock:
                    rec = inflight.pop(ev, None) if ev is not None else None
                    if rec is not None:
                        self.done += 1
                        self.finished(self.items.pop(ev), rec.final_ns)
                if rec is not None and gen.progress:
                    gen.progress(self.done, plan.num_requests)
                try:
                    ev = gen._events.get_nowait()
                except queue.Empty:
                    break
        return self.records
