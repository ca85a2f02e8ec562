"""``rtk slo``: streaming load against Triton, LLM latency metrics, and an SLO verdict.

Entry points (see runner.py): :func:`run_slo`, :func:`sweep_slo`, :func:`search_slo`; reports
in report.py; metric definitions in metrics.py and docs/slo.md; request outcomes in outcome.py.
Imports are lazy: toolkit.spec reads the objective names from metrics.py, which must not pull in
the runner (or the spec) in turn.
"""

from __future__ import annotations

__all__ = [
    "EXIT_CODES",
    "FAIL",
    "INCONCLUSIVE",
    "PASS",
    "SLOReport",
    "SweepReport",
    "run_slo",
    "search_slo",
    "sweep_slo",
]


def __getattr__(name):
    if name in ("run_slo", "sweep_slo", "search_slo", "SLOReport", "SweepReport"):
        from . import runner

        return getattr(runner, name)
    if name in ("PASS", "FAIL", "INCONCLUSIVE", "EXIT_CODES"):
        from . import verdict

        return getattr(verdict, name)
    raise AttributeError(name)
