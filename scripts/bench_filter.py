#!/usr/bin/env python
"""What the front door and its content filter add to TTFT and per token over Triton's gRPC stream.

    flock /tmp/rtk/cpu.lock python scripts/bench_filter.py [--requests 60] [--tokens 64] [--concurrency 1 8]
        [--paths frontdoor front+filter] [--client raw|httpx] [--metrics] [--compare-frontdoor DIR]
        [--interface ensemble|tensorrt_llm]

One tritonserver serves a paced decoupled model (tests/triton_helpers.py's fake LLM: first token after
``--ttft-ms``, then one every ``--itl-ms``, the text " tok1234" per token), so the engine's own time is
fixed and what differs between paths is the path.  The same closed-loop workload (each of
``--concurrency`` streams sends its next request when the previous one ends) runs these ways, taking
turns ``--rounds`` times:

* ``grpc``          — Triton's gRPC stream, straight from this process with the front door's own backend
  code (grpc.aio, kept ``ModelStreamInfer`` calls);
* ``frontdoor``     — the OpenAI-compatible front door (its own process), SSE over HTTP, no filter;
* ``front+filter``  — the same with a content filter: ``--keywords`` keywords, 8 regular expressions,
  a 32-character hold-back window; nothing in the text matches, so the answer is unchanged;
* ``frontdoor@DIR`` — with ``--compare-frontdoor DIR``: the front door of another tree (e.g. an earlier
  commit, ``git archive <commit> toolkit | tar -x -C DIR``), no filter, in the same run.

``--interface tensorrt_llm`` serves the fake as ``tensorrt_llm`` (token ids in and out) and gives the front
doors the embedded model's tokenizer, so they take their default path (tokenised and detokenised in the
front door, docs/guard.md "The primary path"); the ``grpc`` path then runs the same tokenising and
decoding in this process (``TritonBackend`` with the same ``PromptRules``), so both paths carry the text
work and what differs is still the front door's HTTP side and its own code.  The default, ``ensemble``,
serves the fake as a text-in, text-out ensemble.

``--metrics`` gives the front doors Triton's metrics URL, as ``rtk serve`` does, so they read the
engine's gauges every 100 ms (the fake exports none, but the reads cost what they cost).

The HTTP paths' client is ``--client raw`` (default: asyncio streams on kept-alive connections, one
``readline`` per chunk, about as little work per message as the gRPC path's client) or ``httpx``.  This
process runs on the event loop uvicorn gives the front door, uvloop's where it is installed (``--client-loop
asyncio``: asyncio's own, as every table before 2026-12-06 night was measured), so the gRPC path's client and the
front door's Triton side run on the same kind of loop.

Per request: TTFT (send → first text), E2E (send → last text).  Added per token = (E2E − the grpc path's
median E2E at that concurrency) / tokens, p50 and p99 over requests; the targets are p99 ≤ 0.3 ms for the
front door and ≤ 0.8 ms for front+filter.  ITL is every gap between consecutive chunks.  The hold-back
window delays the first chunk (TTFT) by the time the window takes to fill.  The front door's CPU per
request is its process's CPU time while its path ran, less its idle rate (its Triton poller), over the
requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from toolkit.runtime.os_threads import cpu_seconds

PATTERNS = [
    r"\b\d{3}-\d{2}-\d{4}\b",
    r"\bpass(word)?\s*[:=]",
    r"(?:api|secret)[_-]?key",
    r"\bkill\s+all\b",
    r"\b(?:drop|truncate)\s+table\b",
    r"bearer\s+[a-z0-9]{20,}",
    r"<script\b",
    r"\bcredit\s+card\b",
]

FRONT_DOOR = """
import sys, time, json
sys.path.insert(0, {root!r})
from toolkit.frontdoor import FrontDoorConfig, FrontDoorServer, create_app
from toolkit.spec import FilterSpec
from pathlib import Path
repo = {repo!r}
cfg = FrontDoorConfig(model_name="fake", filter=FilterSpec(**json.loads({flt!r})), max_seq_len=4096,
                      default_max_tokens=16, repository=Path(repo) if repo else None,
                      tokenizer_dir=Path(repo) / "preprocessing/tokenizer" if repo else None)
cfg.sessions = cfg.sessions.model_copy(update={{"enabled": False}})
cfg.jobs = cfg.jobs.model_copy(update={{"enabled": False}})
fd = FrontDoorServer(create_app(cfg, {grpc!r}, metrics_url={metrics!r}), "127.0.0.1", {port})
fd.start()
print("ready", flush=True)
while True:
    time.sleep(3600)
