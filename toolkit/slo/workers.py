"""``--workers N``: N client processes on one host under one schedule.

Each worker is a spawned process (never forked: gRPC's threads do not survive a fork) running
:func:`~toolkit.slo.client.worker_main`.  It connects, warms up its share, and says so; when every
worker is ready the parent hands all of them the same start ``t0`` (a few milliseconds ahead), and
each sends its every-n-th part of the schedule.  The parent watches the server's metrics meanwhile
and merges the raw records: percentiles come from every sample, never from per-worker summaries.
"""

from __future__ import annotations

import multiprocessing as mp
import time

from ..errors import ServerError
from .client import ClientJob, ClientResult, connect, make_workload, start_time

READY_TIMEOUT_S = 300.0  # spawning, importing and warming up on a busy host
START_MARGIN_NS = 50_000_000  # t0 this far after the last worker is ready: every worker has its t0 by then


def run_workers(job: ClientJob, watcher, start_at: float | None):
    """(model info, tokenizer name, has tokenizer, [ClientResult per worker])."""
    # Check the server and the interface here first, so a bad URL is one clear error, not n.
    transport, info = connect(job)
    transport.close()
    _, tok_name, has_tok = make_workload(job)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for k in range(job.workers):
        parent, child = ctx.Pipe()
        part = ClientJob(**{**job.__dict__, "worker": k})
        p = ctx.Process(target=_entry, args=(part, child), name=f"rtk-slo-worker-{k}", daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results: list[ClientResult | None] = [None] * job.workers
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for k, c in enumerate(conns):
            _expect(c, "ready", k, deadline)
        t0 = start_time(start_at, START_MARGIN_NS)
        for c in conns:
            c.send(t0)
        with watcher:
            for k, c in enumerate(conns):
                results[k] = _expect(c, "done", k, None)
    except BaseException:
        for c in conns:
            try:
                c.send(None)
            except OSError:
                pass
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return info, tok_name, has_tok, results


def _entry(job: ClientJob, conn) -> None:
    from .client import worker_main

    worker_main(job, conn)


def _expect(conn, what: str, k: int, deadline: float | None):
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    if timeout is not None and not conn.poll(timeout):
        raise ServerError(f"client worker {k} did not get ready within {READY_TIMEOUT_S:g} s")
    try:
        kind, value = conn.recv()
    except EOFError:
        raise ServerError(f"client worker {k} exited without a result") from None
    if kind == "error":
        raise value
    if kind != what:
        raise ServerError(f"client worker {k} sent '{kind}' where '{what}' was expected")
    return value
