"""Start, wait for, and stop ``tritonserver`` on a model repository.

* :func:`find_tritonserver` picks the binary: ``serving.tritonserver`` if set, else ``tritonserver``
  on PATH (NGC containers: ``/opt/tritonserver/bin``), else the one bundled in the
  ``nvidia-pytriton`` wheel.  For the bundled one it prepares what the python backend needs
  : a backend directory of symlinks with the stub built for this
  interpreter's X.Y (in a user cache dir, never inside site-packages), ``PATH`` with this venv's
  ``bin`` first, ``LD_LIBRARY_PATH`` with the base interpreter's ``LIBDIR``, and the flags that
  silence the GPU probes.
* :class:`Launch` is how the server runs for a target (toolkit/targets/: one rank per GPU under
  ``mpirun``, orchestrator mode, extra flags); :class:`TritonServer` builds the command from it, so
  nothing patches a server from outside.
* :class:`TritonServer` starts the process on 127.0.0.1 by default, waits for
  ``GET /v2/health/ready`` (failing fast with the log's tail if the process exits), checks model
  readiness, and stops it with SIGTERM, then SIGKILL.  It is a context manager.
* Detached servers (``rtk serve --detach``) write a small JSON state file beside the repository
  (``<repo parent>/.rtk-triton/<repo name>.json``); :func:`stop_detached` reads it back.  Several
  servers of one repository (``rtk serve --replicas N``) share that file (``{"replicas": [...]}``),
  start together (:func:`start_detached_group`) and stop together; the one front door over them is
  recorded on the first replica's state (``frontdoor_url``, ``frontdoor_pid``), so :func:`read_state`
  finds it as it finds a single server's.

Everything tritonserver prints goes to a log file beside the repository; errors quote its tail.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import ServerError, UsageError
from ..net import Endpoints, connect_host

log = logging.getLogger(__name__)

NGC_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")
STATE_DIR = ".rtk-triton"
RUN_DIR_ENV = "RTK_RUN_DIR"  # where state files and logs go instead (a read-only repository: a pod's volume)


def run_dir(repository: Path) -> Path:
    """``<repo parent>/.rtk-triton``, or ``$RTK_RUN_DIR`` when set."""
    return Path(os.environ[RUN_DIR_ENV]) if os.environ.get(RUN_DIR_ENV) else repository.parent / STATE_DIR


LOG_TAIL_LINES = 30
# Lines the bundled server prints on a host without a GPU; harmless (it probes for CUDA and finds none).
_NOISE = ("CudaDriverHelper has not been initialized",)


# -- finding the binary -----------------------------------------------------------------------


@dataclass(frozen=True)
class TritonBinary:
    """A tritonserver executable and what it needs to run: extra flags and environment."""

    path: Path
    kind: Literal["configured", "system", "bundled"]
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in self.env.items():
            if key in ("PATH", "LD_LIBRARY_PATH") and env.get(key):
                env[key] = f"{value}{os.pathsep}{env[key]}"
            else:
                env[key] = value
        return env


def bundled_tritonserver_root() -> Path | None:
    """``site-packages/pytriton/tritonserver`` of the installed nvidia-pytriton wheel, if any."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    return root if (root / "bin" / "tritonserver").is_file() else None


def user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rtk"


def find_tritonserver(configured: str | os.PathLike | None = None, *, cache_dir: Path | None = None) -> TritonBinary:
    """The tritonserver to use, in the order: configured path, PATH / NGC location, bundled wheel."""
    if configured:
        path = Path(configured).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise UsageError(
                f"serving.tritonserver '{configured}' is not an executable file; "
                "point it at a tritonserver binary or leave it unset to use the one on PATH or the bundled one"
            )
        root = bundled_tritonserver_root()
        if root is not None and path.resolve() == (root / "bin" / "tritonserver").resolve():
            return _bundled(root, cache_dir, kind="configured")
        return TritonBinary(path=path, kind="configured")
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonBinary(path=Path(on_path), kind="system")
    if NGC_TRITONSERVER.is_file():
        return TritonBinary(path=NGC_TRITONSERVER, kind="system")
    root = bundled_tritonserver_root()
    if root is None:
        raise ServerError(
            "no tritonserver found: not on PATH, not at /opt/tritonserver/bin, and nvidia-pytriton is not installed. "
            "Install it with `pip install -c .ci/constraints.txt 'nvidia-pytriton==0.7.0'` (CPU hosts), "
            "use an NGC tritonserver container, or set serving.tritonserver"
        )
    return _bundled(root, cache_dir)


