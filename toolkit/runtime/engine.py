"""rtk's CPU engine: requests in, streamed tokens out (the ``cpu`` target's TensorRT-LLM stand-in).

::

    engine = Engine("engines/demo/quantized/hf", EngineConfig.from_build(spec.build))
    rid = engine.add_request(GenerationRequest(prompt_ids=ids, max_new_tokens=64))
    while engine.has_work():
        for ev in engine.step():          # one in-flight batching iteration
            print(ev.request_id, ev.token_id, ev.finished)

:class:`BackgroundEngine` runs ``step()`` in its own thread and calls back per token; the Triton
``tensorrt_llm`` python model wraps it.  Semantics follow TensorRT-LLM's executor where it has one:

* ``end_id`` ends a request and is *not* part of the output; ``None`` means the checkpoint's EOS
  ids (generation_config.json), ``-1`` means no end id.
* a stop sequence ends a request *after* its tokens, which are part of the output.
* timestamps are ``time.time_ns()`` (epoch), like TensorRT-LLM's request perf metrics.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError
from .free_cores import FreeCores
from .kv_cache import BlockManager, blocks_for
from .os_threads import ENGINE_THREAD, name_this_thread
from .sampling import SamplingParams, sample_sequences
from .scheduler import POLICIES, Scheduler, Sequence
from .step_times import attention_rows

if TYPE_CHECKING:
    from ..spec import BuildSpec
    from .checkpoint import Checkpoint

log = logging.getLogger(__name__)

__all__ = [
    "BackgroundEngine",
    "Engine",
    "EngineConfig",
    "GenerationRequest",
    "RequestTimes",
    "SamplingParams",
    "TokenEvent",
]


DECODE_BATCHING = ("auto", "exact", "attention", "full")
DECODE_ATTENTION = ("auto", "sdpa", "in_place")
LM_HEADS = ("exported", "int8")
FLOAT32_PROMPT_ROWS = ("auto", "mkl", "gemv")


@dataclass
class EngineConfig:
    max_batch_size: int = 8
    max_num_tokens: int = 512
    # the budget of a step in which no sequence is generating (nobody waits for a token); None: the
    # larger of max_num_tokens and max_input_len, so a prompt arriving at an idle engine runs whole
    max_num_tokens_without_decode: int | None = None
    # a time budget (ms) for steps in which someone is generating: prompt chunks are cut so the step's
    # predicted time (runtime/step_times.py, fitted to the last steps' measured times) stays within it,
    # keeping at least one attention unit a step; None: max_num_tokens alone
    step_budget_ms: float | None = None
    # the same budget as a multiple of the predicted time of the step's decode rows alone (> 1), so it
    # follows the load: a bound on ITL p99 / p50.  With step_budget_ms too, the smaller applies
    step_budget_ratio: float | None = None
    # under either time budget a step still takes the prompt tokens waiting over this many steps (whole
    # units), so prompts arriving faster than the budget's cut lets through wait about this many steps
    # instead of queueing behind a unit a step; 0: the cut alone
    prompt_backlog_steps: int = 6
    # prompt chunks end on multiples of this many tokens (or at the prompt's end) and prefill attention
    # runs this many query rows a call, so a prompt's numbers never depend on how the load split it; a
    # power of two <= tokens_per_block.  None: tokens_per_block, halved until a step with a full batch
    # decoding still fits one (scheduler.attention_unit).  Smaller: finer chunks for step_budget_ms to
    # cut to, at a few per cent of prefill speed (more attention calls)
    context_chunk_unit: int | None = None
    max_input_len: int = 1024
    max_seq_len: int = 2048
    tokens_per_block: int = 32
    kv_cache_blocks: int | None = None  # default: max_batch_size full-length sequences
    enable_kv_cache_reuse: bool = True
    enable_chunked_context: bool = True
    # torch intra-op threads; default: torch's (all cores), served: every core (targets.cpu.served_threads)
    num_threads: int | None = None
    prefill_threads: int | None = None  # threads for steps that prefill prompt rows; None = num_threads
    # threads for decode steps of one sequence alone (no prompt rows); None = num_threads
    lone_decode_threads: int | None = None
    # served engines: GOMP_SPINCOUNT for the stub's libgomp, read before torch loads (targets.cpu.bound_openmp_spin);
    # None: targets.cpu.SERVED_GOMP_SPINCOUNT
    openmp_spin_count: int | None = None
    # step with no more threads than the cores other processes leave free (free_cores.FreeCores); served engines
    # whose spec sets no threads do (targets.cpu.load_engine)
    follow_free_cores: bool = False
    # auto = bfloat16 where the CPU has native bf16, else float32; float32 for an INT8 / INT4 export where rtk's
    # VNNI integer products run (model.resolve_dtype)
    dtype: str = "auto"
    # Attention (QK^T, softmax, PV) in float32 on the compute dtype's q/k/v: several times faster
    # than torch's bf16 CPU attention at decode shapes, and more accurate; "model" = the compute
    # dtype, bit-identical to transformers' bf16 SDPA.
    attention_dtype: str = "float32"
    # INT8-SQ / INT4-AWQ exports where rtk's kernels cannot run: torch's W8A16 / W4A16 CPU kernels
    # read the integer codes (a half / quarter of bf16's bytes per token, rounding differently);
    # False = dequantized dense bf16 (the reference path).
    int_weight_kernels: bool = True
    # rtk's own CPU kernels (runtime/kernels.py, AVX512-BF16/VBMI, built once per host), each giving the
    # bits of what it replaces (checked at load; INT4 per int4_gemv below): the decode rows' matmuls
    # over bf16 weights (~1.6x oneDNN's bandwidth here) or over the FP8 / INT8 / INT4 codes of a quantized export, the
    # projections' input quantization in one pass, and the K/V reads of float32 attention in one
    # pass; False = torch's operators only.
    cpu_kernels: bool = True
    # rtk's GEMV over INT4-AWQ codes (with cpu_kernels): "dot" sums code x activation per group of
    # inputs and scales each group's sum (no per-weight rounding, ~2.5x "exact"'s speed; within a
    # stated tolerance of the float32 product, not the dense path's bits; docs/engine.md); "exact"
    # rebuilds the dense path's bf16 weights bf16(code x scale) in registers (its bits)
    int4_gemv: str = "dot"
    # a float32 engine's prompt rows where its decode rows take rtk's AVX2 GEMV (bf16 / FP8 weights): "mkl" = MKL's
    # GEMM over float32 copies packed at load (kernels_avx2.MklTiles), "gemv" = the GEMV for every row, "auto" =
    # gemv where the 256-bit build runs (AVX2 without AVX512-VNNI), else mkl (model.resolve_float32_prompt_rows)
    float32_prompt_rows: str = "auto"
    # The LM head the engine reads: "exported" = as the checkpoint holds it (bf16 unless the export quantized it,
    # quantization.quantize_lm_head); "int8" = a bf16 head re-quantized at load to int8 codes per output row
    # (checkpoint.int8_rows, W8A16): half the bytes a token (SmolLM2-135M: 57 -> 28 MB), rounding as the
    # W8A16 head does (docs/engine-measurements.md, "An int8 LM head at load").  A head already quantized stays
    # as it is.
    lm_head: str = "exported"
    # How decoding sequences share a step (docs/engine.md, Numerics): "exact" = one attention call
    # per sequence and one-row GEMMs where the kernel's rounding depends on the row count (a
    # request's bits never depend on the batch); "attention" = one masked attention call for all
    # decode rows, GEMMs as "exact"; "full" = also one GEMM over all rows (fastest from 2 sequences);
    # "auto" = "full" where INT4 projections take AMX's int8 tiles, else "attention" (model.resolve_decode_batching).
    # Where decode rows attend in place (decode_attention below: float32 engines by default) each reads its own
    # context in "exact" and "attention" alike, so there they differ in nothing.
    decode_batching: str = "auto"
    # Decode rows' attention (with cpu_kernels, float32 attention, no KV-cache quantization): "in_place" = rtk's
    # kernel over each row's own context where it lies in the paged pool (runtime/decode_attention.h; no copy of
    # the context per layer, no SDPA call per row; within float32 rounding of SDPA, not its bits); "sdpa" = the
    # context gathered and torch's SDPA, transformers' call (its bits); "auto" = in_place on float32 engines,
    # sdpa on bf16 engines, whose decode rows then keep transformers' bits (docs/engine-measurements.md, "Decode
    # attention read in place on bf16 engines").  Where the kernel cannot run, SDPA does.
    decode_attention: str = "auto"
    # rtk's fused decode step (with cpu_kernels): decode rows run whole decoder layers in one C++ call
    # instead of ~30 torch operators per layer from Python, with the operators' bits and one attention
    # call per row (as "exact" decode batching, whatever decode_batching says); False = torch's operators.
    fused_decode: bool = True
    # the decode kernels' weights and the K/V pool on 2 MiB pages (runtime/hugepages.py) where Linux allows
    # it: fewer TLB misses in the streams a decode step reads; False = ordinary allocations
    huge_pages: bool = True
    scheduler_policy: str = "guaranteed_no_evict"  # or "max_utilization" (admit eagerly, preempt on a full pool)

    @classmethod
    def from_build(cls, build: BuildSpec, **overrides) -> EngineConfig:
        fields = dict(
            max_batch_size=build.max_batch_size,
            max_num_tokens=build.max_num_tokens,
            max_num_tokens_without_decode=build.max_num_tokens_without_decode,
            step_budget_ms=build.step_budget_ms,
            step_budget_ratio=build.step_budget_ratio,
            prompt_backlog_steps=cls.prompt_backlog_steps
            if build.prompt_backlog_steps is None
            else build.prompt_backlog_steps,
            context_chunk_unit=build.context_chunk_unit,
            max_input_len=build.max_input_len,
            max_seq_len=build.max_seq_len,
            tokens_per_block=build.tokens_per_block,
            kv_cache_blocks=build.kv_cache_blocks,
            enable_kv_cache_reuse=build.enable_kv_cache_reuse,
            enable_chunked_context=build.enable_chunked_context,
            num_threads=build.num_threads,
            prefill_threads=build.prefill_threads,
            lone_decode_threads=build.lone_decode_threads,
            openmp_spin_count=build.openmp_spin_count,
            int4_gemv=build.int4_gemv,
            float32_prompt_rows=build.float32_prompt_rows,
            lm_head=build.lm_head,
            dtype=build.compute_dtype,
            decode_batching=build.decode_batching,
            decode_attention=build.decode_attention,
        )
        return cls(**{**fields, **overrides})

    @property
    def step_tokens_without_decode(self) -> int:
        """The budget of a step in which no sequence is generating (``max_num_tokens_without_decode`` resolved)."""
        return self.max_num_tokens_without_decode or max(self.max_num_tokens, self.max_input_len)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_blocks or self.max_batch_size * blocks_for(self.max_seq_len, self.tokens_per_block)

    def validate(self) -> None:
        def bad(name, msg):
            raise UsageError(f"engine config '{name}': {msg}")

        for name in ("max_batch_size", "max_num_tokens", "max_input_len", "max_seq_len", "tokens_per_block"):
            if getattr(self, name) < 1:
                bad(name, f"{getattr(self, name)} must be at least 1")
        if self.max_input_len >= self.max_seq_len:
            bad(
                "max_input_len",
                f"{self.max_input_len} must be below max_seq_len ({self.max_seq_len}) to leave room for output",
            )
        if self.max_num_tokens_without_decode is not None and self.max_num_tokens_without_decode < self.max_num_tokens:
            bad(
                "max_num_tokens_without_decode",
                f"{self.max_num_tokens_without_decode} is below max_num_tokens ({self.max_num_tokens}); "
                "leave it unset or raise it",
            )
        if self.step_budget_ms is not None and not self.step_budget_ms > 0:
            bad("step_budget_ms", f"{self.step_budget_ms} must be above 0 ms")
        if self.step_budget_ratio is not None and not self.step_budget_ratio > 1:
            bad("step_budget_ratio", f"{self.step_budget_ratio} must be above 1 (the decode rows' own time)")
        if self.prompt_backlog_steps < 0:
            bad("prompt_backlog_steps", f"{self.prompt_backlog_steps} must be 0 (off) or more steps")
        for name in ("step_budget_ms", "step_budget_ratio"):
            if getattr(self, name) is not None and not self.enable_chunked_context:
                bad(name, "cuts prompt chunks; set enable_chunked_context true or leave it unset")
        if self.context_chunk_unit is not None:
            u, room = self.context_chunk_unit, self.max_num_tokens - self.max_batch_size + 1
            if u < 1 or u & (u - 1) or u > self.tokens_per_block:
                bad("context_chunk_unit", f"{u} must be a power of two up to tokens_per_block {self.tokens_per_block}")
            if u > room:
                bad(
                    "context_chunk_unit",
                    f"{u} does not fit a step beside a full batch's decodes (max_num_tokens - max_batch_size + 1 = "
                    f"{room}); lower it or raise max_num_tokens",
                )
        if self.max_num_tokens < self.max_batch_size:
            bad(
                "max_num_tokens",
                f"{self.max_num_tokens} is below max_batch_size ({self.max_batch_size}); a full batch could not decode",
            )
        need = blocks_for(self.max_seq_len, self.tokens_per_block)
        if self.num_blocks < need:
            bad(
                "kv_cache_blocks",
                f"{self.num_blocks} blocks cannot hold one sequence of max_seq_len {self.max_seq_len} "
                f"({need} blocks of {self.tokens_per_block})",
            )
        if self.scheduler_policy not in POLICIES:
            bad("scheduler_policy", f"'{self.scheduler_policy}' is not one of {', '.join(POLICIES)}")
        if self.decode_batching not in DECODE_BATCHING:
            bad("decode_batching", f"'{self.decode_batching}' is not one of {', '.join(DECODE_BATCHING)}")
        if self.decode_attention not in DECODE_ATTENTION:
            bad("decode_attention", f"'{self.decode_attention}' is not one of {', '.join(DECODE_ATTENTION)}")
        if self.int4_gemv not in ("dot", "exact"):
            bad("int4_gemv", f"'{self.int4_gemv}' is not 'dot' or 'exact'")
        if self.float32_prompt_rows not in FLOAT32_PROMPT_ROWS:
            bad("float32_prompt_rows", f"'{self.float32_prompt_rows}' is not one of {', '.join(FLOAT32_PROMPT_ROWS)}")
        if self.lm_head not in LM_HEADS:
            bad("lm_head", f"'{self.lm_head}' is not one of {', '.join(LM_HEADS)}")
        if self.attention_dtype not in ("float32", "model"):
            bad("attention_dtype", f"'{self.attention_dtype}' is not 'float32' or 'model'")
        if self.num_threads is not None and self.num_threads < 1:
            bad("num_threads", f"{self.num_threads} must be at least 1")
        if self.prefill_threads is not None and self.prefill_threads < 1:
            bad("prefill_threads", f"{self.prefill_threads} must be at least 1")
        if self.lone_decode_threads is not None and self.lone_decode_threads < 1:
            bad("lone_decode_threads", f"{self.lone_decode_threads} must be at least 1")
        if self.openmp_spin_count is not None and self.openmp_spin_count < 0:
            bad("openmp_spin_count", f"{self.openmp_spin_count} must be 0 or more")


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    end_id: int | None = None  # None: the checkpoint's EOS ids; -1: none
    stop_sequences: list[list[int]] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None  # assigned by the engine when None


@dataclass
class TokenEvent:
    request_id: str
    token_id: int | None  # None on a final event that carries no token (end id, cancel, error)
    index: int  # position of the token among the generated ones
    time_ns: int
    finished: bool
    finish_reason: str | None  # "length" | "end_id" | "stop" | "cancelled" | "error"
    error: str | None = None
    log_prob: float | None = None  # the token's log-probability, when its request asks (SamplingParams.log_probs)


@dataclass
class RequestTimes:
    arrival_ns: int
    first_scheduled_ns: int | None
    first_token_ns: int | None
    last_token_ns: int | None


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``).  Loading frees the checkpoint's
    float copies and the load checks' tensors, and glibc keeps those pages mapped: SmolLM2's FP8 engine held 1.65 GB
    resident after load, 1.08 GB after the trim (Intel AMX host, 2026-12-06).  Nothing where the C library has no
    such call."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's C library
    except (OSError, AttributeError):
        return
    trim(0)


class Engine:
    """Paged-KV transformer with an in-flight batching scheduler.  Not thread-safe; see BackgroundEngine."""

    def __init__(self, checkpoint: Checkpoint | str | Path, config: EngineConfig):
        import torch

        from .checkpoint import int8_rows, load_checkpoint
        from .model import Transformer, resolve_decode_batching, resolve_dtype, resolve_float32_prompt_rows

        config.validate()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        ckpt = load_checkpoint(checkpoint) if isinstance(checkpoint, (str, Path)) else checkpoint
        if config.lm_head == "int8" and ckpt.lm_head.codes is None:
            ckpt = replace(ckpt, lm_head=int8_rows(ckpt.lm_head))
        mc = ckpt.config
        if config.max_seq_len > mc.max_position_embeddings:
            raise UsageError(
                f"engine config 'max_seq_len': {config.max_seq_len} exceeds the model's max_position_embeddings "
                f"({mc.max_position_embeddings}); lower build.max_seq_len"
            )
        self.model_config = mc
        self.eos_ids = frozenset(mc.eos_token_ids)
        dtype = resolve_dtype(config.dtype, ckpt, config.cpu_kernels, config.int4_gemv)
        # what decode_batching "auto" means here (the config keeps what was asked)
        self.decode_batching = resolve_decode_batching(
            config.decode_batching, ckpt, dtype, config.cpu_kernels, config.int4_gemv
        )
        # a float32 engine's prompt rows run MKL over weights packed at load (kernels_avx2.MklTiles), laid out for the
        # threads present then: packed on one thread, a two-thread call took ~40 % longer. So it loads on the
        # threads that prefill.
        prompt_threads = config.prefill_threads if dtype == torch.float32 and config.cpu_kernels else None
        decode_threads = torch.get_num_threads()
        if prompt_threads:
            torch.set_num_threads(prompt_threads)
        self.model = Transformer(
            ckpt,
            dtype,
            max_positions=config.max_seq_len,
            attention_dtype=torch.float32 if config.attention_dtype == "float32" else dtype,
            int_kernels=config.int_weight_kernels,
            batch_invariant=self.decode_batching != "full",
            cpu_kernels=config.cpu_kernels,
            fused_decode=config.fused_decode,
            huge_pages=config.huge_pages,
            int4_gemv=config.int4_gemv,
            decode_attention=config.decode_attention,
            float32_prompt_rows=resolve_float32_prompt_rows(config.float32_prompt_rows),
        )
        if prompt_threads:
            torch.set_num_threads(decode_threads)
        self.free_cores = FreeCores(config.num_threads) if config.follow_free_cores else None
        self.blocks = BlockManager(config.num_blocks, config.tokens_per_block, config.enable_kv_cache_reuse)
        self.pool = self.model.new_pool(config.num_blocks, config.tokens_per_block)
        self.scheduler = Scheduler(
            self.blocks,
            config.max_batch_size,
            config.max_num_tokens,
            config.enable_chunked_context,
            config.scheduler_policy,
            config.step_tokens_without_decode,
            config.step_budget_ms,
            config.context_chunk_unit,
            config.step_budget_ratio,
            config.prompt_backlog_steps,
        )
        self._seqs: dict[str, Sequence] = {}  # live requests
        self._times: dict[str, RequestTimes] = {}  # finished requests' times, kept for times()
        self._order = itertools.count()
        self._ids = itertools.count()
        self._pending_events: list[TokenEvent] = []
        self.steps = 0
        self._torch = torch
        del ckpt, checkpoint  # the checkpoint's tensors (where this engine loaded it) go before the trim
        return_freed_memory()
        # RTK_STEP_TRACE=FILE: one line a step (docs/engine-measurements.md, "Where a served step's time goes")
        trace = os.environ.get("RTK_STEP_TRACE")
        self._trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115 (open for the engine's life)

    # -- requests -------------------------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> None:
        """Raise UsageError naming what is wrong with ``req``; nothing changes."""
        c = self.config
        ids = req.prompt_ids
        if not isinstance(ids, (list, tuple)) or len(ids) == 0:
            raise UsageError("prompt_ids is empty; send at least one token")
        if len(ids) > c.max_input_len:
            raise UsageError(
                f"prompt of {len(ids)} tokens exceeds max_input_len {c.max_input_len}; shorten it or raise "
                "build.max_input_len"
            )
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise UsageError(f"prompt_ids must be integers in [0, {vocab})")
        if not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
            raise UsageError(f"max_new_tokens {req.max_new_tokens} must be at least 1")
        if len(ids) + req.max_new_tokens > c.max_seq_len:
            raise UsageError(
                f"prompt ({len(ids)}) + max_new_tokens ({req.max_new_tokens}) exceeds max_seq_len {c.max_seq_len}; "
                f"ask for at most {c.max_seq_len - len(ids)} new tokens"
            )
        if req.end_id is not None and req.end_id != -1 and not (0 <= req.end_id < vocab):
            raise UsageError(f"end_id {req.end_id} is not a token id (0..{vocab - 1}, or -1 for none)")
        for s in req.stop_sequences:
            if not s or any(not isinstance(t, int) or t < 0 or t >= vocab for t in s):
                raise UsageError(f"stop sequence {s!r} must be a non-empty list of token ids")
        req.sampling.validate()
        if req.request_id is not None and req.request_id in self._seqs:
            raise UsageError(f"request_id '{req.request_id}' is already in flight; use a unique id")

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, req: GenerationRequest, arrival_ns: int | None = None) -> str:
        self.validate(req)
        rid = req.request_id or self.new_request_id()
        end_ids = self.eos_ids if req.end_id is None else (frozenset() if req.end_id == -1 else frozenset([req.end_id]))
        seq = Sequence(
            request_id=rid,
            order=next(self._order),
            tokens=list(req.prompt_ids),
            prompt_len=len(req.prompt_ids),
            max_new_tokens=req.max_new_tokens,
            end_ids=end_ids,
            stop_sequences=[list(s) for s in req.stop_sequences],
            sampling=req.sampling,
            generator=req.sampling.make_generator(),
            arrival_ns=arrival_ns or time.time_ns(),
        )
        self._seqs[rid] = seq
        self._times.pop(rid, None)
        self.scheduler.add(seq)
        return rid

    def cancel(self, request_id: str) -> None:
        """Stop a request now: its blocks are freed and its final event (``cancelled``) comes with the next step()."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return  # already finished (or never known): nothing to do
        self._finish(seq, "cancelled", None)
        self._pending_events.append(TokenEvent(request_id, None, seq.num_generated, time.time_ns(), True, "cancelled"))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_events)

    def times(self, request_id: str) -> RequestTimes:
        seq = self._seqs.get(request_id)
        if seq is not None:
            return _times_of(seq)
        if request_id in self._times:
            return self._times[request_id]
        raise UsageError(f"unknown request_id '{request_id}'")

    def kv_stats(self) -> dict:
        s = self.blocks.stats()
        s.update(
            pool_bytes=self.pool.nbytes,
            preempted_total=self.scheduler.preempted_total,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
        )
        return s

    def request_stats(self, request_id: str) -> dict:
        """KV usage of a live request (TensorRT-LLM's kv_cache_{reused,alloc_total}_blocks outputs)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise UsageError(f"request '{request_id}' is not in flight")
        return {"reused_blocks": seq.reused_blocks, "blocks": len(seq.block_table), "preemptions": seq.preemptions}

    def _finish(self, seq: Sequence, reason: str, now: int | None) -> None:
        seq.finished, seq.finish_reason = True, reason
        self.scheduler.drop(seq)
        del self._seqs[seq.request_id]
        self._times[seq.request_id] = _times_of(seq)
        if len(self._times) > 4096:  # keep the most recent finished requests' times only
            for rid in list(itertools.islice(self._times, len(self._times) - 4096)):
                del self._times[rid]

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list:
        """Run one iteration: schedule, one forward over the flat batch, sample, stream."""
        torch = self._torch
        events, self._pending_events = self._pending_events, []
        planning = time.perf_counter()
        work = self.scheduler.schedule()
        if not work:
            return events
        now = time.time_ns()
        started = time.perf_counter()
        input_ids, logit_rows, sampled = [], [], []
        row = decode_rows = prompt_rows = 0
        attention = 0.0
        # the step's shape and time feed the budget's fit (and the step trace)
        timed = self.scheduler.budgets_time or self._trace is not None
        cpu_started = time.process_time() if self._trace is not None else 0.0
        for seq, n in work:
            if seq.first_scheduled_ns is None:
                seq.first_scheduled_ns = now
            if timed and seq.prefilling:
                prompt_rows += n
                attention += attention_rows(n, seq.num_cached)
            elif timed:
                decode_rows += n
            input_ids.extend(seq.tokens[seq.num_cached : seq.num_cached + n])
            row += n
            if seq.num_cached + n == len(seq.tokens):
                logit_rows.append(row - 1)
                sampled.append(seq)
        from .model import build_plan

        plan = build_plan(
            [(seq.block_table, seq.num_cached, n, seq.prefilling) for seq, n in work],
            self.config.tokens_per_block,
            self.scheduler.unit,
            reads_own_kv=self.pool.quant is None,
            # padded contexts only for SDPA's masked call: rows attended in one call each read their own context
            batched=self.decode_batching != "exact" and not self.model.attends_rows_in_one_call,
        )
        plan.logit_rows = torch.tensor(logit_rows, dtype=torch.int64)
        if plan.prefills:
            threads = self.config.prefill_threads
        else:
            threads = self.config.lone_decode_threads if len(work) == 1 else None
        if self.free_cores is not None:
            threads = min(threads or torch.get_num_threads(), self.free_cores.threads())
        switch = threads is not None and threads != torch.get_num_threads()
        if switch:
            decode_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
        # the step's thread count holds through sampling too: its operators over the logits (a float32 copy, the
        # argmax) are parallel regions, which on two threads would wake the OpenMP worker on a core that the
        # free-core count just gave to another process
        try:
            with torch.inference_mode():
                logits = self.model.forward(torch.tensor(input_ids, dtype=torch.int64), plan, self.pool)
                for seq, n in work:
                    self.scheduler.commit(seq, n)
                next_ids, log_probs = sample_sequences(logits, sampled, self.model.argmax_rows) if sampled else ([], [])
        finally:
            if switch:
                torch.set_num_threads(decode_threads)
        if timed:
            ms = (time.perf_counter() - started) * 1e3
            self.scheduler.step_times.observe(decode_rows, prompt_rows, attention, ms)
            if self._trace is not None:  # start (ns), rows, threads, wall ms, the process's CPU ms, schedule() ms
                cpu_ms = (time.process_time() - cpu_started) * 1e3
                used = threads if threads is not None else torch.get_num_threads()
                plan_ms = (started - planning) * 1e3
                self._trace.write(f"{now} {decode_rows} {prompt_rows} {used} {ms:.3f} {cpu_ms:.3f} {plan_ms:.3f}\n")
        self.steps += 1
        now = time.time_ns()
        for seq, tok, lp in zip(sampled, next_ids, log_probs, strict=True):
            events.append(self._append(seq, tok, now, lp))
        return events

    def _append(self, seq: Sequence, tok: int, now: int, log_prob: float | None = None) -> TokenEvent:
        index = seq.num_generated
        if tok in seq.end_ids:
            self._stamp(seq, now)
            self._finish(seq, "end_id", now)
            return TokenEvent(seq.request_id, None, index, now, True, "end_id")
        seq.tokens.append(tok)
        self._stamp(seq, now)
        reason = None
        if any(seq.num_generated >= len(s) and seq.tokens[-len(s) :] == s for s in seq.stop_sequences):
            reason = "stop"
        elif seq.num_generated >= seq.max_new_tokens:
            reason = "length"
        if reason:
            self._finish(seq, reason, now)
        return TokenEvent(seq.request_id, tok, index, now, reason is not None, reason, log_prob=log_prob)

    @staticmethod
    def _stamp(seq: Sequence, now: int) -> None:
        if seq.first_token_ns is None:
            seq.first_token_ns = now
        seq.last_token_ns = now

    def fail_all(self, message: str) -> list:
        """End every live request with an ``error`` event (used when a step raised)."""
        now = time.time_ns()
        events = []
        for seq in list(self._seqs.values()):
            self._finish(seq, "error", now)
            events.append(TokenEvent(seq.request_id, None, seq.num_generated, now, True, "error", message))
        return events

    # -- conveniences -----------------------------------------------------------------------------
    def generate(self, req: GenerationRequest) -> list[int]:
        """Run ``req`` (alongside anything already queued) to completion; its generated ids.

        Events of other requests produced meanwhile are dropped, so use this when the engine is otherwise idle.
        """
        rid = self.add_request(req)
        out: list[int] = []
        while True:
            for ev in self.step():
                if ev.request_id != rid:
                    continue
                if ev.token_id is not None:
                    out.append(ev.token_id)
                if ev.finished:
                    if ev.finish_reason == "error":
                        raise RuntimeError(ev.error)
                    return out

    def prompt_logits(self, token_ids: list[int]):
        """Logits (float32 ``[T, vocab]``) at every position of ``token_ids``, computed through the
        paged KV cache in ``max_num_tokens`` chunks (what perplexity evaluation needs)."""
        torch = self._torch
        from .model import build_plan

        tpb = self.config.tokens_per_block
        if not token_ids or len(token_ids) > self.config.max_seq_len:
            raise UsageError(f"need 1..{self.config.max_seq_len} tokens, got {len(token_ids)}")
        need = blocks_for(len(token_ids), tpb)
        if need > self.blocks.num_available - self.scheduler._outstanding():
            raise UsageError("the KV pool is busy; score prompts while the engine is idle")
        table = [self.blocks.allocate() for _ in range(need)]
        out = []
        try:
            with torch.inference_mode():
                unit = self.scheduler.unit
                step = max(unit, self.config.max_num_tokens // unit * unit)
                for start in range(0, len(token_ids), step):
                    chunk = token_ids[start : start + step]
                    plan = build_plan(
                        [(table, start, len(chunk), True)], tpb, unit, reads_own_kv=self.pool.quant is None
                    )
                    out.append(self.model.forward(torch.tensor(chunk, dtype=torch.int64), plan, self.pool))
        finally:
            self.blocks.release_all(table)
        return torch.cat(out)


def _times_of(seq: Sequence) -> RequestTimes:
    return RequestTimes(seq.arrival_ns, seq.first_scheduled_ns, seq.first_token_ns, seq.last_token_ns)


def _not_first(ev: TokenEvent) -> bool:
    return ev.index != 0


class BackgroundEngine:
    """Runs :meth:`Engine.step` in a thread while there is work; callbacks come from that thread.

    ``submit`` validates in the caller's thread (so a bad request raises UsageError there) and
    hands the request over; the engine thread admits it before its next step.
    """

    def __init__(self, engine: Engine | Callable[[], Engine]):
        """``engine``: the engine, or a function that loads it, called on the engine's thread and waited for (its
        exception raised here).  Load a served engine that way: libgomp keeps a pool of OpenMP workers for each
        thread that starts parallel regions, and with one pool for the loading thread and another for the stepping
        thread there are more OpenMP threads than cores, so libgomp's workers spin ~1000 rounds instead of ~300000
        before sleeping and each parallel region waits for them to wake (libgomp's ``gomp_throttled_spin_count_var``,
        gcc-mirror/gcc libgomp/env.c).  SmolLM2's INT4-AWQ steps of 8 decode and 16 prompt rows on 2 threads took
        40 ms instead of 17.5 ms on the 2-core AMX host (docs/engine-measurements.md, "One OpenMP pool: the engine loads
        on its own thread")."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._incoming: list[tuple[GenerationRequest, int, Callable]] = []
        self._cancels: list[str] = []
        self._callbacks: dict[str, Callable] = {}
        self._closed = False
        self._load = None if isinstance(engine, Engine) else engine
        self._load_error: BaseException | None = None
        self.engine = engine if self._load is None else None
        loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(loaded,), name="rtk-cpu-engine", daemon=True)
        self._thread.start()
        loaded.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error

    def submit(self, req: GenerationRequest, on_event: Callable[[TokenEvent], None]) -> str:
        if self._closed:
            raise UsageError("the engine is closed")
        self.engine.validate(req)
        with self._lock:
            if req.request_id is None:
                req.request_id = self.engine.new_request_id()
            elif req.request_id in self._callbacks:
                raise UsageError(f"request_id '{req.request_id}' is already in flight; use a unique id")
            self._callbacks[req.request_id] = on_event
            self._incoming.append((req, time.time_ns(), on_event))
        self._wake.set()
        return req.request_id

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.append(request_id)
        self._wake.set()

    def close(self) -> None:
        """Cancel what is in flight (each gets its ``cancelled`` event) and stop the thread."""
        self._closed = True
        self._wake.set()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _dispatch(self, events: list[TokenEvent]) -> None:
        if len(events) > 1:
            # A step's first tokens before its other tokens: each callback ahead of a request's first token (a
            # served one builds a response and queues it for the server) adds to that request's time to first
            # token, while a token that follows others only keeps its gap to the next one.  A request's own events
            # stay in order (its first token has the lowest index).
            events = sorted(events, key=_not_first)
        for ev in events:
            with self._lock:
                cb = self._callbacks.pop(ev.request_id, None) if ev.finished else self._callbacks.get(ev.request_id)
            if cb is None:
                continue
            try:
                cb(ev)
            except Exception:  # a client's callback must not take the engine down
                log.exception("token callback for request %s raised", ev.request_id)

    def _run(self, loaded: threading.Event) -> None:
        name_this_thread(ENGINE_THREAD)  # before the load: the OpenMP workers it starts take the name too
        try:
            if self._load is not None:
                self.engine = self._load()
        except BaseException as exc:  # raised to the caller of __init__
            self._load_error = exc
            return
        finally:
            self._load = None
            loaded.set()
        eng = self.engine
        while True:
            with self._lock:
                incoming, self._incoming = self._incoming, []
                cancels, self._cancels = self._cancels, []
                self._wake.clear()
            for req, arrival, _cb in incoming:
                try:
                    eng.add_request(req, arrival_ns=arrival)
                except Exception as exc:  # e.g. the same id submitted twice at once: tell that client only
                    self._dispatch([TokenEvent(req.request_id, None, 0, time.time_ns(), True, "error", str(exc))])
            for rid in cancels:
                eng.cancel(rid)
            if self._closed:
                for rid in list(eng._seqs):
                    eng.cancel(rid)
                self._dispatch(eng.step())  # nothing is scheduled now: just the cancellation events
                return
            if eng.has_work():
                try:
                    events = eng.step()
                except Exception as exc:  # a bug: fail loudly to every client instead of hanging them
                    log.exception("engine step failed")
                    events = eng.fail_all(f"engine step failed: {exc}")
                self._dispatch(events)
            else:
                self._wake.wait()
