"""Stage artifacts: manifests, hashing, atomic output directories and the stage cache.

Every stage writes into ``<out>.tmp-<pid>/`` next to its final directory and renames it into
place only after its manifest (``rtk-manifest.json``) is written last.  So a directory without a
manifest, or with a manifest whose ``key`` does not match, is never taken for a finished artifact;
a killed run leaves only a ``.tmp-*`` directory, which the next run removes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from . import __version__

MANIFEST = "rtk-manifest.json"
# Stage output directories under engines/<name>/ (see engines/README.md).
STAGE_DIRS = {"fetch": "checkpoint", "quantize": "quantized", "build": "engine"}


@dataclass
class StageResult:
    """What every stage returns: where its artifact is, and whether the cache answered."""

    stage: str
    path: Path
    skipped: bool
    manifest: dict = field(default_factory=dict)

    @property
    def summary(self) -> str:
        verb = "up to date (cached)" if self.skipped else "written"
        return f"{self.stage}: {self.path} {verb}"


def default_output(spec, stage: str, root: Path | str = "engines") -> Path:
    """``engines/<spec.name>/<stage dir>``."""
    return Path(root) / spec.name / STAGE_DIRS[stage]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file below ``root`` (manifests excluded), keyed by relative posix path."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST and "__pycache__" not in p.parts:
            out[p.relative_to(root).as_posix()] = sha256_file(p)
    return out


def tool_versions(*names: str) -> dict[str, str]:
    """Installed versions of the named distributions (``None`` where absent)."""
    out = {"rtk": __version__}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_complete(directory: Path, key: str) -> bool:
    """True when ``directory`` holds a finished artifact made from the same inputs (``key``)."""
    m = read_manifest(directory)
    if not m or m.get("key") != key or not m.get("complete"):
        return False
    d = Path(directory)
    return all((d / rel).is_file() for rel in m.get("files", {}))


@dataclass
class StageOutput:
    """Handle given to a stage while it writes: the temporary directory and the manifest to fill."""

    stage: str
    final: Path
    tmp: Path
    key: str
    manifest: dict = field(default_factory=dict)
    _t0: float = field(default_factory=time.perf_counter)

    def timing(self, name: str, seconds: float) -> None:
        self.manifest.setdefault("timings_s", {})[name] = round(seconds, 3)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.timing(name, time.perf_counter() - t)


def _clean_stale_tmp(final: Path) -> None:
    for p in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
        except ValueError:
            pid = -1
        if pid > 0 and pid != os.getpid() and _alive(pid):
            continue  # another live run is writing it
        shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_stage(
    stage: str, final: Path, key: str, *, inputs: dict, spec_section: Any, tools: dict
) -> Iterator[StageOutput]:
    """Write a stage's output atomically.

    Yields a :class:`StageOutput` whose ``tmp`` directory the stage fills.  On success the manifest
    (inputs, spec section, tool versions, timings, file hashes, ``complete: true``) is written last
    and the directory renamed onto ``final`` (an older artifact is replaced).  On any exception the
    temporary directory is removed and ``final`` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_tmp(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    out = StageOutput(stage=stage, final=final, tmp=tmp, key=key)
    try:
        yield out
        m = {
            "stage": stage,
            "key": key,
            "rtk_version": __version__,
            "created_unix": round(time.time(), 3),
            "inputs": inputs,
            "spec": spec_section,
            "tools": tools,
            **out.manifest,
        }
        m.setdefault("timings_s", {})["total"] = round(time.perf_counter() - out._t0, 3)
        m["files"] = hash_tree(tmp)
        m["complete"] = True
        (tmp / MANIFEST).write_text(json.dumps(m, indent=2, sort_keys=True, default=str) + "\n")
        old = None
        if final.exists():
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            final.rename(old)
        tmp.rename(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def stage_key(stage: str, spec_section: Any, inputs: dict, tools: dict) -> str:
    """Cache key: everything that determines a stage's output."""
    return sha256_json({"stage": stage, "spec": spec_section, "inputs": inputs, "tools": tools})


def stage_log_path(output: Path) -> Path:
    """Where a stage's third-party output goes: beside the artifact, so it survives a failed run."""
    output = Path(output)
    return output.parent / f"{output.name}.log"


def run_stage(
    stage: str,
    output: Path | str,
    *,
    section: Any,
    inputs: dict,
    tools: dict,
    write: Callable[[StageOutput], None],
    force: bool = False,
    complete: Callable[[Path], bool] | None = None,
) -> StageResult:
    """The sequence every stage follows: key, cache check, atomic write, result.

    ``write(out)`` fills ``out.tmp`` (and may add to ``out.manifest``).  It runs with third-party
    output (library prints and warnings) sent to :func:`stage_log_path` unless rtk runs verbose.
    ``complete(path)`` adds a check to the cache test (e.g. an empty directory a manifest cannot list).
    """
    from .console import third_party_output

    output = Path(output)
    key = stage_key(stage, section, inputs, tools)
    if not force and is_complete(output, key) and (complete is None or complete(output)):
        return StageResult(stage, output, True, read_manifest(output))
    with atomic_stage(stage, output, key, inputs=inputs, spec_section=section, tools=tools) as out:
        with third_party_output(stage_log_path(output)):
            write(out)
    return StageResult(stage, output, False, read_manifest(output))


def link_or_copy(src: Path, dest: Path, *, recursive: bool = False, files: Iterable[Path] | None = None) -> None:
    """Hard-link the files of ``src`` (or just ``files``) into ``dest``; copies across file systems.

    Manifests are left out.  A hard link shares the inode: writers replace files, never edit them in place.
    """
    src, dest = Path(src), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    chosen = files if files is not None else (src.rglob("*") if recursive else src.iterdir())
    for f in sorted(Path(f) for f in chosen):
        if not f.is_file() or f.name == MANIFEST:
            continue
        target = dest / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)


def write_json_atomic(path: Path, obj: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)
