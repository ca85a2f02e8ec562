"""Serving the front door with uvicorn: in a thread of this process, or as its own process.

:class:`FrontDoorServer` is what the server launch starts next to tritonserver and stops with it;
``python -m toolkit.frontdoor`` is the same server as a process (for a detached deployment).

Hot model update (``rtk serve --reload``, toolkit/triton/launch.py): a detached front door follows its
repository's state file.  On SIGHUP it reads the state file again and, when the first server recorded
there is another tritonserver than the one it uses, sends new requests to it
(:meth:`~toolkit.frontdoor.app.FrontDoor.swap_backend`); the requests in flight finish on the old one.
It reports in :func:`swap_report_path` (``swapped``, then ``drained`` once those requests are done, or
``failed`` with the reason).  Only a process that may signal the front door and write the state file
can move it, so the hook needs no key and opens nothing on the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from ..errors import ServerError
from ..net import http_url

log = logging.getLogger("rtk.frontdoor")


def event_loop_factory(kind: str = "auto"):
    """``(factory, name)`` of uvicorn's event loop ``kind``: ``auto``, the loop the front door runs on (uvloop's where
    it is installed, asyncio's otherwise), or ``asyncio``; benchmarks run their clients on the front door's kind."""
    from uvicorn.loops.asyncio import asyncio_loop_factory
    from uvicorn.loops.auto import auto_loop_factory

    factory = (auto_loop_factory if kind == "auto" else asyncio_loop_factory)()
    return factory, factory.__module__.split(".")[0]


class FrontDoorServer:
    """``with FrontDoorServer(app, host, port): ...`` or ``start()`` / ``stop()``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8080, ready_timeout_s: float = 30.0):
        import uvicorn

        self.host, self.port, self.ready_timeout_s = host, port, ready_timeout_s
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            # uvloop's loop where it is installed (a dependency of rtk on Linux and macOS), asyncio's otherwise;
            # grpc.aio's Triton streams run on it too
            loop="auto",
            access_log=False,
            # Per request: no X-Forwarded-* middleware (nothing here reads the client's address) and no
            # ``server`` header (one header less to build and check).
            proxy_headers=False,
            server_header=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
            log_config=None,
        )
        self.app = app
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._swap_lock: asyncio.Lock | None = None

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    def start(self) -> FrontDoorServer:
        self.thread = threading.Thread(target=self._run, name="rtk-frontdoor", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise ServerError(
                    f"the front door could not start on {self.host}:{self.port} "
                    "(port in use? see serving.frontend.port)"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"the front door did not start on {self.host}:{self.port} within {self.ready_timeout_s:.0f} s"
                )
            time.sleep(0.02)
        return self

    def _run(self) -> None:
        """uvicorn's ``Server.run``, keeping the event loop so another thread can hand it work."""
        with asyncio.Runner(loop_factory=self.server.config.get_loop_factory()) as runner:
            self.loop = runner.get_loop()
            runner.run(self.server.serve())

    def stop(self) -> None:
        if self.thread is None:
            return
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.thread = None

    # -- hot model update ------------------------------------------------------------------------------
    def follow_state_file(self, repository) -> None:
        """SIGHUP: switch to the server the state file of ``repository`` names (main thread only)."""
        signal.signal(signal.SIGHUP, lambda *_: self.request_swap(repository))

    def request_swap(self, repository) -> None:
        if self.loop is not None and not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._swap(Path(repository)), self.loop)

    async def _swap(self, repository: Path) -> None:
        from ..triton.server import read_state

        if self._swap_lock is None:
            self._swap_lock = asyncio.Lock()
        report = swap_report_path(repository)
        async with self._swap_lock:  # one swap at a time, in the order asked
            fd = self.app.state.frontdoor
            st = read_state(repository)
            if len(fd.replicas) > 1:
                _write_report(report, phase="failed", error=f"this front door serves {len(fd.replicas)} replicas")
                return
            if st is None:
                _write_report(report, phase="failed", error=f"no server is recorded for {repository}")
                return
            if st.grpc_url == fd.backend.grpc_url:
                _write_report(report, phase="drained", grpc_url=st.grpc_url, in_flight=0)
                return
            try:
                old, in_flight = await fd.swap_backend(st.grpc_url, st.metrics_url)
            except Exception as exc:  # noqa: BLE001 — reported to rtk serve --reload; the old server keeps serving
                _write_report(report, phase="failed", grpc_url=st.grpc_url, error=str(exc))
                return
            log.info(
                "front door: new requests go to %s; %d in flight finish on the old server", st.grpc_url, len(in_flight)
            )
            _write_report(report, phase="swapped", grpc_url=st.grpc_url, in_flight=len(in_flight))
            while in_flight & fd.estimator.inflight.keys():
                await asyncio.sleep(0.05)
            for backend in old:
                await backend.close()
            _write_report(report, phase="drained", grpc_url=st.grpc_url, in_flight=len(in_flight))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def quiet_third_party() -> None:
    """uvicorn's and httpx's chatter goes to the log, not the console."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(name).propagate = True
        logging.getLogger(name).setLevel(logging.WARNING)


# -- with the server launch (toolkit/triton/launch.py) ---------------------------------------------------

SERVER_SECTIONS = ("frontend", "guard", "cache", "filter", "sessions", "jobs")  # front-door sections of `serving`


def config_for(repository, serving, *, triton_model: str = "ensemble"):
    """The front door's config for a served repository: the manifest's model limits, and the front-door
    sections of ``serving`` (the spec's, which may differ from the emitted ones: they are server-only)."""
    from .config import config_from

    cfg = config_from(repository, triton_model=triton_model)
    for name in SERVER_SECTIONS:
        if hasattr(cfg, name) and hasattr(serving, name):
            setattr(cfg, name, getattr(serving, name).model_copy(deep=True))
    if serving.frontend.model_name:
        cfg.model_name = serving.frontend.model_name
    return cfg


def start_for(servers, repository, serving, *, port: int | None = None) -> FrontDoorServer | None:
    """Start the front door of a ready server, or of a list of ready replicas, in this process (``rtk serve``
    foreground, chat, slo --serve); None when ``serving.frontend.enabled`` is false."""
    from .app import create_app

    if not serving.frontend.enabled:
        return None
    quiet_third_party()
    cfg = config_for(repository, serving)
    servers = servers if isinstance(servers, list) else [servers]
    app = create_app(cfg, [s.grpc_url for s in servers], metrics_url=[s.metrics_url for s in servers])
    return FrontDoorServer(app, serving.frontend.host, port or serving.frontend.port).start()


def start_detached(
    grpc_url: str | list[str],
    metrics_url: str | list[str],
    repository,
    serving,
    log_path,
    *,
    port: int | None = None,
    timeout_s: float = 60.0,
):
    """Start the front door as its own process that outlives this one, over one server or over replicas (lists
    of their gRPC addresses and metrics URLs); returns (pid, url) once it listens, or None when
    ``serving.frontend.enabled`` is false.  Its output goes to ``log_path``."""
    import subprocess
    import sys

    if not serving.frontend.enabled:
        return None
    sections = {n: getattr(serving, n).model_dump(mode="json") for n in SERVER_SECTIONS if hasattr(serving, n)}
    ready = Path(log_path).with_suffix(".ready")
    ready.unlink(missing_ok=True)
    grpc_urls = [grpc_url] if isinstance(grpc_url, str) else grpc_url
    metrics_urls = [metrics_url] if isinstance(metrics_url, str) else metrics_url
    cmd = [
        sys.executable,
        "-m",
        "toolkit.frontdoor",
        str(repository),
        *(a for url in grpc_urls for a in ("--triton-grpc", url)),
        *(a for url in metrics_urls for a in ("--metrics-url", url)),
        "--serving-json",
        json.dumps(sections),
        "--ready-file",
        str(ready),
        "--follow-state-file",
    ] + (["--port", str(port)] if port else [])
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ.copy(),
        )
    deadline = time.monotonic() + timeout_s
    while not ready.is_file():
        if proc.poll() is not None:
            raise ServerError(f"the front door exited with code {proc.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise ServerError(f"the front door did not start within {timeout_s:.0f} s; see {log_path}")
        time.sleep(0.05)
    url = ready.read_text().strip()
    ready.unlink(missing_ok=True)
    return proc.pid, url


def swap_report_path(repository) -> Path:
    """Where a detached front door reports a swap: beside the state file, ``<repository name>.frontdoor-swap.json``."""
    from ..triton.server import state_path

    path = state_path(repository)
    return path.with_name(path.stem + ".frontdoor-swap.json")


def _write_report(path: Path, **report) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({**report, "unix": time.time()}) + "\n")
    tmp.replace(path)


