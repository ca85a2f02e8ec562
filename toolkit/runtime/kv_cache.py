"""Paged KV cache: a fixed pool of blocks, per-sequence block tables, and prefix reuse.

Memory is bounded and known up front: ``num_blocks`` blocks of ``tokens_per_block`` token slots,
allocated once per layer as flat "slot" tensors (``[num_blocks * tokens_per_block, kv_heads,
head_dim]``); a token at position ``p`` of a sequence lives in slot
``block_table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block``.

Prefix reuse follows TensorRT-LLM's block reuse (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp,
evictionPolicy.cpp): a block that is *full* is identified by a hash of its tokens chained with
the hash of the block before it, so equal keys mean equal token prefixes.  Registered blocks that
no sequence uses any more stay in an LRU list and are handed out again on a key match, or evicted
(least recently released first) when the pool runs out of never-used blocks.  Only full blocks are
shared, and a sequence only ever writes into its own last, partial block, so sharing never needs
copy-on-write.

:class:`BlockManager` is pure bookkeeping (no tensors); :class:`KVPool` holds the tensors.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from . import hugepages

ROOT_KEY = b""


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """Key of a full block: a digest of the parent block's key and this block's token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def blocks_for(num_tokens: int, tokens_per_block: int) -> int:
    return -(-num_tokens // tokens_per_block)


class OutOfBlocks(RuntimeError):
    """The pool has no free or evictable block (the scheduler prevents this; seeing it is a bug)."""


class BlockManager:
    """Reference-counted blocks with a free list and an LRU of reusable (registered, unused) blocks."""

    def __init__(self, num_blocks: int, tokens_per_block: int, enable_reuse: bool = True):
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.enable_reuse = enable_reuse
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # never registered, or evicted
        self._lru: OrderedDict[int, None] = OrderedDict()  # registered, refcount 0; oldest first
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.reused_total = 0  # blocks handed out again through a key match
        self.allocated_total = 0  # blocks handed out fresh
        self.evicted_total = 0

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def is_cached_unused(self, block: int) -> bool:
        return block in self._lru

    def stats(self) -> dict:
        return {
            "blocks_total": self.num_blocks,
            "blocks_free": self.num_available,
            "blocks_used": self.num_used,
            "blocks_cached": len(self._lru),
            "blocks_reused_total": self.reused_total,
            "blocks_allocated_total": self.allocated_total,
            "blocks_evicted_total": self.evicted_total,
            "tokens_per_block": self.tokens_per_block,
        }

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._lru:
            block, _ = self._lru.popitem(last=False)  # least recently released
            del self._block_of[self._key_of.pop(block)]
            self.evicted_total += 1
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        self._refs[block] = 1
        self.allocated_total += 1
        return block

    def match_prefix(self, keys: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of ``keys`` (not yet acquired)."""
        if not self.enable_reuse:
            return []
        out = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, block: int) -> None:
        """Take a reference on a registered block found by :meth:`match_prefix`."""
        if self._refs[block] == 0:
            self._lru.pop(block)
        self._refs[block] += 1
        self.reused_total += 1

    def release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] < 0:
            raise AssertionError(f"KV block {block} released more often than taken")
        if self._refs[block] == 0:
            if block in self._key_of:
                self._lru[block] = None  # most recently released at the end
            else:
                self._free.append(block)

    def release_all(self, blocks: list[int]) -> None:
        # Last block first: in the LRU a sequence's tail is then evicted before its head, so a
        # surviving cached prefix stays contiguous (a child block is useless without its parent).
        for b in reversed(blocks):
            self.release(b)

    def register(self, block: int, key: bytes) -> None:
        """Mark a full block as holding the prefix ``key`` so later sequences can reuse it."""
        if not self.enable_reuse or block in self._key_of or key in self._block_of:
            return  # already registered, or another block already holds the same prefix
        self._key_of[block] = key
        self._block_of[key] = block


@dataclass
class KVQuant:
    """How K/V are stored: ``kind`` "fp8" (e4m3) or "int8", with per-layer scales (K and V)."""

    kind: str
    k_scales: list[float]
    v_scales: list[float]


class KVPool:
    """The K and V tensors of every layer, ``[num_layers, num_slots, kv_heads, head_dim]`` each.

    With KV-cache quantization the pool stores 1-byte codes (fp8 e4m3 bits viewed as uint8, or
    int8) of ``k / k_scale`` and ``v / v_scale`` after RoPE, as TensorRT-LLM's quantized KV cache
    does; :meth:`gather` dequantizes to the compute dtype.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        tokens_per_block: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        quant: KVQuant | None = None,
        huge_pages: bool = False,
    ):
        self.num_slots = num_blocks * tokens_per_block
        self.dtype = dtype
        self.quant = quant
        store = {None: dtype, "fp8": torch.uint8, "int8": torch.int8}[quant.kind if quant else None]
        shape = (num_layers, self.num_slots, kv_heads, head_dim)
        if huge_pages:  # zeroed too; a decode step reads its context's K/V from memory (hugepages)
            nbytes = math.prod(shape) * store.itemsize
            self.k, self.v = (hugepages.empty(nbytes).view(store).view(shape) for _ in range(2))
        else:
            self.k = torch.zeros(shape, dtype=store)
            self.v = torch.zeros(shape, dtype=store)
        self._k_layers, self._v_layers = list(self.k.unbind(0)), list(self.v.unbind(0))  # views, made once
        self.fast_gather = False  # rtk's gather_kv kernel for bf16 -> float32 reads (set by the model)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def _encode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        kind = self.quant.kind
        xf = x.to(torch.float32) / scale
        if kind == "fp8":
            return xf.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        return xf.round().clamp(-128, 127).to(torch.int8)

    def _decode(self, codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        if self.quant.kind == "fp8":
            codes = codes.view(torch.float8_e4m3fn)
        return (codes.to(torch.float32) * scale).to(dtype)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[T, kv_heads, head_dim]``) at ``slots`` (``[T]``)."""
        if self.quant is not None:
            k = self._encode(k, self.quant.k_scales[layer])
            v = self._encode(v, self.quant.v_scales[layer])
        self._k_layers[layer].index_copy_(0, slots, k)
        self._v_layers[layer].index_copy_(0, slots, v)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V as stored, ``[num_slots, kv_heads, head_dim]`` each (views, no copy)."""
        return self._k_layers[layer], self._v_layers[layer]

    def gather(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any shape ``S``) as ``S + [kv_heads, head_dim]`` in ``dtype`` (default: the
        compute dtype); quantized codes are dequantized straight into ``dtype``."""
        dtype = dtype or self.dtype
        flat = slots.reshape(-1)
        if self.fast_gather and self.quant is None and self.dtype == torch.bfloat16 and dtype == torch.float32:
            from . import kernels

            k, v = kernels.gather_kv(self._k_layers[layer], self._v_layers[layer], flat)
            tail = k.shape[1:]
            return k.view(*slots.shape, *tail), v.view(*slots.shape, *tail)
        k = self._k_layers[layer].index_select(0, flat)
        v = self._v_layers[layer].index_select(0, flat)
        if self.quant is not None:
            k = self._decode(k, self.quant.k_scales[layer], dtype)
            v = self._decode(v, self.quant.v_scales[layer], dtype)
        elif dtype != self.dtype:
            k, v = k.to(dtype), v.to(dtype)
        tail = k.shape[1:]
        return k.view(*slots.shape, *tail), v.view(*slots.shape, *tail)