def _bundled(root: Path, cache_dir: Path | None, kind: Literal["configured", "bundled"] = "bundled") -> TritonBinary:
    """The wheel's server plus the backend dir, env and flags its python backend needs."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise ServerError(
            f"this Python ({sys.executable}) is built without a shared libpython, so the bundled tritonserver's "
            "python backend stub cannot run on it; use a Python built with --enable-shared (pyenv: "
            "PYTHON_CONFIGURE_OPTS=--enable-shared) or a system/NGC tritonserver"
        )
    backends, caches = prepare_bundled_backends(root, cache_dir)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    bindir = sysconfig.get_path("scripts")  # <venv>/bin: its python3 makes the stub use this venv
    env = {"PATH": bindir, "LD_LIBRARY_PATH": libdir}
    args = (
        f"--backend-directory={backends}",
        f"--cache-directory={caches}",
        "--pinned-memory-pool-byte-size=0",
        "--allow-gpu-metrics=false",
    )
    return TritonBinary(path=root / "bin" / "tritonserver", kind=kind, args=args, env=env)


def prepare_bundled_backends(root: Path, cache_dir: Path | None = None) -> tuple[Path, Path]:
    """A backend directory of symlinks into the wheel, with the stub for this interpreter's X.Y.

    Made once per (wheel location, Python version) in the user cache dir and renamed into place
    atomically, so concurrent starts never see half of it.  Returns (backends dir, caches dir).
    """
    xy = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / xy / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").glob("*"))
        raise ServerError(
            f"the bundled tritonserver has no python backend stub for Python {xy} (it has {have}); use one of those"
        )
    links = {
        "backends/python/libtriton_python.so": root / "backends/python/libtriton_python.so",
        "backends/python/triton_python_backend_utils.py": root / "backends/python/triton_python_backend_utils.py",
        "backends/python/triton_python_backend_stub": stub,
        "caches": root / "caches",
    }
    key = hashlib.sha256(f"{root.resolve()}|{xy}".encode()).hexdigest()[:12]
    final = (cache_dir or user_cache_dir()) / "triton-backends" / f"py{xy}-{key}"
    if not all((final / rel).resolve() == target.resolve() for rel, target in links.items()):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for rel, target in links.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).symlink_to(target)
        try:
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "backends", final / "caches"


# -- ports ------------------------------------------------------------------------------------


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago (the kernel's choice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _check_port_free(host: str, port: int, what: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ServerError(
                f"{what} port {port} on {host} is already in use ({exc.strerror}); stop what holds it "
                f"or choose another port (serving.{what}_port)"
            ) from None


# -- the server -------------------------------------------------------------------------------


@dataclass
class ServerState(Endpoints):
    """What a detached server leaves behind so another process can find and stop it."""

    pid: int
    repository: str
    binary: str
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: str
    started_unix: float
    frontdoor_url: str | None = None  # the OpenAI-compatible front door (toolkit/frontdoor), when started
    frontdoor_pid: int | None = None


def state_path(repository: str | os.PathLike) -> Path:
    repo = Path(repository).resolve()
    return run_dir(repo) / f"{repo.name}.json"


def _with_parent_death_signal(cmd: list[str]) -> list[str]:
    """``cmd`` under util-linux's ``setpriv --pdeathsig TERM``: the kernel sends the server SIGTERM when
    the thread that started it dies.  Without setpriv, ``cmd`` as it is (the server then outlives a
    killed parent).

    Not a ``preexec_fn``: Python code between fork and exec runs the parent's at-fork handlers in the
    child, and grpcio's, with a ``grpc.aio`` channel busy in another thread (the in-process front
    door), kill that child now and then (SIGSEGV / SIGBUS / SIGABRT before exec, so an empty log).
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        log.debug("setpriv not found; tritonserver will not be stopped if this process is killed")
        return cmd
    return [setpriv, "--pdeathsig", "TERM", *cmd]


