"""One error hierarchy for rtk. The CLI maps each class to an exit code in one place (cli.py).

Every message a user can cause says what is wrong *and* what to change, naming the spec field or
the file involved.
"""

from __future__ import annotations


class RtkError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UsageError(RtkError):
    """Bad input from the user: spec, flags, paths. Nothing has been written."""

    exit_code = 2


class SpecError(UsageError):
    """The spec file is malformed or violates a rule; the message names the field."""

    def __init__(self, message: str, *, field: str | None = None, file: str | None = None):
        where = []
        if file:
            where.append(f"in {file}")
        if field:
            where.append(f"field '{field}'")
        prefix = (" ".join(where) + ": ") if where else ""
        super().__init__(prefix + message)
        self.field = field
        self.file = file


class SourceError(UsageError):
    """The model source cannot be read (missing directory, unreachable hub, unsupported model)."""


class StageError(RtkError):
    """A stage failed for a reason that is not the user's input (a tool crashed, an export broke)."""

    exit_code = 1


class QualityGateError(RtkError):
    """The quantized checkpoint is worse than the spec's quality gate allows."""

    exit_code = 3


class HostMismatchError(UsageError):
    """An artifact was built for another GPU / software stack than the host offers."""


class ServerError(RtkError):
    """tritonserver failed to start, become ready, or answer."""

    exit_code = 4
