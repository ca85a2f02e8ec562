"""Sessions (``serving.sessions``): a conversation kept by the front door, outside the model process.

A request with ``"session_id"`` sends only its new messages; the front door prepends the stored
conversation.  The conversation is stored with the exact token ids the engine saw (prompt and
generated ids), and the next turn's prompt is those ids followed by the tokens of the new messages
only, sent straight to the repository's ``tensorrt_llm`` model.  So the unchanged history is
token-for-token what the engine already has KV blocks for (it registers blocks filled by generated
tokens too), and its prefix reuse skips it; re-tokenising the reply text could give other ids and
miss.  The front door therefore does for session requests what the ensemble's pre- and
postprocessing do for the others: chat template, context window (oldest turns dropped, system
messages kept), incremental detokenisation.

Storage is SQLite (stdlib) by default, a file beside the server's state file, or Redis when
``serving.sessions.url`` is given; either survives a restart of tritonserver or of the front door.
Sessions expire ``ttl_s`` after their last turn; one that would grow over ``max_tokens`` stored ids
drops its oldest turns.  A session belongs to the API key that made it (a hash of it, never the key);
reading, listing and deleting others' sessions needs the admin key.

One turn of a session at a time: a request holds its session's *turn lease* in the store from before it
reads the history until its answer is stored (or it fails); another request for the same session meanwhile
is refused with 409 ``session_busy`` — across front doors sharing the store too.  A lease is renewed while
its turn streams and lapses ``TURN_LEASE_S`` after a front door died holding it.  A session request that a
fallback deployment answers is sent there with the stored history (and without ``session_id``), and the
answer is stored as the turn.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import sqlite3
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .protocol import APIError, GenRequest, bad
from .tokens import ChatTokens

log = logging.getLogger("rtk.frontdoor")
SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
LLM_MODEL = "tensorrt_llm"
SUMMARY_INSTRUCTION = (
    "Summarise the conversation below in a few sentences. Keep every name, number, fact and "
    "decision; write nothing else."
)
SUMMARY_PREFIX = "Summary of the earlier conversation: "
REDIS_PREFIX = "rtk:session:"
REDIS_LEASE_PREFIX = "rtk:session-turn:"
OWNER_HEADER = "x-rtk-session-owner"  # accepted only from the job runner
TURN_LEASE_S = 30.0  # a turn's hold on its session; renewed while it streams, so only a dead front door's lapses
RELEASE_IF_MINE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


def owner_of(key: str | None) -> str:
    """What a session records of the API key that made it: a short hash ("" without keys)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


@dataclass
class Session:
    id: str
    owner: str = ""
    messages: list[dict] = field(default_factory=list)  # {"role", "content", "tokens"}
    ids: list[int] = field(default_factory=list)  # exactly what the engine saw, closed after the last reply
    text: str = ""  # the rendered text ``ids`` stand for
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    turns: int = 0
    dropped_turns: int = 0
    stats: list[dict] = field(default_factory=list)  # per turn: prompt tokens, reused ids, engine's reused blocks
    summary: str = ""  # window_policy summarize: what the dropped turns said, written by the served model

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Session:
        return cls(**json.loads(text))

    def public(self, *, with_messages: bool = True) -> dict:
        out = {
            "id": self.id,
            "object": "session",
            "created": int(self.created),
            "updated": int(self.updated),
            "turns": self.turns,
            "tokens": len(self.ids),
            "dropped_turns": self.dropped_turns,
            "stats": self.stats,
        }
        if with_messages:
            out["messages"] = self.messages
        return out


# -- stores ------------------------------------------------------------------------------------------


