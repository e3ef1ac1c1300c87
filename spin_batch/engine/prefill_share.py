"""Prefill shared between rows: the prefix cache's side of the batch loop, and n samples per prompt.

Before each step is planned (BatchLoop.plan), every slot still prefilling takes what it can instead of
computing it:

- a sample of a request with n > 1 copies the prompt's K/V (all but the last token) from a live
  sibling that has prefilled it, or from the copy its group kept of them while samples were still
  queued for a slot (with fewer free slots than samples), or waits, unplanned, while a sibling is
  prefilling it: the prompt is prefilled once, and each sample feeds only the last prompt token, whose
  logits give its first token;
- any other prefilling slot copies the cached blocks (prefix_cache.py) that begin its prompt past
  what it holds already, up to its last prompt token.

After a step commits, the prompt blocks each prefilling slot completed are stored in the prefix cache,
and siblings waiting on a slot that has now prefilled their prompt copy it at once (before the slot
can finish and be freed).

A copied K/V row is the very row a prefill would have written where rows are batch-invariant (the C
decoder: docs/kernels.md), so greedy output does not change; elsewhere it may differ in its last bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from ..models.cache import KVCache
from ..records import Completion, Request
from ..sampling import make_generator, request_seed
from .prefix_cache import PrefixCache, one_thread


@dataclass(eq=False)
class SampleGroup:
    """One request decoded as n samples: each sample has its own slot; the group's completions go out
    together, sample 0 first, once all n have finished (so a stopped run writes all n or none)."""

    req: Request
    ids: list[int]
    n: int
    queued: list[int] = field(default_factory=list)  # sample indices not yet in a slot
    done: dict[int, Completion] = field(default_factory=dict)
    # the prompt's K/V [2, layers, kv_heads, len - 1, head_dim] (and features), kept while samples are queued
    kept: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def finish(self, c: Completion) -> Completion | None:
        """Record a sample's completion; the group's (sample 0 carrying the others) once all are in."""
        self.done[c.index] = c
        if len(self.done) < self.n:
            return None
        first, *more = (self.done[i] for i in range(self.n))
        return replace(first, more=tuple(more))


def sample_generator(job_seed: int, req: Request, sample: int) -> torch.Generator:
    """Sample i's random stream. Sample 0's is the request's own (make_generator: from the row's seed,
    else the job seed and the id), so n = 1 draws as before; sample i > 0 is seeded from sample 0's
    seed s and i (sampling.request_seed(s, "sample i"))."""
    key = req.id or req.source
    if sample == 0:
        return make_generator(job_seed, key, req.params.seed)
    base = request_seed(job_seed, key) if req.params.seed is None else req.params.seed % (1 << 63)
    return make_generator(base, f"sample {sample}")


class PrefillShare:
    """What the loop's prefilling slots take instead of computing: cached prefix blocks, a sibling's prompt."""

    def __init__(self, prefix: PrefixCache | None, cache: KVCache, features: list):
        self.prefix = prefix
        self.cache = cache
        self.features = features

    def before_plan(self, active: list) -> tuple[set[int], int]:
        """Give prefilling slots what can be copied; returns (slots that wait for a sibling, tokens copied)."""
        waiting: set[int] = set()
        reused = 0
        for s in active:
            if s.decoding or s.prefilled >= s.prompt_len - 1:
                continue
            if s.group is not None:
                src = self._sibling_source(s, active)
                if src is not None or s.group.kept is not None:
                    reused += self._fork(src, s)
                    continue
                if self._sibling_prefilling(s, active):
                    waiting.add(s.index)
                    continue
            reused += self._from_cache(s)
        for s in active:  # a group with every sample in a slot needs its kept copy no more
            if s.group is not None and not s.group.queued:
                s.group.kept = None
        return waiting, reused

    def after_commit(self, prefilled: list, active: list) -> int:
        """Store the prompt blocks the slots in `prefilled` completed; fork their waiting siblings.
        Returns the tokens copied to siblings."""
        reused = 0
        for s in prefilled:
            if self.prefix is not None:
                self.prefix.store(s.tokens, min(s.prefilled, s.prompt_len), self.cache, s.index, self.features)
            if s.group is not None and s.prefilled >= s.prompt_len - 1:
                for t in active:
                    if t is not s and t.group is s.group and t.prefilled < t.prompt_len - 1:
                        reused += self._fork(s, t)
                if s.group.queued and s.group.kept is None:  # samples wait for a slot: keep the prompt for them
                    n = s.prompt_len - 1
                    with one_thread():
                        s.group.kept = (torch.stack((self.cache.k[:, s.index, :, :n],
                                                     self.cache.v[:, s.index, :, :n])),
                                        tuple(f.g[s.index, :n].clone() for f in self.features))
        return reused

    def _from_cache(self, s) -> int:
        if self.prefix is None or not s.reuse_prefix:
            return 0
        blocks = self.prefix.match(s.tokens, s.prompt_len - 1)  # the last prompt token is always computed
        have = s.prefilled // self.prefix.block  # whole blocks the slot holds already
        if len(blocks) <= have:
            return 0
        end = self.prefix.load(blocks, have, self.cache, s.index, self.features)
        got = end - s.prefilled
        self.prefix.reused += got
        s.prefilled = end
        return got

    @staticmethod
    def _sibling_source(s, active: list):
        return next((t for t in active if t is not s and t.group is s.group and t.prefilled >= t.prompt_len - 1), None)

    @staticmethod
    def _sibling_prefilling(s, active: list) -> bool:
        """Whether a sibling ahead of s is prefilling the prompt (the one furthest on, then the lowest sample)."""
        ahead = [t for t in active if t.group is s.group and t.prefilled < t.prompt_len - 1]
        first = min(ahead, key=lambda t: (-t.prefilled, t.sample))
        return first is not s

    def _fork(self, src, dst) -> int:
        """Copy the prompt's K/V (and features), all but the last prompt token, into dst: from the sibling src,
        or (src None) from the group's kept copy."""
        n = dst.prompt_len - 1
        with one_thread():
            if src is not None:
                self.cache.copy_rows(src.index, dst.index, n)
                for f in self.features:
                    f.g[dst.index, :n] = f.g[src.index, :n]
            else:
                kv, feats = dst.group.kept
                self.cache.k[:, dst.index, :, :n] = kv[0]
                self.cache.v[:, dst.index, :, :n] = kv[1]
                for f, g in zip(self.features, feats):
                    f.g[dst.index, :n] = g
        got = n - dst.prefilled
        dst.prefilled = n
        return got


