"""``rtk serve``: start Triton on an emitted repository, wait until every model is loaded and warm.

The source is a spec (its repository, ``serving`` host and ports) or a repository directory (its
manifest holds the ``serving`` section it was emitted with).  Before starting, a GPU artifact is
checked against this host (toolkit/hostinfo.check_host_compatible) so a mismatch is a clear
error, not a crash inside the backend.  Triton runs each model's ``model_warmup`` before it marks
the model ready, so "ready" here means warm.  The process itself is handled by
toolkit/server.py's :class:`TritonServer`; a multi-GPU engine is launched under ``mpirun`` with the
command toolkit/targets/mpi.py gives.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from ..artifacts import read_manifest
from ..errors import ServerError, UsageError
from . import config as C


@dataclass
class ServeTarget:
    """What to serve and how, resolved from a spec or a repository directory."""

    repository: Path
    serving: dict  # the spec's serving section
    target: str
    engine_dir: Path | None
    models: list[str]
    spec: object | None = None
    world_size: int = 1


def resolve(source: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ServeTarget:
    """A spec file (``*.yaml``/``*.yml``) or an emitted repository directory."""
    source = Path(source)
    if source.is_dir():
        if overrides:
            raise UsageError("--set needs a spec; with a repository directory use --host / --http-port / --grpc-port / --metrics-port")
        repo, spec = source, None
    elif source.is_file():
        from ..spec import load_spec

        spec = load_spec(source, list(overrides))
        repo = spec.repository_dir()
    else:
        raise UsageError(f"'{source}' is neither a spec file nor a model repository directory")
    manifest = read_manifest(repo)
    if not manifest or not manifest.get("complete"):
        hint = f"rtk build {source}" if spec is not None else "rtk build SPEC"
        raise UsageError(f"'{repo}' is not an emitted rtk model repository (no complete rtk-manifest.json); run `{hint}` first")
    section = manifest.get("spec") or {}
    serving = dict(section.get("serving") or {})
    if spec is not None:
        if manifest["spec"].get("build") != spec.build.model_dump():
            raise UsageError(f"'{repo}' was emitted for other build settings than {source} has now; run `rtk build {source}` again")
        serving = spec.serving.model_dump()
        how = {"host", "http_port", "grpc_port", "metrics_port", "tritonserver", "repository"}  # not in the repository
        emitted = {k: v for k, v in (section.get("serving") or {}).items() if k not in how}
        if emitted != {k: v for k, v in serving.items() if k not in how}:
            raise UsageError(f"'{repo}' was emitted for other serving settings than {source} has now; run `rtk build {source}` again")
    engine = (manifest.get("inputs") or {}).get("engine_dir")
    build = section.get("build") or {}
    if C.ENSEMBLE in manifest.get("models", []) and not (repo / C.ENSEMBLE / "1").is_dir():
        (repo / C.ENSEMBLE / "1").mkdir()  # an empty directory a copy tool may have dropped
    return ServeTarget(
        repository=repo, serving=serving, target=manifest.get("target", build.get("target", "cpu")),
        engine_dir=Path(engine) if engine else None, models=list(manifest.get("models") or []), spec=spec,
        world_size=int(build.get("tp_size", 1)) * int(build.get("pp_size", 1)),
    )


def check_host(t: ServeTarget) -> None:
    """Refuse a GPU artifact this host cannot run (HostMismatchError names what differs and the fix)."""
    if t.target == "cpu":
        return
    from ..hostinfo import check_host_compatible, probe_host

    manifest = read_manifest(t.engine_dir) if t.engine_dir else None
    if manifest is None:
        raise UsageError(f"the engine '{t.engine_dir}' this repository serves is missing; run `rtk build SPEC` again")
    check_host_compatible(manifest, probe_host())


def make_server(t: ServeTarget, *, host: str | None = None, http_port: int | None = None, grpc_port: int | None = None,
                metrics_port: int | None = None, ready_timeout_s: float = 600.0):
    from ..server import TritonServer

    s = t.serving
    server = TritonServer(
        t.repository, host=host or s.get("host", "127.0.0.1"),
        http_port=http_port or s.get("http_port", 8000), grpc_port=grpc_port or s.get("grpc_port", 8001),
        metrics_port=metrics_port or s.get("metrics_port", 8002), tritonserver=s.get("tritonserver"),
        ready_timeout_s=ready_timeout_s,
        # rtk writes complete configs; skipping auto-complete saves a stub start per python model.
        extra_args=["--disable-auto-complete-config"],
    )
    if t.world_size > 1 and t.spec is not None:
        _use_mpirun(server, t)
    return server


def _use_mpirun(server, t: ServeTarget) -> None:
    """Launch one tritonserver per rank under mpirun (toolkit/targets/mpi.py)."""
    from dataclasses import replace

    from ..targets.mpi import tritonserver_launch

    spec = t.spec.model_copy(deep=True)
    spec.serving.host, spec.serving.http_port = server.host, server.http_port
    spec.serving.grpc_port, spec.serving.metrics_port = server.grpc_port, server.metrics_port
    binary = server.binary
    launch = tritonserver_launch(spec, str(binary.path), str(server.repository), extra=tuple(binary.args))
    server._binary = replace(binary, env={**binary.env, **launch.env})
    server.command = lambda: list(launch.argv)


def serve(source: str | Path, *, overrides=(), detach: bool = False, on_ready=None, **server_kwargs):
    """Serve ``source`` until interrupted (or, with ``detach``, start it in the background and return its state).

    ``on_ready(server)`` is called once every model is ready and warm.
    """
    t = resolve(source, overrides)
    check_host(t)
    server = make_server(t, **server_kwargs)
    if detach:
        return server.start_detached(models=t.models)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        server.start()
        try:
            server.wait_ready(models=t.models)
            if on_ready:
                on_ready(server)
            while not stop.wait(0.5):
                code = server.process.poll()
                if code is not None:
                    raise ServerError(f"tritonserver exited with code {code}.\n{server.log_tail()}")
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return None


def stop(source: str | Path, overrides=()):
    """Stop the detached server of ``source``; returns its state, or None when none was running."""
    from ..server import stop_detached

    source = Path(source)
    repo = source if source.is_dir() else resolve_repository(source, overrides)
    return stop_detached(repo)


def resolve_repository(spec_path: Path, overrides=()) -> Path:
    from ..spec import load_spec

    return load_spec(spec_path, list(overrides)).repository_dir()


@contextlib.contextmanager
def running(source: str | Path, *, overrides=(), **server_kwargs):
    """A server on ``source`` for the duration of a ``with`` block (used by ``rtk chat``)."""
    t = resolve(source, overrides)
    check_host(t)
    server = make_server(t, **server_kwargs)
    server.start()
    try:
        server.wait_ready(models=t.models)
        yield server
    finally:
        server.stop()