"""


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def start_front_door(
    grpc_url: str, flt: dict, metrics_url: str | None = None, root: Path = ROOT, repo: str | None = None
) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = FRONT_DOOR.format(
        root=str(root), flt=json.dumps(flt), grpc=grpc_url, port=port, metrics=metrics_url, repo=repo
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if "ready" not in p.stdout.readline():
        raise SystemExit("the front door did not start")
    return p, f"http://127.0.0.1:{port}"


async def grpc_request(backend, n_tokens: int) -> tuple[float, list[float], int]:
    from toolkit.frontdoor.protocol import GenRequest

    req = GenRequest(
        kind="chat",
        model="fake",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=n_tokens,
        stream=True,
    )
    sent = time.perf_counter()
    stream = backend.stream(req)
    times, nbytes = [], 0
    while True:
        piece = await stream.next()
        if piece.text:
            times.append(time.perf_counter())
            nbytes += len(piece.text.encode())
        if piece.final:
            break
    return sent, times, nbytes


async def http_request(client, url: str, n_tokens: int) -> tuple[float, list[float], int]:
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": n_tokens,
        "stream": True,
    }
    sent = time.perf_counter()
    times, nbytes = [], 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                text = ev["choices"][0]["delta"].get("content") if ev.get("choices") else None
                if text:
                    times.append(time.perf_counter())
                    nbytes += len(text.encode())
    return sent, times, nbytes


class RawHTTP:
    """A lean HTTP/1.1 client for one kept-alive connection (asyncio streams): the request's bytes are built
    once, the chunked SSE body is read with the least work per token (a token is a chunk whose event has
    ``"content"``), so the client costs about what the gRPC path's client does and the difference is the
    front door's."""

    def __init__(self, url: str, n_tokens: int):
        from urllib.parse import urlsplit

        self.url = urlsplit(url)
        body = json.dumps(
            {
                "model": "fake",
                "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": n_tokens,
                "stream": True,
            }
        ).encode()
        self.request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.idle: list = []

    async def one(self) -> tuple[float, list[float], int]:
        kept = bool(self.idle)
        reader, writer = self.idle.pop() if kept else await asyncio.open_connection(self.url.hostname, self.url.port)
        times, nbytes = [], 0
        sent = time.perf_counter()
        writer.write(self.request)
        status = await reader.readline()
        if not status and kept:  # the server closed the idle connection (uvicorn's keep-alive timeout): anew
            writer.close()
            reader, writer = await asyncio.open_connection(self.url.hostname, self.url.port)
            sent = time.perf_counter()
            writer.write(self.request)
            status = await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        if b" 200 " not in status:
            raise RuntimeError(f"front door: {status!r}")
        while True:  # chunked transfer encoding: size line, data, CRLF; a 0 size ends the body
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                await reader.readline()
                break
            data = await reader.readexactly(size + 2)
            if b'"content"' in data:
                times.append(time.perf_counter())
                i = data.index(b'"content":') + 10
                nbytes += len(json.loads(data[i : data.index(b"}", i)]).encode())
        self.idle.append((reader, writer))
        return sent, times, nbytes

    def close(self) -> None:
        for _, w in self.idle:
            w.close()


async def closed_loop(one, concurrency: int, count: int) -> list[tuple[float, list[float], int]]:
    out = []
    left = [count]

    async def worker():
        while left[0] > 0:
            left[0] -= 1
            out.append(await one())

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def run(args) -> int:
    from triton_helpers import running_server, write_fake_llm

    words = [f"forbidden phrase {i}" for i in range(args.keywords)]
    with tempfile.TemporaryDirectory() as tmp:
        models, tokens = Path(tmp) / "models", None
        fake = dict(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, max_batch_size=16)
        write_fake_llm(models, args.interface, interface=args.interface, **fake)
        if args.interface == "tensorrt_llm":
            # The front doors' "repository": only the tokenizer where an emitted one keeps it.
            from toolkit.fetch import builtin_tokenizer

            tokens = Path(tmp) / "frontdoor"
            builtin_tokenizer().save_pretrained(tokens / "preprocessing/tokenizer")
        with running_server(models) as triton:
            return await measure(args, triton, words, tokens)


