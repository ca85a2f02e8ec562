"""The OpenAI-compatible front door: a Starlette app in front of Triton.

``create_app(source, triton_grpc_url, metrics_url=...)`` builds it; :mod:`toolkit.frontdoor.runner`
serves it with uvicorn.  Per request, before the first byte:

1. validate (400 naming the field), check the API key (401);
2. a deterministic request found in the response cache is answered from it;
3. Triton unhealthy → the fallback chain, else 503 + Retry-After;
4. predicted TTFT (toolkit/frontdoor/admission.py) over the deadline → the fallback chain, else 429
   + Retry-After; all of this is in memory, so a refusal takes well under 50 ms.  Over replicas
   (toolkit/frontdoor/replicas.py) the request goes to the ready one with the lowest prediction;
5. admitted: the request goes to Triton; if the first token has not come by the deadline and a
   fallback tier exists, the Triton request is cancelled and the chain answers instead.  Triton's
   own overload refusal ("Exceeds maximum queue size") is treated like a failed prediction.

Every answer names its tier in the ``x-rtk-tier`` header and the ``rtk_tier`` field of its final
chunk (or body).  Every response to a generation request, refusals and errors included, carries
``Server-Timing: frontdoor;dur=<ms>``: from the handler's start to the response's head (a stream's
head goes with its first token; a refusal's is the refusal), the front door's own share of the
latency a client measures (W3C Server Timing).  A client that disconnects cancels its Triton request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..slo.outcome import PRIMARY_TIER as PRIMARY
from ..slo.outcome import TIER_FIELD, TIER_HEADER, TIMING_HEADER, TIMING_METRIC
from .admission import Estimator, PrefixCache
from .config import FrontDoorConfig, config_from
from .filter import Rules, TritonClassifier, check_request, filtered
from .jobs import JobService
from .protocol import (
    APIError,
    ContentFramer,
    GenRequest,
    bad,
    chunk,
    full_response,
    logprob_items,
    logprobs_field,
    parse_request,
    sse,
    usage,
    usage_chunk,
)
from .replicas import Replica, Router, replica_urls
from .sessions import AfterSend, SessionService
from .tiers import Answer, DeploymentTier, RuleTier, make_cache, read_secret
from .triton import TritonBackend, TritonRefused, TritonStream, classify_refusal

log = logging.getLogger("rtk.frontdoor")
DEADLINE_HEADER = "x-rtk-ttft-deadline-ms"
PREDICTED_HEADER = "x-rtk-predicted-ttft-ms"  # on the primary tier's answers: the admission's prediction
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_json_body(request: Request, max_bytes: int):
    """The request's JSON body, refused with 413 above ``max_bytes`` and 400 when it is not JSON."""
    raw = await request.body()
    if len(raw) > max_bytes:
        raise APIError(
            413,
            f"the request body is {len(raw)} bytes; the limit is {max_bytes} (serving.frontend.max_request_bytes)",
            code="request_too_large",
        )
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


