"""One client process's part of a run: build the workload and transport, warm up, send its share
of the shared schedule, decode the responses.

:func:`~toolkit.slo.runner.run_slo` runs it in-process (``workers = 1``) or in ``n`` spawned
processes (``workers = n``): each takes every n-th arrival (open loop) or every n-th slot and
request (closed loop) of the *same* schedule, starting at one ``t0`` that the parent hands out
once every worker is connected and warm.  ``time.perf_counter_ns`` is ``CLOCK_MONOTONIC`` on
Linux, one clock for every process on the host, so their records merge as they are.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, field

from .loadgen import LoadGenerator, LoadPlan
from .records import RequestRecord
from .transport import ModelInfo, Replicas, finish_record, make_transport, now_ns
from .workload import JsonlWorkload, SyntheticWorkload, load_tokenizer


@dataclass
class ClientJob:
    """Everything a client process needs (picklable)."""

    slo: dict  # SLOSpec.model_dump()
    urls: list[str]
    transport: str
    model: str
    endpoint: str
    repository: str | None = None
    balance: str = "round_robin"
    keep_output: bool = True
    worker: int = 0
    workers: int = 1


@dataclass
class ClientResult:
    records: list[RequestRecord]
    t0: int  # the measured schedule's start (now_ns clock)
    cpu_s: float  # this process's CPU time for the whole run
    unmatched_errors: list[str] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)


def make_workload(job: ClientJob):
    """(workload, tokenizer name, whether a model tokenizer was found)."""
    slo = job.slo
    want_ids = job.endpoint == "tensorrt_llm"
    tokenizer = load_tokenizer(slo["tokenizer"], job.repository)
    if slo["dataset"]:
        workload = JsonlWorkload(
            slo["dataset"], output_tokens=slo["output_tokens"], tokenizer=tokenizer, want_ids=want_ids
        )
    else:
        workload = SyntheticWorkload(
            input_tokens=slo["input_tokens"],
            input_std=slo["input_tokens_stddev"],
            output_tokens=slo["output_tokens"],
            output_std=slo["output_tokens_stddev"],
            turns=slo["turns"],
            seed=slo["seed"],
            tokenizer=tokenizer,
            want_ids=want_ids,
        )
    return workload, (workload.tokenizer.name if workload.tokenizer else "none"), tokenizer is not None


def connect(job: ClientJob):
    """The transport (one URL or :class:`Replicas`) and the model's interface, checked."""
    transport = make_transport(job.transport, job.urls, job.model, job.endpoint, job.balance)
    return transport, transport.model_info()


def plan_of(slo: dict) -> LoadPlan:
    return LoadPlan(
        concurrency=slo["concurrency"] if slo["request_rate"] is None else None,
        rate=slo["request_rate"],
        arrival=slo["arrival"],
        burstiness=slo["burstiness"],
        max_inflight=slo["max_inflight"],
        num_requests=slo["num_requests"],
        duration_s=slo["duration_s"],
        seed=slo["seed"],
    )


def warmup_plan(slo: dict) -> LoadPlan | None:
    n = slo["warmup_requests"]
    if not n:
        return None
    return LoadPlan(
        concurrency=max(1, min(n, slo["concurrency"] or slo["max_inflight"] or 4)), num_requests=n, seed=slo["seed"]
    )


class Client:
    """One process's connection, workload and load generator."""

    def __init__(self, job: ClientJob, progress=None):
        self.job = job
        self.workload, self.tokenizer_name, self.has_tokenizer = make_workload(job)
        self.transport, self.info = connect(job)
        slo = job.slo
        self.gen = LoadGenerator(
            self.transport, self.workload, request_timeout_s=slo["request_timeout_s"], progress=progress
        )
        self.records: list[RequestRecord] = []
        self._switch = sys.getswitchinterval()
        self._cpu0 = time.process_time()

    @property
    def part(self) -> tuple[int, int]:
        return self.job.worker, self.job.workers

    def open_and_warm(self) -> None:
        # The sender, the response reader and the HTTP loop share the GIL; a short switch interval
        # bounds how long a due send can wait for it (the default 5 ms would show as schedule lag).
        sys.setswitchinterval(0.0005)
        self.transport.open(self.gen.on_response, self.gen.on_error)
        warm = warmup_plan(self.job.slo)
        if warm is not None:
            self.records += self.gen.run(warm, phase="warmup", partition=self.part)
        # A full collection walks every object the process holds (imports, earlier runs): 40-65 ms
        # with the sender stopped, seen as send-lag spikes.  Frozen objects are left out of it until
        # finish(); the collector still runs over what the measured run itself creates.
        gc.collect()
        gc.freeze()

    def measure(self, t0: int | None) -> None:
        self.records += self.gen.run(plan_of(self.job.slo), phase="measure", t0=t0, partition=self.part)

    def finish(self) -> ClientResult:
        """Close the connection and decode every response; the result is what the parent merges."""
        sys.setswitchinterval(self._switch)
        gc.unfreeze()
        self.transport.close()
        for r in self.records:
            if r.raw:
                finish_record(r, self.info, self.transport.name, self.job.keep_output)
        k, n = self.part
        assigned = getattr(self.transport, "assigned", {})
        for r in self.records:
            r.replica = assigned.get(str(r.index))
            r.worker = k
            r.index = r.index * n + k  # unique across workers
        urls = self.transport.urls if isinstance(self.transport, Replicas) else [self.transport.url]
        return ClientResult(
            self.records, self.gen.last_t0 or 0, time.process_time() - self._cpu0, list(self.gen.unmatched_errors), urls
        )


def worker_main(job: ClientJob, conn) -> None:
    """A spawned worker: connect and warm up, report ready, wait for the shared t0, run, send back."""
    try:
        client = Client(job)
        client.open_and_warm()
        conn.send(("ready", None))
        t0 = conn.recv()
        if t0 is None:  # the parent gave up (another worker failed)
            client.finish()
            return
        client.measure(t0)
        conn.send(("done", client.finish()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it there
        conn.send(("error", exc))
    finally:
        conn.close()


def start_time(start_at: float | None, margin_ns: int = 2_000_000) -> int:
    """The schedule's start on the now_ns clock: ``start_at`` (Unix time) or a moment from now."""
    if start_at is None:
        return now_ns() + margin_ns
    ahead = start_at - time.time()
    if ahead < 0:
        from ..errors import UsageError

        raise UsageError(
            f"--start-at {start_at:.3f} is {-ahead:.1f} s in the past; give a Unix time ahead of every host's start"
        )
    return now_ns() + int(ahead * 1e9)


def model_info_note(info: ModelInfo, transport: str) -> list[str]:
    notes = []
    if transport == "openai" and info.sessions:
        notes.append(
            "the server keeps sessions: each turn of a multi-turn conversation sent only its new user message "
            "with the conversation's session_id, and the server supplied the history"
        )
    if transport != "openai":
        if not info.stamps:
            notes.append(
                f"model '{info.name}' does not return server timestamps (return_perf_metrics); "
                "server-side columns are empty"
            )
        if "min_tokens" not in info.inputs:
            notes.append(
                f"model '{info.name}' does not take min_tokens: output length is not enforced, and responses "
                "shorter than requested are counted in short_output_rate"
            )
    return notes
