"""Structured output under speculation: each constrained slot's grammar masks the target's rows.

A slot whose request asks for a constraint (grammars.py) holds a :class:`GrammarState`: an llguidance
matcher advanced over the slot's committed tokens. At each step the verifier reads the target's rows
of the slot's segment (the last committed token and its drafts, a chain or a tree); row r is masked by
the grammar state reached along that row's path, the draft prefix before it (controls.chain_prefixes /
tree_prefixes, the prefixes the penalties count). The matcher walks the rows in order: it rolls back to
the longest prefix it shares with the row's path, consumes the rest, fills the row's token bitmask, and
rolls back to the committed state at the end. Every row is then exactly the row plain decoding would
see had the drafts before it been committed, so greedy constrained speculation equals greedy
constrained plain decoding token for token, and the sampled verifier reads the masked distribution as p.

A row whose path holds a token the grammar refuses (or a stop token) is left unmasked: the verifier
never reaches it, as the row before gives that token probability 0 (or the request stops there).

Where the grammar may end (its end-of-sequence token is allowed), the request's own stop tokens (EOS,
stop_token_ids) are allowed too. When the grammar can take no more tokens (stopped), the request
stops there, as at EOS. min_tokens does not hold a request past its grammar's end: a row that the
controls would leave no token keeps the grammar's tokens with their raw logits.

Drafts: a model drafter masks its own logits along each draft path (:class:`DraftGrammar`, a copy of the
slot's matcher, handed to it as DraftRequest.grammar), so it proposes only tokens the grammar allows, and
appends the tokens the grammar forces with no forward. Any proposal is then cut, a chain at the first token
the grammar refuses, a tree without those nodes (and their subtrees), before the verify forward, where that
keeps sampling exact: greedy rows, the Gumbel sampler (the text is fixed by the target's rows), and
deterministic drafts (no q: a cut position draws from p, as a rejected one-hot draft would). A sampled draft
with its q keeps its tokens; the verifier rejects a refused one (p = 0 there).

Jump-forward: where the grammar allows exactly one continuation for the next tokens (a JSON key, its
quotes and colon), a slot with no draft of its own proposes those tokens with no draft forward
(GrammarState.forced), verified like any deterministic draft. The masked target gives each of them
probability 1, so they are accepted, and the output is the one plain decoding gives.

Each distinct constraint is compiled once per loop (:class:`Grammars`) and copied per request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from ..grammars import Structured, grammar_text, one_line, problem
from ..sampling import SamplingParams


JUMP_FORWARD = True  # forced tokens proposed as a draft where a slot has none (the module docstring)


class Grammars:
    """The loop's grammar engine: the tokenizer as llguidance reads it (made on first use), one compiled
    matcher per distinct constraint (copied for each request), and the time spent masking."""

    def __init__(self, tokenizer, vocab: int):
        self.tok = tokenizer
        self.vocab = vocab
        self._engine_tok = None
        self._compiled: dict[Structured, object] = {}
        self.mask_s = 0.0  # seconds in mask_segments() (bitmask fills and their application)
        self.mask_rows = 0  # rows masked
        self.draft_mask_s = 0.0  # seconds in DraftGrammar.refused() (the drafters' masks)
        self.draft_mask_rows = 0  # draft rows masked

    @property
    def engine_tok(self):
        if self._engine_tok is None:
            import llguidance.hf

            self._engine_tok = llguidance.hf.from_tokenizer(self.tok, n_vocab=self.vocab)
        return self._engine_tok

    def problem(self, s: Structured | None) -> str | None:
        """Why a request with this constraint cannot be decoded (grammars.problem, then compiled against this
        tokenizer), or None."""
        if s is None:
            return None
        why = problem(s)
        if why is None:
            error = self._matcher(s).get_error()
            why = f"the {s.kind} constraint does not compile: {one_line(error)}" if error else None
        return why

    def _matcher(self, s: Structured):
        if s not in self._compiled:
            from llguidance import LLMatcher

            self._compiled[s] = LLMatcher(self.engine_tok, grammar_text(s), log_level=0)
        return self._compiled[s]

    def open(self, s: Structured, stops: frozenset[int], min_tokens: int = 0) -> GrammarState:
        """A fresh state of constraint s for one request, whose own stop tokens are ``stops``."""
        return GrammarState(self, self._matcher(s).deep_copy(), stops, min_tokens)

    def refused(self, bitmask: torch.Tensor) -> torch.Tensor:
        """[n, W] int32 bitmasks -> [n, V] bool, True where token i is refused (bit i % 32 of word i // 32 clear)."""
        words = (~bitmask).contiguous().numpy().view(np.uint8)  # [n, 4W], little-endian words
        return torch.from_numpy(np.unpackbits(words, axis=1, bitorder="little")[:, : self.vocab]).view(torch.bool)


class GrammarState:
    """One request's matcher, at its committed tokens between steps."""

    def __init__(self, grammars: Grammars, matcher, stops: frozenset[int], min_tokens: int = 0):
        self.g = grammars
        self.m = matcher
        self.stops = stops
        self.min_tokens = min_tokens  # while fewer tokens are committed, the controls may mask the stops
        self.committed = 0
        self.eos = grammars.engine_tok.eos_token
        self.stopped = False  # the grammar takes no more tokens: the request ends

    def goto(self, matcher, done: list[int], path: Sequence[int]) -> bool:
        """Move matcher from the committed tokens + done (changed to match) to the committed tokens + path, rolling
        back only past their shared prefix; False where the grammar refuses a token of path or path holds a stop
        token (the matcher then at the longest prefix it takes)."""
        c = 0
        while c < min(len(done), len(path)) and done[c] == path[c]:
            c += 1
        if len(done) > c:
            matcher.rollback(len(done) - c)
            del done[c:]
        for t in path[c:]:
            if t in self.stops or t == self.eos or matcher.try_consume_tokens([t]) != 1:
                return False
            done.append(t)
        return True

    def _walk(self, paths: Sequence[Sequence[int]], visit) -> None:
        """Visit each path's state in turn (visit(r, ok): ok when the grammar takes the whole path, the
        matcher then at its end), rolling back only past the shared prefix; back at the committed state after."""
        done: list[int] = []
        for r, path in enumerate(paths):
            visit(r, self.goto(self.m, done, path))
        if done:
            self.m.rollback(len(done))

    def fill(self, bitmask: torch.Tensor, prefixes: Sequence[Sequence[int]]) -> int:
        """Fill one segment's bitmask rows [n, W] int32 (all bits set on entry), row r with the state along
        prefixes[r]; a row whose path the grammar refuses stays all set. Returns the rows filled."""
        filled = 0
        words = bitmask.shape[1]

        def fill(r: int, whole: bool) -> None:
            nonlocal filled
            if whole:
                self.m.unsafe_compute_mask_ptr(bitmask[r].data_ptr(), words * 4)
                filled += 1

        self._walk(prefixes, fill)
        return filled

    def allow_stops(self, refused: torch.Tensor) -> None:
        """Where the grammar may end (its EOS not refused), the request's own stop tokens are allowed too."""
        stops = sorted(i for i in self.stops if 0 <= i < refused.shape[1])
        if stops and 0 <= self.eos < refused.shape[1]:
            ends = ~refused[:, self.eos]
            refused[:, torch.tensor(stops, dtype=torch.long)] &= ~ends[:, None]

    def advance(self, new: list[int]) -> list[int]:
        """A step's new tokens as committed: consumed by the grammar up to the token that stops it (the
        rest dropped, and ``stopped`` set) or up to a stop token of the request's (the loop stops there)."""
        self.committed += len(new)
        for i, t in enumerate(new):
            if t in self.stops:
                return new[: i + 1]
            if not self.m.consume_token(t):
                raise RuntimeError(f"token {t} was committed against the grammar: {self.m.get_error()}")
            if self.m.is_stopped():
                self.stopped = True
                return new[: i + 1]
        return new

    def forced(self, cap: int) -> list[int]:
        """The tokens the grammar forces from the committed state (none where it allows a choice or may end),
        at most cap, as a chain draft (cut like any: up to a stop token)."""
        if cap <= 0 or self.stopped or not JUMP_FORWARD:
            return []
        return self.cut(list(self.m.compute_ff_tokens())[:cap], None)[0]

    def cut(self, tokens: list[int], parents: list[int] | None) -> tuple[list[int], list[int] | None, list[int]]:
        """A proposal without the tokens the grammar refuses: a chain up to the first, a tree without those
        nodes and their subtrees; returns (tokens, parents, indices of the kept nodes)."""
        if parents is None:
            k = self.m.validate_tokens(tokens)
            for i, t in enumerate(tokens[:k]):
                if t in self.stops or t == self.eos:
                    k = i + 1  # a stop token ends the draft: nothing after it is verified usefully
                    break
            return tokens[:k], None, list(range(k))
        paths: list[list[int]] = []
        for x, a in zip(tokens, parents):
            paths.append((paths[a] if a >= 0 else []) + [x])
        keep: list[int] = []  # a node is kept when the grammar takes its whole path (so its ancestors are kept),
        whole_paths: set[int] = set()  # or when it is a stop token where the grammar may end (a leaf, as in a chain)

        def visit(r: int, whole: bool) -> None:
            a, t = parents[r], tokens[r]
            if whole:
                whole_paths.add(r)
            elif not ((t in self.stops or t == self.eos) and (a < 0 or a in whole_paths) and self.m.is_accepting()):
                return  # (a stop token's parent path is whole: the walk stopped there, the matcher at its end)
            keep.append(r)

        self._walk(paths, visit)
        new_index = {old: j for j, old in enumerate(keep)}
        return ([tokens[i] for i in keep], [new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep], keep)


class DraftGrammar:
    """A slot's grammar as its drafter sees it for one step (DraftRequest.grammar): the tokens it allows after
    each draft path. It walks its own copy of the slot's matcher, made on first use and moved from path to path
    (rolled back past their shared prefix only), so the slot's committed state never moves."""

    def __init__(self, state: GrammarState):
        self.state = state
        self._m = None  # the copy, at the committed tokens + _done
        self._done: list[int] = []

    def _open(self, path: Sequence[int]) -> bool:
        """The copy at path; whether a token may follow it (the grammar takes it whole, it holds no stop token,
        and the grammar is not complete there)."""
        if self._m is None:
            self._m = self.state.m.deep_copy()
        return self.state.goto(self._m, self._done, path) and not self._m.is_stopped()

    def ends(self, path: Sequence[int]) -> bool:
        """Whether nothing may be drafted after path."""
        return not self._open(path)

    def refused(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """[n, V] bool, row r True where token i is refused after paths[r] (the grammar's tokens, and the
        request's stop tokens where it may end); a row all True where nothing may follow paths[r]."""
        t0 = time.perf_counter()
        g = self.state.g
        bitmask = torch.zeros((len(paths), (g.vocab + 31) // 32), dtype=torch.int32)  # a row left so refuses all
        for r, path in enumerate(paths):
            if self._open(path):
                self._m.unsafe_compute_mask_ptr(bitmask[r].data_ptr(), bitmask.shape[1] * 4)
        eos = self.state.eos
        if 0 <= eos < g.vocab:  # allow_stops on the words: a stop token's bit is set where the EOS bit is
            words = bitmask.numpy()
            ends = (words[:, eos // 32] >> (eos % 32)) & 1  # [n]
            for i in self.state.stops:
                if 0 <= i < g.vocab:
                    words[:, i // 32] |= ends << (i % 32)
        refused = g.refused(bitmask)
        g.draft_mask_s += time.perf_counter() - t0
        g.draft_mask_rows += len(paths)
        return refused

    def takes(self, tokens: list[int]) -> int:
        """How many leading tokens of a chain the grammar takes from the committed state (GrammarState.cut)."""
        self._open([])
        k = self._m.validate_tokens(tokens)
        for i, t in enumerate(tokens[:k]):
            if t in self.state.stops or t == self.state.eos:
                return i + 1
        return k

    def forced(self, path: Sequence[int], cap: int) -> list[int]:
        """The tokens the grammar forces after path (jump-forward, GrammarState.forced), at most cap."""
        if cap <= 0 or not JUMP_FORWARD or not self._open(path):
            return []
        forced = list(self._m.compute_ff_tokens())[:cap]
        forced = forced[: self._m.validate_tokens(forced)]
        for i, t in enumerate(forced):
            if t in self.state.stops or t == self.state.eos:
                return forced[: i + 1]
        return forced


def mask_segments(out: torch.Tensor, raw: torch.Tensor,
                  segments: Sequence[tuple[GrammarState, int, Sequence[Sequence[int]]]]) -> None:
    """Mask the constrained segments' rows of a step at once: out [R, V] float32 (the controlled rows, changed
    in place), raw [R, V] (the target's rows); segments: (state, first row, prefixes [n] of its n rows)."""
    if not segments:
        return
    t0 = time.perf_counter()
    g = segments[0][0].g
    words = (g.vocab + 31) // 32
    rows = torch.cat([torch.arange(r, r + len(p)) for _, r, p in segments])  # [M]
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)  # a row left unfilled allows every token
    filled, at = 0, 0
    for state, _, prefixes in segments:
        filled += state.fill(bitmask[at : at + len(prefixes)], prefixes)
        at += len(prefixes)
    refused = g.refused(bitmask)  # [M, V]
    at = 0
    for state, _, prefixes in segments:
        state.allow_stops(refused[at : at + len(prefixes)])
        at += len(prefixes)
    refused, rows = refused.to(out.device), rows.to(out.device)
    if len(rows) == out.shape[0]:
        out.masked_fill_(refused, -torch.inf)
    else:
        out[rows] = out[rows].masked_fill_(refused, -torch.inf)
    if any(state.committed < state.min_tokens for state, _, _ in segments):
        # min_tokens may have left the grammar nothing at its end: such a row keeps the grammar's tokens, raw
        dead = torch.isneginf(out[rows]).all(dim=-1)
        if bool(dead.any()):
            out[rows[dead]] = raw[rows[dead]].to(out.dtype).masked_fill(refused[dead], -torch.inf)
    g.mask_s += time.perf_counter() - t0
    g.mask_rows += filled


def may_cut(sp: SamplingParams, has_q: bool) -> bool:
    """Whether cutting a draft keeps this request's decoding exact (the module docstring)."""
    return sp.greedy or sp.sampler == "gumbel" or not has_q


def cut_proposal(state: GrammarState | None, sp: SamplingParams, tokens: list[int], parents: list[int] | None,
                 probs: torch.Tensor | None) -> tuple[list[int], list[int] | None, torch.Tensor | None]:
    """One slot's proposal (tokens, tree parents or None, q [len, V] or None) as verified: cut where the grammar
    refuses a token, when the slot has a grammar and a cut keeps its decoding exact; else as it was."""
    if state is None or not tokens or not may_cut(sp, probs is not None):
        return tokens, parents, probs
    tokens, parents, kept = state.cut(tokens, parents)
    if probs is not None:
        probs = probs[torch.tensor(kept, dtype=torch.long, device=probs.device)]
    return tokens, parents if tokens else None, probs