class FrontDoor:
    """The front door over one tritonserver, or over several replicas of one repository: ``triton_grpc_url``
    and ``metrics_url`` are then lists, one entry per replica (toolkit/frontdoor/replicas.py)."""

    def __init__(
        self,
        config: FrontDoorConfig,
        triton_grpc_url: str | Sequence[str],
        metrics_url: str | Sequence[str | None] | None = None,
    ):
        self.config = config
        urls = replica_urls(triton_grpc_url, metrics_url)
        self.replicas = [
            Replica(
                str(i),
                TritonBackend(grpc, config.primary_model, metrics),
                Estimator(
                    max_batch=config.max_batch_size,
                    step_tokens=config.step_tokens,
                    prefix=PrefixCache(*config.prefix_cache) if config.prefix_cache else None,
                    quantile=config.guard.prediction_quantile,
                ),
            )
            for i, (grpc, metrics) in enumerate(urls)
        ]
        self.router = Router(self.replicas)
        self.keys = read_secret(config.frontend.api_keys)
        self.counters: Counter = Counter()
        self.cache = None
        self.tiers: list = []
        self.tokenizer = None
        self.prompts = None  # tokens.PromptRules: the primary path tokenises for the tensorrt_llm model
        self.chat_tokenizer = None  # transformers' tokenizer for the chat template (llmapi), loaded when needed
        self._tasks: list[asyncio.Task] = []
        clf = config.filter.classifier
        self.filter = Rules.from_spec(config.filter, TritonClassifier(self.some_backend, clf.model) if clf else None)
        self.sessions = SessionService(config, urls[0][0], self.filter)
        self.jobs = JobService(config)

    @property
    def backend(self) -> TritonBackend:
        """The first replica's backend (the only one without replicas)."""
        return self.replicas[0].backend

    @property
    def estimator(self) -> Estimator:
        """The first replica's estimator (the only one without replicas)."""
        return self.replicas[0].estimator

    def some_backend(self) -> TritonBackend:
        """A ready replica's backend (the first), else the first replica's: for what any replica can answer
        (the filter's classifier, the model's interface)."""
        for r in self.replicas:
            if r.backend.ready:
                return r.backend
        return self.replicas[0].backend

    @property
    def interface(self) -> str:
        """The served model's interface (``ensemble``, ``llmapi`` or ``tensorrt_llm``), as the first replica that
        answered says."""
        for r in self.replicas:
            if r.backend.inputs:
                return r.backend.interface
        return self.replicas[0].backend.interface

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        import httpx

        self.http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None))
        if self.config.primary_ids:
            self._use_prompts(await asyncio.to_thread(self._prompt_rules))
        else:
            self._load_tokenizer()
        for t in self.config.guard.fallbacks:
            if t.kind == "cache":
                self.cache = make_cache(self.config.cache)
            elif t.kind == "rule":
                self.tiers.append(RuleTier(t.label, t.template))
            else:
                url = t.url or (lambda spec=t.spec: _frontdoor_of_spec(spec))
                key = (read_secret(t.api_key) or [None])[0]
                self.tiers.append(DeploymentTier(t.label, url, t.model, key, self.http))
        await self.sessions.start()
        await asyncio.gather(*(r.backend.open() for r in self.replicas))
        if self.interface == "llmapi" and self.config.tokenizer_dir is not None:
            await asyncio.to_thread(self._load_chat_tokenizer)  # the chat template, off the event loop
        await asyncio.gather(*(r.backend.read_gauges(self.http) for r in self.replicas))
        # One poller per replica: a replica that hangs does not hold up the others' health and gauges.
        self._tasks += [asyncio.create_task(self._poll(r)) for r in self.replicas]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for r in self.replicas:
            await r.backend.close()
        await self.sessions.stop()
        if self.cache is not None:
            await self.cache.close()
        await self.http.aclose()

    async def _poll(self, replica: Replica) -> None:
        """The replica's health (every 0.5 s, and every period while it is not ready) and engine gauges (every
        period; without a metrics URL there are none, and the poller wakes only for the health checks)."""
        period = self.config.guard.metrics_poll_ms / 1e3
        last_health = 0.0
        while True:
            backend = replica.backend  # a hot reload may have replaced it
            await asyncio.sleep(period if backend.metrics_url or not backend.ready else max(period, 0.5))
            backend = replica.backend
            try:
                if time.monotonic() - last_health > 0.5 or not backend.ready:
                    await backend.check_health()
                    last_health = time.monotonic()
                await backend.read_gauges(self.http)
            except Exception as exc:  # noqa: BLE001 — keep polling; the state stays as last read
                log.warning("front door: polling Triton failed: %r", exc)

    def _load_tokenizer(self) -> None:
        d = self.config.tokenizer_dir
        if d is None or not (d / "tokenizer.json").is_file():
            return
        try:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 — counting falls back to an estimate from the bytes
            log.warning("front door: cannot load the tokenizer from %s: %r", d, exc)

    def _prompt_rules(self):
        """The tokenizer, chat template and context window of the primary path to ``tensorrt_llm`` (slow: run
        it off the event loop)."""
        from .tokens import ChatTokens, PromptRules

        c = self.config
        return PromptRules(
            ChatTokens(c.tokenizer_dir),
            max_input_len=c.max_input_len,
            max_seq_len=c.max_seq_len,
            context_policy=c.context_policy,
        )

    def _use_prompts(self, prompts) -> None:
        """Every replica's primary path, and the sessions, tokenise with ``prompts``; the estimate of other
        prompts' lengths counts with the same tokenizer (its fast backend), not a second copy."""
        self.prompts = prompts
        self.tokenizer = prompts.tokens.tok.backend_tokenizer
        self.sessions.tokens = prompts.tokens
        for r in self.replicas:
            r.backend.prompts = prompts

    async def swap_backend(self, grpc_url: str, metrics_url: str | None) -> tuple[list[TritonBackend], set[str]]:
        """Hot model update (``rtk serve --reload``, toolkit/frontdoor/runner.py): new requests go to the
        tritonserver at ``grpc_url`` once it answers ready, with the model limits of the rebuilt repository.
        Returns the previous backends (to close once drained) and the ids of the requests in flight on them.
        Refused over replicas (``rtk serve --reload`` refuses them before anything starts)."""
        if len(self.replicas) > 1:
            raise RuntimeError(
                f"this front door serves {len(self.replicas)} replicas; a hot reload swaps one server behind it"
            )
        replica = self.replicas[0]
        backend = TritonBackend(grpc_url, self.config.primary_model, metrics_url)
        await backend.open()
        if not backend.ready:
            await backend.close()
            raise RuntimeError(f"the new tritonserver at {grpc_url} is not ready: {backend.ready_reason}")
        await backend.read_gauges(self.http)
        if self.config.repository is not None:
            fresh = await asyncio.to_thread(config_from, self.config.repository)
            for name in ("max_batch_size", "max_seq_len", "max_input_len", "default_max_tokens", "tokenizer_dir"):
                setattr(self.config, name, getattr(fresh, name))
            replica.estimator.max_batch = fresh.max_batch_size
            if not self.config.primary_ids:
                await asyncio.to_thread(self._load_tokenizer)
        prompts = await asyncio.to_thread(self._prompt_rules) if self.config.primary_ids else None
        # No await from here on: a request sees either the old backend or the new one, never half of each
        # (the filter's classifier asks some_backend(), so it follows).
        old = [replica.backend, *self.sessions.forget_engine(grpc_url)]
        replica.backend = backend
        if prompts is not None:
            self._use_prompts(prompts)
        return old, set(replica.estimator.inflight)

    def prompt_tokens(self, req: GenRequest) -> int:
        """Prompt length for the prediction when the front door does not tokenise the prompt itself (the
        ensemble and llmapi paths): the chat template's few tokens per message are estimated,
        unless the front door rendered it."""
        if req.rendered is not None and self.tokenizer is not None:
            return len(self.tokenizer.encode(req.rendered, add_special_tokens=False).ids)
        texts = [req.prompt] if req.kind == "completion" else [m["content"] for m in req.messages]
        if self.tokenizer is not None:  # one by one: encode_batch wakes the tokenizer's thread pool, ~2x the CPU
            n = sum(len(self.tokenizer.encode(t, add_special_tokens=False).ids) for t in texts)
        else:
            n = sum(len(t.encode()) for t in texts) // 4 + 1
        return n + (0 if req.kind == "completion" else 5 * len(texts) + 3)

    # -- endpoints --------------------------------------------------------------------------------
    def _check_key(self, request: Request) -> None:
        if not self.keys:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not given or not any(hmac.compare_digest(given, k) for k in self.keys):
            raise APIError(
                401, "missing or wrong API key; send 'Authorization: Bearer <key>'", param=None, code="invalid_api_key"
            )

    async def models(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except APIError as exc:
            return self._error(exc)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "rtk"}],
            }
        )

    async def health(self, request: Request) -> Response:
        if len(self.replicas) == 1:
            ready = self.backend.ready
            body = {"live": True, "ready": ready, "reason": self.backend.ready_reason}
            return JSONResponse(body, status_code=200 if ready else 503)
        n_ready = self.router.ready_count()
        body = {
            "live": True,
            "ready": n_ready > 0,
            "reason": self._unready_reason() if n_ready == 0 else f"{n_ready} of {len(self.replicas)} replicas ready",
            "replicas_ready": n_ready,
            "replicas": [
                {"replica": r.label, "ready": r.backend.ready, "reason": r.backend.ready_reason} for r in self.replicas
            ],
        }
        return JSONResponse(body, status_code=200 if n_ready else 503)

    def _unready_reason(self) -> str:
        """Why no request can go to Triton now."""
        if len(self.replicas) == 1:
            return self.backend.ready_reason
        why = "; ".join(f"replica {r.label}: {r.backend.ready_reason}" for r in self.replicas)
        return f"no replica is ready ({why})"

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(self.render_metrics(), media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completion")

    def _error(self, exc: APIError) -> JSONResponse:
        reason = ERROR_REASONS.get(exc.status, "error")
        self.counters[("rtk_frontdoor_errors_total", (("status", str(exc.status)), ("reason", reason)))] += 1
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    # -- the decision ---------------------------------------------------------------------------------
    async def generate(self, request: Request, kind: str) -> Response:
        arrival = time.perf_counter()
        try:
            self._check_key(request)
            body = await read_json_body(request, self.config.frontend.max_request_bytes)
            req = parse_request(
                kind,
                body,
                served_model=self.config.model_name,
                max_seq_len=self.config.max_seq_len,
                default_max_tokens=self.config.default_max_tokens,
            )
            await self._check_input(req)
            self._prepare_for_model(req)
            deadline_ms = self._deadline(request, req)
            if req.session_id:  # one turn of a session at a time (toolkit/frontdoor/sessions.py)
                resp = await self.sessions.serve_turn(
                    req, request, lambda: self._route(request, req, body, deadline_ms, arrival)
                )
            else:
                resp = await self._route(request, req, body, deadline_ms, arrival)
        except APIError as exc:
            resp = self._error(exc)
        _stamp(resp, arrival)
        return resp

    def _prepare_for_model(self, req: GenRequest) -> None:
        """What depends on the served model: log-probs (not with an output filter, whose hold-back would not
        line up with them) and, for a model that takes a plain prompt (llmapi), the chat template."""
        if req.logprobs and self._output_filter() is not None:
            raise bad("logprobs", "is not served while the content filter checks the output (serving.filter.output)")
        if req.kind == "chat" and req.session_id is None and self.interface == "llmapi":
            req.rendered = self.render_chat(req.messages)

    def _load_chat_tokenizer(self) -> None:
        d = self.config.tokenizer_dir
        try:
            from transformers import AutoTokenizer

            self.chat_tokenizer = AutoTokenizer.from_pretrained(str(d), trust_remote_code=False, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 — chat requests are refused (400), the server keeps serving
            log.warning("front door: cannot load the chat template from %s: %r", d, exc)
            self.chat_tokenizer = False

    def render_chat(self, messages: list[dict]) -> str:
        """The chat as the model's chat template renders it, with the generation prompt (the repository's
        tokenizer, loaded once, never running code shipped with the model)."""
        if self.chat_tokenizer is None:
            self._load_chat_tokenizer()
        if not self.chat_tokenizer or not getattr(self.chat_tokenizer, "chat_template", None):
            raise bad("messages", "this deployment has no chat template; send a plain prompt to /v1/completions")
        from .tokens import render_chat

        return render_chat(self.chat_tokenizer, messages)

    async def _check_input(self, req: GenRequest) -> None:
        try:
            await check_request(self.filter, req)
        except APIError as exc:
            rule = exc.headers["x-rtk-filter"]
            self.counters[("rtk_frontdoor_filtered_total", (("where", "input"), ("rule", rule)))] += 1
            raise

    def _output_filter(self):
        return self.filter.stream() if self.filter is not None and self.filter.check_output else None

    def _filtered(self, pieces, flt):
        """``pieces`` through the output filter; a hit is counted and named by ``flt.hit``."""

        async def gen():
            async for p in filtered(pieces, flt):
                yield p
            if flt is not None and flt.hit:
                self.counters[("rtk_frontdoor_filtered_total", (("where", "output"), ("rule", flt.hit)))] += 1

        return gen()

    def _deadline(self, request: Request, req: GenRequest) -> float | None:
        h = request.headers.get(DEADLINE_HEADER)
        if h is not None:
            try:
                v = float(h)
            except ValueError:
                v = math.nan
            if not math.isfinite(v) or v <= 0:
                raise APIError(
                    400,
                    f"header '{DEADLINE_HEADER}': {h!r} is not a positive number of milliseconds",
                    param=DEADLINE_HEADER,
                    code="invalid_value",
                )
            return v
        return req.ttft_deadline_ms if req.ttft_deadline_ms is not None else self.config.guard.ttft_deadline_ms

    async def _route(
        self, request: Request, req: GenRequest, body: dict, deadline_ms: float | None, arrival: float
    ) -> Response:
        def left_s() -> float | None:
            return None if deadline_ms is None else deadline_ms / 1e3 - (time.perf_counter() - arrival)

        if self.cache is not None and req.deterministic:
            hit = await self.cache.get(req.cache_key())
            if hit is not None:
                return self._answer(req, "cache", hit)
        router = self.router
        if not router.any_ready():
            return await self._unhealthy(req, body, left_s)
        # The primary path to tensorrt_llm tokenises here, once: the prediction counts the very ids that are sent.
        # A session turn's ids are the stored conversation's and the new messages'; the engine finds the stored
        # ones in its prefix cache, so the prediction counts the rest (what it prefills).  Other prompts sent as
        # ids count out the leading blocks the engine's cache holds by the front door's mirror of it.
        ids = turn = None
        if req.session_id:
            turn = await self.sessions.begin(req, request)
            n_prompt = len(turn.prompt_ids) - turn.reused_ids
            counted = (
                f"{n_prompt} prompt tokens to prefill ({len(turn.prompt_ids)} in all, {turn.reused_ids} kept from "
                "the session)"
            )
        else:
            ids = self.prompts.prompt_ids(req) if self.prompts is not None else None
            n_prompt = len(ids) if ids is not None else self.prompt_tokens(req)
            counted = f"{n_prompt} prompt tokens"
        deadline_s = None if deadline_ms is None else deadline_ms / 1e3
        # More than one pass only over replicas: a replica that cannot be reached before the first token is
        # marked not ready and the request goes to the next best one.
        for _ in self.replicas:
            picked = router.pick(n_prompt, deadline_s, ids)
            if picked is None:  # every ready replica failed under this request
                break
            replica, p = picked
            if p.cached_tokens:
                counted = (
                    f"{p.prompt_tokens} prompt tokens to prefill ({n_prompt} in all, {p.cached_tokens} in the "
                    "engine's prefix cache)"
                )
            if deadline_ms is not None and p.bound_s * 1e3 > deadline_ms:
                retry = math.ceil(p.bound_s - deadline_ms / 1e3)
                where = "" if router.single is not None else f" on the best of {router.ready_count()} ready replicas"
                margin = (
                    f" ({p.bound_s * 1e3:.0f} ms with the recent predictions' error)" if p.bound_s > p.ttft_s else ""
                )
                return await self._fallback(
                    req,
                    body,
                    left_s,
                    "predicted_late",
                    status=429,
                    retry_s=retry,
                    message=f"the predicted time to first token is {p.ttft_s * 1e3:.0f} ms{margin}{where} for "
                    f"{counted} ({p.requests_ahead} requests, {p.tokens_ahead} prompt tokens ahead), over the "
                    f"{deadline_ms:.0f} ms deadline; "
                    "retry later",
                )
            # Admitted.
            # An input the model lacks is a 400 here, before anything is sent.
            backend, est = replica.backend, replica.estimator
            if turn is not None:
                stream = await self.sessions.stream(req, turn, backend)
            else:
                stream = backend.stream(req, ids)
            est.admit(req.id, req.max_tokens, p, ids if turn is None else turn.prompt_ids)
            replica.routed += 1
            try:
                first = await self._first(stream, left_s() if self.tiers or self.cache else None)
            except TimeoutError:
                stream.cancel()
                est.finish(req.id)  # it was in the engine: the gauge may count it a little longer
                self.counters[("rtk_frontdoor_deadline_misses_total", ())] += 1
                return await self._fallback(
                    req,
                    body,
                    left_s,
                    "late",
                    status=429,
                    retry_s=self.config.guard.retry_after_s,
                    message="the first token did not come before the deadline; retry later",
                )
            except TritonRefused as exc:
                est.inflight.pop(req.id, None)
                if exc.unreachable and router.single is None:
                    backend.mark_unreachable(str(exc))
                    replica.unreachable += 1
                    log.warning("front door: replica %s (%s) is unreachable: %s", replica.label, backend.grpc_url, exc)
                    continue
                if exc.overload:
                    return await self._fallback(
                        req,
                        body,
                        left_s,
                        "engine_queue_full",
                        status=429,
                        retry_s=self.config.guard.retry_after_s,
                        message=f"the engine's queue is full ({exc}); retry later",
                    )
                raise classify_refusal(exc, req) from None
            except BaseException:
                stream.cancel()
                est.finish(req.id)
                raise
            return self._primary(req, stream, first, n_prompt, est, p.ttft_s)
        return await self._unhealthy(req, body, left_s)

    async def _unhealthy(self, req: GenRequest, body: dict, left_s) -> Response:
        """No replica can take the request: the chain, else 503."""
        return await self._fallback(
            req,
            body,
            left_s,
            "unhealthy",
            status=503,
            message=f"the model is not available ({self._unready_reason()}); retry later",
            retry_s=self.config.guard.retry_after_s,
        )

    async def _first(self, stream: TritonStream, timeout_s: float | None):
        """The first response that carries text (or the final one)."""

        async def first():
            while True:
                piece = await stream.next()
                if piece.text or piece.final:
                    return piece

        if timeout_s is None:
            return await first()
        return await asyncio.wait_for(first(), timeout=max(0.0, timeout_s))

    async def _fallback(
        self, req: GenRequest, body: dict, left_s, reason: str, *, status: int, message: str, retry_s: int
    ) -> Response:
        """Try the tiers in order; refuse when none answers."""
        if req.session_id and any(not isinstance(t, RuleTier) for t in self.tiers):
            body = await self.sessions.history_body(req, body)  # another deployment gets the conversation
        for tier in self.tiers:
            if isinstance(tier, RuleTier):
                return self._answer(req, tier.label, tier.answer(req, self.config.guard.ttft_deadline_ms))
            remaining = left_s()
            opened = await tier.open(req, body, remaining if remaining is not None else 30.0)
            if opened is not None:
                label, pieces, meta = opened
                if req.session_id:
                    pieces = self.sessions.recorded(req, label, pieces)  # its answer is the session's turn
                return self._relay(req, label, pieces, meta)
        self.counters[("rtk_frontdoor_refusals_total", (("status", str(status)), ("reason", reason)))] += 1
        retry = str(max(self.config.guard.retry_after_s, int(retry_s)))
        code = "overloaded" if status == 429 else "unavailable"
        raise APIError(
            status,
            message,
            kind="server_error" if status == 503 else "rate_limit_error",
            code=code,
            headers={"Retry-After": retry, TIER_HEADER: "refused"},
        )

    # -- answers ---------------------------------------------------------------------------------------
    def _count(self, req: GenRequest, tier: str) -> None:
        self.counters[("rtk_frontdoor_requests_total", (("endpoint", req.kind), ("tier", tier)))] += 1

    def _answer(self, req: GenRequest, tier: str, a: Answer) -> Response:
        self._count(req, tier)
        u = usage(a.prompt_tokens, a.completion_tokens)
        headers = {TIER_HEADER: tier}
        if not req.stream:
            return JSONResponse(full_response(req, a.text, a.finish_reason, u, {TIER_FIELD: tier}), headers=headers)

        async def gen():
            yield sse(chunk(req, a.text, first=True))
            yield _ending(req, chunk(req, None, a.finish_reason, extra={TIER_FIELD: tier}), u)

        return _SSE(gen(), headers)

    def _relay(self, req: GenRequest, tier: str, pieces: AsyncIterator[str], meta: dict) -> Response:
        """Another deployment's stream, re-framed as ours."""
        self._count(req, tier)
        headers = {TIER_HEADER: tier}

        def final_usage():
            return usage(int(meta.get("prompt_tokens", 0)), int(meta.get("completion_tokens", 0)))

        flt = self._output_filter()
        pieces = self._filtered(pieces, flt)

        def reason():
            return "content_filter" if flt is not None and flt.hit else meta.get("finish_reason", "stop")

        if not req.stream:

            async def collect():
                text = "".join([p async for p in pieces])
                return JSONResponse(
                    full_response(req, text, reason(), final_usage(), {TIER_FIELD: tier}),
                    headers=headers,
                )

            return _Deferred(collect)

        async def gen():
            first = True
            async for p in pieces:
                yield sse(chunk(req, p, first=first))
                first = False
            yield _ending(req, chunk(req, None, reason(), first=first, extra={TIER_FIELD: tier}), final_usage())

        return _SSE(gen(), headers)

    def _primary(
        self, req: GenRequest, stream: TritonStream, first, n_prompt: int, est: Estimator, predicted_s: float
    ) -> Response:
        self._count(req, PRIMARY)
        est.first_token(req.id)
        state = {"text": [first.text], "piece": first, "done": first.final, "responses": int(bool(first.text))}
        headers = {TIER_HEADER: PRIMARY, PREDICTED_HEADER: f"{predicted_s * 1e3:.1f}"}
        flt = self._output_filter()

        async def raw() -> AsyncIterator[tuple[str, list[float]]]:
            """The stream's texts straight from Triton, each with its tokens' log-probs (when asked for); a
            response without text (a character still incomplete) passes its log-probs on to the next."""
            piece, carry = first, []
            while True:
                if piece.logprobs:
                    carry += piece.logprobs
                if piece.text or piece is first:
                    yield piece.text, carry
                    carry = []
                if state["done"]:
                    if carry:
                        yield "", carry
                    return
                piece = await stream.next()
                est.token(req.id)
                state["piece"], state["done"] = piece, piece.final
                if piece.text:
                    state["responses"] += 1
                    state["text"].append(piece.text)

        def texts() -> AsyncIterator[tuple[str, list[float]]]:
            # The hot path: without an output filter, the pieces straight from Triton (no generator between);
            # with one, through it (log-probs are refused with an output filter: what it holds back would not
            # line up).
            if flt is None:
                return raw()

            async def plain():
                async for text, _ in raw():
                    yield text

            async def checked():
                async for text in self._filtered(plain(), flt):
                    yield text, []

            return checked()

        async def finish(cancelled: bool) -> tuple[str, dict]:
            piece = state["piece"]
            if not state["done"]:
                stream.cancel()
                self.counters[("rtk_frontdoor_cancelled_total", ())] += int(cancelled)
            n_out = piece.completion_tokens if piece.completion_tokens is not None else state["responses"]
            reason = "length" if n_out >= req.max_tokens else "stop"
            if piece.finish_reason in ("stop", "length"):
                reason = piece.finish_reason  # the model's own word (llmapi)
            # An answer that ran to its end is a sample of how long answers run (admission's slot wait).
            ran_out = state["done"] and not cancelled
            est.finish(req.id, n_out if ran_out else None, stopped=reason == "stop")
            u = usage(piece.prompt_tokens if piece.prompt_tokens is not None else n_prompt, n_out)
            if flt is not None and flt.hit:
                state["done"], reason = True, "content_filter"  # the Triton request was cancelled above
            elif state["done"] and self.cache is not None and req.deterministic:
                await self.cache.put(req.cache_key(), Answer("".join(state["text"]), reason, u["prompt_tokens"], n_out))
            return reason, u

        if not req.stream:

            async def collect():
                parts, items = [], []
                try:
                    async for text, lps in texts():
                        parts.append(text)
                        items += logprob_items(text, lps)
                    reason, u = await finish(False)
                except TritonRefused as exc:
                    await finish(False)
                    raise APIError(
                        502, f"the model failed while answering: {exc}", kind="server_error", code="upstream_error"
                    ) from None
                except BaseException:
                    await finish(True)
                    raise
                lp = logprobs_field(req, items) if req.logprobs else None
                body = full_response(req, "".join(parts), reason, u, {TIER_FIELD: PRIMARY}, logprobs=lp)
                return JSONResponse(body, headers=headers)

            return _Deferred(collect)

        async def gen():
            try:
                first_chunk = True
                frame = None
                offset = 0
                try:
                    async for text, lps in texts():
                        if req.logprobs:
                            lp = logprobs_field(req, logprob_items(text, lps), offset)
                            offset += len(text)
                            yield sse(chunk(req, text, first=first_chunk, logprobs=lp))
                            first_chunk = False
                        elif first_chunk:
                            yield sse(chunk(req, text, first=True))
                            first_chunk, frame = False, ContentFramer(req)
                        else:
                            yield frame(text)
                except TritonRefused as exc:  # after the first byte there is no status left to change
                    yield sse(
                        {
                            "error": {
                                "message": f"the model failed while answering: {exc}",
                                "type": "server_error",
                                "param": None,
                                "code": "upstream_error",
                            }
                        }
                    )
                    return
                reason, u = await finish(False)
                yield _ending(req, chunk(req, None, reason, first=first_chunk, extra={TIER_FIELD: PRIMARY}), u)
            finally:
                if not state["done"] or req.id in est.inflight:
                    await finish(True)

        return _SSE(gen(), headers)

    # -- /metrics ----------------------------------------------------------------------------------------
    def render_metrics(self) -> str:
        lines = []
        helps = {
            "rtk_frontdoor_requests_total": "answered requests by endpoint and the tier that answered",
            "rtk_frontdoor_refusals_total": "requests refused at admission (429 overload, 503 unhealthy) by reason",
            "rtk_frontdoor_errors_total": "error responses by status",
            "rtk_frontdoor_deadline_misses_total": "admitted requests whose first token missed the deadline",
            "rtk_frontdoor_cancelled_total": "primary requests cancelled because the client went away",
            "rtk_frontdoor_filtered_total": "inputs refused and outputs stopped by the content filter, by rule",
        }
        for name, text in helps.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} counter"]
            rows = [(labels, v) for (n, labels), v in sorted(self.counters.items()) if n == name]
            if not rows and not any(True for (n, labels) in self.counters if n == name):
                rows = [((), 0)] if name.endswith(("misses_total", "cancelled_total")) else []
            for labels, v in rows:
                lab = ",".join(f'{k}="{val}"' for k, val in labels)
                lines.append(f"{name}{{{lab}}} {v}" if lab else f"{name} {v}")
        replicas = self.replicas
        n = len(replicas)
        gauges = {
            "rtk_frontdoor_inflight": ("primary requests in flight", sum(len(r.estimator.inflight) for r in replicas)),
            "rtk_frontdoor_step_seconds": (
                "measured engine step time" + ("" if n == 1 else " (mean over the replicas)"),
                sum(r.estimator.step_s for r in replicas) / n,
            ),
            "rtk_frontdoor_prefill_seconds_per_token": (
                "measured prefill time per prompt token" + ("" if n == 1 else " (mean over the replicas)"),
                sum(r.estimator.prefill_s_per_token for r in replicas) / n,
            ),
            "rtk_frontdoor_prediction_margin": (
                "factor from a predicted TTFT to the bound checked against the deadline (the recent error's "
                "serving.guard.prediction_quantile)" + ("" if n == 1 else " (mean over the replicas)"),
                sum(r.estimator.margin() for r in replicas) / n,
            ),
            "rtk_frontdoor_triton_ready": (
                "1 when Triton and the model are ready" + ("" if n == 1 else " on at least one replica"),
                int(self.router.any_ready()),
            ),
        }
        for name, (text, v) in gauges.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {v}"]
        if n > 1:
            lines += self._replica_metric_lines()
        lines += self.sessions.metric_lines() + self.jobs.metric_lines()
        return "\n".join(lines) + "\n"

    def _replica_metric_lines(self) -> list[str]:
        """Per-replica series (label ``replica``: its index), only when the front door has several."""
        series = {
            "rtk_frontdoor_replica_requests_total": ("counter", "requests sent to each replica", lambda r: r.routed),
            "rtk_frontdoor_replica_unreachable_total": (
                "counter",
                "requests that could not reach the replica before their first token and went to another",
                lambda r: r.unreachable,
            ),
            "rtk_frontdoor_replica_ready": (
                "gauge",
                "1 when the replica's Triton and model are ready (it receives requests)",
                lambda r: int(r.backend.ready),
            ),
            "rtk_frontdoor_replica_inflight": (
                "gauge",
                "primary requests in flight on the replica",
                lambda r: len(r.estimator.inflight),
            ),
            "rtk_frontdoor_replica_step_seconds": (
                "gauge",
                "the replica's measured engine step time",
                lambda r: r.estimator.step_s,
            ),
            "rtk_frontdoor_replica_prefill_seconds_per_token": (
                "gauge",
                "the replica's measured prefill time per prompt token",
                lambda r: r.estimator.prefill_s_per_token,
            ),
        }
        lines = []
        for name, (kind, text, value) in series.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{replica="{r.label}"}} {value(r)}' for r in self.replicas]
        return lines


