"""The prefix cache: K/V of prompt prefixes computed once, reused by later rows that start the same way.

Prompts are cut into blocks of BLOCK tokens from their start. A cached block is found by its tokens
and its parent block (the one before it), so a block stands for the whole token sequence from the
prompt's start to its end: the chained block hashes of vLLM's automatic prefix caching, with the
parent's identity and the block's own tokens as the exact key (a dict lookup compares the tokens, so
two prefixes never share an entry by a hash collision). Blocks rather than a radix tree (SGLang's): the
loop's KV cache is a fixed array per slot that admission copies into, so there is nothing to gain from
sharing at token granularity, and fixed blocks keep the accounting and eviction simple.

A block holds, for every layer, the K and V rows of its BLOCK positions, and the target features of
those positions where drafts read them (models.distilled.TargetFeatures): a slot that reuses a prefix
gets everything the target's prefill of it would have written. Model drafters with their own cache
(drafters/model.py) catch up lazily from the tokens, as they always do, so they need no cached copy;
early-exit drafts (the int8 copy included) share the target's cache.

Reuse is exact wherever a K/V row does not depend on the batch it was computed in: the C decoder's
rows are batch-invariant (docs/kernels.md), so a reused prefix gives the very bits a prefill would
have. The cache is bounded by a byte budget: when a new block does not fit, the least recently used
block that no other cached block continues is evicted (a block is touched after its descendants, so
that is the LRU block itself in practice); a block larger than the whole budget is not kept.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..models.cache import KVCache

BLOCK = 16  # tokens per cached block


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside: the cache's copies are small and memory-bound, and OpenMP's fork and join
    around each of them cost far more than the copy where the machine is busy (its threads wait for cores)."""
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


@dataclass(eq=False)
class Block:
    """BLOCK prompt positions' K/V (and target features), continuing `parent` (None: the prompt's start)."""

    id: int
    parent: Block | None
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [2, layers, kv_heads, BLOCK, head_dim]: K then V
    features: tuple[torch.Tensor, ...]  # per feature buffer, [BLOCK, width]
    nbytes: int
    children: int = 0  # cached blocks that continue this one

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        return (-1 if self.parent is None else self.parent.id), self.tokens


@dataclass
class PrefixCache:
    """Cached prompt blocks under a byte budget, least recently used first out.

    `reused`, `stored` and `evicted` count tokens reused, blocks stored and blocks evicted.
    """

    budget_bytes: int
    block: int = BLOCK
    used_bytes: int = 0
    reused: int = 0
    stored: int = 0
    evicted: int = 0
    _blocks: dict[tuple[int, tuple[int, ...]], Block] = field(default_factory=dict)
    _lru: OrderedDict[int, Block] = field(default_factory=OrderedDict)  # by id, least recent first
    _next_id: int = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, tokens: list[int], limit: int) -> list[Block]:
        """The cached blocks that begin `tokens`, in order, covering at most `limit` tokens; touched."""
        found: list[Block] = []
        parent = -1
        b = self.block
        while (len(found) + 1) * b <= limit:
            n = len(found) * b
            blk = self._blocks.get((parent, tuple(tokens[n : n + b])))
            if blk is None:
                break
            found.append(blk)
            parent = blk.id
        self._touch(found)
        return found

    def peek(self, tokens: list[int]) -> int:
        """How many cached blocks begin `tokens` (up to its last token), without touching them."""
        parent, n, b = -1, 0, self.block
        while (n + 1) * b <= len(tokens) - 1:
            blk = self._blocks.get((parent, tuple(tokens[n * b : (n + 1) * b])))
            if blk is None:
                break
            parent, n = blk.id, n + 1
        return n

    def load(self, blocks: list[Block], first: int, cache: KVCache, slot: int,
             features: list = ()) -> int:
        """Copy blocks[first:] into `slot` of the KV cache (and each feature buffer) at their positions;
        returns the tokens they cover from the prompt's start, len(blocks) * block."""
        b = self.block
        with one_thread():
            for i in range(first, len(blocks)):
                blk = blocks[i]
                rows = slice(i * b, (i + 1) * b)
                cache.k[:, slot, :, rows] = blk.kv[0]
                cache.v[:, slot, :, rows] = blk.kv[1]
                for f, g in zip(features, blk.features):
                    f.g[slot, rows] = g
        return len(blocks) * b

    def store(self, tokens: list[int], upto: int, cache: KVCache, slot: int, features: list = ()) -> int:
        """Keep the blocks of `tokens` that lie wholly in [0, upto), whose K/V (and features) `slot` of
        `cache` holds, where they are not cached yet; returns how many blocks were added."""
        b = self.block
        chain = self.match(tokens, upto)
        added = 0
        for i in range(len(chain), upto // b):
            rows = slice(i * b, (i + 1) * b)
            with one_thread():
                kv = torch.stack((cache.k[:, slot, :, rows], cache.v[:, slot, :, rows]))  # a copy
                feats = tuple(f.g[slot, rows].clone() for f in features)
            nbytes = kv.numel() * kv.element_size() + sum(g.numel() * g.element_size() for g in feats)
            if not self._make_room(nbytes, chain):
                break
            parent = chain[-1] if chain else None
            blk = Block(self._next_id, parent, tuple(tokens[i * b : (i + 1) * b]), kv, feats, nbytes)
            self._next_id += 1
            if parent is not None:
                parent.children += 1
            self._blocks[blk.key] = blk
            self._lru[blk.id] = blk
            self.used_bytes += nbytes
            chain.append(blk)
            added += 1
        self.stored += added
        self._touch(chain)
        return added

    def _touch(self, chain: list[Block]) -> None:
        """Most recent: the chain's blocks, its start last (so a block is never older than a descendant)."""
        for blk in reversed(chain):
            self._lru.move_to_end(blk.id)

    def _make_room(self, nbytes: int, keep: list[Block]) -> bool:
        """Evict least recently used leaf blocks (never one in `keep`) until nbytes more fit the budget."""
        if nbytes > self.budget_bytes:
            return False
        kept = {blk.id for blk in keep}
        while self.used_bytes + nbytes > self.budget_bytes:
            victim = next((blk for blk in self._lru.values() if blk.children == 0 and blk.id not in kept), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, blk: Block) -> None:
        del self._blocks[blk.key]
        del self._lru[blk.id]
        self.used_bytes -= blk.nbytes
        self.evicted += 1
        if blk.parent is not None:
            blk.parent.children -= 1
