"""The outcome of one request: the one definition every rtk component uses.

* **served**: the whole answer arrived, from the primary tier (the deployment the gate is about);
* **shed**: refused on purpose at admission (HTTP 429 or 503), or answered by a fallback tier
  (the response names its tier in :data:`TIER_HEADER` / the final chunk's :data:`TIER_FIELD`);
* **failed**: any other error, or a stream that broke;
* **timed out**: no final response within the request timeout (``slo.request_timeout_s``).

How each enters the numbers (docs/slo.md, "Request outcomes"): failed and timed-out requests enter
the TTFT and E2E distributions at the request timeout, so a percentile cannot pass by losing its
slowest requests; shed requests enter ``shed_rate`` and goodput (as misses) but no latency
distribution of served requests; ``error_rate`` counts failed and timed out.
"""

from __future__ import annotations

SERVED, SHED, FAILED, TIMED_OUT = "served", "shed", "failed", "timed_out"
OUTCOMES = (SERVED, SHED, FAILED, TIMED_OUT)

# Statuses that mean "refused on purpose, retry later" (admission control), never an error.
SHED_STATUSES = frozenset({429, 503})

# The front door names the tier that answered: a response header and a field of the final chunk.
TIER_HEADER = "x-rtk-tier"
TIER_FIELD = "rtk_tier"
PRIMARY_TIER = "primary"

# The front door's own time from its handler's start to the response's head (W3C Server Timing,
# ``Server-Timing: frontdoor;dur=<ms>``): on a streamed answer its time to the first token.
TIMING_HEADER = "server-timing"
TIMING_METRIC = "frontdoor"


def server_timing_ms(value: str | None, metric: str = TIMING_METRIC) -> float | None:
    """``metric``'s ``dur`` in milliseconds from a ``Server-Timing`` header value; None when it has none."""
    for entry in (value or "").split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        if name != metric:
            continue
        for param in params:
            key, _, v = param.partition("=")
            if key.strip().lower() == "dur":
                try:
                    return float(v)
                except ValueError:
                    return None
    return None


def classify(
    *, finished: bool, error: str | None, status: int | None = None, tier: str | None = None, timed_out: bool = False
) -> str:
    """The outcome of a request from what the client saw.

    ``status`` is the HTTP status of a refusal (None on gRPC, whose stream errors carry no code),
    ``tier`` the tier that answered (None: the server does not name tiers, so it is the primary).
    """
    if timed_out:
        return TIMED_OUT
    if error is not None:
        return SHED if status in SHED_STATUSES else FAILED
    if not finished:
        return TIMED_OUT
    if tier is not None and tier != PRIMARY_TIER:
        return SHED
    return SERVED