def read_swap_report(repository) -> dict | None:
    try:
        return json.loads(swap_report_path(repository).read_text())
    except (OSError, ValueError):
        return None


def signal_swap(pid: int) -> None:
    """Ask the detached front door ``pid`` to follow its state file (only a front door process is signalled)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        cmdline = []
    if b"toolkit.frontdoor" not in cmdline:
        raise ServerError(f"the front door (pid {pid}) is not running; restart the server (rtk serve --stop, --detach)")
    if b"--follow-state-file" not in cmdline:  # SIGHUP would end it
        raise ServerError(
            f"the front door (pid {pid}) was started without --follow-state-file (by an older rtk), so it cannot "
            "switch servers; restart the server once (rtk serve --stop, then --detach)"
        )
    os.kill(pid, signal.SIGHUP)


def stop_detached(pid: int | None, timeout_s: float = 10.0) -> None:
    """Stop a front door process started by :func:`start_detached` (SIGTERM, then SIGKILL)."""
    if not pid:
        return
    try:
        if b"toolkit.frontdoor" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return  # gone, and the pid now belongs to another process
    except OSError:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    from ..triton.server import _wait_pid_gone  # reaps it when it is our child (a zombie looks alive)

    if not _wait_pid_gone(pid, timeout_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_pid_gone(pid, 5)
