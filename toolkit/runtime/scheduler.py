"""In-flight batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget (``max_num_tokens``) and a sequence limit (``max_batch_size``).
The budget bounds how long anyone generating waits for their next token while prompts prefill; a
step in which no sequence is generating has nobody waiting, and its budget is
``max_num_tokens_without_decode`` (the engine's default: the larger of ``max_num_tokens`` and the
longest prompt, ``EngineConfig.step_tokens_without_decode``), so a prompt that arrives at an idle
engine runs in one step.  A step with someone generating may also have a time budget
(``step_budget_ms``, or ``step_budget_ratio`` times its decode rows' own predicted time, whichever
is smaller when both are set): prompt chunks are then cut to what the step's predicted time leaves
(step_times.py: the engine's measured step times), keeping at least one attention unit of prompt a
step, so the wait between tokens follows the host's speed of the moment rather than a token count
chosen for one hour of it.  Under a time budget a step also takes at least the prompt tokens waiting
over ``prompt_backlog_steps`` (whole units), so prompts arriving faster than the cut lets through
wait a bounded number of steps rather than in a growing queue.

1. sequences that are generating get their token first, so a long prompt arriving never delays
   anyone's next token by more than one step;
2. prompts already being prefilled continue, chunked to what is left of the budget;
3. waiting requests are admitted in arrival order while budget, batch slots and KV blocks last,
   first matching their prompt against the prefix cache.

Prompt chunks end on multiples of the *attention unit* (``unit``: the block size, or a smaller
power of two when the step budget is tiny, or ``context_chunk_unit``) or at the prompt's end, and
the model computes attention one unit of queries at a time, so how a prompt is split into steps
(which depends on the load) never changes its numbers.  TensorRT-LLM also sizes context chunks in whole blocks
(cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp).

Two capacity policies, after TensorRT-LLM's capacity scheduler
(cpp/include/tensorrt_llm/batch_manager/capacityScheduler.h):

* ``guaranteed_no_evict`` admits a request only when the blocks it could ever need (prompt +
  max_new_tokens) are free after what running sequences may still claim; nothing is preempted.
* ``max_utilization`` admits as soon as the next chunk fits; when a sequence needs a block and
  the pool is full, the most recently arrived sequence is preempted: its blocks are released (full
  ones stay in the prefix cache) and it re-queues with its generated tokens.  On readmission its
  prompt is prefilled again and its generated tokens are recomputed one row each, as they were
  first computed, so the continuation is exactly what it would have been.

Nothing is lost either way: a preempted sequence keeps its tokens and sampling state and its
stream simply continues later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .kv_cache import BlockManager, block_key, blocks_for
from .sampling import SamplingParams
from .step_times import StepTimes

POLICIES = ("guaranteed_no_evict", "max_utilization")


@dataclass(eq=False)
class Sequence:
    request_id: str
    order: int  # arrival order; lower = older = higher priority
    tokens: list[int]  # prompt + generated
    prompt_len: int
    max_new_tokens: int
    end_ids: frozenset[int]
    stop_sequences: list[list[int]]
    sampling: SamplingParams
    generator: torch.Generator | None
    arrival_ns: int
    tokens_per_block: int = 1
    first_scheduled_ns: int | None = None
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # keys of the full blocks of ``tokens``
    num_cached: int = 0  # leading tokens whose K/V are in the pool
    num_registered: int = 0  # leading blocks registered for reuse
    reused_blocks: int = 0  # blocks taken from the prefix cache (all admissions)
    preemptions: int = 0
    finished: bool = False
    finish_reason: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.tokens) - self.num_cached

    @property
    def prefilling(self) -> bool:
        return self.num_cached < self.prompt_len

    @property
    def lifetime_blocks(self) -> int:
        """Blocks this sequence may hold at most: K/V of the prompt and all but the last output token."""
        return blocks_for(self.prompt_len + self.max_new_tokens - 1, self.tokens_per_block)

    def keys_upto(self, num_blocks: int) -> list[bytes]:
        """Keys of the first ``num_blocks`` full blocks (computed once, incrementally)."""
        tpb = self.tokens_per_block
        while len(self.block_keys) < num_blocks:
            i = len(self.block_keys)
            parent = self.block_keys[-1] if self.block_keys else b""
            self.block_keys.append(block_key(parent, self.tokens[i * tpb : (i + 1) * tpb]))
        return self.block_keys[:num_blocks]


def attention_unit(tokens_per_block: int, max_num_tokens: int, max_batch_size: int) -> int:
    """Query rows per prefill attention call: the block size, unless a step could not fit one."""
    room = max(1, max_num_tokens - max_batch_size + 1)  # budget a lone prefill always has
    unit = tokens_per_block
    while unit > room:
        unit //= 2
    return unit


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_batch_size: int,
        max_num_tokens: int,
        chunked: bool = True,
        policy: str = "guaranteed_no_evict",
        max_num_tokens_without_decode: int | None = None,
        step_budget_ms: float | None = None,
        unit: int | None = None,
        step_budget_ratio: float | None = None,
        prompt_backlog_steps: int = 0,
    ):
        if policy not in POLICIES:
            from ..errors import UsageError

            raise UsageError(f"scheduler policy '{policy}' is not one of {', '.join(POLICIES)}")
        self.blocks = blocks
        self.tpb = blocks.tokens_per_block
        self.unit = unit or attention_unit(self.tpb, max_num_tokens, max_batch_size)
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.max_num_tokens_without_decode = max_num_tokens_without_decode or max_num_tokens
        self.chunked = chunked
        self.policy = policy
        self.step_budget_ms = step_budget_ms
        self.step_budget_ratio = step_budget_ratio
        self.prompt_backlog_steps = prompt_backlog_steps
        self.step_times = StepTimes()  # the engine reports every step's time to it
        self._time_left: float | None = None  # ms this step's prompt chunks may still take (time budget)
        self._prompt_rows = 0  # prompt rows planned so far this step
        self._prompt_floor = 0  # prompt rows this step takes whatever the time budget (the backlog's share)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.preempted_total = 0

    # -- membership ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.tokens_per_block = self.tpb
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def drop(self, seq: Sequence) -> None:
        """Remove a finished or cancelled sequence and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.release_all(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0
        seq.num_registered = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.preemptions += 1
        self.preempted_total += 1
        # Back into the queue by arrival order (preempted sequences are older than new arrivals).
        i = 0
        while i < len(self.waiting) and self.waiting[i].order < seq.order:
            i += 1
        self.waiting.insert(i, seq)

    # -- sizing ---------------------------------------------------------------------------------------
    def _outstanding(self) -> int:
        """Blocks running sequences may still claim (guaranteed_no_evict reservations)."""
        return sum(max(0, s.lifetime_blocks - len(s.block_table)) for s in self.running)

    def _grow(self, seq: Sequence, upto_tokens: int) -> None:
        for _ in range(blocks_for(upto_tokens, self.tpb) - len(seq.block_table)):
            seq.block_table.append(self.blocks.allocate())

    def _step_tokens(self, seq: Sequence, budget: int) -> int:
        """Tokens ``seq`` runs this step within ``budget`` (0 = not now).

        Generation (and the recompute of generated tokens) runs one row per token; a prompt runs
        in chunks that end on a multiple of the attention unit or at the prompt's end.  Under a time
        budget a chunk is also cut to the rows predicted to fit what is left of it, except that the
        step's first chunk keeps at least one unit, so a prompt always advances.
        """
        if not seq.prefilling:  # one row per token; a recompute takes at most a unit of rows per step
            return min(seq.remaining, budget, self.unit)
        left = seq.prompt_len - seq.num_cached
        if self._time_left is not None:  # a time budget; the step takes at least its floor, its first chunk a unit
            fit = self.step_times.prompt_rows_within(self._time_left, seq.num_cached)
            owed = max(self._prompt_floor - self._prompt_rows, 0 if self._prompt_rows else self.unit)
            budget = min(budget, max(fit, min(left, owed)))
        if left <= budget:
            return left
        if not self.chunked and left <= self.max_num_tokens:
            return 0  # without chunked context a prompt runs whole; wait for a step with room
        return self._align(seq, budget)

    def _align(self, seq: Sequence, n: int) -> int:
        """Largest chunk <= ``n`` ending on an attention-unit boundary (num_cached is on one)."""
        return max(0, (seq.num_cached + n) // self.unit * self.unit - seq.num_cached)

    def _fit(self, seq: Sequence, n: int) -> int:
        """max_utilization: shrink ``n`` to the blocks that are free."""
        free = (len(seq.block_table) + self.blocks.num_available) * self.tpb - seq.num_cached
        if n <= free:
            return n
        return self._align(seq, free) if seq.prefilling else max(0, free)

    def _make_room(self, seq: Sequence, need: int) -> bool:
        """max_utilization: preempt the newest sequences until ``need`` blocks are free.

        Returns False when ``seq`` itself is the newest and was preempted.
        """
        while self.blocks.num_available < need:
            victim = max(self.running, key=lambda s: s.order)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    # -- the step -----------------------------------------------------------------------------------
    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's work as ``(sequence, tokens)``, generating sequences first; blocks are allocated."""
        decoding = any(not s.prefilling for s in self.running)
        budget = self.max_num_tokens if decoding else self.max_num_tokens_without_decode
        generating: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []
        preempted = False

        # Oldest first, so a preemption victim (the newest sequence) is never one already planned.
        for seq in sorted((s for s in self.running if not s.prefilling), key=lambda s: s.order):
            if seq not in self.running:  # preempted to make room for an older one
                continue
            n = self._step_tokens(seq, budget)
            if n == 0:
                break
            need = max(0, blocks_for(seq.num_cached + n, self.tpb) - len(seq.block_table))
            if need > self.blocks.num_available:
                if self.policy == "guaranteed_no_evict":  # cannot happen: admission reserved the blocks
                    raise AssertionError("KV pool exhausted under guaranteed_no_evict")
                preempted = True
                if n > 1:  # a recompute: take what fits, at least one token
                    n = max(1, self._fit(seq, n))
                    need = max(0, blocks_for(seq.num_cached + n, self.tpb) - len(seq.block_table))
                if not self._make_room(seq, need):
                    continue
            self._grow(seq, seq.num_cached + n)
            generating.append((seq, n))
            budget -= n

        self._prompt_rows, self._time_left = 0, None
        if (
            self.budgets_time
            and decoding
            and (self.waiting or any(s.prefilling for s in self.running))
            and self.step_times.ready  # fits only here: a step with decodes and a prompt to cut
        ):
            self._time_left = self._prompt_time(self.step_times.decode_ms(sum(n for _, n in generating)))
            self._prompt_floor = self._backlog_floor()
        for seq in sorted((s for s in self.running if s.prefilling), key=lambda s: s.order):
            if seq not in self.running or budget == 0:
                continue
            n = self._step_tokens(seq, budget)
            if n and self.policy == "max_utilization":
                n = self._fit(seq, n)
                if n == 0 and not generating and not prefills:  # nothing else can move: free blocks
                    preempted = True
                    if self._make_room(seq, blocks_for(seq.num_cached + self.unit, self.tpb) - len(seq.block_table)):
                        n = self._fit(seq, self._step_tokens(seq, budget))
            if n == 0:
                continue
            self._grow(seq, seq.num_cached + n)
            prefills.append((seq, n))
            budget -= n
            self._charge(seq, n)

        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size and not preempted:
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            self._grow(seq, seq.num_cached + n)
            (prefills if seq.prefilling else generating).append((seq, n))
            budget -= n
            self._charge(seq, n)
        self._time_left, self._prompt_floor = None, 0
        return generating + prefills

    @property
    def budgets_time(self) -> bool:
        """Whether steps with someone generating have a time budget (and so the engine times its steps)."""
        return self.step_budget_ms is not None or self.step_budget_ratio is not None

    def _prompt_time(self, decode_ms: float) -> float:
        """ms a step's prompt chunks may take beside decode rows predicted to take ``decode_ms``."""
        left = [self.step_budget_ms - decode_ms] if self.step_budget_ms is not None else []
        if self.step_budget_ratio is not None:
            left.append((self.step_budget_ratio - 1) * decode_ms)
        return min(left)

    def _backlog_floor(self) -> int:
        """Prompt rows a step takes under a time budget whatever its cut: the prompt tokens waiting (prefills
        under way and the queue, before any prefix-cache match) over ``prompt_backlog_steps``, in whole units
        (rounded down).  Where prompts arrive faster than the budget's cut lets through, the backlog grows until
        this floor carries them, so a prompt waits about that many steps instead of a queue growing behind a
        unit a step (a ratio budget at 8 streams); at lower load it is below a unit and the cut decides."""
        if not self.prompt_backlog_steps:
            return 0
        waiting = sum(s.prompt_len - s.num_cached for s in self.running if s.prefilling)
        waiting += sum(s.prompt_len for s in self.waiting)
        return waiting // (self.prompt_backlog_steps * self.unit) * self.unit

    def _charge(self, seq: Sequence, n: int) -> None:
        """Take a planned prompt chunk's predicted time off what is left of the step's time budget."""
        if seq.prefilling:
            self._prompt_rows += n
            if self._time_left is not None:
                self._time_left -= self.step_times.prompt_ms(n, seq.num_cached)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Match the prefix cache and reserve blocks for ``seq``; returns its first chunk (0 = not now)."""
        # Reuse at most the blocks before the last token: that token must run to give logits.
        reusable = (len(seq.tokens) - 1) // self.tpb
        matched = self.blocks.match_prefix(seq.keys_upto(reusable)) if reusable else []
        lru_hits = sum(1 for b in matched if self.blocks.is_cached_unused(b))
        available = self.blocks.num_available - lru_hits
        seq.num_cached = len(matched) * self.tpb
        n = self._step_tokens(seq, budget)
        if n and self.policy == "guaranteed_no_evict":
            need = max(seq.lifetime_blocks, blocks_for(len(seq.tokens), self.tpb)) - len(matched)
            if available - self._outstanding() < need:
                n = 0
        elif n:
            free = (len(matched) + available) * self.tpb - seq.num_cached
            if n > free:
                n = self._align(seq, free) if seq.prefilling else max(0, free)
        if n == 0:
            seq.num_cached = 0
            return 0
        for b in matched:
            self.blocks.acquire(b)
        seq.block_table = list(matched)
        seq.num_registered = len(matched)
        seq.reused_blocks += len(matched)
        return n

    def commit(self, seq: Sequence, n: int) -> None:
        """After the forward: ``n`` more tokens of ``seq`` have K/V in the pool; share its newly full blocks."""
        seq.num_cached += n
        full = seq.num_cached // self.tpb
        if full > seq.num_registered and self.blocks.enable_reuse:
            keys = seq.keys_upto(full)
            for i in range(seq.num_registered, full):
                self.blocks.register(seq.block_table[i], keys[i])
        seq.num_registered = max(seq.num_registered, full)