DONE = b"data: [DONE]\n\n"
# rtk_frontdoor_errors_total's reason label by status
ERROR_REASONS = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    429: "overload",
    503: "unhealthy",
}


def _ending(req: GenRequest, final: dict, u: dict) -> bytes:
    """A stream's last events in one piece (one write): the final chunk, the usage chunk when asked for,
    and ``[DONE]``."""
    return sse(final) + (sse(usage_chunk(req, u)) if req.include_usage else b"") + DONE


class _SSE(Response):
    """A server-sent event stream (Starlette's StreamingResponse, leaner on the time to first token).

    The body is sent from the request's own task; one plain asyncio task waits for the client to
    disconnect and then cancels it, so the generator's ``finally`` cancels the Triton request and the
    engine frees its KV blocks.  Starlette's StreamingResponse does the same with an anyio task group
    (two tasks, cancel scopes), which cost about 0.2 ms of the event loop per request."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str]):
        self.body_iterator = content
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **headers})

    async def __call__(self, scope, receive, send):
        task = asyncio.current_task()
        gone = False

        async def watch():
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            more = True
            async for data in self.body_iterator:
                more = not data.endswith(DONE)  # the stream's last event: the body ends with it
                await send({"type": "http.response.body", "body": data, "more_body": more})
            if more:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client left: nothing more to send
            await self.body_iterator.aclose()  # its clean-up (cancel the Triton request) has run, or runs now
        finally:
            watcher.cancel()


def _timing(arrival: float) -> str:
    return f"{TIMING_METRIC};dur={(time.perf_counter() - arrival) * 1e3:.2f}"


def _stamp(resp, arrival: float) -> None:
    """The ``Server-Timing`` header of a response whose head is about to go (a deferred body's when it is ready)."""
    inner = resp.response if isinstance(resp, AfterSend) else resp
    if isinstance(inner, _Deferred):
        inner.arrival = arrival
    else:
        inner.headers[TIMING_HEADER] = _timing(arrival)


class _Deferred(Response):
    """A response whose body is computed when served, so a client disconnect can cancel the work."""

    def __init__(self, make):
        super().__init__()
        self.make = make
        self.arrival: float | None = None  # the request's start, for the Server-Timing header

    async def __call__(self, scope, receive, send):
        task = asyncio.ensure_future(self.make())

        async def watch():
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    task.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            try:
                response = await task
            except asyncio.CancelledError:
                if watcher.done():
                    return  # the client left; nothing to send
                raise
            except APIError as exc:
                response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        finally:
            watcher.cancel()
        if self.arrival is not None:
            response.headers[TIMING_HEADER] = _timing(self.arrival)
        await response(scope, receive, send)


def _frontdoor_of_spec(spec_path: str) -> str:
    """The base URL of the front door serving another rtk spec (from its state file)."""
    from ..spec import load_spec
    from ..triton.server import read_state

    st = read_state(load_spec(spec_path).repository_dir())
    url = getattr(st, "frontdoor_url", None) if st is not None else None
    if not url:
        raise LookupError(
            f"the fallback deployment of '{spec_path}' is not running; start it with `rtk serve {spec_path} --detach`"
        )
    return url.rstrip("/") + "/v1"


def create_app(
    source,
    triton_grpc_url: str | Sequence[str],
    *,
    metrics_url: str | Sequence[str | None] | None = None,
    triton_model: str = "ensemble",
) -> FrontDoorApp:
    """The front door for ``source`` (a Spec, a repository directory or a FrontDoorConfig) over Triton's gRPC:
    one server, or replicas of one repository (a list of gRPC addresses and one metrics URL for each)."""
    import contextlib

    config = config_from(source, triton_model=triton_model)
    fd = FrontDoor(config, triton_grpc_url, metrics_url)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await fd.start()
        await fd.jobs.start(fd, app)
        try:
            yield
        finally:
            await fd.jobs.stop()
            await fd.stop()

    routes = [
        Route("/v1/chat/completions", fd.chat, methods=["POST"]),
        Route("/v1/completions", fd.completions, methods=["POST"]),
        Route("/v1/models", fd.models, methods=["GET"]),
        Route("/health", fd.health, methods=["GET"]),
        Route("/health/ready", fd.health, methods=["GET"]),
        Route("/health/live", fd.live, methods=["GET"]),
        Route("/metrics", fd.metrics, methods=["GET"]),
    ]
    routes += fd.sessions.routes(fd) + fd.jobs.routes(fd)

    async def unknown_route(request: Request, exc: HTTPException) -> Response:
        return fd._error(route_error(request, exc.status_code, exc.headers))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: unknown_route, 405: unknown_route})
    app.state.frontdoor = fd
    return FrontDoorApp(app, {"/v1/chat/completions": fd.chat, "/v1/completions": fd.completions})