class SQLiteSessions:
    """Sessions in one SQLite file (WAL); calls run in a worker thread."""

    def __init__(self, path: Path, ttl_s: float):
        self.path, self.ttl_s = Path(path), ttl_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, owner TEXT NOT NULL, updated REAL NOT NULL, "
            "body TEXT NOT NULL)"
        )
        self._db.execute("CREATE TABLE IF NOT EXISTS turns (id TEXT PRIMARY KEY, token TEXT NOT NULL, expires REAL)")

    def _run(self, fn):
        def locked():
            with self._lock:
                return fn(self._db)

        return asyncio.to_thread(locked)

    async def get(self, sid: str) -> Session | None:
        cutoff = time.time() - self.ttl_s
        row = await self._run(
            lambda db: db.execute("SELECT body FROM sessions WHERE id = ? AND updated >= ?", (sid, cutoff)).fetchone()
        )
        return Session.from_json(row[0]) if row else None

    async def put(self, s: Session) -> None:
        await self._run(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO sessions (id, owner, updated, body) VALUES (?, ?, ?, ?)",
                (s.id, s.owner, s.updated, s.to_json()),
            )
        )

    async def delete(self, sid: str) -> bool:
        return (await self._run(lambda db: db.execute("DELETE FROM sessions WHERE id = ?", (sid,)).rowcount)) > 0

    async def list(self, owner: str | None) -> list[Session]:
        cutoff = time.time() - self.ttl_s

        def q(db):
            if owner is None:
                return db.execute(
                    "SELECT body FROM sessions WHERE updated >= ? ORDER BY updated DESC", (cutoff,)
                ).fetchall()
            return db.execute(
                "SELECT body FROM sessions WHERE owner = ? AND updated >= ? ORDER BY updated DESC", (owner, cutoff)
            ).fetchall()

        return [Session.from_json(r[0]) for r in await self._run(q)]

    async def purge(self) -> int:
        cutoff = time.time() - self.ttl_s

        def q(db):
            db.execute("DELETE FROM turns WHERE expires < ?", (time.time(),))
            return db.execute("DELETE FROM sessions WHERE updated < ?", (cutoff,)).rowcount

        return await self._run(q)

    async def count(self) -> int:
        cutoff = time.time() - self.ttl_s
        return await self._run(
            lambda db: db.execute("SELECT COUNT(*) FROM sessions WHERE updated >= ?", (cutoff,)).fetchone()[0]
        )

    async def acquire(self, sid: str, token: str, lease_s: float) -> bool:
        """Take (or renew) the turn lease of ``sid`` for ``token``; False while another token holds it."""
        now = time.time()
        return (
            await self._run(
                lambda db: (
                    db.execute(
                        "INSERT INTO turns (id, token, expires) VALUES (?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                        "token = excluded.token, expires = excluded.expires WHERE turns.token = ? OR turns.expires < ?",
                        (sid, token, now + lease_s, token, now),
                    ).rowcount
                )
            )
        ) == 1

    async def release(self, sid: str, token: str) -> None:
        await self._run(lambda db: db.execute("DELETE FROM turns WHERE id = ? AND token = ?", (sid, token)))

    async def close(self) -> None:
        await self._run(lambda db: db.close())


class RedisSessions:
    """Sessions in Redis: one key per session with the TTL as its expiry."""

    def __init__(self, url: str, ttl_s: float):
        import redis.asyncio as redis

        self.client = redis.from_url(url)
        self.ttl_s = ttl_s

    async def get(self, sid: str) -> Session | None:
        raw = await self.client.get(REDIS_PREFIX + sid)
        return Session.from_json(raw.decode()) if raw else None

    async def put(self, s: Session) -> None:
        await self.client.set(REDIS_PREFIX + s.id, s.to_json(), px=max(1, int(self.ttl_s * 1000)))

    async def delete(self, sid: str) -> bool:
        return bool(await self.client.delete(REDIS_PREFIX + sid))

    async def list(self, owner: str | None) -> list[Session]:
        out = []
        async for key in self.client.scan_iter(match=REDIS_PREFIX + "*", count=500):
            raw = await self.client.get(key)
            if raw:
                s = Session.from_json(raw.decode())
                if owner is None or s.owner == owner:
                    out.append(s)
        return sorted(out, key=lambda s: -s.updated)

    async def purge(self) -> int:
        return 0  # Redis expires the keys itself

    async def count(self) -> int:
        return sum([1 async for _ in self.client.scan_iter(match=REDIS_PREFIX + "*", count=500)])

    async def acquire(self, sid: str, token: str, lease_s: float) -> bool:
        key, ms = REDIS_LEASE_PREFIX + sid, max(1, int(lease_s * 1000))
        if await self.client.set(key, token, nx=True, px=ms):
            return True
        # Renewal by the holder (a Lua script, so it cannot take a lease another token got meanwhile).
        renew = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end"
        return bool(await self.client.eval(renew + " return 0", 1, key, token, ms))

    async def release(self, sid: str, token: str) -> None:
        await self.client.eval(RELEASE_IF_MINE, 1, REDIS_LEASE_PREFIX + sid, token)

    async def close(self) -> None:
        await self.client.aclose()


class CountedStore:
    """A store whose failed calls are counted by operation (``rtk_frontdoor_session_store_errors_total``)."""

    def __init__(self, store, errors: Counter):
        self.store, self.errors = store, errors

    def __getattr__(self, op: str):
        call = getattr(self.store, op)
        if not asyncio.iscoroutinefunction(call):
            return call

        async def counted(*args, **kwargs):
            try:
                return await call(*args, **kwargs)
            except Exception:
                self.errors[op] += 1
                raise

        return counted


