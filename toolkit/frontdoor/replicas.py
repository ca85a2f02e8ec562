"""One front door over several tritonservers of one repository (``rtk serve --replicas N``).

Each replica has its own gRPC stream pool and health (:class:`~toolkit.frontdoor.triton.TritonBackend`, with
the engine gauges of its own metrics endpoint) and its own :class:`~toolkit.frontdoor.admission.Estimator`
(its engine's measured speed and the front door's requests on it).  A request goes to the ready replica with
the lowest predicted TTFT; predictions within :data:`TIE_FRACTION` (plus :data:`TIE_S`) of the lowest are
ties, taken in turn (round robin), so equally loaded replicas share the load even though their measured
speeds never come out exactly equal.  A replica whose health check fails receives nothing.

With one replica :meth:`Router.pick` is the front door's old decision: one readiness check, one prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .admission import Estimator, Prediction
from .triton import TritonBackend

TIE_FRACTION = 0.05  # predictions this close to the lowest are ties ...
TIE_S = 0.001  # ... and this much more (estimates of idle, equal replicas differ by a few µs)


@dataclass(eq=False)
class Replica:
    """One tritonserver behind the front door."""

    label: str  # its index in the list given to the front door: the ``replica`` label in /metrics
    backend: TritonBackend
    estimator: Estimator
    routed: int = 0  # requests sent to it
    unreachable: int = 0  # requests that could not reach it and were sent to another replica


def replica_urls(grpc_urls: str | Sequence[str], metrics_urls: str | Sequence[str | None] | None) -> list[tuple]:
    """``[(grpc_url, metrics_url), ...]``, one per replica: one URL each, or lists of equal length."""
    grpc = [grpc_urls] if isinstance(grpc_urls, str) else list(grpc_urls)
    if metrics_urls is None:
        metrics = [None] * len(grpc)
    else:
        metrics = [metrics_urls] if isinstance(metrics_urls, str) else list(metrics_urls)
    if not grpc:
        raise ValueError("triton_grpc_url: give the gRPC address of at least one tritonserver")
    if len(metrics) != len(grpc):
        raise ValueError(f"metrics_url: give one per replica ({len(grpc)} gRPC addresses, {len(metrics)} metrics URLs)")
    seen = set()
    for url in grpc:
        key = url.removeprefix("grpc://")
        if key in seen:
            raise ValueError(f"triton_grpc_url: {key} is listed twice; each replica is another tritonserver")
        seen.add(key)
    return list(zip(grpc, metrics, strict=True))


class Router:
    """Picks the replica a request goes to."""

    def __init__(self, replicas: list[Replica]):
        self.replicas = replicas
        self.single = replicas[0] if len(replicas) == 1 else None  # the common case, decided without a loop
        self._turn = 0  # where the round robin over ties starts

    def any_ready(self) -> bool:
        if self.single is not None:
            return self.single.backend.ready
        return any(r.backend.ready for r in self.replicas)

    def ready_count(self) -> int:
        return sum(1 for r in self.replicas if r.backend.ready)

    def pick(
        self, prompt_tokens: int, deadline_s: float | None = None, ids: list[int] | None = None
    ) -> tuple[Replica, Prediction] | None:
        """The ready replica with the lowest predicted TTFT and its prediction; None when none is ready.  Replicas
        are compared by the bound their deadline check uses (the prediction times the replica's own recent error,
        admission.py), which is the prediction until a replica has shown an error.

        ``ids``: the prompt as sent, where known: each replica counts what its own prefix cache holds, so a
        prompt that shares a prefix with recent ones leans towards the replica that has it.  Ties (within
        :data:`TIE_FRACTION` + :data:`TIE_S` of the lowest, and never past ``deadline_s`` when the lowest
        meets it) go round robin."""
        single = self.single
        if single is not None:
            if not single.backend.ready:
                return None
            return single, single.estimator.predict(prompt_tokens, single.backend.gauges, ids)
        replicas = self.replicas
        predictions = [
            r.estimator.predict(prompt_tokens, r.backend.gauges, ids) if r.backend.ready else None for r in replicas
        ]
        best = min((p.bound_s for p in predictions if p is not None), default=None)
        if best is None:
            return None
        bound = best * (1 + TIE_FRACTION) + TIE_S
        if deadline_s is not None:
            bound = max(best, min(bound, deadline_s))
        n = len(replicas)
        for k in range(n):
            i = (self._turn + k) % n
            p = predictions[i]
            if p is not None and p.bound_s <= bound:
                self._turn = i + 1
                return replicas[i], p
        return None  # not reached: the lowest is within its own bound