def reuse_order(stream: Iterator[Request], encode: Callable[[Request], list[int]], prefix: PrefixCache,
                window: int) -> tuple[Iterator[Request], Callable[[Request], list[int]]]:
    """The stream reordered for reuse within a window of `window` requests read ahead: the request whose
    prompt has the most cached blocks goes first, ties (no hit, most often) in input order. Each request is
    encoded once, as it enters the window; the encode returned hands out that result (or its error)."""
    encoded: dict[int, tuple[Request, list[int] | ValueError]] = {}  # by id(): a Request need not hash

    def encode_once(req: Request) -> list[int]:
        held, got = encoded.pop(id(req), (None, None))
        if held is not req:
            return encode(req)
        if isinstance(got, ValueError):
            raise got
        return got

    def ordered() -> Iterator[Request]:
        buf: list[Request] = []
        source = iter(stream)
        exhausted = False
        while True:
            while not exhausted and len(buf) < window:
                req = next(source, None)
                if req is None:
                    exhausted = True
                    break
                if req.error is None:
                    try:
                        encoded[id(req)] = req, encode(req)
                    except ValueError as e:
                        encoded[id(req)] = req, e
                buf.append(req)
            if not buf:
                return
            hits = [prefix.peek(ids) if isinstance(ids := encoded.get(id(r), (r, None))[1], list) else 0 for r in buf]
            best = max(range(len(buf)), key=lambda i: (hits[i], -i))
            yield buf.pop(best)

    return ordered(), encode_once