def make_store(spec, default_path: Path):
    if spec.url:
        return RedisSessions(spec.url, spec.ttl_s)
    return SQLiteSessions(Path(spec.path) if spec.path else default_path, spec.ttl_s)


def default_sqlite_path(repository: Path | None) -> Path:
    """Beside the server's state file: ``<repository's parent>/.rtk-triton/<repository name>.sessions.sqlite``."""
    from ..triton.server import state_path

    if repository is None:
        return Path(".rtk-triton") / "sessions.sqlite"
    return state_path(repository).with_suffix(".sessions.sqlite")


# -- the chat in token ids -------------------------------------------------------------------------------


@dataclass
class Turn:
    """One request of a session: what is sent and what to store when it completes."""

    session: Session
    new_messages: list[dict]
    prompt_ids: list[int]
    prompt_text: str
    history: list[dict]  # the messages the prompt holds (after dropping turns to fit)
    reused_ids: int  # how many leading prompt ids are the stored ones
    dropped: int = 0
    dropped_messages: list[dict] = field(default_factory=list)


class SessionManager:
    def __init__(self, spec, store, tokens: ChatTokens, *, window: int, max_seq_len: int, rules=None):
        self.spec, self.store, self.tokens = spec, store, tokens
        self.window, self.max_seq_len = window, max_seq_len
        self.rules = rules  # the content filter: a reply that breaks it is not stored

    async def allowed(self, reply: str) -> bool:
        from .filter import FilterHit

        if self.rules is None or not self.rules.check_output:
            return True
        try:
            await self.rules.check_text(reply)
        except FilterHit:
            return False
        return True

    async def load(self, sid: str, owner: str, *, create: bool) -> Session | None:
        s = await read_owned(self.store, sid, owner)
        if s is None and create:
            s = Session(id=sid, owner=owner)
        return s

    async def begin(self, req: GenRequest, sid: str, owner: str) -> Turn:
        s = await self.load(sid, owner, create=True)
        new = [{"role": m["role"], "content": m["content"]} for m in req.messages]
        window = min(self.window, self.max_seq_len - req.max_tokens)
        history = list(s.messages)
        dropped = 0
        while True:
            ids, text, reused = self._prompt(s, history, new, exact=dropped == 0)
            if len(ids) <= window:
                break
            shorter = _drop_oldest_turn(history)
            if shorter is None:
                raise bad(
                    "messages",
                    f"the new messages (with the system prompt) have {len(ids)} tokens, more than "
                    f"the {window} that fit the context window; shorten them or lower max_tokens",
                )
            history, dropped = shorter, dropped + 1
        kept = {id(m) for m in history}
        gone = [m for m in s.messages if id(m) not in kept and not m.get("summary")]
        return Turn(s, new, ids, text, history, reused, dropped, gone)

    def _prompt(self, s: Session, history: list[dict], new: list[dict], *, exact: bool) -> tuple[list[int], str, int]:
        full = self.tokens.render(history + new, generation_prompt=True)
        if exact and self.spec.exact_ids and s.ids and full.startswith(s.text):
            suffix = full[len(s.text) :]
            return s.ids + self.tokens.encode(suffix), full, len(s.ids)
        return self.tokens.encode(full), full, 0

    async def commit(self, turn: Turn, generated: list[int], reply: str, stats: dict) -> Session:
        """Store the completed turn: the prompt ids, the generated ids, and the template's close of the reply."""
        s = turn.session
        gen = list(generated)
        if gen and gen[-1] == self.tokens.end_id:
            gen = gen[:-1]
        answer = {"role": "assistant", "content": reply}
        closed = self.tokens.render(turn.history + turn.new_messages + [answer], generation_prompt=False)
        head = turn.prompt_text + reply
        if closed.startswith(head):
            s.ids = turn.prompt_ids + gen + self.tokens.encode(closed[len(head) :])
        else:  # a template that does not render the history as a prefix: exactness is lost for this turn
            s.ids = self.tokens.encode(closed)
        s.text = closed
        counts = [len(self.tokens.encode(m["content"])) for m in turn.new_messages]
        s.messages = turn.history + [{**m, "tokens": n} for m, n in zip(turn.new_messages, counts, strict=True)]
        s.messages.append({**answer, "tokens": len(gen)})
        s.stats = (s.stats + [stats])[-16:]
        s.dropped_turns += turn.dropped
        s.turns += 1
        s.updated = time.time()
        while len(s.ids) > self.spec.max_tokens:  # the size cap: drop the oldest turns (the next turn re-renders)
            shorter = _drop_oldest_turn(s.messages[:-1])
            if shorter is None:
                break
            s.messages = shorter + s.messages[-1:]
            s.text = self.tokens.render(s.messages, generation_prompt=False)
            s.ids = self.tokens.encode(s.text)
            s.dropped_turns += 1
        await self.store.put(s)
        return s


