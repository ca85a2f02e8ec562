"""Serve an emitted repository: the one way every caller starts tritonserver.

``rtk serve`` (foreground, ``--detach``, ``--stop``), ``rtk chat``, ``rtk slo --serve`` and the tests
all go through :func:`resolve` then :func:`make_server`:

* :func:`resolve` reads what to serve from a spec or from a repository directory.  Either way the
  repository's manifest holds the ``build`` and ``serving`` sections it was emitted with, so a
  repository served by its path is launched exactly as one served by its spec (MPI ranks,
  orchestrator mode).  A repository emitted by an incompatible rtk is refused with what to re-run.
* :func:`check_host` refuses a GPU artifact this host cannot run (the target's ``serve_host_check``
  in toolkit/targets/), so a mismatch is a clear error, not a crash inside the backend.
* :func:`make_server` builds the :class:`~toolkit.triton.server.TritonServer` with the target's
  :class:`~toolkit.triton.server.Launch`.  Triton runs each model's ``model_warmup`` before it marks
  the model ready, so "ready" means warm.
* :func:`make_replicas` (``rtk serve --replicas N``, cpu target): N servers of one repository on
  this host, each on its own free ports and python-backend shared-memory prefix; they start, are
  recorded in one state file and stop together.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from ..artifacts import read_manifest
from ..errors import ServerError, UsageError
from ..spec import BuildSpec, ServingSpec, load_spec
from ..targets import TARGETS, Target
from .emit import REPOSITORY_FORMAT, SERVER_ONLY_FIELDS
from .server import (
    Launch,
    ServerState,
    TritonServer,
    free_ports,
    read_states,
    start_detached_group,
    stop_detached,
    stop_detached_all,
    write_states,
)


@dataclass
class ServeTarget:
    """What to serve and how, resolved from a spec or a repository directory."""

    repository: Path
    target: Target
    build: BuildSpec
    serving: ServingSpec
    engine_dir: Path | None
    models: list[str]

    def launch(self) -> Launch:
        fn = self.target.triton_launch
        return fn(self.build, self.serving) if fn else Launch()


def resolve(source: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ServeTarget:
    """A spec file (``*.yaml``/``*.yml``) or an emitted repository directory."""
    source = Path(source)
    if source.is_dir():
        if overrides:
            raise UsageError(
                "--set needs a spec; with a repository directory use --host / --http-port / --grpc-port / "
                "--metrics-port"
            )
        repo, spec = source, None
    elif source.is_file():
        spec = load_spec(source, list(overrides))
        repo = spec.repository_dir()
    else:
        raise UsageError(f"'{source}' is neither a spec file nor a model repository directory")
    manifest = read_manifest(repo)
    rebuild = f"rtk build {source}" if spec is not None else "rtk emit SPEC"
    if not manifest or not manifest.get("complete"):
        raise UsageError(
            f"'{repo}' is not an emitted rtk model repository (no complete rtk-manifest.json); run `{rebuild}` first"
        )
    fmt = manifest.get("repository_format", 1)
    if fmt != REPOSITORY_FORMAT:
        raise UsageError(
            f"'{repo}' was emitted by rtk {manifest.get('rtk_version', '?')} (repository format {fmt}); this rtk "
            f"serves format {REPOSITORY_FORMAT}. Re-run `{rebuild}` to write it again"
        )
    section = manifest.get("spec") or {}
    try:
        build = BuildSpec.model_validate(section.get("build") or {})
        serving = ServingSpec.model_validate(section.get("serving") or {})
    except ValidationError:
        raise UsageError(
            f"'{repo}' records settings this rtk cannot read; re-run `{rebuild}` to write it again"
        ) from None
    if spec is not None:
        if build != spec.build:
            raise UsageError(
                f"'{repo}' was emitted for other build settings than {source} has now; run `rtk build {source}` again"
            )
        if serving.model_dump(exclude=SERVER_ONLY_FIELDS) != spec.serving.model_dump(exclude=SERVER_ONLY_FIELDS):
            raise UsageError(
                f"'{repo}' was emitted for other serving settings than {source} has now; run `rtk build {source}` again"
            )
        serving = spec.serving
    engine = (manifest.get("inputs") or {}).get("engine_dir")
    target = TARGETS[manifest.get("target", build.target)]
    if target.ensemble and (repo / "ensemble").is_dir():
        (repo / "ensemble" / "1").mkdir(exist_ok=True)  # an empty directory a copy tool may have dropped
    return ServeTarget(
        repository=repo,
        target=target,
        build=build,
        serving=serving,
        engine_dir=Path(engine) if engine else None,
        models=list(manifest.get("models") or []),
    )


def check_host(t: ServeTarget) -> None:
    """Refuse a GPU artifact this host cannot run (HostMismatchError names what differs and the fix)."""
    if t.target.serve_host_check is None:
        return
    from ..hostinfo import probe_host

    manifest = read_manifest(t.engine_dir) if t.engine_dir else None
    if manifest is None:
        raise UsageError(f"the engine '{t.engine_dir}' this repository serves is missing; run `rtk build SPEC` again")
    t.target.serve_host_check(manifest, probe_host())


def make_server(
    t: ServeTarget,
    *,
    host: str | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    free_ports: bool = False,
    ready_timeout_s: float = 600.0,
) -> TritonServer:
    """The server for ``t``: the serving section's host and ports (or free ones), its binary, the target's launch."""
    s = t.serving
    ports = (None, None, None) if free_ports else (s.http_port, s.grpc_port, s.metrics_port)
    return TritonServer(
        t.repository,
        host=host or s.host,
        tritonserver=s.tritonserver,
        http_port=http_port or ports[0],
        grpc_port=grpc_port or ports[1],
        metrics_port=metrics_port or ports[2],
        ready_timeout_s=ready_timeout_s,
        launch=t.launch(),
        # rtk writes complete configs; skipping auto-complete saves a stub start per python model.
        extra_args=["--disable-auto-complete-config"],
    )


def make_replicas(
    t: ServeTarget,
    replicas: int,
    *,
    host: str | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    free_ports: bool = False,
    ready_timeout_s: float = 600.0,
) -> list[TritonServer]:
    """``replicas`` servers of ``t`` on one host (one: :func:`make_server` as asked)."""
    kwargs = {"host": host, "ready_timeout_s": ready_timeout_s}
    if replicas == 1:
        return [
            make_server(
                t, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, free_ports=free_ports, **kwargs
            )
        ]
    if replicas < 1:
        raise UsageError(f"--replicas {replicas}: give 1 or more")
    if t.target.name != "cpu":
        raise UsageError(
            f"--replicas runs several servers of the cpu target on one host; a {t.target.name} server "
            "owns its GPUs (use serving.instance_count, or replicas on Kubernetes: rtk deploy k8s)"
        )
    if any(p is not None for p in (http_port, grpc_port, metrics_port)):
        raise UsageError(
            "with --replicas every replica gets its own free ports (listed when ready); "
            "drop --http-port / --grpc-port / --metrics-port"
        )
    # All ports picked at once so no two replicas are handed the same one.
    ports = _free(3 * replicas, (host or t.serving.host).strip("[]"))
    servers = []
    for i in range(replicas):
        server = make_server(
            t, http_port=ports[3 * i], grpc_port=ports[3 * i + 1], metrics_port=ports[3 * i + 2], **kwargs
        )
        # Triton's python backend needs its own shared-memory prefix per server on one host.
        server.extra_args.append(f"--backend-config=python,shm-region-prefix-name=rtk_replica{i}_")
        servers.append(server)
    return servers


def _free(n: int, host: str) -> list[int]:
    return free_ports(n, "127.0.0.1" if host in ("", "0.0.0.0", "localhost") else host)


def serve(
    source: str | Path, *, overrides=(), detach: bool = False, on_ready=None, replicas: int = 1, **server_kwargs
) -> ServerState | list[ServerState] | None:
    """Serve ``source`` until interrupted (or, with ``detach``, start it in the background and return its state:
    one :class:`ServerState`, or a list of them with ``replicas`` > 1).

    ``on_ready(server)`` is called for each server once every model is ready and warm.
    """
    t = resolve(source, overrides)
    check_host(t)
    servers = make_replicas(t, replicas, **server_kwargs)
    if detach:
        states = start_detached_group(servers, models=t.models)
        if replicas == 1:
            _detach_frontdoor(t, states, free_port=server_kwargs.get("free_ports", False))
        return states if replicas > 1 else states[0]
    frontdoor = None
    stop_event = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop_event.set())
    try:
        try:
            for server in servers:
                server.start()
            for server in servers:
                server.wait_ready(models=t.models)
            if replicas == 1:
                frontdoor = _start_frontdoor(t, servers[0], free_port=server_kwargs.get("free_ports", False))
            if on_ready:
                for server in servers:
                    on_ready(server)
            while not stop_event.wait(0.5):
                for server in servers:
                    code = server.process.poll()
                    if code is not None:
                        raise ServerError(f"tritonserver exited with code {code}.\n{server.log_tail()}")
        except KeyboardInterrupt:
            pass
        finally:
            if frontdoor is not None:
                frontdoor.stop()
            for server in servers:
                server.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return None


@contextlib.contextmanager
def running(source: str | Path, *, overrides=(), **server_kwargs):
    """A ready server on ``source`` for the duration of a ``with`` block (``rtk chat``, ``rtk slo --serve``)."""
    t = resolve(source, overrides)
    check_host(t)
    server = make_server(t, **server_kwargs)
    server.start()
    frontdoor = None
    try:
        server.wait_ready(models=t.models)
        frontdoor = _start_frontdoor(t, server, free_port=server_kwargs.get("free_ports", False))
        yield server
    finally:
        if frontdoor is not None:
            frontdoor.stop()
        server.stop()


def _start_frontdoor(t: ServeTarget, server: TritonServer, *, free_port: bool):
    """The repository's front door (toolkit/frontdoor) in this process, on ``server``; its URL is set on
    ``server.frontdoor_url``.  None when ``serving.frontend.enabled`` is false or the target has no ensemble."""
    from ..frontdoor.runner import start_for

    if not t.target.ensemble:
        return None  # llmapi: one model with its own inputs; the front door speaks the ensemble's
    port = _free(1, t.serving.frontend.host)[0] if free_port else None
    frontdoor = start_for(server, t.repository, t.serving, port=port)
    server.frontdoor_url = frontdoor.url if frontdoor is not None else None
    return frontdoor


def _detach_frontdoor(t: ServeTarget, states: list[ServerState], *, free_port: bool) -> None:
    """Start the front door of a detached server as its own process and record it in the state file;
    if it cannot start, the server is stopped too (nothing half-started is left behind)."""
    from ..frontdoor.runner import start_detached

    if not t.target.ensemble or not t.serving.frontend.enabled:
        return
    st = states[0]
    port = _free(1, t.serving.frontend.host)[0] if free_port else None
    log_path = Path(st.log_path).with_name(Path(st.log_path).stem + "-frontdoor.log")
    try:
        st.frontdoor_pid, st.frontdoor_url = start_detached(
            st.grpc_url, st.metrics_url, t.repository, t.serving, log_path, port=port
        )
    except BaseException:
        stop_detached_all(t.repository)
        raise
    write_states(t.repository, states)


def _stop_frontdoors(repository: Path) -> None:
    from ..frontdoor.runner import stop_detached as stop_frontdoor

    for st in read_states(repository):
        stop_frontdoor(st.frontdoor_pid)


def stop(source: str | Path, overrides=()) -> ServerState | None:
    """Stop the detached server(s) of ``source``; returns the (first) state, or None when none was running."""
    repository = _repository(source, overrides)
    _stop_frontdoors(repository)
    return stop_detached(repository)


def stop_all(source: str | Path, overrides=()) -> list[ServerState]:
    """Stop every detached server (all replicas) of ``source`` together; returns those that were running."""
    repository = _repository(source, overrides)
    _stop_frontdoors(repository)
    return stop_detached_all(repository)


def _repository(source: str | Path, overrides=()) -> Path:
    source = Path(source)
    return source if source.is_dir() else load_spec(source, list(overrides)).repository_dir()
