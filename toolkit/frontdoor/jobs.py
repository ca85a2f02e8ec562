"""Async jobs (``serving.jobs``): ``POST /v1/jobs`` takes an OpenAI body (chat if it has ``messages``, else a
completion) and an optional ``callback_url``, answers 202 with a job id at once, and runs the request
in the background through the front door itself (admission, fallbacks, filter and sessions apply; an
overload refusal is retried later).  ``GET /v1/jobs/{id}`` gives the state and the result.

Jobs live in SQLite (a file beside the server's state file), so a front door that stops or is killed
loses none: at start, a job that was running is run again, and a result whose callback was not yet
delivered is delivered.  Finished jobs are kept ``ttl_s``.

Callbacks are POSTed (no redirects followed) with retries and exponential backoff until a 2xx answer:
at least once.  Each carries

* ``Idempotency-Key: <job id>:<run>`` — ``run`` is the execution of the job that produced the result
  (1 unless a restart interrupted it), so every delivery of one result, however often retried and
  across restarts, has the same key;
* ``X-Rtk-Signature: t=<unix time>,v1=<hex HMAC-SHA256 of "<t>.<body>">`` with the secret of
  ``serving.jobs.callback_secret`` (never logged or stored);
* ``X-Rtk-Delivery-Attempt: <n>``.

A callback URL must be http(s) and must not resolve to a loopback, private, link-local, unspecified,
multicast or reserved address (IPv4-mapped IPv6 forms included) unless ``allow_private_callbacks``;
the check runs at submission and again before every delivery.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import sqlite3
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from .protocol import APIError
from .sessions import OWNER_HEADER

log = logging.getLogger("rtk.frontdoor")
SIGNATURE_HEADER = "X-Rtk-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
ATTEMPT_HEADER = "X-Rtk-Delivery-Attempt"
QUEUED, RUNNING, SUCCEEDED, FAILED = "queued", "running", "succeeded", "failed"


def sign(secret: str, body: bytes, t: int | None = None) -> str:
    t = int(time.time()) if t is None else t
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def verify(secret: str, body: bytes, header: str, *, tolerance_s: float = 300.0) -> bool:
    """What a receiver does: check the signature and that it is recent."""
    try:
        parts = dict(p.split("=", 1) for p in header.split(","))
        t = int(parts["t"])
    except (ValueError, KeyError):
        return False
    return abs(time.time() - t) <= tolerance_s and hmac.compare_digest(sign(secret, body, t), header)


# -- callback URLs ------------------------------------------------------------------------------------


def _forbidden(ip: ipaddress._BaseAddress) -> str | None:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        inner = _forbidden(ip.ipv4_mapped)
        return f"IPv4-mapped {inner}" if inner else None
    for what in ("unspecified", "loopback", "link_local", "multicast", "reserved", "private"):
        if getattr(ip, f"is_{what}"):
            return what.replace("_", "-")
    return None


async def check_callback_url(url: str, *, allow_private: bool) -> None:
    """Raise a 400 naming ``callback_url`` unless it is an http(s) URL to a public address."""

    def refuse(why: str):
        return APIError(400, f"'callback_url': {why}", param="callback_url", code="invalid_callback_url")

    if not isinstance(url, str) or len(url) > 2048:
        raise refuse("must be a URL string of at most 2048 characters")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise refuse(f"scheme '{parts.scheme}' is not allowed; use http or https")
    host = parts.hostname
    if not host:
        raise refuse("has no host")
    if parts.username or parts.password:
        raise refuse("must not carry credentials")
    if allow_private:
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise refuse("has an invalid port") from None
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise refuse(f"host '{host}' does not resolve") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        why = _forbidden(ip)
        if why:
            raise refuse(
                f"'{host}' resolves to a {why} address ({ip}); callbacks go to public addresses only "
                "(serving.jobs.allow_private_callbacks allows others)"
            )


# -- the store -------------------------------------------------------------------------------------------


@dataclass
class Job:
    id: str
    owner: str
    kind: str  # chat | completion
    body: dict
    callback_url: str | None = None
    state: str = QUEUED
    run: int = 0  # executions started
    result: dict | None = None
    result_run: int | None = None  # the execution that produced the result
    error: dict | None = None
    callback_state: str | None = None  # pending | delivered | failed
    deliveries: int = 0
    next_delivery: float = 0.0
    next_run: float = 0.0
    created: float = 0.0
    updated: float = 0.0

    def public(self) -> dict:
        out = {
            "id": self.id,
            "object": "job",
            "status": self.state,
            "created": int(self.created),
            "updated": int(self.updated),
            "runs": self.run,
        }
        if self.result is not None:
            out["result"] = self.result
        if self.error is not None:
            out["error"] = self.error
        if self.callback_url:
            out["callback"] = {
                "status": self.callback_state,
                "deliveries": self.deliveries,
                "idempotency_key": self.idempotency_key,
            }
        return out

    @property
    def idempotency_key(self) -> str | None:
        return f"{self.id}:{self.result_run}" if self.result_run else None


class JobStore:
    """Jobs in SQLite; calls run in a worker thread."""

    COLUMNS = (
        "id",
        "owner",
        "kind",
        "body",
        "callback_url",
        "state",
        "run",
        "result",
        "result_run",
        "error",
        "callback_state",
        "deliveries",
        "next_delivery",
        "next_run",
        "created",
        "updated",
    )
    JSON = ("body", "result", "error")

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, owner TEXT, kind TEXT, body TEXT, callback_url TEXT,"
            " state TEXT, run INTEGER, result TEXT, result_run INTEGER, error TEXT, callback_state TEXT,"
            " deliveries INTEGER, next_delivery REAL, next_run REAL, created REAL, updated REAL)"
        )

    def _run(self, fn):
        def locked():
            with self._lock:
                return fn(self._db)

        return asyncio.to_thread(locked)

    def _row(self, row) -> Job:
        d = dict(zip(self.COLUMNS, row, strict=True))
        for k in self.JSON:
            d[k] = json.loads(d[k]) if d[k] is not None else None
        return Job(**d)

    async def put(self, job: Job) -> None:
        job.updated = time.time()
        values = [getattr(job, c) for c in self.COLUMNS]
        values = [
            json.dumps(v) if c in self.JSON and v is not None else v for c, v in zip(self.COLUMNS, values, strict=True)
        ]
        marks = ",".join("?" * len(self.COLUMNS))
        await self._run(lambda db: db.execute(f"INSERT OR REPLACE INTO jobs VALUES ({marks})", values))

    async def get(self, jid: str) -> Job | None:
        row = await self._run(lambda db: db.execute("SELECT * FROM jobs WHERE id = ?", (jid,)).fetchone())
        return self._row(row) if row else None

    async def due(self, now: float) -> tuple[list[Job], list[Job], dict[str, int]]:
        """(jobs to run, callbacks to deliver) whose time has come, and how many jobs are in each state."""

        def q(db):
            runs = db.execute(
                "SELECT * FROM jobs WHERE state = ? AND next_run <= ? ORDER BY created", (QUEUED, now)
            ).fetchall()
            calls = db.execute(
                "SELECT * FROM jobs WHERE callback_state = 'pending' AND next_delivery <= ?", (now,)
            ).fetchall()
            states = dict(db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())
            return runs, calls, states

        runs, calls, states = await self._run(q)
        return [self._row(r) for r in runs], [self._row(r) for r in calls], states

    async def requeue_running(self) -> int:
        """At start: jobs a stopped front door was running run again."""
        return await self._run(
            lambda db: db.execute("UPDATE jobs SET state = ?, next_run = 0 WHERE state = ?", (QUEUED, RUNNING)).rowcount
        )

    async def purge(self, ttl_s: float) -> int:
        cutoff = time.time() - ttl_s
        return await self._run(
            lambda db: (
                db.execute(
                    "DELETE FROM jobs WHERE state IN (?, ?) AND updated < ? "
                    "AND (callback_state IS NULL OR callback_state != 'pending')",
                    (SUCCEEDED, FAILED, cutoff),
                ).rowcount
            )
        )

    async def close(self) -> None:
        await self._run(lambda db: db.close())


def default_jobs_path(repository: Path | None) -> Path | None:
    from ..triton.server import state_path

    return state_path(repository).with_suffix(".jobs.sqlite") if repository else None


# -- the runner --------------------------------------------------------------------------------------------


class JobService:
    """Accepts jobs, runs them through the front door's own app, delivers callbacks."""

    def __init__(self, config):
        from .tiers import read_secret

        self.config, self.spec = config, config.jobs
        self.secret = (read_secret(self.spec.callback_secret) or [None])[0] if self.spec.callback_secret else None
        self.store: JobStore | None = None
        self.unavailable = ""
        self._tasks: list[asyncio.Task] = []
        self._running: set[str] = set()
        self._wake = asyncio.Event()
        self._internal_key = secrets.token_urlsafe(32)  # lets the runner through API-key checks; memory only
        self.states: dict[str, int] | None = None  # jobs in the store by state, as the loop last counted them
        self.counters: Counter = Counter()  # (metric, label value) → count since this front door started

    async def start(self, fd, app) -> None:
        import httpx

        if not self.spec.enabled:
            self.unavailable = "jobs are off (serving.jobs.enabled: false)"
            return
        path = Path(self.spec.path) if self.spec.path else default_jobs_path(self.config.repository)
        if path is None:
            self.unavailable = "no job store: set serving.jobs.path"
            return
        self.store = JobStore(path)
        if fd.keys:
            fd.keys.append(self._internal_key)
        fd.sessions.internal_key = self._internal_key  # a job's session turns are its owner's
        self.local = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://frontdoor", timeout=httpx.Timeout(None)
        )
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.spec.callback_timeout_s), follow_redirects=False)
        resumed = await self.store.requeue_running()
        if resumed:
            log.info("front door: %d interrupted job(s) run again", resumed)
        self._tasks.append(asyncio.create_task(self._loop()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.store is not None:
            await self.local.aclose()
            await self.http.aclose()
            await self.store.close()

    # -- HTTP ------------------------------------------------------------------------------------------------
    def routes(self, fd) -> list:
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        from .sessions import bearer, owner_of

        async def submit(request):
            try:
                fd._check_key(request)
                if self.store is None:
                    raise APIError(404, self.unavailable, code="jobs_unavailable")
                body = await self._validate(fd, request)
                job = Job(
                    id="job-" + uuid.uuid4().hex,
                    owner=owner_of(bearer(request) or None),
                    kind="chat" if "messages" in body else "completion",
                    body=body,
                    callback_url=body.pop("callback_url", None),
                    created=time.time(),
                )
                job.callback_state = "waiting" if job.callback_url else None
                await self.store.put(job)
                self.counters[("submitted", "")] += 1
                self._wake.set()
                return JSONResponse(job.public(), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})
            except APIError as exc:
                return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

        async def read(request):
            try:
                fd._check_key(request)
                if self.store is None:
                    raise APIError(404, self.unavailable, code="jobs_unavailable")
                jid = request.path_params["job_id"]
                job = await self.store.get(jid)
                if job is None or job.owner != owner_of(bearer(request) or None):
                    raise APIError(
                        404,
                        f"job '{jid}' does not exist for this API key (finished jobs are kept {self.spec.ttl_s:.0f} s)",
                        param="job_id",
                        code="job_not_found",
                    )
                return JSONResponse(job.public())
            except APIError as exc:
                return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

        return [Route("/v1/jobs", submit, methods=["POST"]), Route("/v1/jobs/{job_id}", read, methods=["GET"])]

    async def _validate(self, fd, request) -> dict:
        from .app import read_json_body
        from .protocol import parse_request

        body = await read_json_body(request, self.config.frontend.max_request_bytes)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        if body.get("stream"):
            raise APIError(
                400,
                "'stream': a job's result is read with GET /v1/jobs/{id} or sent to callback_url; leave stream unset",
                param="stream",
                code="invalid_value",
            )
        kind = "chat" if "messages" in body else "completion"
        rest = {k: v for k, v in body.items() if k != "callback_url"}
        parse_request(
            kind,
            rest,
            served_model=self.config.model_name,
            max_seq_len=self.config.max_seq_len,
            default_max_tokens=self.config.default_max_tokens,
        )
        url = body.get("callback_url")
        if url is not None:
            if self.secret is None:
                raise APIError(
                    400,
                    "'callback_url': this deployment has no callback secret to sign callbacks "
                    "with; set serving.jobs.callback_secret (env:VARIABLE or file:PATH)",
                    param="callback_url",
                    code="invalid_callback_url",
                )
            await check_callback_url(url, allow_private=self.spec.allow_private_callbacks)
        return body

    # -- running and delivering --------------------------------------------------------------------------------
    async def _loop(self) -> None:
        purge_at = 0.0
        while True:
            try:
                now = time.time()
                runs, calls, self.states = await self.store.due(now)
                for job in runs:
                    if len(self._running) >= self.spec.max_concurrent:
                        break
                    if job.id not in self._running:
                        self._running.add(job.id)
                        self._tasks.append(asyncio.create_task(self._execute(job)))
                for job in calls:
                    if job.id not in self._running:
                        self._running.add(job.id)
                        self._tasks.append(asyncio.create_task(self._deliver(job)))
                self._tasks = [t for t in self._tasks if not t.done()] or self._tasks[:1]
                if now > purge_at:
                    await self.store.purge(self.spec.ttl_s)
                    purge_at = now + 60
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — keep the loop alive; the next round retries
                self.counters[("store_errors", "")] += 1
                log.warning("front door: job loop: %r", exc)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.spec.poll_s)
            except TimeoutError:
                pass

    async def _execute(self, job: Job) -> None:
        try:
            job.state, job.run = RUNNING, job.run + 1
            await self.store.put(job)
            path = "/v1/chat/completions" if job.kind == "chat" else "/v1/completions"
            headers = {"Authorization": f"Bearer {self._internal_key}", OWNER_HEADER: job.owner}
            r = await self.local.post(path, json=job.body, headers=headers)
            # Overload, or another turn of the job's session running: try again later, as a client would.
            if r.status_code in (429, 503) or (r.status_code == 409 and _error_code(r) == "session_busy"):
                job.state = QUEUED
                job.next_run = time.time() + float(r.headers.get("retry-after", "1"))
            elif r.status_code == 200:
                job.state, job.result, job.result_run = SUCCEEDED, r.json(), job.run
            else:
                job.state, job.result_run = FAILED, job.run
                job.error = (
                    r.json().get("error")
                    if r.headers.get("content-type", "").startswith("application/json")
                    else {"message": r.text[:500]}
                )
            if job.state != QUEUED and job.callback_url:
                job.callback_state, job.next_delivery = "pending", 0.0
            self.counters[("runs", "requeued" if job.state == QUEUED else job.state)] += 1
            await self.store.put(job)
        finally:
            self._running.discard(job.id)
            self._wake.set()

    def _payload(self, job: Job) -> bytes:
        return json.dumps(job.public(), separators=(",", ":"), ensure_ascii=False).encode()

    async def _deliver(self, job: Job) -> None:
        try:
            body = self._payload(job)
            job.deliveries += 1
            ok = False
            try:
                await check_callback_url(job.callback_url, allow_private=self.spec.allow_private_callbacks)
                r = await self.http.post(
                    job.callback_url,
                    content=body,
                    headers={
                        "Content-Type": "application/json",
                        SIGNATURE_HEADER: sign(self.secret, body),
                        IDEMPOTENCY_HEADER: job.idempotency_key,
                        ATTEMPT_HEADER: str(job.deliveries),
                    },
                )
                ok = 200 <= r.status_code < 300
                why = f"HTTP {r.status_code}"
            except APIError as exc:
                why = exc.message
            except Exception as exc:  # noqa: BLE001 — a failed delivery is retried
                why = type(exc).__name__
            if ok:
                job.callback_state = "delivered"
            elif job.deliveries >= self.spec.callback_max_attempts:
                job.callback_state = "failed"
                log.warning("front door: callback of %s given up after %d attempts (%s)", job.id, job.deliveries, why)
            else:
                delay = min(self.spec.callback_backoff_s * 2 ** (job.deliveries - 1), self.spec.callback_max_backoff_s)
                job.next_delivery = time.time() + delay
            self.counters[("callbacks", "retried" if job.callback_state == "pending" else job.callback_state)] += 1
            await self.store.put(job)
        finally:
            self._running.discard(job.id)

    # -- /metrics ---------------------------------------------------------------------------------------------
    def metric_lines(self) -> list[str]:
        def counter(name: str, text: str, key: str, label: str | None, values: tuple[str, ...]) -> list[str]:
            out = [f"# HELP {name} {text}", f"# TYPE {name} counter"]
            if label is None:
                return out + [f"{name} {self.counters[(key, '')]}"]
            return out + [f'{name}{{{label}="{v}"}} {self.counters[(key, v)]}' for v in values]

        lines = counter("rtk_frontdoor_jobs_submitted_total", "jobs accepted (202)", "submitted", None, ())
        lines += counter(
            "rtk_frontdoor_job_runs_total",
            "job executions by result (requeued: overload or a busy session; run again later)",
            "runs",
            "result",
            (SUCCEEDED, FAILED, "requeued"),
        )
        lines += counter(
            "rtk_frontdoor_job_callbacks_total",
            "callback delivery attempts: delivered (2xx), retried (failed, tried again later), failed (given up)",
            "callbacks",
            "result",
            ("delivered", "retried", "failed"),
        )
        lines += counter(
            "rtk_frontdoor_job_store_errors_total",
            "failed rounds of the job loop (the job store)",
            "store_errors",
            None,
            (),
        )
        if self.states is not None:
            lines += ["# HELP rtk_frontdoor_jobs jobs in the store by state", "# TYPE rtk_frontdoor_jobs gauge"]
            lines += [
                f'rtk_frontdoor_jobs{{state="{st}"}} {self.states.get(st, 0)}'
                for st in (QUEUED, RUNNING, SUCCEEDED, FAILED)
            ]
        return lines


def _error_code(r) -> str | None:
    try:
        return (r.json().get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None
