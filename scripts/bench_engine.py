#!/usr/bin/env python
"""rtk's CPU engine against transformers, measured in one run on the same model and machine.

Model: the embedded SmolLM2-135M-Instruct (bf16 checkpoint from ``rtk fetch``), or ``--checkpoint``.
Each side runs in the dtype it is fastest in here (bf16 on a CPU with AVX512-BF16; named in the
table).  Parity of the tokens is checked by the tests (tests/test_runtime_*.py), not here.

1. **Memory bandwidth** the machine gives this process, STREAM-style: a sum over a 1 GiB float32
   buffer (32x this host's last-level cache, so every byte comes from DRAM) with the same thread
   count, ``--bw-repeats`` reads; the median is used and min / max are printed.  The bound for a
   batch-1 decode is ``bandwidth / bytes of weights read per token``.
2. **Batch 1**: time to first token and decode tokens/s of one request (prompt of ~``--prompt``
   tokens, ``--new`` tokens) vs ``transformers`` ``generate`` (timed per token by a streamer).
3. **Share of the bandwidth bound** reached by the engine's batch-1 decode: each batch-1 run is paired
   with a probe of ``--bw-pair-reads`` reads taken just before it, and the share is the median of the
   runs' shares (a VM's bandwidth can move by half within minutes: one probe at the start of the run
   would credit or blame the engine for the host's phase).
4. **8 concurrent requests**: aggregate output tokens/s of the engine vs the same 8 requests as
   one batched ``generate`` call (left padding; the prompts have equal length here, so no pad
   token is computed).
5. **Inter-token latency p99 / p50** over 8 streams while a long prompt arrives mid-stream and
   is prefilled in chunks of the step budget (``--itl-budget`` tokens per step); the same with one
   step per prompt (no chunking) for contrast.

Every figure is the median of ``--repeats`` runs; engine and transformers runs are interleaved so
that load from other processes falls on both.  Usage::

    python scripts/bench_engine.py [--threads 2] [--repeats 5] [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from toolkit.runtime.engine import Engine, EngineConfig, GenerationRequest  # noqa: E402


def default_checkpoint() -> Path:
    """The embedded model as a bf16 checkpoint, fetched once into rtk's cache."""
    from toolkit.fetch import fetch
    from toolkit.spec import spec_from_dict

    out = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rtk" / "bench" / "smollm2" / "checkpoint"
    spec = spec_from_dict({"name": "bench", "model": {"source": "builtin:smollm2-135m-instruct"}})
    return fetch(spec, output=out).path


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` distinct prompts of exactly ``length`` tokens from the shipped held-out texts."""
    from toolkit.quality import builtin_texts

    ids = tokenizer("\n".join(builtin_texts("eval")), add_special_tokens=False)["input_ids"]
    if len(ids) < n * length:
        ids = ids * (n * length // len(ids) + 1)
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def read_bandwidth(repeats: int, gib: float = 1.0) -> list[float]:
    """Bytes/s of ``repeats`` full reads of a ``gib`` GiB buffer (written first, so its pages exist)."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        rates.append(x.numel() * 4 / (time.perf_counter() - t))
    return rates


class Stamps:
    """A transformers streamer that records when each new token arrives."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_run(model, ids: list[int], new: int) -> tuple[float, float, float]:
    """(ttft s, decode tokens/s, total s) of one transformers generate()."""
    s = Stamps()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            torch.tensor([ids]),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            streamer=s,
            eos_token_id=None,
            pad_token_id=0,
        )
    total = time.perf_counter() - t0
    return s.times[0] - t0, (len(s.times) - 1) / (s.times[-1] - s.times[0]), total


def engine_run(engine: Engine, ids: list[int], new: int) -> tuple[float, float, float]:
    t0 = time.time_ns()
    rid = engine.add_request(GenerationRequest(prompt_ids=ids, max_new_tokens=new, end_id=-1))
    stamps = []
    while engine.has_work():
        stamps += [e.time_ns for e in engine.step() if e.request_id == rid and e.token_id is not None]
    total = (time.time_ns() - t0) / 1e9
    rate = (len(stamps) - 1) / ((stamps[-1] - stamps[0]) / 1e9) if len(stamps) > 1 else float("nan")
    return (stamps[0] - t0) / 1e9, rate, total


def engine_concurrent(engine: Engine, batch: list[list[int]], new: int) -> float:
    t0 = time.perf_counter()
    for ids in batch:
        engine.add_request(GenerationRequest(prompt_ids=ids, max_new_tokens=new, end_id=-1))
    n = 0
    while engine.has_work():
        n += sum(1 for e in engine.step() if e.token_id is not None)
    return n / (time.perf_counter() - t0)


def hf_batched(model, batch: list[list[int]], new: int) -> float:
    """Aggregate output tokens/s of one batched ``generate`` over ``batch`` (left-padded)."""
    width = max(len(ids) for ids in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return len(batch) * new / (time.perf_counter() - t0)


def itl_ratio(
    engine: Engine, streams: list[list[int]], long_prompt: list[int], new: int, arrive_after: int
) -> tuple[float, float, float, float]:
    """(p50 ms, p99 ms, p99/p50, long prompt's ttft s) of the streams' inter-token latencies."""
    rids = [engine.add_request(GenerationRequest(prompt_ids=ids, max_new_tokens=new, end_id=-1)) for ids in streams]
    stamps: dict[str, list[int]] = {r: [] for r in rids}
    steps, long_id, long_t0, long_first = 0, None, 0, None
    while engine.has_work():
        if steps == arrive_after:
            long_t0 = time.time_ns()
            long_id = engine.add_request(GenerationRequest(prompt_ids=long_prompt, max_new_tokens=4, end_id=-1))
        for e in engine.step():
            if e.token_id is None:
                continue
            if e.request_id in stamps:
                stamps[e.request_id].append(e.time_ns)
            elif e.request_id == long_id and long_first is None:
                long_first = e.time_ns
        steps += 1
    itls = sorted((b - a) / 1e6 for s in stamps.values() for a, b in itertools.pairwise(s))
    p50 = statistics.median(itls)
    p99 = itls[min(len(itls) - 1, int(0.99 * len(itls)))]
    return p50, p99, p99 / p50, (long_first - long_t0) / 1e9


def profile_decode(engine: Engine, batch: list[list[int]], steps: int = 10, rows: int = 20) -> None:
    """torch.profiler's table of ``steps`` decode steps at batch 1 and at ``len(batch)``, and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    for b in (1, len(batch)):
        for ids in batch[:b]:
            engine.add_request(GenerationRequest(prompt_ids=ids, max_new_tokens=3 * steps + 4, end_id=-1))
        while any(s.prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        engine.step()
        wall = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            wall.append(time.perf_counter() - t)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
        while engine.has_work():
            engine.step()
        print(
            f"\n### {steps} decode steps at batch {b}: step median {statistics.median(wall) * 1e3:.1f} ms unprofiled; "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def one_token_a_step(qdir: Path) -> Engine:
    """An engine that prefills one token a step, each a one-row call through the decode GEMV (INT4's group
    sums included, which prompt rows otherwise never use): a prompt's logits as decoding computes them."""
    eng = Engine(qdir, EngineConfig(max_num_tokens=1, max_batch_size=1, max_input_len=512, max_seq_len=1024))
    for layer in eng.model.layers:
        for group in (layer.qkv, layer.o, layer.gate_up, layer.down):
            for proj in group.parts:
                proj.own_rounding = False
    return eng


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--checkpoint", type=Path, help="checkpoint directory (default: the embedded SmolLM2, fetched once)"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for both sides")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bw-repeats", type=int, default=15, help="full reads of the 1 GiB buffer for the bandwidth probe")
    ap.add_argument(
        "--bw-pair-reads", type=int, default=3, help="reads of the probe just before each batch-1 run (its bound)"
    )
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens for batch-1 and concurrent runs")
    ap.add_argument("--new", type=int, default=64, help="output tokens per request")
    ap.add_argument("--long", type=int, default=768, help="tokens of the long prompt in the ITL run")
    ap.add_argument("--itl-budget", type=int, default=32, help="max_num_tokens (step budget) of the ITL run")
    ap.add_argument(
        "--itl-step-ms",
        type=float,
        help="also run the ITL run under this time budget (build.step_budget_ms; prompt chunks in 8-token units)",
    )
    ap.add_argument(
        "--quantized",
        type=Path,
        action="append",
        default=[],
        help="a quantized export (…/quantized/hf) whose batch-1 decode to compare with the bf16 checkpoint "
        "(the cost of activation-quantization emulation); repeatable",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--profile", action="store_true", help="only profile decode steps (batch 1 and 8) and exit")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    ckpt = args.checkpoint or default_checkpoint()
    tok = AutoTokenizer.from_pretrained(ckpt)
    # Prefix reuse off: repeats of the same prompt must not be served from the cache (reuse has its own row).
    base = {
        "max_batch_size": 8,
        "max_num_tokens": 512,
        "max_input_len": 1024,
        "max_seq_len": 2048,
        "tokens_per_block": 32,
        "num_threads": args.threads,
        "enable_kv_cache_reuse": False,
    }

    def config(**changes) -> EngineConfig:
        """The benchmark's engine settings with ``changes``."""
        return EngineConfig(**{**base, **changes})

    engine = Engine(ckpt, config())
    if args.profile:
        profile_decode(engine, prompts(tok, 8, args.prompt))
        return 0
    hf_dtype = torch.bfloat16 if engine.model.dtype == torch.bfloat16 else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=hf_dtype).eval()
    batch = prompts(tok, 9, args.prompt)
    one, eight = batch[0], batch[1:]
    R = args.repeats

    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"threads {args.threads}, model {ckpt}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at start",
        flush=True,
    )
    bw = read_bandwidth(args.bw_repeats)
    engine_run(engine, one, 8), hf_run(hf, one, 8)  # warm-up
    b1_e, b1_h, b1_bw = [], [], []
    for _ in range(R):
        b1_bw.append(statistics.median(read_bandwidth(args.bw_pair_reads)))
        b1_e.append(engine_run(engine, one, args.new))
        b1_h.append(hf_run(hf, one, args.new))
    # the same engine on torch's operators only (EngineConfig.cpu_kernels False): what rtk's kernels add
    plain = Engine(ckpt, config(cpu_kernels=False))
    engine_run(plain, one, 8)
    b1_plain = [engine_run(plain, one, args.new) for _ in range(R)]
    conc_plain = [engine_concurrent(plain, eight, args.new) for _ in range(R)]
    del plain
    reuse_engine = Engine(ckpt, config(enable_kv_cache_reuse=True))
    engine_run(reuse_engine, one, 1)  # the prompt's blocks are now cached
    ttft_reuse = [engine_run(reuse_engine, one, 1)[0] for _ in range(R)]
    del reuse_engine
    conc_e, conc_h = [], []
    hf_batched(hf, eight, 4)  # warm-up at batch 8
    invariant = Engine(ckpt, config(decode_batching="exact"))
    full = Engine(ckpt, config(decode_batching="full"))
    conc_inv, conc_full = [], []
    for _ in range(R):
        conc_e.append(engine_concurrent(engine, eight, args.new))
        conc_h.append(hf_batched(hf, eight, args.new))
        conc_inv.append(engine_concurrent(invariant, eight, args.new))
        conc_full.append(engine_concurrent(full, eight, args.new))
    del invariant, full
    # 8 streams + the long prompt run together: room for 9 sequences
    itl_base = {"max_batch_size": 16, "max_input_len": max(1024, args.long)}
    itl_engine = Engine(ckpt, config(max_num_tokens=max(args.itl_budget, 16), **itl_base))
    whole_engine = Engine(ckpt, config(max_num_tokens=args.long + 16, enable_chunked_context=False, **itl_base))
    long_prompt = prompts(tok, 1, args.long)[0]
    streams = prompts(tok, 8, 32)
    timed_engine = None
    if args.itl_step_ms:
        timed_engine = Engine(
            ckpt,
            config(
                max_num_tokens=max(args.itl_budget, 16),
                step_budget_ms=args.itl_step_ms,
                context_chunk_unit=8,
                **itl_base,
            ),
        )
    itl_c, itl_w, itl_t = [], [], []
    for _ in range(R):
        itl_c.append(itl_ratio(itl_engine, streams, long_prompt, 96, arrive_after=16))
        itl_w.append(itl_ratio(whole_engine, streams, long_prompt, 96, arrive_after=16))
        if timed_engine:
            itl_t.append(itl_ratio(timed_engine, streams, long_prompt, 96, arrive_after=16))

    quant_rows = []
    for qdir in args.quantized:
        qeng = Engine(qdir, config())
        kernels = sorted(
            {
                p.kernel
                for layer in qeng.model.layers
                for g in (layer.qkv, layer.o, layer.gate_up, layer.down)
                for p in g.parts
            }
        )
        engine_run(qeng, one, 8)
        q = [(engine_run(qeng, one, args.new)[1], engine_run(engine, one, args.new)[1]) for _ in range(R)]
        qc = [(engine_concurrent(qeng, eight, args.new), engine_concurrent(engine, eight, args.new)) for _ in range(R)]
        qt, bt = statistics.median(r[0] for r in q), statistics.median(r[1] for r in q)
        qct, bct = statistics.median(r[0] for r in qc), statistics.median(r[1] for r in qc)
        algo = qeng.model.quant_algo or "unquantized"
        want = 1.5 if algo.startswith("W4A16") else 1.0
        label = f"{algo} export ({qdir.parent.parent.name}; projections: {', '.join(kernels)}, "
        label += f"{qeng.model.weight_bytes_per_token / 1e6:.0f} MB/token)"
        quant_rows.append(
            (
                f"batch-1 decode tokens/s, {label} vs bf16 checkpoint",
                f"{qt:.1f} vs {bt:.1f}",
                "",
                f"{qt / bt:.2f}x",
                f">= {want}x" if want > 1 else "> 1x",
                qt / bt >= want if want > 1 else qt / bt > 1,
            )
        )
        quant_rows.append(
            (
                "  8 concurrent, aggregate output tokens/s, same export vs bf16",
                f"{qct:.1f} vs {bct:.1f}",
                "",
                f"{qct / bct:.2f}x",
                "",
                None,
            )
        )
        report = qdir.parent / "quality.json"
        if report.is_file():
            from toolkit.quality import eval_token_lists, perplexity

            rep = json.loads(report.read_text())
            texts = eval_token_lists(AutoTokenizer.from_pretrained(qdir), rep["eval_texts"])
            ppl = {}
            for name, eng in (
                ("kernels", qeng),
                (
                    "dense",
                    Engine(
                        qdir,
                        EngineConfig(max_num_tokens=512, max_batch_size=1, int_weight_kernels=False, cpu_kernels=False),
                    ),
                ),
                ("decode", one_token_a_step(qdir)),
            ):
                ppl[name] = perplexity(lambda x, e=eng: e.prompt_logits(x[0].tolist())[None], texts)
            want_ppl = rep["quantized_ppl"]
            what = (
                f"  perplexity through the engine (bf16, {rep['eval_tokens']} tokens; prompt logits, i.e. prefill) "
                f"vs quality.json {want_ppl:.3f}; dense bf16 path {ppl['dense']:.3f}"
            )
            quant_rows.append(
                (what, f"{ppl['kernels']:.3f}", "", f"{(ppl['kernels'] / want_ppl - 1) * 100:+.2f} %", "", None)
            )
            quant_rows.append(
                (
                    "  same, one token a step: every position through the decode GEMV",
                    f"{ppl['decode']:.3f}",
                    "",
                    f"{(ppl['decode'] / want_ppl - 1) * 100:+.2f} %",
                    "",
                    None,
                )
            )
        del qeng

    med = statistics.median
    bandwidth = med(bw)
    ttft_e, tps_e = med(r[0] for r in b1_e), med(r[1] for r in b1_e)
    ttft_h, tps_h = med(r[0] for r in b1_h), med(r[1] for r in b1_h)
    wbytes = engine.model.weight_bytes_per_token
    bound = bandwidth / wbytes
    hf_bytes = wbytes * (2 if hf_dtype == torch.float32 and engine.model.dtype == torch.bfloat16 else 1)  # same weights
    # each batch-1 run against the probe read just before it
    shares_e = [r[1] * wbytes / b for r, b in zip(b1_e, b1_bw, strict=True)]
    shares_h = [r[1] * hf_bytes / b for r, b in zip(b1_h, b1_bw, strict=True)]
    c_e, c_h = med(conc_e), med(conc_h)
    p50c, p99c, rc, lt_c = (med(r[i] for r in itl_c) for i in range(4))
    p50w, p99w, rw, lt_w = (med(r[i] for r in itl_w) for i in range(4))

    def name(dt):
        return str(dt).replace("torch.", "")

    # each side's weights/activations and attention dtype, as they really run
    edt = f"{name(engine.model.dtype)}, attention {name(engine.model.attn_dtype)}"
    hdt = f"{name(hf_dtype)}, attention {name(hf_dtype)} ({hf.config._attn_implementation})"

    rows = [
        (
            "batch-1 decode tokens/s",
            f"{tps_e:.1f}",
            f"{tps_h:.1f}",
            f"{tps_e / tps_h:.2f}x",
            ">= 1.5x",
            tps_e / tps_h >= 1.5,
        ),
        (
            f"batch-1 time to first token ({args.prompt}-token prompt), ms",
            f"{ttft_e * 1e3:.0f}",
            f"{ttft_h * 1e3:.0f}",
            f"{ttft_h / ttft_e:.2f}x faster",
            "",
            None,
        ),
        (
            "  same, engine without rtk's CPU kernels (cpu_kernels false): decode tokens/s, time to first token ms",
            f"{med(r[1] for r in b1_plain):.1f}, {med(r[0] for r in b1_plain) * 1e3:.0f}",
            "",
            f"kernels: {tps_e / med(r[1] for r in b1_plain):.2f}x decode",
            "",
            None,
        ),
        ("  same prompt again, its blocks in the prefix cache, ms", f"{med(ttft_reuse) * 1e3:.0f}", "", "", "", None),
        (
            f"8 concurrent, aggregate output tokens/s, decode_batching {engine.config.decode_batching} = "
            f"{engine.decode_batching} here (transformers: one batched generate)",
            f"{c_e:.1f}",
            f"{c_h:.1f}",
            f"{c_e / c_h:.2f}x",
            "",
            None,
        ),
        (
            "  same, engine without rtk's CPU kernels",
            f"{med(conc_plain):.1f}",
            "",
            f"kernels: {c_e / med(conc_plain):.2f}x",
            "",
            None,
        ),
        (
            "  same, decode_batching exact (one attention call per sequence) / full (one GEMM over all rows)",
            f"{med(conc_inv):.1f} / {med(conc_full):.1f}",
            "",
            "",
            "",
            None,
        ),
        (
            f"batch-1 share of the bandwidth bound ({wbytes / 1e6:.0f} MB/token; each run against a probe just "
            f"before it, {min(b1_bw) / 1e9:.1f}-{max(b1_bw) / 1e9:.1f} GB/s; engine's runs "
            f"{min(shares_e) * 100:.0f}-{max(shares_e) * 100:.0f} %)",
            f"{med(shares_e) * 100:.0f} %",
            f"{med(shares_h) * 100:.0f} %",
            "",
            ">= 70 %",
            med(shares_e) >= 0.7,
        ),
        (
            (
                f"ITL p99/p50, 8 streams + {args.long}-token prompt mid-stream, step budget {args.itl_budget} tokens "
                f"(prompt chunks in {itl_engine.scheduler.unit}-token units)"
            ),
            f"{rc:.2f} ({p99c:.0f}/{p50c:.0f} ms)",
            "",
            "",
            "<= 2",
            rc <= 2,
        ),
        (
            "  same, prompt in one step (no chunking), for contrast",
            f"{rw:.2f} ({p99w:.0f}/{p50w:.0f} ms)",
            "",
            "",
            "",
            None,
        ),
        ("  long prompt's time to first token: chunked / one step, s", f"{lt_c:.2f} / {lt_w:.2f}", "", "", "", None),
    ]
    if itl_t:
        p50t, p99t, rt, lt_t = (med(r[i] for r in itl_t) for i in range(4))
        rows.append(
            (
                f"  same, chunks cut to a {args.itl_step_ms:g} ms step (step_budget_ms; 8-token units); "
                "long prompt's TTFT",
                f"{rt:.2f} ({p99t:.0f}/{p50t:.0f} ms); {lt_t:.2f} s",
                "",
                "",
                "<= 2",
                rt <= 2,
            )
        )
    rows += quant_rows
    print(f"\n| metric | rtk engine ({edt}) | transformers ({hdt}) | ratio | target | met |")
    print("|---|---|---|---|---|---|")
    for name, e, h, r, target, ok in rows:
        print(f"| {name} | {e} | {h} | {r} | {target} | {'' if ok is None else ('yes' if ok else 'NO')} |")
    print(
        f"\nbandwidth probe at the start: median {bandwidth / 1e9:.1f} GB/s of {len(bw)} reads of 1 GiB "
        f"(a bound of {bound:.0f} tok/s), min {min(bw) / 1e9:.1f}, max {max(bw) / 1e9:.1f}; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at end"
    )
    print(
        f"medians of {R} runs; new tokens per request {args.new}; "
        f"engine: max_batch_size 8, tokens_per_block 32, max_num_tokens 512 (ITL run: {args.itl_budget}); "
        f"single-row kernels: {engine.model.single_row_modes}; rtk's GEMV for shapes {engine.model.gemv_shapes}, "
        f"its K/V gather: {engine.model.fast_gather}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": [r[:5] for r in rows],
                    "bandwidth": bandwidth,
                    "bandwidth_reads": bw,
                    "weight_bytes": wbytes,
                    "batch1_bandwidth": b1_bw,
                    "batch1_shares": shares_e,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
