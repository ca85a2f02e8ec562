"""What every stage returns, and where its output goes by default."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .spec import Spec

# Stage output directories under engines/<name>/ (see engines/README.md).
STAGE_DIRS = {"fetch": "checkpoint", "quantize": "quantized", "build": "engine"}


@dataclass
class StageResult:
    stage: str
    path: Path
    skipped: bool
    manifest: dict = field(default_factory=dict)

    @property
    def summary(self) -> str:
        verb = "up to date (cached)" if self.skipped else "written"
        return f"{self.stage}: {self.path} {verb}"


def default_output(spec: Spec, stage: str, root: Path | str = "engines") -> Path:
    return Path(root) / spec.name / STAGE_DIRS[stage]
