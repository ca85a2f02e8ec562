"""Serving the front door with uvicorn: in a thread of this process, or as its own process.

:class:`FrontDoorServer` is what the server launch starts next to tritonserver and stops with it;
``python -m toolkit.frontdoor`` is the same server as a process (for a detached deployment).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from ..errors import ServerError
from ..net import http_url


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
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
            log_config=None,
        )
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    def start(self) -> FrontDoorServer:
        self.thread = threading.Thread(target=self.server.run, name="rtk-frontdoor", daemon=True)
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

    def stop(self) -> None:
        if self.thread is None:
            return
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.thread = None

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


def start_for(server, repository, serving, *, port: int | None = None) -> FrontDoorServer | None:
    """Start the front door of a ready ``server`` in this process (``rtk serve`` foreground, chat, slo --serve);
    None when ``serving.frontend.enabled`` is false."""
    from .app import create_app

    if not serving.frontend.enabled:
        return None
    quiet_third_party()
    cfg = config_for(repository, serving)
    app = create_app(cfg, server.grpc_url, metrics_url=server.metrics_url)
    return FrontDoorServer(app, serving.frontend.host, port or serving.frontend.port).start()


def start_detached(
    grpc_url: str, metrics_url: str, repository, serving, log_path, *, port: int | None = None, timeout_s: float = 60.0
):
    """Start the front door as its own process that outlives this one; returns (pid, url) once it listens,
    or None when ``serving.frontend.enabled`` is false.  Its output goes to ``log_path``."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not serving.frontend.enabled:
        return None
    sections = {n: getattr(serving, n).model_dump(mode="json") for n in SERVER_SECTIONS if hasattr(serving, n)}
    ready = Path(log_path).with_suffix(".ready")
    ready.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "toolkit.frontdoor",
        str(repository),
        "--triton-grpc",
        grpc_url,
        "--metrics-url",
        metrics_url,
        "--serving-json",
        json.dumps(sections),
        "--ready-file",
        str(ready),
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


def stop_detached(pid: int | None, timeout_s: float = 10.0) -> None:
    """Stop a front door process started by :func:`start_detached` (SIGTERM, then SIGKILL)."""
    import os
    import signal
    from pathlib import Path

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