async def measure(args, triton, words, tokens: Path | None) -> int:
    import httpx

    from toolkit.frontdoor.triton import TritonBackend

    grpc_url = triton.grpc_url
    backend = TritonBackend(grpc_url, args.interface)
    await backend.open()
    if tokens is not None:
        from toolkit.frontdoor.tokens import ChatTokens, PromptRules

        chat = ChatTokens(tokens / "preprocessing/tokenizer")
        backend.prompts = PromptRules(chat, max_input_len=2048, max_seq_len=4096, context_policy="truncate_oldest")
    filters = {"frontdoor": {}, "front+filter": {"keywords": words, "patterns": PATTERNS, "hold_back_chars": 32}}
    metrics = triton.metrics_url if args.metrics else None
    repo = str(tokens) if tokens is not None else None
    doors = {
        name: start_front_door(grpc_url, flt, metrics, repo=repo) for name, flt in filters.items() if name in args.paths
    }
    if args.compare_frontdoor:
        other = Path(args.compare_frontdoor).resolve()
        doors[f"frontdoor@{other.name}"] = start_front_door(grpc_url, {}, metrics, root=other, repo=repo)
    client = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64))
    raws = {name: RawHTTP(url, args.tokens) for name, (_, url) in doors.items()}
    paths = {"grpc": lambda: grpc_request(backend, args.tokens)}
    for name, (_, url) in doors.items():
        if args.client == "httpx":
            paths[name] = lambda u=url: http_request(client, u, args.tokens)
        else:
            paths[name] = raws[name].one
    expected = None
    idle_cpu = {}  # CPU seconds per second of each front door while idle (its Triton health and metrics poller)
    c0 = {name: cpu_seconds(p.pid) for name, (p, _) in doors.items()}
    await asyncio.sleep(4.0)
    for name, (p, _) in doors.items():
        idle_cpu[name] = (cpu_seconds(p.pid) - c0[name]) / 4.0
    try:
        rows = []
        for c in args.concurrency:
            res = {name: [] for name in paths}
            cpu = dict.fromkeys(paths, 0.0)
            for one in paths.values():  # warm-up
                await closed_loop(one, c, args.warmup)
            for _ in range(args.rounds):
                for name, one in paths.items():
                    pid = doors[name][0].pid if name in doors else None
                    cpu0, wall0 = (cpu_seconds(pid), time.perf_counter()) if pid else (0.0, 0.0)
                    got = await closed_loop(one, c, args.requests // args.rounds)
                    if pid:
                        busy = cpu_seconds(pid) - cpu0 - idle_cpu[name] * (time.perf_counter() - wall0)
                        cpu[name] += busy
                    res[name] += got
                    sizes = {n for _, _, n in got}
                    expected = expected or sizes
                    if sizes != expected:
                        raise SystemExit(f"{name}: answers of {sizes} bytes, expected {expected}")
            base = float(np.median([t[-1] - s for s, t, _ in res["grpc"]]))
            for name, reqs in res.items():
                e2e = [t[-1] - s for s, t, _ in reqs]
                ttft = [t[0] - s for s, t, _ in reqs]
                itl = [b - a for _, t, _ in reqs for a, b in zip(t, t[1:], strict=False)]
                added = [(x - base) / args.tokens * 1e3 for x in e2e]
                rows.append(
                    (
                        c,
                        name,
                        len(reqs),
                        pct(ttft, 50) * 1e3,
                        pct(ttft, 99) * 1e3,
                        pct(itl, 50) * 1e3,
                        pct(itl, 99) * 1e3,
                        pct(e2e, 50) * 1e3,
                        pct(added, 50),
                        pct(added, 99),
                        cpu[name] / len(reqs) * 1e3 if name in doors else float("nan"),
                    )
                )
    finally:
        await client.aclose()
        for r in raws.values():
            r.close()
        await backend.close()
        for p, _ in doors.values():
            p.terminate()
            p.wait(10)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"\n{when}  load average {load}  cpus {os.cpu_count()}  tokens/request {args.tokens}  "
        f"itl {args.itl_ms} ms  filter: {args.keywords} keywords + {len(PATTERNS)} patterns, hold-back 32  "
        f"HTTP client: {args.client}  client loop: {args.client_loop}  "
        f"metrics read: {'yes' if args.metrics else 'no'}  fake: {args.interface}"
    )
    print("front door CPU while idle, ms per s: " + ", ".join(f"{n} {v * 1e3:.1f}" for n, v in idle_cpu.items()))
    print(
        "| streams | path | requests | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | E2E p50 ms "
        "| added/token p50 ms | added/token p99 ms | front door CPU/request ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | " + " | ".join(f"{v:.2f}" for v in r[3:]) + " |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=60, help="measured requests per path and concurrency")
    ap.add_argument("--rounds", type=int, default=3, help="the paths take turns this many times")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--itl-ms", type=float, default=5.0)
    ap.add_argument("--ttft-ms", type=float, default=5.0)
    ap.add_argument("--keywords", type=int, default=200)
    ap.add_argument(
        "--paths",
        nargs="+",
        default=["frontdoor", "front+filter"],
        choices=["frontdoor", "front+filter"],
        help="the front door paths measured beside grpc",
    )
    ap.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="HTTP client: raw (asyncio streams, least work per token, like the gRPC path's) or httpx",
    )
    ap.add_argument("--metrics", action="store_true", help="the front doors read Triton's metrics, as rtk serve's do")
    ap.add_argument(
        "--interface",
        choices=["ensemble", "tensorrt_llm"],
        default="ensemble",
        help="the fake's interface: a text ensemble, or tensorrt_llm (token ids: the front door's default path)",
    )
    ap.add_argument(
        "--compare-frontdoor",
        metavar="DIR",
        help="also measure the front door of the tree in DIR (its toolkit/), no filter, in the same run",
    )
    ap.add_argument(
        "--client-loop",
        choices=["auto", "asyncio"],
        default="auto",
        help="this process's event loop (the grpc path's client and every HTTP client): auto, the loop uvicorn gives "
        "the front door (uvloop's where it is installed), so that both sides of the comparison run on the same kind "
        "of loop; or asyncio's",
    )
    args = ap.parse_args(argv)
    from toolkit.frontdoor.runner import event_loop_factory

    factory, args.client_loop = event_loop_factory(args.client_loop)  # the loop's package, as printed
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