def store_unavailable(exc: BaseException) -> APIError:
    return APIError(
        503,
        f"the session store is not available ({type(exc).__name__}); retry later",
        kind="server_error",
        code="session_store_unavailable",
        headers={"Retry-After": "1"},
    )


async def read_owned(store, sid: str, owner: str) -> Session | None:
    """The session ``sid`` of ``owner``: None when missing, 404 when another key's, 503 when the store fails."""
    try:
        s = await store.get(sid)
    except Exception as exc:  # noqa: BLE001 — counted by CountedStore
        raise store_unavailable(exc) from None
    if s is not None and s.owner != owner:
        raise APIError(
            404, f"session '{sid}' does not exist for this API key", param="session_id", code="session_not_found"
        )
    return s


def _drop_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """``messages`` without the oldest non-system turn (a user message and the replies to it)."""
    n_system = 0
    while n_system < len(messages) and messages[n_system]["role"] == "system":
        n_system += 1
    rest = messages[n_system:]
    if not rest:
        return None
    cut = 1
    while cut < len(rest) and rest[cut]["role"] != "user":
        cut += 1
    return messages[:n_system] + rest[cut:]


def session_id_of(body: dict) -> str | None:
    sid = body.get("session_id")
    if sid is None:
        return None
    if not isinstance(sid, str) or not SESSION_ID.match(sid):
        raise bad(
            "session_id", "must be 1-128 characters: letters, digits and . _ : - (not starting with one of those signs)"
        )
    return sid


# -- the engine stream of a session turn ------------------------------------------------------------------


class SessionStream:
    """A turn sent as token ids to the ``tensorrt_llm`` model; answers like :class:`TritonStream` (text pieces)
    and stores the turn when its final response comes."""

    def __init__(
        self,
        backend,
        manager: SessionManager,
        turn: Turn,
        req: GenRequest,
        *,
        store: bool = True,
        on_final=None,
        renew=None,
    ):
        from .tokens import IdsText, ids_request
        from .triton import TritonStream

        self.manager, self.turn, self.req, self.store = manager, turn, req, store
        self.on_final, self.renew = on_final, renew  # async (turn, stored) ; async () -> still holds the lease
        self._renewed = time.monotonic()
        self.text: list[str] = []
        self.ids = IdsText(manager.tokens, turn.prompt_ids)
        msg = ids_request(backend, req, turn.prompt_ids, manager.tokens, ("kv_cache_reused_blocks",))
        self.stream = TritonStream(backend, msg, self.ids)

    async def next(self):
        if self.renew is not None and time.monotonic() - self._renewed > TURN_LEASE_S / 3:
            self._renewed = time.monotonic()
            try:
                if not await self.renew():
                    self.store = False  # the lease lapsed and another turn has the session: this one is not stored
            except Exception as exc:  # noqa: BLE001 — counted by CountedStore; the answer still streams
                log.warning("front door: renewing a session's turn lease failed: %r", exc)
        piece = await self.stream.next()
        self.text.append(piece.text)
        if piece.final:
            generated = self.ids.generated
            stats = {
                "prompt_tokens": len(self.turn.prompt_ids),
                "reused_ids": self.turn.reused_ids,
                "completion_tokens": len(generated),
                "kv_reused_blocks": self.ids.reused_blocks,
                "dropped_turns": self.turn.dropped,
            }
            reply = "".join(self.text)
            stored = False
            if self.store and await self.manager.allowed(reply):
                try:
                    await self.manager.commit(self.turn, generated, reply, stats)
                    stored = True
                except Exception as exc:  # noqa: BLE001 — the answer still reaches the client
                    log.warning("front door: storing turn %d of a session failed: %r", self.turn.session.turns + 1, exc)
            if self.on_final is not None:  # before the client sees the end: its next turn finds the session free
                await self.on_final(self.turn, stored)
        return piece

    @property
    def finished(self) -> bool:
        return self.stream.finished

    def cancel(self) -> None:
        self.stream.cancel()

    def close(self) -> None:
        self.stream.close()


# -- what the front door holds, and the HTTP API ------------------------------------------------------------


def bearer(request) -> str:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


TURN_RESULTS = ("stored", "busy")
BUSY_WAIT_S = 0.2  # a turn that finds its session busy waits this long (a summary being written), then 409
SUMMARY_WAIT_S = 10.0
STORE_OPS = ("get", "put", "delete", "list", "acquire", "release", "purge", "count")


