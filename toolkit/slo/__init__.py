"""``rtk slo``: streaming load against Triton, LLM latency metrics, and an SLO verdict.

Entry points (see runner.py): :func:`run_slo`, :func:`sweep_slo`, :func:`search_slo`; reports
in report.py; metric definitions in metrics.py and docs/slo.md.
"""

from __future__ import annotations

from .verdict import EXIT_CODES, FAIL, INCONCLUSIVE, PASS

__all__ = ["run_slo", "sweep_slo", "search_slo", "SLOReport", "SweepReport", "PASS", "FAIL", "INCONCLUSIVE", "EXIT_CODES"]


def __getattr__(name):  # keep `import toolkit.slo` light; the runner pulls numpy and friends
    if name in ("run_slo", "sweep_slo", "search_slo", "SLOReport", "SweepReport"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(name)
