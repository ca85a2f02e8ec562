"""One record per request, in integer nanoseconds of the client's monotonic clock.

The load generator fills the times; the transport appends response arrivals.  Everything the
metrics need is here, so tests can build records by hand (AIPerf style) instead of timing sleeps.
Server timestamps (``return_perf_metrics``) are kept as the server sent them, on the server's
clock; only differences between them are ever used.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..triton.models.rtk_text import PERF_OUTPUTS as SERVER_STAMPS
from . import outcome as _outcome

ARRIVAL, FIRST_SCHEDULED, FIRST_TOKEN, LAST_TOKEN = SERVER_STAMPS


@dataclass
class RequestRecord:
    index: int
    phase: str = "measure"  # "warmup" requests are kept in the JSON but never measured
    session: int = 0
    turn: int = 0
    scheduled_ns: int = 0  # when the request was due (arrival process, or a freed closed-loop slot)
    released_ns: int | None = None  # when a slot let it go (later than scheduled only under max_inflight)
    sent_ns: int | None = None  # when the client handed it to the transport
    chunk_ns: list[int] = field(default_factory=list)  # arrival of each response that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those responses
    final_ns: int | None = None  # arrival of the final response (end of the request)
    input_tokens: int = 0
    requested_output_tokens: int = 0
    error: str | None = None
    status: int | None = None  # HTTP status of a non-200 answer (gRPC stream errors carry none)
    timed_out: bool = False  # no final response within the request timeout
    tier: str | None = None  # the tier that answered, when the server names it (outcome.TIER_HEADER)
    replica: int | None = None  # which --url served it, when several were given
    worker: int = 0  # which client process sent it (--workers)
    server: dict[str, int] = field(default_factory=dict)  # SERVER_STAMPS, server clock
    text: str | None = None  # generated text (ensemble) when kept
    output_ids: list[int] | None = None  # generated ids (tensorrt_llm) when kept
    # Raw responses (arrival ns, payload) waiting to be decoded after the run; never serialized.
    raw: list[tuple[int, Any]] = field(default_factory=list, repr=False)

    # -- state ---------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.final_ns is not None or self.error is not None

    @property
    def ok(self) -> bool:
        """Served: the whole answer arrived from the primary tier (outcome.py)."""
        return self.outcome == _outcome.SERVED

    @property
    def outcome(self) -> str:
        return _outcome.classify(
            finished=self.final_ns is not None,
            error=self.error,
            status=self.status,
            tier=self.tier,
            timed_out=self.timed_out,
        )

    @property
    def measured(self) -> bool:
        return self.phase == "measure"

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    # -- times (ms); None when not defined for this record -------------------------------------
    @staticmethod
    def _ms(a: int | None, b: int | None) -> float | None:
        return None if a is None or b is None else (b - a) / 1e6

    @property
    def first_token_ns(self) -> int | None:
        return self.chunk_ns[0] if self.chunk_ns else None

    @property
    def last_token_ns(self) -> int | None:
        return self.chunk_ns[-1] if self.chunk_ns else None

    def ttft_ms(self, *, from_sent: bool = False) -> float | None:
        return self._ms(self.sent_ns if from_sent else self.scheduled_ns, self.first_token_ns)

    def e2e_ms(self, *, from_sent: bool = False) -> float | None:
        return self._ms(self.sent_ns if from_sent else self.scheduled_ns, self.final_ns)

    def tpot_ms(self) -> float | None:
        """(last token − first token) / (tokens − 1): the per-request decode pace (vLLM's TPOT)."""
        n = self.output_tokens
        if n < 2 or len(self.chunk_ns) < 2:
            return None
        return (self.chunk_ns[-1] - self.chunk_ns[0]) / 1e6 / (n - 1)

    def itl_ms(self) -> list[float]:
        """Gaps between consecutive token-carrying responses."""
        c = self.chunk_ns
        return [(b - a) / 1e6 for a, b in zip(c, c[1:], strict=False)]

    def schedule_lag_ms(self) -> float | None:
        """sent − scheduled: everything that delayed the send, slot waits included."""
        return self._ms(self.scheduled_ns, self.sent_ns)

    def client_lag_ms(self) -> float | None:
        """sent − released: the client's own delay in sending a request that was free to go."""
        return self._ms(self.released_ns if self.released_ns is not None else self.scheduled_ns, self.sent_ns)

    def server_ms(self, start: str, end: str) -> float | None:
        a, b = self.server.get(start), self.server.get(end)
        if not a or not b:
            return None
        return (b - a) / 1e6

    def refusal_ms(self) -> float | None:
        """scheduled → the refusal (429/503) arrived: how fast a shed request learnt it."""
        if self.error is None or self.status not in _outcome.SHED_STATUSES:
            return None
        return self._ms(self.scheduled_ns, self.final_ns)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("raw")
        d["output_tokens"] = self.output_tokens
        d["outcome"] = self.outcome
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k != "raw"}
        return cls(**d)