@dataclass
class Held:
    sid: str
    owner: str


class AfterSend:
    """An ASGI response that runs ``done`` once it has been sent, or the client has left."""

    def __init__(self, response, done):
        self.response, self.done = response, done
        self.status_code, self.headers = response.status_code, response.headers

    async def __call__(self, scope, receive, send):
        try:
            await self.response(scope, receive, send)
        finally:
            await asyncio.shield(self.done())


class SessionService:
    """The store (opened with the front door), the tokenizer and the ``tensorrt_llm`` stream (opened at the
    first session turn), and the admin key.  Over replicas a turn goes to the server the front door chose for
    it, with its whole stored history (a replica that did not serve the previous turn has none of its KV
    blocks, so it prefills the history again)."""

    def __init__(self, config, grpc_url: str, rules=None):
        from .tiers import read_secret

        self.config, self.spec, self.grpc_url, self.rules = config, config.sessions, grpc_url, rules
        self.admin_keys = read_secret(self.spec.admin_key) if self.spec.admin_key else []
        self.store = None
        self.manager: SessionManager | None = None
        self.tokens: ChatTokens | None = None  # the front door's, when its primary path already loaded them
        self.backends: dict = {}  # gRPC address → the tensorrt_llm backend on that server
        self.backend = None  # the latest turn's (a summary is written there)
        self._opening = asyncio.Lock()
        self._purger: asyncio.Task | None = None
        self._summaries: set[asyncio.Task] = set()
        self.unavailable = ""
        self._held: dict[str, Held] = {}  # request id → the session whose turn lease it holds
        self.internal_key: str | None = None  # the job runner's (toolkit/frontdoor/jobs.py)
        self.store_errors: Counter = Counter()  # by store operation
        self.turn_results: Counter = Counter()  # stored | busy
        self.stored_sessions: int | None = None  # counted by the purge loop

    async def start(self) -> None:
        if not self.spec.enabled:
            self.unavailable = "sessions are off (serving.sessions.enabled: false)"
            return
        path = (
            Path(self.spec.path)
            if self.spec.path
            else (default_sqlite_path(self.config.repository) if self.config.repository else None)
        )
        if not self.spec.url and path is None:
            self.unavailable = "no session store: set serving.sessions.path or serving.sessions.url"
            return
        if self.config.tokenizer_dir is None:  # no session can be made: say so to every caller (and rtk slo)
            self.unavailable = (
                "this deployment has no tokenizer in its repository, so the front door cannot keep token ids; "
                "send the whole conversation instead"
            )
            return
        self.store = CountedStore(make_store(self.spec, path), self.store_errors)
        self._purger = asyncio.create_task(self._purge())

    async def _purge(self) -> None:
        while True:
            try:
                await self.store.purge()
                self.stored_sessions = await self.store.count()
            except Exception as exc:  # noqa: BLE001 — the next round retries
                log.warning("front door: purging expired sessions failed: %r", exc)
            await asyncio.sleep(max(1.0, min(30.0, self.spec.ttl_s / 4)))

    async def stop(self) -> None:
        for t in [self._purger, *self._summaries]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*[t for t in [self._purger, *self._summaries] if t is not None], return_exceptions=True)
        for backend in self.backends.values():
            await backend.close()
        if self.store is not None:
            await self.store.close()

    async def _manager(self) -> SessionManager:
        """The tokenizer and chat template (loaded at the first session turn)."""
        async with self._opening:
            if self.manager is None:
                if self.store is None:
                    raise APIError(
                        400, f"'session_id': {self.unavailable}", param="session_id", code="sessions_unavailable"
                    )
                d = self.config.tokenizer_dir
                if d is None:
                    raise APIError(
                        400,
                        "'session_id': this deployment has no tokenizer in its repository, so the "
                        "front door cannot keep token ids; send the whole conversation instead",
                        param="session_id",
                        code="sessions_unavailable",
                    )
                tokens = self.tokens or await asyncio.to_thread(ChatTokens, d)
                self.manager = SessionManager(
                    self.spec,
                    self.store,
                    tokens,
                    window=self.config.max_input_len,
                    max_seq_len=self.config.max_seq_len,
                    rules=self.rules,
                )
            return self.manager

    async def _open_engine(self, grpc_url: str, server=None) -> tuple[SessionManager, object]:
        """The manager and the ``tensorrt_llm`` backend on ``grpc_url``: ``server`` itself when it is one (the
        front door's primary path already talks to ``tensorrt_llm``), else one opened for sessions."""
        from .triton import TritonBackend

        manager = await self._manager()
        grpc_url = grpc_url.removeprefix("grpc://")
        async with self._opening:
            backend = server if server is not None and server.model == LLM_MODEL else self.backends.get(grpc_url)
            if backend is None:
                backend = TritonBackend(grpc_url, LLM_MODEL)
                await backend.open()
                self.backends[grpc_url] = backend
        if not backend.ready and not await backend.check_health():
            raise APIError(
                503,
                f"sessions are served by the '{LLM_MODEL}' model, which is not available "
                f"({backend.ready_reason}); retry later",
                kind="server_error",
                code="unavailable",
                headers={"Retry-After": "1"},
            )
        self.backend = backend
        return manager, backend

    async def begin(self, req: GenRequest, request) -> Turn:
        """The turn's prompt ids (the stored conversation's, then the new messages'), made before admission so
        that the prediction counts what the engine will prefill."""
        manager = await self._manager()
        return await manager.begin(req, req.session_id, self.owner(request))

    async def stream(self, req: GenRequest, turn: Turn, server=None) -> SessionStream:
        """The stream of ``turn`` (from :meth:`begin`) on the tritonserver of ``server`` (the front door's
        backend for the replica it chose; default: the one this service was made for)."""
        manager, backend = await self._open_engine(server.grpc_url if server is not None else self.grpc_url, server)
        renew = (lambda: self._renew(req.id)) if req.id in self._held else None
        return SessionStream(backend, manager, turn, req, on_final=self._turn_ended(req.id), renew=renew)

    def forget_engine(self, grpc_url: str) -> list:
        """Hot reload: later turns go to the server at ``grpc_url``, with the rebuilt repository's tokenizer;
        returns the backends to close once the turns in flight on them have ended."""
        old = list(self.backends.values())
        self.grpc_url, self.backends, self.backend, self.manager, self.tokens = grpc_url, {}, None, None, None
        return old

    # -- one turn at a time -------------------------------------------------------------------------------------
    async def serve_turn(self, req: GenRequest, request, route):
        """The front door's answer to a session request (``await route()``), given while holding the session's
        turn lease; 409 ``session_busy`` while another request holds it."""
        if self.store is None:
            raise APIError(400, f"'session_id': {self.unavailable}", param="session_id", code="sessions_unavailable")
        sid, owner = req.session_id, self.owner(request)
        try:
            got = await self._acquire(sid, req.id, BUSY_WAIT_S)
        except Exception as exc:  # noqa: BLE001 — counted by CountedStore
            raise store_unavailable(exc) from None
        if not got:
            await read_owned(self.store, sid, owner)  # another key's session: 404, as if it did not exist
            self.turn_results["busy"] += 1
            raise APIError(
                409,
                f"session '{sid}' is answering another turn; send the next turn when the previous answer has ended",
                param="session_id",
                code="session_busy",
                headers={"Retry-After": "1"},
            )
        self._held[req.id] = Held(sid, owner)
        try:
            response = await route()
        except BaseException:
            await self._release(req.id)
            raise
        return AfterSend(response, lambda: self._release(req.id))

    def owner(self, request) -> str:
        """Whose session a request continues: its API key's; a job's run (the job runner's internal key) names
        the job's owner in :data:`OWNER_HEADER`."""
        import hmac

        key = bearer(request)
        if self.internal_key and key and hmac.compare_digest(key, self.internal_key):
            return request.headers.get(OWNER_HEADER, "")
        return owner_of(key or None)

    async def _acquire(self, sid: str, token: str, wait_s: float) -> bool:
        """The turn lease of ``sid``, waiting up to ``wait_s`` for its holder to release it."""
        deadline = time.monotonic() + wait_s
        while not await self.store.acquire(sid, token, TURN_LEASE_S):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def _renew(self, rid: str) -> bool:
        held = self._held.get(rid)
        return held is not None and await self.store.acquire(held.sid, rid, TURN_LEASE_S)

    async def _release(self, rid: str) -> None:
        held = self._held.pop(rid, None)
        if held is not None:
            try:
                await self.store.release(held.sid, rid)
            except Exception as exc:  # noqa: BLE001 — counted; the lease lapses by itself
                log.warning("front door: releasing a session's turn lease failed: %r", exc)

    def _turn_ended(self, rid: str):
        async def ended(turn: Turn, stored: bool) -> None:
            if stored:
                self.turn_results["stored"] += 1
                if self.spec.window_policy == "summarize":
                    self._after_turn(turn)
            await self._release(rid)

        return ended

    # -- a fallback deployment answers a session request ---------------------------------------------------------
    async def history_body(self, req: GenRequest, body: dict) -> dict:
        """The request for a fallback deployment: the stored conversation and the new messages, no session_id."""
        held = self._held.get(req.id)
        s = await read_owned(self.store, held.sid, held.owner) if held is not None else None
        history = [{"role": m["role"], "content": m["content"]} for m in (s.messages if s is not None else [])]
        out = {k: v for k, v in body.items() if k != "session_id"}
        out["messages"] = history + [{"role": m["role"], "content": m["content"]} for m in req.messages]
        return out

    def recorded(self, req: GenRequest, tier: str, pieces):
        """``pieces`` of a fallback's answer, stored as the session's turn once the stream has ended."""

        async def gen():
            text = []
            async for p in pieces:
                text.append(p)
                yield p
            await self._store_reply(req, tier, "".join(text))

        return gen()

    async def _store_reply(self, req: GenRequest, tier: str, reply: str) -> None:
        held = self._held.get(req.id)
        try:
            manager = await self._manager()
            if held is None or not reply or not await manager.allowed(reply):
                return
            turn = await manager.begin(req, held.sid, held.owner)
            generated = manager.tokens.encode(reply)  # not what that engine saw: the next turn's ids still match
            stats = {
                "prompt_tokens": len(turn.prompt_ids),
                "reused_ids": 0,
                "completion_tokens": len(generated),
                "kv_reused_blocks": None,
                "dropped_turns": turn.dropped,
                "tier": tier,
            }
            await manager.commit(turn, generated, reply, stats)
            self.turn_results["stored"] += 1
        except Exception as exc:  # noqa: BLE001 — the answer has reached the client
            log.warning("front door: storing a session turn answered by '%s' failed: %r", tier, exc)
        finally:
            await self._release(req.id)

    # -- /metrics ---------------------------------------------------------------------------------------------
    def metric_lines(self) -> list[str]:
        lines = [
            "# HELP rtk_frontdoor_session_turns_total session requests: turns stored, or refused because another "
            "turn of the session was running (409)",
            "# TYPE rtk_frontdoor_session_turns_total counter",
        ]
        lines += [f'rtk_frontdoor_session_turns_total{{result="{r}"}} {self.turn_results[r]}' for r in TURN_RESULTS]
        lines += [
            "# HELP rtk_frontdoor_session_store_errors_total failed calls to the session store, by operation",
            "# TYPE rtk_frontdoor_session_store_errors_total counter",
        ]
        ops = sorted(set(STORE_OPS) | set(self.store_errors))
        lines += [f'rtk_frontdoor_session_store_errors_total{{op="{op}"}} {self.store_errors[op]}' for op in ops]
        lines += [
            "# HELP rtk_frontdoor_sessions_active sessions with a turn running on this front door",
            "# TYPE rtk_frontdoor_sessions_active gauge",
            f"rtk_frontdoor_sessions_active {len(self._held)}",
        ]
        if self.stored_sessions is not None:
            lines += [
                "# HELP rtk_frontdoor_sessions_stored sessions in the store within their TTL (counted every 30 s "
                "at most)",
                "# TYPE rtk_frontdoor_sessions_stored gauge",
                f"rtk_frontdoor_sessions_stored {self.stored_sessions}",
            ]
        return lines

    # -- window_policy: summarize ------------------------------------------------------------------------------
    def _after_turn(self, turn: Turn) -> None:
        """Off the request's critical path: summarise the turns this one dropped into the session."""
        if turn.dropped_messages:
            task = asyncio.create_task(self._summarize(turn.session.id, turn.session.owner, turn.dropped_messages))
            self._summaries.add(task)
            task.add_done_callback(self._summaries.discard)

    async def _summarize(self, sid: str, owner: str, dropped: list[dict]) -> None:
        try:
            manager = self.manager
            s = await manager.load(sid, owner, create=False)
            if s is None:
                return
            transcript = "\n".join(f"{m['role']}: {m['content']}" for m in dropped)
            budget = min(manager.window, manager.max_seq_len - self.spec.summary_max_tokens) - 96
            ids = manager.tokens.encode(transcript)
            if len(ids) > budget:  # keep the newest part of what was dropped
                transcript = manager.tokens.tok.decode(ids[-max(budget, 16) :])
            earlier = f"Earlier summary: {s.summary}\n\n" if s.summary else ""
            messages = [
                {"role": "system", "content": SUMMARY_INSTRUCTION},
                {"role": "user", "content": f"{earlier}Conversation:\n{transcript}"},
            ]
            summary = (await self._generate(messages, self.spec.summary_max_tokens)).strip()
            if not summary or not await manager.allowed(summary):
                return
            token = "summary-" + uuid.uuid4().hex
            if not await self._acquire(sid, token, SUMMARY_WAIT_S):  # a running turn would overwrite it
                log.warning("front door: a session's summary was dropped: its turns kept it busy")
                return
            try:
                await self._put_summary(manager, sid, owner, summary)
            finally:
                await self.store.release(sid, token)
        except Exception as exc:  # noqa: BLE001 — a session without a summary still works (truncated)
            log.warning("front door: summarising a session failed: %r", exc)

    async def _put_summary(self, manager: SessionManager, sid: str, owner: str, summary: str) -> None:
        s = await manager.load(sid, owner, create=False)  # a turn may have been stored meanwhile
        if s is None:
            return
        s.summary = summary
        rest = [m for m in s.messages if not m.get("summary")]
        n_system = 0
        while n_system < len(rest) and rest[n_system]["role"] == "system":
            n_system += 1
        note = {
            "role": "system",
            "content": f"{SUMMARY_PREFIX}{summary}",
            "tokens": len(manager.tokens.encode(summary)),
            "summary": True,
        }
        s.messages = rest[:n_system] + [note] + rest[n_system:]
        await manager.store.put(s)  # the next turn re-renders (its stored text is no longer a prefix)

    async def _generate(self, messages: list[dict], max_tokens: int) -> str:
        manager = self.manager
        text = manager.tokens.render(messages, generation_prompt=True)
        req = GenRequest(kind="chat", model="summary", messages=messages, max_tokens=max_tokens)
        turn = Turn(Session(id="-"), messages, manager.tokens.encode(text), text, [], 0)
        stream = SessionStream(self.backend, manager, turn, req, store=False)
        out = []
        while True:
            piece = await stream.next()
            out.append(piece.text)
            if piece.final:
                return "".join(out)

    # -- HTTP ---------------------------------------------------------------------------------------------
    def _is_admin(self, request) -> bool:
        import hmac

        key = bearer(request)
        return bool(key) and any(hmac.compare_digest(key, k) for k in self.admin_keys)

    def _caller(self, fd, request) -> tuple[str, bool]:
        """(owner, is_admin); an admin key passes where API keys are required."""
        if self._is_admin(request):
            return owner_of(bearer(request)), True
        fd._check_key(request)
        if self.store is None:
            raise APIError(404, self.unavailable, code="sessions_unavailable")
        return owner_of(bearer(request) or None), False

    def routes(self, fd) -> list:
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        def guarded(handler):
            async def endpoint(request):
                try:
                    owner, admin = self._caller(fd, request)
                    if self.store is None:
                        raise APIError(404, self.unavailable, code="sessions_unavailable")
                    return await handler(request, owner, admin)
                except APIError as exc:
                    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

            return endpoint

        async def listing(request, owner, admin):
            everyone = request.query_params.get("all") in ("1", "true")
            if everyone and not admin:
                raise APIError(
                    403,
                    "listing every session needs the admin key (serving.sessions.admin_key)",
                    param="all",
                    code="admin_key_required",
                )
            found = await self.store.list(None if everyone else owner)
            return JSONResponse({"object": "list", "data": [s.public(with_messages=False) for s in found]})

        async def one(request, owner, admin):
            sid = request.path_params["session_id"]
            s = await self.store.get(sid)
            if s is None or (s.owner != owner and not admin):
                raise APIError(
                    404,
                    f"session '{sid}' does not exist for this API key",
                    param="session_id",
                    code="session_not_found",
                )
            if request.method == "DELETE":
                await self.store.delete(sid)
                return JSONResponse({"id": sid, "object": "session.deleted", "deleted": True})
            return JSONResponse(s.public())

        return [
            Route("/v1/sessions", guarded(listing), methods=["GET"]),
            Route("/v1/sessions/{session_id}", guarded(one), methods=["GET", "DELETE"]),
        ]


# -- the operator's view (``rtk sessions``): the store itself, so every session, like the admin key ---------


def store_for_spec(spec):
    """The session store a spec's front door uses."""
    from ..errors import UsageError

    sp = spec.serving.sessions
    path = Path(sp.path) if sp.path else default_sqlite_path(spec.repository_dir())
    if not sp.url and not path.is_file():
        raise UsageError(
            f"no sessions yet for '{spec.name}' ({path} does not exist); they are made by requests "
            "with a session_id to its front door"
        )
    return make_store(sp, path)


async def list_sessions(spec) -> list[Session]:
    store = store_for_spec(spec)
    try:
        return await store.list(None)
    finally:
        await store.close()


async def read_session(spec, sid: str) -> Session | None:
    store = store_for_spec(spec)
    try:
        return await store.get(sid)
    finally:
        await store.close()


async def delete_session(spec, sid: str) -> bool:
    store = store_for_spec(spec)
    try:
        return await store.delete(sid)
    finally:
        await store.close()
