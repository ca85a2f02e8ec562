"""Serving the front door with uvicorn: in a thread of this process, or as its own process.

:class:`FrontDoorServer` is what the server launch starts next to tritonserver and stops with it;
``python -m toolkit.frontdoor`` is the same server as a process (for a detached deployment).
"""

from __future__ import annotations

import logging
import threading
import time

from ..errors import ServerError


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
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

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
