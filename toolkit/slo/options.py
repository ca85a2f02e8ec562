"""What ``rtk slo``'s options mean, as library functions: objectives from text or a file, and
options laid over a spec's ``slo`` section (the load, the transport's interface) — so the command
only parses and calls, and the same rules hold from Python.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import SpecError, UsageError
from ..spec import Objective, SLOSpec, _spec_error
from .metrics import OBJECTIVE_STATS

_STAT = "|".join(re.escape(s) for s in sorted(OBJECTIVE_STATS, key=len, reverse=True))  # p99.9 before p99
_SHORTHAND = re.compile(rf"^\s*([a-z0-9_]+)\s*(?::\s*({_STAT}))?\s*(<=|>=|<|>)\s*([0-9.eE+-]+)\s*$")
OPENAI_ENDPOINTS = ("chat", "completions")


def parse_objective(text: str) -> Objective:
    """``'ttft:p99<=300'``, ``'error_rate<=0.001'``, ``'attainment>=0.99'`` → Objective."""
    m = _SHORTHAND.match(text)
    if not m:
        raise UsageError(
            f"--objective '{text}' is not METRIC[:STAT]<=VALUE or >=VALUE, e.g. 'ttft:p99<=300' or 'attainment>=0.99'"
        )
    metric, stat, op, value = m.groups()
    try:
        bound = float(value)
    except ValueError:
        raise UsageError(f"--objective '{text}': '{value}' is not a number") from None
    data = {"metric": metric, "stat": stat or "value", ("max" if op.startswith("<") else "min"): bound}
    try:
        return Objective.model_validate(data)
    except ValidationError as exc:
        raise UsageError(f"--objective '{text}': {_spec_error(exc, None)}") from None


def load_objectives(path: str | Path) -> list[Objective]:
    """A YAML list of objectives (or a mapping with ``objectives:``)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"objectives file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    items = data.get("objectives") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise UsageError(f"{path}: expected a list of objectives (or a mapping with 'objectives:')")
    out = []
    for i, item in enumerate(items):
        try:
            out.append(Objective.model_validate(item))
        except ValidationError as exc:
            raise UsageError(f"{path}: objective {i + 1}: {_spec_error(exc, None)}") from None
    return out


def validate_slo(data: dict) -> SLOSpec:
    """An SLOSpec from a dict; errors name the field as ``slo.<field>``."""
    try:
        return SLOSpec.model_validate(data)
    except ValidationError as exc:
        err = _spec_error(exc, None)
        if err.field is None or err.field.startswith("slo."):
            raise err from None
        message = str(err).split(": ", 1)[1]  # SpecError's text is "field 'F': message"
        raise SpecError(message, field=f"slo.{err.field}") from None


def apply_options(base: dict, given: dict[str, Any]) -> dict:
    """``base`` (an ``slo`` section as a dict) with the options that were ``given`` laid over it.

    A load replaces the other kind of load: a rate drops the spec's concurrency and the reverse.
    A new transport that cannot serve the spec's interface takes its own default interface.
    """
    data = dict(base)
    given = {k: v for k, v in given.items() if v is not None}
    if "request_rate" in given and "concurrency" not in given:
        data["concurrency"] = None
    if "concurrency" in given and "request_rate" not in given:
        data["request_rate"] = None
    if "transport" in given and "endpoint" not in given:
        openai = data.get("endpoint") in OPENAI_ENDPOINTS
        if (given["transport"] == "openai") != openai:
            data.pop("endpoint", None)
    data.update(given)
    return data


def with_load(slo: SLOSpec, kind: str, value: float) -> SLOSpec:
    """The same SLO section with its load replaced (``kind``: rate or concurrency)."""
    if kind not in ("rate", "concurrency"):
        raise UsageError(f"a load is a rate or a concurrency, not '{kind}'")
    given = {"request_rate": float(value)} if kind == "rate" else {"concurrency": int(value)}
    return validate_slo(apply_options(slo.model_dump(exclude_unset=False), given))


def parse_values(text: str) -> list[float]:
    """``'1,2,4,8'`` → [1.0, 2.0, 4.0, 8.0] (sweep loads)."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--values '{text}' is not a comma-separated list of numbers, e.g. 1,2,4,8") from None
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"--values '{text}': give one or more positive loads, e.g. 1,2,4,8")
    return values


def configure(spec, given: dict[str, Any], objectives: list[Objective] | None = None):
    """The run's configuration: ``spec`` (a Spec, or None for the defaults) with the ``given``
    options and, when not None, ``objectives`` replacing the spec's.  Returns a Spec or an SLOSpec."""
    base = spec.slo.model_dump() if spec is not None else SLOSpec().model_dump()
    data = apply_options(base, given)
    if objectives is not None:
        data["objectives"] = [o.model_dump() for o in objectives]
    slo = validate_slo(data)
    return spec.model_copy(update={"slo": slo}) if spec is not None else slo


def objectives_from(texts: list[str] | tuple[str, ...], path: str | Path | None) -> list[Objective] | None:
    """``--objectives FILE`` then every ``--objective``; None when neither was given (keep the spec's)."""
    out = load_objectives(path) if path else None
    if texts:
        out = (out or []) + [parse_objective(t) for t in texts]
    return out
