"""Arrival processes for open-loop load: when each new request (or session) is due.

* ``constant``: exactly every ``1/rate`` seconds.
* ``poisson``: exponential gaps with mean ``1/rate`` (memoryless arrivals of independent users).
* ``gamma``: gamma gaps with shape ``burstiness`` and mean ``1/rate`` (vLLM's ``--burstiness``):
  shape 1 is Poisson, below 1 burstier (clumps and lulls), above 1 more even.

Offsets are integer nanoseconds from the start, reproducible from the seed.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def arrival_offsets(kind: str, rate: float, *, burstiness: float = 1.0, seed: int = 0) -> Iterator[int]:
    """Endless offsets (ns) of arrivals; the first is at 0."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = np.random.default_rng(seed)
    mean = 1.0 / rate
    t = 0.0
    yield 0
    while True:
        if kind == "constant":
            gaps = np.full(1024, mean)
        elif kind == "poisson":
            gaps = rng.exponential(mean, 1024)
        elif kind == "gamma":
            gaps = rng.gamma(burstiness, mean / burstiness, 1024)
        else:
            raise ValueError(f"unknown arrival process '{kind}'; use constant, poisson or gamma")
        for g in gaps:
            t += float(g)
            yield int(round(t * 1e9))
