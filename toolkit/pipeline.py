"""``rtk build``: fetch → quantize → build → emit, each stage skipped when its manifest matches.

Each stage is keyed on its spec section, its input artifact's manifest key and the tool versions
(toolkit/artifacts.py), so after a change only the stages downstream of it run again; ``force``
names stages to redo anyway.  Before the first stage, the target's host check (toolkit/targets/)
says whether this host can run every stage at all, so a GPU build on a CPU host is refused at once
instead of after fetching and quantizing a large model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .artifacts import StageResult
from .console import info
from .errors import HostMismatchError
from .spec import Spec
from .targets import NGC_CONTAINER, target_of

STAGES = ("fetch", "quantize", "build", "emit")


@dataclass
class PipelineResult:
    stages: list[StageResult] = field(default_factory=list)

    @property
    def repository(self) -> Path:
        return self.stages[-1].path

    def __getitem__(self, stage: str) -> StageResult:
        return next(r for r in self.stages if r.stage == stage)


def build(
    spec: Spec, *, force: tuple[str, ...] | list[str] = (), engines_root: Path | str = "engines"
) -> PipelineResult:
    """Run the four stages for ``spec``; ``force``: stage names to redo even if cached ("all" for every one)."""
    from .artifacts import default_output
    from .errors import UsageError
    from .fetch import fetch
    from .quantize import quantize
    from .targets import build as build_target
    from .triton.emit import emit

    unknown = set(force) - set(STAGES) - {"all"}
    if unknown:
        raise UsageError(f"--force {', '.join(sorted(unknown))}: not a stage; use one of {', '.join(STAGES)} or all")
    redo = set(STAGES) if "all" in force else set(force)
    check_build_host(spec)
    out = PipelineResult()

    def run(n: int, name: str, fn) -> StageResult:
        info(f"[bold][{n}/{len(STAGES)}] {name}[/]")
        result = fn()
        out.stages.append(result)
        info(f"  {'[dim]cached[/]' if result.skipped else '[green]done[/]'}: {result.path}")
        return result

    root = Path(engines_root)
    ckpt = run(1, "fetch", lambda: fetch(spec, output=default_output(spec, "fetch", root), force="fetch" in redo))
    quant = run(
        2,
        "quantize",
        lambda: quantize(
            spec, checkpoint=ckpt.path, output=default_output(spec, "quantize", root), force="quantize" in redo
        ),
    )
    engine = run(
        3,
        f"build ({spec.build.target})",
        lambda: build_target(spec, quant.path, default_output(spec, "build", root), force="build" in redo),
    )
    run(4, "emit", lambda: emit(spec, engine.path, tokenizer_dir=quant.path / "hf", force="emit" in redo))
    return out


def check_build_host(spec: Spec, host=None) -> None:
    """Refuse at once (exit 2) when this host cannot run the build stage of ``spec``'s target, saying what to do."""
    target = target_of(spec)
    if target.build_host_problems is None:
        return
    from .hostinfo import probe_host

    problems = target.build_host_problems(spec, host or probe_host(triton_version=False))
    if problems:
        raise HostMismatchError(
            f"this host cannot build the {target.name} target: {'; '.join(problems)}. Nothing was started. "
            f"Here, `rtk quantize SPEC` prepares the quantized checkpoint (ModelOpt runs on a CPU); then run "
            f"`rtk build SPEC` on a GPU host inside {NGC_CONTAINER} "
            f"(`rtk doctor --target {target.name}` lists what it needs)"
        )
