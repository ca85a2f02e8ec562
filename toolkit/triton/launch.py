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
  recorded in one state file and stop together, with one front door over them all (recorded on the
  first replica's state, as the single server's is).
* :func:`reload` (``rtk serve --reload``): blue/green behind the front door.  A second tritonserver on
  free ports loads and warms the rebuilt repository; the detached front door then sends new requests
  to it while the streams in flight finish on the old one, which then stops (docs/guard.md, "Hot model
  update").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
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
    _is_our_server,
    _wait_pid_gone,
    free_ports,
    priority,
    read_states,
    run_dir,
    set_priority,
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
    if serving.server_niceness is None:  # a repository's record without it: the target's default
        serving = serving.model_copy(update={"server_niceness": target.default_server_niceness})
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
        niceness=s.server_niceness or 0,
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
            frontdoor = _start_frontdoor(t, servers, free_port=server_kwargs.get("free_ports", False))
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


def _start_frontdoor(t: ServeTarget, servers: TritonServer | list[TritonServer], *, free_port: bool):
    """The repository's front door (toolkit/frontdoor) in this process, over ``servers`` (one, or the
    replicas); its URL is set on each one's ``frontdoor_url``.  None when ``serving.frontend.enabled`` is
    false.  It fronts the ensemble, or the llmapi target's one ``tensorrt_llm`` model with that model's own
    inputs (toolkit/frontdoor/triton.py)."""
    from ..frontdoor.runner import start_for

    servers = servers if isinstance(servers, list) else [servers]
    port = _free(1, t.serving.frontend.host)[0] if free_port else None
    frontdoor = start_for(servers, t.repository, t.serving, port=port)
    for server in servers:
        server.frontdoor_url = frontdoor.url if frontdoor is not None else None
    return frontdoor


def _detach_frontdoor(t: ServeTarget, states: list[ServerState], *, free_port: bool) -> None:
    """Start the front door of detached servers (one, or the replicas) as its own process and record it in
    the state file, on the first server's state; if it cannot start, the servers are stopped too (nothing
    half-started is left behind)."""
    from ..frontdoor.runner import start_detached

    if not t.serving.frontend.enabled:
        return
    st = states[0]
    port = _free(1, t.serving.frontend.host)[0] if free_port else None
    log_path = Path(st.log_path).with_name(Path(st.log_path).stem + "-frontdoor.log")
    try:
        st.frontdoor_pid, st.frontdoor_url = start_detached(
            [s.grpc_url for s in states], [s.metrics_url for s in states], t.repository, t.serving, log_path, port=port
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


# -- hot model update: rtk serve --reload ------------------------------------------------------------------


@dataclass
class ReloadResult:
    old: ServerState  # the server that was serving and is now stopped
    new: ServerState  # the one now recorded in the state file
    in_flight: int  # requests in flight at the swap; they finished on the old server
    drained: bool  # False: the drain timeout passed and the old server was stopped with requests left
    seconds: dict[str, float]  # start (new server ready and answering), swap, drain, stop


def reload(
    source: str | Path,
    *,
    overrides=(),
    ready_timeout_s: float = 600.0,
    drain_timeout_s: float = 300.0,
    load_niceness: int = 10,
    on_ready: Callable[[TritonServer], None] | None = None,
) -> ReloadResult:
    """Swap the detached server of ``source`` for a new one on the repository as it is now (after
    ``rtk build``), without dropping a request.  Refused (UsageError, before anything starts) for what
    cannot be swapped; a new server that fails to start, load, warm up or answer is stopped and the old
    one keeps serving (ServerError).  ``on_ready(server)`` runs once the new server answers, before the swap.

    The new server loads and warms up ``load_niceness`` steps below the old one's CPU priority, so the
    requests still served by the old one keep the CPU; it is set back to the old one's priority before
    the swap (raising a priority needs root: without it the new server loads at the old one's priority).
    """
    t = resolve(source, overrides)
    check_host(t)
    old = _swappable(t, source)
    with _reload_lock(t.repository):
        t0 = time.monotonic()
        # Its own ports, so its own python-backend shm prefix (TritonServer's default): the old server's
        # regions stay in use until it stops.
        server = make_server(t, host=old.host, free_ports=True, ready_timeout_s=ready_timeout_s)
        try:
            server.start(detach=True)
            base = priority(old.pid)
            lower = [None if v is None else min(19, v + load_niceness) for v in base]
            # Only as root: setting the priority back is privileged.
            lowered = load_niceness > 0 and os.geteuid() == 0 and set_priority(server.process.pid, *lower)
            server.wait_ready(models=t.models)
            _probe(server)
            if lowered:
                set_priority(server.process.pid, *base)
            if on_ready is not None:
                on_ready(server)
        except BaseException as exc:
            server.stop()
            if isinstance(exc, ServerError):
                raise ServerError(f"the new server did not come up, so {old.http_url} keeps serving: {exc}") from None
            raise
        new = replace(server.state(), frontdoor_url=old.frontdoor_url, frontdoor_pid=old.frontdoor_pid)
        if server._log_file is not None:  # the child keeps its own descriptor
            server._log_file.close()
            server._log_file = None
        t_ready = time.monotonic()
        # Both are recorded while the old one drains: `rtk serve --stop` stops both if this is interrupted.
        write_states(t.repository, [new, old])
        try:
            report = _swap_frontdoor(t.repository, old.frontdoor_pid, new.grpc_url)
        except BaseException:
            write_states(t.repository, [old])
            server.stop()
            raise
        t_swap = time.monotonic()
        drained = _wait_drained(t.repository, new.grpc_url, drain_timeout_s)
        t_drain = time.monotonic()
        _stop_pid(old.pid)
        write_states(t.repository, [new])
        t_stop = time.monotonic()
    return ReloadResult(
        old=old,
        new=new,
        in_flight=int(report.get("in_flight", 0)),
        drained=drained,
        seconds={
            "start": round(t_ready - t0, 2),
            "swap": round(t_swap - t_ready, 2),
            "drain": round(t_drain - t_swap, 2),
            "stop": round(t_stop - t_drain, 2),
        },
    )


def _swappable(t: ServeTarget, source) -> ServerState:
    """The running server to swap out, or UsageError with why it cannot be swapped."""
    why = "; stop and start it instead: rtk serve --stop, then rtk serve --detach"
    launch = t.launch()
    if launch.uses_mpi:
        raise UsageError(
            f"--reload swaps a single-process server; {t.repository} runs under MPI with {launch.ranks} rank(s) "
            f"(build.tp_size x build.pp_size), and a second copy would need GPUs of its own{why}"
        )
    if not t.target.ensemble:
        raise UsageError(
            f"--reload checks the new server with one generation through its ensemble before the swap; the "
            f"{t.target.name} target's repository has no ensemble (its one tensorrt_llm model takes other inputs, "
            f"and that check is not written for it){why}"
        )
    if not t.serving.frontend.enabled:
        raise UsageError(
            "--reload switches servers in the front door, and serving.frontend.enabled is false; enable it "
            f"(requests then go through it){why}"
        )
    states = read_states(t.repository)
    if sum(1 for st in states if st.frontdoor_pid) > 1:
        raise UsageError(
            f"a reload of {t.repository} is running or was interrupted ({len(states)} servers recorded); "
            "wait for it, or stop them all with rtk serve --stop"
        )
    if len(states) > 1:
        raise UsageError(
            f"--reload swaps one server behind its front door; {t.repository} runs {len(states)} replicas "
            f"(--replicas) behind one front door, and swapping them is not supported; stop and start them instead: "
            f"rtk serve --stop, then rtk serve --detach --replicas {len(states)}"
        )
    live = [st for st in states if _is_our_server(st)]
    if not live:
        raise UsageError(f"no detached server of {t.repository} is running; start it with rtk serve {source} --detach")
    old = live[0]
    if not old.frontdoor_pid:
        raise UsageError(f"the server of {t.repository} was started without its front door{why}")
    return old


@contextlib.contextmanager
def _reload_lock(repository: Path):
    path = run_dir(repository) / f"{repository.name}.reload.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"another rtk serve --reload of {repository} is running; wait for it") from None
        yield


def _probe(server: TritonServer, timeout_s: float = 120.0) -> None:
    """One short generation through the whole ensemble: the new server answers, not only loads."""
    body = json.dumps({"text_input": "Hello", "max_tokens": 1}).encode()
    req = urllib.request.Request(
        f"{server.http_url}/v2/models/ensemble/generate", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise ServerError(f"its first request failed ({exc.code}): {detail}\n{server.log_tail()}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServerError(f"its first request failed: {exc}\n{server.log_tail()}") from None


def _swap_frontdoor(repository: Path, frontdoor_pid: int, grpc_url: str, timeout_s: float = 60.0) -> dict:
    """Signal the front door to follow the state file; its report once new requests go to ``grpc_url``."""
    from ..frontdoor.runner import read_swap_report, signal_swap, swap_report_path

    swap_report_path(repository).unlink(missing_ok=True)
    signal_swap(frontdoor_pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = read_swap_report(repository) or {}
        if report.get("grpc_url") == grpc_url and report.get("phase") in ("swapped", "drained"):
            return report
        if report.get("phase") == "failed":
            raise ServerError(f"the front door did not switch to the new server: {report.get('error')}")
        time.sleep(0.05)
    raise ServerError(f"the front door (pid {frontdoor_pid}) did not switch within {timeout_s:.0f} s")


def _wait_drained(repository: Path, grpc_url: str, timeout_s: float) -> bool:
    from ..frontdoor.runner import read_swap_report

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = read_swap_report(repository) or {}
        if report.get("grpc_url") == grpc_url and report.get("phase") == "drained":
            return True
        time.sleep(0.1)
    return False


def _stop_pid(pid: int, timeout_s: float = 30.0) -> None:
    """SIGTERM (Triton finishes what it still runs), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if not _wait_pid_gone(pid, timeout_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_pid_gone(pid, 10)
