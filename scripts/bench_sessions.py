#!/usr/bin/env python
"""Does a long conversation stay fast?  Turn-8 TTFT against turn-1 TTFT of an 8-turn session, with the engine's
KV reuse on and off.

    flock /tmp/rtk/cpu.lock python scripts/bench_sessions.py --quantized DIR [--format fp8] [--conversations 6]

``DIR`` is a quantize stage output (``hf/`` inside; e.g. engines/<name>/quantized).  The script builds the cpu
engine twice from it (``build.enable_kv_cache_reuse`` true and false), emits each repository, serves it with
a real tritonserver and the front door, and runs ``--conversations`` chats of 8 turns through sessions:
each turn sends only its new user message (about ``--words`` words) with ``session_id``; answers are greedy,
``--max-tokens`` long, so the history grows past 800 tokens by turn 8.  Configurations:

* ``reuse``        — KV reuse on, the session's stored token ids sent (the default);
* ``reuse, text``  — KV reuse on, the history re-tokenised from its text (serving.sessions.exact_ids false);
* ``no reuse``     — KV reuse off: every turn prefills the whole history.

TTFT is from the request's send to its first streamed content chunk (client side, loopback).  Printed: the
median TTFT of each turn, the prompt tokens and the engine's reused blocks at turn 8, and the ratio
turn-8 / turn-1 of the medians (target with reuse: ≤ 1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TOPICS = [
    "the river delta",
    "a mountain railway",
    "the old lighthouse",
    "a desert observatory",
    "the night market",
    "a glacier expedition",
    "the coral reef survey",
    "an orbital station",
]


def message(turn: int, words: int) -> str:
    base = (
        f"Turn {turn}. Here are my notes about {TOPICS[turn % len(TOPICS)]}: the team arrived early, "
        "checked the equipment, wrote down what they saw, compared it with last year's records and argued "
        "about what had changed and why. "
    )
    text = base
    while len(text.split()) < words:
        text += base
    return " ".join(text.split()[:words]) + " Summarise the most important change in one sentence."


def ttft_of(client, url: str, body: dict) -> float:
    sent = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                ev = json.loads(line[6:])
                if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - sent
    return first


def run_config(repo: Path, model: str, args, *, exact_ids: bool, db: Path) -> dict:
    import httpx
    from triton_helpers import running_server

    from toolkit.frontdoor import FrontDoorServer, create_app
    from toolkit.frontdoor.config import config_from
    from toolkit.spec import SessionsSpec
    from toolkit.triton.server import free_ports

    with running_server(repo, ready_timeout_s=600) as triton:
        cfg = config_from(repo)
        cfg.sessions = SessionsSpec(path=str(db), exact_ids=exact_ids)
        with (
            FrontDoorServer(create_app(cfg, triton.grpc_url), "127.0.0.1", free_ports(1)[0]) as fd,
            httpx.Client(timeout=300) as client,
        ):
            ttfts = [[] for _ in range(8)]
            last = None
            for c in range(args.conversations + 1):  # the first conversation warms up and is not counted
                sid = f"bench-{uuid.uuid4().hex[:12]}"
                for t in range(8):
                    body = {
                        "model": model,
                        "session_id": sid,
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                        "stream": True,
                        "messages": [{"role": "user", "content": message(t + 8 * c, args.words)}],
                    }
                    v = ttft_of(client, fd.url, body)
                    if c:
                        ttfts[t].append(v)
                last = client.get(f"{fd.url}/v1/sessions/{sid}").json()
    med = [float(np.median(x)) * 1e3 for x in ttfts]
    return {
        "ttft_ms": med,
        "ratio": med[7] / med[0],
        "turn8": last["stats"][7],
        "turn1": last["stats"][0],
        "tokens": last["tokens"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantized", type=Path, required=True, help="a quantize stage output (with hf/)")
    ap.add_argument("--format", default="fp8", help="its quantization.format")
    ap.add_argument("--conversations", type=int, default=6, help="measured chats (medians of fewer are noisy)")
    ap.add_argument("--words", type=int, default=70)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)

    from toolkit.spec import spec_from_dict
    from toolkit.targets import build
    from toolkit.triton.emit import emit

    results = {}
    with tempfile.TemporaryDirectory(prefix="rtk-bench-sessions-") as tmp:
        tmp = Path(tmp)
        for reuse in (True, False):
            tag = "reuse" if reuse else "noreuse"
            spec = spec_from_dict(
                {
                    "name": f"bench-sessions-{tag}",
                    "model": {"source": str(args.quantized / "hf")},
                    "quantization": {"format": args.format},
                    "build": {
                        "target": "cpu",
                        "max_batch_size": 2,
                        "max_input_len": 1536,
                        "max_seq_len": 2048,
                        "max_num_tokens": 256,
                        "tokens_per_block": 32,
                        "enable_kv_cache_reuse": reuse,
                    },
                    "serving": {"repository": str(tmp / f"repo-{tag}"), "warmup": True},
                }
            )
            engine = build(spec, args.quantized, tmp / f"engine-{tag}").path
            repo = emit(spec, engine).path
            results["reuse" if reuse else "no reuse"] = run_config(
                repo, spec.name, args, exact_ids=True, db=tmp / f"{tag}.sqlite"
            )
            if reuse:
                results["reuse, text"] = run_config(repo, spec.name, args, exact_ids=False, db=tmp / "text.sqlite")
            shutil.rmtree(engine, ignore_errors=True)

    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"\n{when}  load average {load}  cpus {os.cpu_count()}  model {args.quantized} ({args.format})  "
        f"{args.conversations} conversations x 8 turns, {args.words}-word messages, {args.max_tokens} tokens out"
    )
    print(
        "| configuration | "
        + " | ".join(f"turn {i + 1} TTFT ms" for i in range(8))
        + " | turn-8 prompt tokens | reused ids | engine reused blocks | turn-8 / turn-1 |"
    )
    print("|---|" + "---|" * 12)
    for name, r in results.items():
        t8 = r["turn8"]
        print(
            f"| {name} | "
            + " | ".join(f"{v:.0f}" for v in r["ttft_ms"])
            + f" | {t8['prompt_tokens']} | {t8['reused_ids']} | {t8['kv_reused_blocks']} | {r['ratio']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