def route_error(request: Request, status: int, headers: dict[str, str] | None) -> APIError:
    """A path or method the front door does not serve, as an OpenAI error (clients read ``error.message``
    from every failed response), not Starlette's plain-text "Not Found"."""
    what = f"{request.method} {request.url.path}"
    if status == 405:
        allowed = (headers or {}).get("Allow", "")  # Starlette's Route sets it
        return APIError(
            405,
            f"{what}: the method is not served on this path; use {allowed}",
            code="method_not_allowed",
            headers=dict(headers or {}),
        )
    return APIError(
        404,
        f"{what} is not served here; the OpenAI endpoints are POST /v1/chat/completions, POST /v1/completions "
        "and GET /v1/models",
        code="unknown_url",
    )


class FrontDoorApp:
    """The ASGI app: a POST to a generation endpoint goes straight to its handler; every other request, and
    the lifespan, through Starlette (``app``).  The generation endpoints need none of Starlette's routing or
    middleware (their handlers answer every error themselves, and an unexpected exception reaches uvicorn,
    which answers 500 as Starlette's ServerErrorMiddleware would), and skipping it saves its walk on every
    request and its two wrappers on every streamed chunk."""

    def __init__(self, app: Starlette, hot: dict):
        self.app, self.state, self.hot = app, app.state, hot

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.hot.get(scope["path"])
            if handler is not None:
                response = await handler(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
