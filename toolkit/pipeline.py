"""``rtk build``: fetch → quantize → build → emit, each stage skipped when its manifest matches.

Each stage is keyed on its spec section, its input artifact's manifest key and the tool versions
(toolkit/artifacts.py), so after a change only the stages downstream of it run again; ``force``
names stages to redo anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .console import info
from .spec import Spec
from .stages import StageResult

STAGES = ("fetch", "quantize", "build", "emit")


@dataclass
class PipelineResult:
    stages: list[StageResult] = field(default_factory=list)

    @property
    def repository(self) -> Path:
        return self.stages[-1].path

    def __getitem__(self, stage: str) -> StageResult:
        return next(r for r in self.stages if r.stage == stage)


def build(spec: Spec, *, force: tuple[str, ...] | list[str] = (), engines_root: Path | str = "engines") -> PipelineResult:
    """Run the four stages for ``spec``; ``force``: stage names to redo even if cached ("all" for every one)."""
    from .targets import build as build_target
    from .errors import UsageError
    from .fetch import fetch
    from .quantize import quantize
    from .stages import default_output
    from .triton.emit import emit

    unknown = set(force) - set(STAGES) - {"all"}
    if unknown:
        raise UsageError(f"--force {', '.join(sorted(unknown))}: not a stage; use one of {', '.join(STAGES)} or all")
    redo = set(STAGES) if "all" in force else set(force)
    out = PipelineResult()

    def run(n: int, name: str, fn) -> StageResult:
        info(f"[bold][{n}/{len(STAGES)}] {name}[/]")
        result = fn()
        out.stages.append(result)
        info(f"  {'[dim]cached[/]' if result.skipped else '[green]done[/]'}: {result.path}")
        return result

    root = Path(engines_root)
    ckpt = run(1, "fetch", lambda: fetch(spec, output=default_output(spec, "fetch", root), force="fetch" in redo))
    quant = run(2, "quantize", lambda: quantize(spec, checkpoint=ckpt.path, output=default_output(spec, "quantize", root), force="quantize" in redo))
    engine = run(3, f"build ({spec.build.target})", lambda: build_target(spec, quant.path, default_output(spec, "build", root), force="build" in redo))
    run(4, "emit", lambda: emit(spec, engine.path, tokenizer_dir=quant.path / "hf", force="emit" in redo))
    return out