@dataclass(frozen=True)
class Launch:
    """How tritonserver runs for a repository; the target supplies it (toolkit/targets/).

    With ``ranks > 1`` or ``mpirun``, the command is ``mpirun [--allow-run-as-root] -n 1 <rank 0> : -n 1
    <rank 1> ...`` as TensorRT-LLM's ``triton_backend/scripts/launch_triton_server.py`` (0a2e2c1) runs
    it: every rank gets the same ports (only rank 0 ever listens: the other ranks' ``tensorrt_llm``
    never finishes loading, its executor runs as an MPI worker of rank 0), its own python-backend
    shared-memory prefix, and ranks > 0 load only ``llm_model``.
    """

    ranks: int = 1
    mpirun: bool = False  # under mpirun even with one rank (the llmapi target with tp x pp > 1)
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment
    server_args: tuple[str, ...] = ()  # flags for every rank
    llm_model: str = "tensorrt_llm"  # the only model ranks > 0 load
    allow_run_as_root: bool | None = None  # None: when running as root (NGC containers do; mpirun refuses otherwise)

    @property
    def uses_mpi(self) -> bool:
        return self.mpirun or self.ranks > 1


class TritonServer(Endpoints):
    """One tritonserver process serving ``repository``.

    ``with TritonServer(repo, http_port=..., grpc_port=..., metrics_port=...) as srv:`` starts it,
    waits until it is ready (``ready_timeout_s``) and stops it on exit.  Ports default to free ones
    chosen here.  ``model_control_mode='explicit'`` loads only ``load_models`` (``['*']`` = all).
    """

    frontdoor_url: str | None = None  # set by toolkit/triton/launch.py when it starts the front door

    def __init__(
        self,
        repository: str | os.PathLike,
        *,
        binary: TritonBinary | None = None,
        tritonserver: str | None = None,
        host: str = "127.0.0.1",
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        model_control_mode: Literal["none", "explicit"] = "none",
        load_models: Iterable[str] = (),
        exit_timeout_s: int = 10,
        cache_config: str | None = None,
        log_path: str | os.PathLike | None = None,
        log_verbose: int = 0,
        extra_args: Iterable[str] = (),
        ready_timeout_s: float = 120.0,
        launch: Launch | None = None,
        niceness: int = 0,
    ):
        self.repository = Path(repository).resolve()
        self._binary = binary
        self._configured = tritonserver
        self.host = host
        if None in (http_port, grpc_port, metrics_port):
            picked = iter(free_ports(3, connect_host(host).strip("[]")))
            http_port, grpc_port, metrics_port = (
                p if p is not None else next(picked) for p in (http_port, grpc_port, metrics_port)
            )
        self.http_port, self.grpc_port, self.metrics_port = int(http_port), int(grpc_port), int(metrics_port)
        if model_control_mode not in ("none", "explicit"):
            raise UsageError(f"model_control_mode '{model_control_mode}' is not 'none' or 'explicit'")
        self.model_control_mode = model_control_mode
        self.load_models = list(load_models)
        self.exit_timeout_s = int(exit_timeout_s)
        self.cache_config = cache_config
        self.log_path = (
            Path(log_path) if log_path else run_dir(self.repository) / f"{self.repository.name}-{self.http_port}.log"
        )
        self.log_verbose = log_verbose
        self.extra_args = list(extra_args)
        self.ready_timeout_s = ready_timeout_s
        self.launch = launch or Launch()
        self.niceness = int(niceness)
        self.process: subprocess.Popen | None = None
        self._log_file = None

    @property
    def binary(self) -> TritonBinary:
        if self._binary is None:
            self._binary = find_tritonserver(self._configured)
        return self._binary

    def rank_command(self, rank: int = 0) -> list[str]:
        """One rank's tritonserver command line (the whole command without MPI)."""
        b, launch = self.binary, self.launch
        control = "explicit" if rank > 0 else self.model_control_mode
        cmd = [
            str(b.path),
            f"--model-repository={self.repository}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--model-control-mode={control}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
            *b.args,
        ]
        if rank > 0:
            cmd.append(f"--load-model={launch.llm_model}")
        elif self.model_control_mode == "explicit":
            cmd += [f"--load-model={m}" for m in self.load_models]
        if self.cache_config:
            cmd.append(f"--cache-config={self.cache_config}")
        if launch.uses_mpi:
            cmd.append(f"--backend-config=python,shm-region-prefix-name=prefix{rank}_")
        elif not any("shm-region-prefix-name" in a for a in self.extra_args):
            # Every python-backend server on a host needs its own shared-memory prefix (nvidia-pytriton
            # gives each of its servers one too); the HTTP port is unique among running servers.
            cmd.append(f"--backend-config=python,shm-region-prefix-name=rtk{self.http_port}_")
        return cmd + list(launch.server_args) + self.extra_args

    def command(self) -> list[str]:
        launch = self.launch
        if not launch.uses_mpi:
            return self.rank_command(0)
        as_root = os.geteuid() == 0 if launch.allow_run_as_root is None else launch.allow_run_as_root
        argv = ["mpirun"] + (["--allow-run-as-root"] if as_root else [])
        for rank in range(launch.ranks):
            if rank:
                argv.append(":")
            argv += ["-n", "1", *self.rank_command(rank)]
        return argv

    def environment(self) -> dict[str, str]:
        return {**self.binary.environment(), **self.launch.env}

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, *, detach: bool = False) -> TritonServer:
        """Launch the process (does not wait). ``detach``: survive this Python process."""
        if self.process is not None and self.process.poll() is None:
            raise ServerError(f"tritonserver is already running (pid {self.process.pid})")
        if not self.repository.is_dir():
            raise UsageError(
                f"model repository '{self.repository}' is not a directory; build it first (rtk build) "
                "or pass the right path"
            )
        for what, port in (("http", self.http_port), ("grpc", self.grpc_port), ("metrics", self.metrics_port)):
            _check_port_free(self.host or "0.0.0.0", port, what)
        cmd = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = open(self.log_path, "wb")
        log.info("starting %s", " ".join(cmd))
        # Attached from the main thread, the kernel also sends the server SIGTERM if this process dies
        # without stopping it (the signal follows the starting thread, so not from other threads).
        if not detach and threading.current_thread() is threading.main_thread():
            cmd = _with_parent_death_signal(cmd)
        self.process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,  # own session: Ctrl-C reaches us, and we stop the server in order
        )
        if self.niceness > 0:  # before its models load: the stubs it starts inherit the niceness
            pid = self.process.pid
            if not set_priority(pid, self.niceness, self.niceness if priority(pid)[1] is not None else None):
                log.warning("could not lower tritonserver's CPU priority to niceness %d", self.niceness)
        return self

    def is_ready(self) -> bool:
        return http_ready(self.http_url)

    def model_ready(self, model: str, version: str | None = None) -> bool:
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/ready"
        return _http_status(self.http_url + path) == 200

    def wait_ready(self, timeout: float | None = None, models: Iterable[str] = ()) -> TritonServer:
        """Poll until the server (and ``models``) are ready; raise ServerError with the log tail otherwise."""
        if self.process is None:
            raise ServerError("tritonserver was not started; call start() first")
        timeout = self.ready_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        models = list(models)
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerError(
                    f"tritonserver exited with code {code} before it was ready.\n{self._tail_for_error()}"
                )
            if self.is_ready() and all(self.model_ready(m) for m in models):
                if self.process.poll() is None:  # the answer came from our process, not a stale one
                    return self
            if time.monotonic() > deadline:
                waiting = (
                    "server"
                    if not self.is_ready()
                    else "models " + ", ".join(m for m in models if not self.model_ready(m))
                )
                raise ServerError(
                    f"tritonserver was not ready after {timeout:.0f} s (waiting for {waiting}).\n"
                    f"{self._tail_for_error()}"
                )
            time.sleep(0.05)

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, wait up to ``timeout`` (exit timeout + 10 s), then SIGKILL. Returns the exit code."""
        proc = self.process
        if proc is None:
            return None
        timeout = self.exit_timeout_s + 10 if timeout is None else timeout
        code = proc.poll()
        if code is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver (pid %d) did not exit %.0f s after SIGTERM; killing it", proc.pid, timeout)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                code = proc.wait()
        # Its python stubs are in its process group (start_new_session): one that outlived a server that was
        # killed or crashed would linger with its shared memory, so whatever is left of the group goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _wait_group_gone(proc.pid, 5.0)  # SIGKILL is not instant: none of the group is left on return
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def _tail_for_error(self) -> str:
        return f"Last lines of {self.log_path}:\n{self.log_tail()}"

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- detached mode --------------------------------------------------------------------
    def state(self) -> ServerState:
        if self.process is None:
            raise ServerError("tritonserver was not started")
        return ServerState(
            pid=self.process.pid,
            repository=str(self.repository),
            binary=str(self.binary.path),
            host=self.host,
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            metrics_port=self.metrics_port,
            log_path=str(self.log_path),
            started_unix=time.time(),
        )

    def start_detached(self, timeout: float | None = None, models: Iterable[str] = ()) -> ServerState:
        """Start a server that outlives this process, wait until ready, write its state file."""
        return start_detached_group([self], timeout, models)[0]


def start_detached_group(
    servers: list[TritonServer], timeout: float | None = None, models: Iterable[str] = ()
) -> list[ServerState]:
    """Start servers of one repository that outlive this process, wait until all are ready, then write
    their one state file.  If any fails, every one started is stopped and nothing is recorded."""
    repository = servers[0].repository
    path = state_path(repository)
    old = [st for st in read_states(repository) if _is_our_server(st)]
    if old:
        raise ServerError(
            f"a detached tritonserver (pid {', '.join(str(st.pid) for st in old)}) already serves {repository}; "
            f"stop it first (rtk serve --stop) or remove {path} if it is stale"
        )
    models = list(models)
    started = []
    try:
        for server in servers:
            server.start(detach=True)
            started.append(server)
        for server in servers:
            server.wait_ready(timeout, models)
    except BaseException:
        for server in started:
            server.stop()
        raise
    states = [server.state() for server in servers]
    write_states(repository, states)
    for server in servers:
        if server._log_file is not None:  # the child keeps its own descriptor
            server._log_file.close()
            server._log_file = None
    return states


def write_states(repository: str | os.PathLike, states: list[ServerState]) -> None:
    """Write the state file of ``repository`` (atomically: another process never reads half of it)."""
    path = state_path(repository)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(states[0]) if len(states) == 1 else {"replicas": [asdict(st) for st in states]}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _http_status(url: str, timeout: float = 1.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def http_ready(http_url: str, timeout: float = 1.0) -> bool:
    """Triton at ``http_url`` answers ``GET /v2/health/ready`` with 200."""
    return _http_status(f"{http_url}/v2/health/ready", timeout) == 200


def log_tail(path: str | os.PathLike, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    kept = [ln for ln in text.splitlines() if ln.strip() and not any(n in ln for n in _NOISE)]
    tail = kept[-lines:]
    # glog's error lines (E<mmdd> ...: a model that failed to load says why there) scroll out of the tail
    # while the server unloads the others; they come first
    errors = [ln for ln in kept[: len(kept) - len(tail)] if re.match(r"E\d{4} ", ln)][-10:]
    return "\n".join([*errors, *(["..."] if errors else []), *tail]) or "(log is empty)"


def read_states(repository: str | os.PathLike) -> list[ServerState]:
    """Every detached server recorded for ``repository``: one, or one per replica."""
    try:
        data = json.loads(state_path(repository).read_text())
        items = data["replicas"] if isinstance(data, dict) and "replicas" in data else [data]
        return [ServerState(**item) for item in items]
    except (OSError, ValueError, TypeError, KeyError):
        return []


def read_state(repository: str | os.PathLike) -> ServerState | None:
    """The detached server of ``repository`` (with replicas: the first)."""
    states = read_states(repository)
    return states[0] if states else None


def _is_our_server(st: ServerState) -> bool:
    """True when ``st.pid`` is alive and still the tritonserver serving ``st.repository`` (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{st.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a.decode(errors="replace") == f"--model-repository={st.repository}" for a in cmdline)


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (zombies, already dead, do not count)."""
    members = []
    if not os.path.isdir("/proc"):  # not Linux: nothing to wait on
        return members
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if fields[0] != b"Z" and int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() >= deadline:
            log.warning("processes of tritonserver's group %d are still there %.0f s after SIGKILL", pgid, timeout)
            return False
        time.sleep(0.02)
    return True


def _wait_pid_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:  # reap it if it is our child, so a zombie does not look alive
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def stop_detached(repository: str | os.PathLike, timeout: float = 30.0) -> ServerState | None:
    """Stop the detached server(s) of ``repository`` (SIGTERM, then SIGKILL).

    Returns the (first) stopped state, or None when none was running (a stale state file is removed).
    """
    stopped = stop_detached_all(repository, timeout)
    return stopped[0] if stopped else None


def stop_detached_all(repository: str | os.PathLike, timeout: float = 30.0) -> list[ServerState]:
    """Stop every detached server of ``repository`` together; returns those that were running."""
    running = [st for st in read_states(repository) if _is_our_server(st)]
    for st in running:  # all get SIGTERM first: the replicas drain in parallel
        with contextlib.suppress(ProcessLookupError):
            os.kill(st.pid, signal.SIGTERM)
    for st in running:
        if not _wait_pid_gone(st.pid, timeout):
            log.warning("tritonserver (pid %d) did not exit %.0f s after SIGTERM; killing it", st.pid, timeout)
            with contextlib.suppress(ProcessLookupError):
                os.kill(st.pid, signal.SIGKILL)
            _wait_pid_gone(st.pid, 10)
        # as TritonServer.stop: a python stub that outlives its server keeps its shared memory, whose names
        # (shm-region-prefix-name, from the port) the next server on that port takes again
        if group_members(st.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(st.pid, signal.SIGKILL)
            _wait_group_gone(st.pid, 5.0)
    with contextlib.suppress(OSError):
        state_path(repository).unlink()
    return running


def priority(pid: int) -> tuple[int, int | None]:
    """A server's CPU priority: its niceness, and its autogroup's where the kernel has autogroups.

    With autogroups (``/proc/sys/kernel/sched_autogroup_enabled``) the scheduler first shares the CPU between
    sessions, and a server runs in a session of its own, so only its autogroup's niceness ranks it against the
    processes of other sessions (the front door, a client, another server); a process's niceness counts only
    inside its own session."""
    try:
        group = int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        group = None
    return os.getpriority(os.PRIO_PROCESS, pid), group


def set_priority(pgid: int, niceness: int, group: int | None) -> bool:
    """Set the niceness of a server's process group (tritonserver and the python stubs it starts) and its
    autogroup's (``group``; None: leave it).  Raising a niceness needs no privilege, lowering one needs
    CAP_SYS_NICE."""
    try:
        os.setpriority(os.PRIO_PGRP, pgid, niceness)
        if group is not None:
            Path(f"/proc/{pgid}/autogroup").write_text(str(group))
    except OSError:
        return False
    return True
