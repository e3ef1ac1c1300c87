"""Several drafters on one device step (engine/device_step.py): each slot drafts with its own drafter and gamma.

DraftMix holds the drafters a DeviceLoop may draft with: n-gram lookups (spin_kernels.ngram_draft, each with
its min/max n-gram and gate caps) and model chains (engine/device_draft.DraftChain: a draft with a cache of
its own, or the target's first layers or its int8 copy over the target's cache). Any drafter that can be
written as such a chain object plugs in the same way. The host chooses, per step and per live slot, a drafter
(or none) and a gamma: given by the caller, or by a selection policy (selection/policy.Policy, the SPIN
bandit for `device:spin`), from the mirror's outcomes one step behind (SpinDriver, engine/device_spin.py).
Those choices reach the device with the step's other inputs, one copy from pinned memory.

Fixed shapes. The verify, accept and commit run at the step's bucket (rows B x width G, the widest gamma
asked), as with one drafter: B rows, gamma 0 for the rows that draft nothing. How the rows of different
drafters share the step:

- an n-gram lookup is one kernel over the bucket's rows (gamma 0 for the rows not its own), inside the step's
  graph: it costs next to nothing, so it adds no shape;
- a model chain runs over its own rows only, gathered into a padded sub-bucket (R rows, R from the slot
  buckets, at width G_d from the draft buckets: the widest gamma among them), each chain replayed from a
  graph of its own, before the step's graph; its drafts land in a buffer indexed by slot, from which the
  step gathers them. A chain no row chose does not run.

So the step's graphs stay keyed by its bucket, at most |slot buckets| x |draft buckets| of them (15 over 1-16
slots at gamma <= 8), and each model chain keeps an inventory of its own, at most |slot buckets| x (|draft
buckets| - 1). Keying one graph by the step's bucket and every chain's sub-bucket would multiply those
counts; running every chain over the bucket's rows would keep one inventory but run every model draft at
every step, the ones no slot chose included (at 16 slots with a costly draft, its whole chain).

A draft with a cache of its own must see every committed token (device_draft.DraftChain's invariant). Its
catch-up runs over the bucket's rows at every step, in the step's graph, so a slot that drafts with another
drafter, or with none, keeps it; where the mix has more than one drafter, a slot may have committed up to
width + 1 tokens since this draft last fed it, so it feeds width + 1 rows a slot (2 alone).

Timing: each replay (the step's graph and each chain's) is timed, CUDA events on CUDA, the host clock
elsewhere (the CPU runs the step as it is queued), and read when the step's record is read; the table of
measured times per bucket (ReplayTimes) is what the policy's cost model learns from.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..drafters.model import FeatureDrafter
from ..drafters.ngram import NgramDrafter
from ..models.buckets import Bucket, BucketGraphs, bucket_of
from ..selection.policy import Outcome, Policy, StepChoice, StepCosts
from .device_draft import DraftChain, chain_problem

NONE = -1  # a row's drafter index where it drafts nothing


def mix_problem(drafter) -> str | None:
    """Why a drafter cannot draft in a DraftMix, or None: n-gram, or a token-only model chain
    (device_draft.chain_problem); a draft that reads the target's features drafts alone (device_feature.py)."""
    if isinstance(drafter, NgramDrafter):
        return None
    if isinstance(drafter, FeatureDrafter):
        return f"drafter {drafter.name!r} reads the target's features: not in a draft mix yet"
    return chain_problem(drafter)


@dataclass(frozen=True)
class Lookup:
    """An n-gram drafter on the device: its index among the mix's drafters and its lookup's settings."""

    index: int
    name: str
    min_ngram: int
    max_ngram: int
    keep: torch.Tensor  # [max_ngram + 1] long: the gate's cap per match length (the width everywhere: no gate)


class Chained:
    """A model drafter on the device: its chain, a graph inventory of its own, and its drafts by slot."""

    def __init__(self, index: int, name: str, chain: DraftChain, graphs: BucketGraphs, slots: int, width: int,
                 device: torch.device):
        self.index, self.name, self.chain, self.graphs = index, name, chain, graphs
        self.drafts = torch.zeros(slots, max(width, 1), dtype=torch.long, device=device)  # [P, width] by slot


@dataclass
class MixStep:
    """What the host decided for one queued step, and what it reads back with the step's record."""

    names: list[str | None]  # per row (the loop's row order): the drafter, None where it drafts nothing
    gammas: list[int]  # per row
    bucket: Bucket
    chains: dict[str, Bucket]  # per chain that ran: its sub-bucket
    marks: list  # (key, timing mark) per replay
    chosen: StepChoice | None = None  # the policy's choices, where a policy chose


class ReplayTimes:
    """Measured seconds per replay key (part, rows, width): CUDA events around each replay on CUDA, the host clock
    elsewhere; a decayed mean per key, and the count of replays timed."""

    def __init__(self, device: torch.device, decay: float = 0.9):
        self.cuda = torch.device(device).type == "cuda"
        self.decay = decay
        self.table: dict[tuple, list[float]] = {}  # key -> [replays, mean seconds]

    def begin(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def end(self, mark):
        """The mark of a replay just queued: (start, end) events on CUDA, read later; seconds on the host clock."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return mark, ev
        return time.perf_counter() - mark

    def read(self, key: tuple, mark) -> float:
        """A finished replay's seconds (its step's record read: the events are done), into the table."""
        seconds = mark[0].elapsed_time(mark[1]) / 1000.0 if self.cuda else float(mark)
        row = self.table.setdefault(key, [0, seconds])
        row[0] += 1
        row[1] = self.decay * row[1] + (1 - self.decay) * seconds if row[0] > 1 else seconds
        return seconds

    def summary(self) -> dict:
        """{"part RxG": [replays, mean ms]}."""
        return {f"{k[0]} {k[1]}x{k[2]}": [int(n), round(s * 1000.0, 4)] for k, (n, s) in sorted(self.table.items())}


class DraftMix:
    """The drafters of a DeviceLoop, each slot with its own; see the module docstring. `loop` gives the step state
    (its slots P, history length L, width, target cache, ngram op and graphs' capture setting)."""

    def __init__(self, loop, drafters: Mapping[str, object], policy: Policy | None = None):
        if not drafters:
            raise ValueError("a draft mix needs at least one drafter")
        for d in drafters.values():
            problem = mix_problem(d)
            if problem:
                raise ValueError(problem)
        self.names = list(drafters)
        self.width, P, dev = loop.width, loop.P, loop.device
        catch_up = 2 if len(drafters) == 1 else self.width + 1
        self.lookups: list[Lookup] = []
        self.chains: list[Chained] = []
        for i, (name, d) in enumerate(drafters.items()):
            if isinstance(d, NgramDrafter):
                keep = torch.full((d.max_ngram + 1,), max(self.width, 1), dtype=torch.long, device=dev)
                self.lookups.append(Lookup(i, name, d.min_ngram, d.max_ngram, keep))
            else:
                chain = DraftChain.of(d, loop.cache, P, loop.L, catch_up)
                self.chains.append(Chained(i, name, chain, BucketGraphs(dev, loop.graphs.capture), P, self.width, dev))
        self.index = {n: i for i, n in enumerate(self.names)}
        self.P = P
        pin = dev.type == "cuda"
        C = len(self.chains)
        # per row: drafter index; per chain: its rows' slots, its rows' gammas
        self.inputs = torch.full((1 + 2 * C, loop.row_width), NONE, dtype=torch.long, device=dev)
        self.inputs_host = [torch.zeros(1 + 2 * C, loop.row_width, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.times = ReplayTimes(dev)
        self.slot_buckets, self.draft_buckets = loop.slot_buckets, loop.draft_buckets
        self.policy = policy

    # -- the policy -------------------------------------------------------------------------

    def choose(self, slots: list, names: list[str | None] | None, gammas: list[int] | None,
               buffer: int) -> MixStep:
        """The step's plan for the mirror's live `slots` (DeviceSlot, row order): the drafters and gammas given,
        else the policy's choices (capped by each slot's room on the mirror); each slot counts its pull."""
        chosen = None
        if names is None:
            if self.policy is None:
                raise ValueError("a draft mix without a policy needs each slot's drafter")
            chosen = self.policy.choose([s.index for s in slots], mix_caps(slots, self.width))
            names, gammas = [c.drafter for c in chosen.choices], [c.gamma for c in chosen.choices]
        elif gammas is None:
            gammas = [self.width] * len(slots)
        step = self.plan([s.index for s in slots], names, gammas, buffer)
        step.chosen = chosen
        for s, n in zip(slots, step.names):
            s.pulls[n or "none"] = s.pulls.get(n or "none", 0) + 1
        return step

    def learn(self, step: MixStep, rows: list[tuple[int, int, list[int]]]) -> None:
        """A step's record read: its replay times into the table, and, where a policy chose, what each of its
        rows (row index, slot, record) drafted and accepted, priced by those times."""
        seconds = self.seconds(step)
        if step.chosen is None:
            return
        choices = step.chosen.choices
        outcomes = [Outcome(slot, choices[i], rec[4], rec[0]) for i, slot, rec in rows]
        ran: dict[str, int] = {}
        forwards: dict[str, int] = {}
        for o in outcomes:
            if o.choice.drafter is not None and o.choice.gamma > 0:
                ran[o.choice.drafter] = ran.get(o.choice.drafter, 0) + min(o.drafted + 1, o.choice.gamma)
        draft_s = {n: seconds.get(n, 0.0) for n in ran}  # an n-gram lookup runs inside the step's graph: 0
        for n in ran:
            sub = step.chains.get(n)
            forwards[n] = sub.width if sub is not None else 1
        verify = seconds.get("verify", 0.0)
        self.policy.learn(step.chosen, outcomes, StepCosts({"verify": verify, "draft": sum(draft_s.values())},
                                                           step.bucket.tokens, draft_s, ran, forwards))

    def on_admit(self, slot: int, req_id: str) -> None:
        if self.policy is not None:
            self.policy.on_admit(slot, req_id)

    def on_stream(self, drain: bool) -> None:
        """A stream starts (drain False) or has no request left to admit (drain True)."""
        if self.policy is not None:
            self.policy.on_drain() if drain else self.policy.on_stream()

    # -- the host ---------------------------------------------------------------------------

    def plan(self, slots: list[int], names: list[str | None], gammas: list[int], buffer: int) -> MixStep:
        """The step's rows' drafters and gammas into the pinned inputs `buffer` (copied to the device by queue_chains);
        a drafter with gamma 0, or gamma with no drafter, drafts nothing."""
        if len(names) != len(slots) or len(gammas) != len(slots):
            raise ValueError(f"one drafter and one gamma per live slot ({len(slots)}), got {names}, {gammas}")
        for n in names:
            if n is not None and n not in self.index:
                raise ValueError(f"unknown drafter {n!r}; the mix has: {', '.join(self.names)}")
        names = [n if n is not None and g > 0 else None for n, g in zip(names, gammas)]
        gammas = [g if n is not None else 0 for n, g in zip(names, gammas)]
        host = self.inputs_host[buffer]
        host.fill_(NONE)
        host[0, : len(slots)] = torch.as_tensor([NONE if n is None else self.index[n] for n in names])
        chains: dict[str, Bucket] = {}
        for c, ch in enumerate(self.chains):
            mine = [(s, g) for s, n, g in zip(slots, names, gammas) if n == ch.name]
            host[1 + 2 * c].fill_(self.P - 1)  # padding rows: the scratch slot, never live
            host[2 + 2 * c].zero_()
            if mine:
                host[1 + 2 * c, : len(mine)] = torch.as_tensor([s for s, _ in mine])
                host[2 + 2 * c, : len(mine)] = torch.as_tensor([g for _, g in mine])
                chains[ch.name] = bucket_of(len(mine), [g for _, g in mine], self.slot_buckets, self.draft_buckets)
        return MixStep(names, gammas, bucket_of(len(slots), gammas, self.slot_buckets, self.draft_buckets), chains, [])

    def queue_chains(self, loop, step: MixStep, buffer: int) -> None:
        """Copy the step's inputs in, then replay each chosen chain at its sub-bucket (timed); reads nothing back."""
        self.inputs.copy_(self.inputs_host[buffer], non_blocking=True)
        for c, ch in enumerate(self.chains):
            sub = step.chains.get(ch.name)
            if sub is None:
                continue
            mark = self.times.begin()
            ch.graphs.run(sub, lambda: self._chain_body(loop, c, ch, sub))
            step.marks.append(((ch.name, sub.rows, sub.width), self.times.end(mark)))

    def time_step(self, step: MixStep, run) -> None:
        """Run the step's own graph (`run`), timed."""
        mark = self.times.begin()
        run()
        step.marks.append((("verify", step.bucket.rows, step.bucket.width), self.times.end(mark)))

    def seconds(self, step: MixStep) -> dict[str, float]:
        """Per part ("verify", each chain's name), the step's measured seconds (after its record was read)."""
        return {key[0]: self.times.read(key, mark) for key, mark in step.marks}

    def admit(self, slot: int, ids: list[int], budget: int) -> None:
        for ch in self.chains:
            ch.chain.admit(slot, ids, budget)

    def inventory(self) -> dict:
        """Per chain, the sub-buckets asked for (with counts) and captured, and its replays."""
        return {ch.name: ch.graphs.inventory() for ch in self.chains}

    # -- the device -------------------------------------------------------------------------

    def _chain_body(self, loop, c: int, ch: Chained, sub: Bucket) -> None:
        """One chain's drafts for its rows (a padded sub-bucket), into its buffer by slot."""
        rows, asked = self.inputs[1 + 2 * c, : sub.rows], self.inputs[2 + 2 * c, : sub.rows]
        gamma = drafting_gamma(loop, rows, asked)
        drafts, _ = ch.chain.draft(rows, loop.history, loop.lengths, gamma, sub.width)
        ch.drafts[rows, : sub.width] = drafts

    def drafts(self, loop, rows: torch.Tensor, gamma: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inside the step's graph: (drafts [B, width], counts [B]) of the bucket's rows, each row's from its own
        drafter (the n-gram lookups here, the chains' from their buffers), and the own-cache drafts' catch-up."""
        B, dev = rows.shape[0], rows.device
        which = self.inputs[0, :B]
        drafts = torch.zeros(B, width, dtype=torch.long, device=dev)
        counts = torch.zeros(B, dtype=torch.long, device=dev)
        for lk in self.lookups:
            if width == 0:
                break
            mine = which == lk.index
            d, n, _ = loop.ngram_op(rows, loop.history, loop.lengths, torch.where(mine, gamma, 0), lk.keep, width,
                                    lk.min_ngram, lk.max_ngram)
            drafts = torch.where(mine[:, None], d, drafts)
            counts = torch.where(mine, n, counts)
        j = torch.arange(width, device=dev)
        for ch in self.chains:
            if ch.chain.own_cache:  # every row, every step: the draft's cache sees every committed token
                ch.chain.feed(rows, loop.history, loop.lengths)
            if width == 0:
                continue
            mine = which == ch.index
            g = torch.where(mine, gamma, 0)
            drafts = torch.where(mine[:, None] & (j < g[:, None]), ch.drafts[rows, :width], drafts)
            counts = torch.where(mine, g, counts)
        return drafts, counts


def drafting_gamma(loop, rows: torch.Tensor, asked: torch.Tensor) -> torch.Tensor:
    """Each row's gamma as the step drafts it: asked, capped by the room left (context and max_tokens), 0 where the
    slot is not live (DeviceLoop._body's rule)."""
    n = loop.lengths[rows]
    room = torch.minimum(loop.max_len[rows] - n, loop.max_tokens[rows] - (n - loop.prompt_lens[rows]) - 1)
    return torch.where(loop.live[rows] != 0, torch.minimum(asked, room.clamp(min=0)), 0)


def mix_caps(slots, width: int) -> list[int]:
    """Each mirror slot's gamma cap for the policy: its room on the mirror (one step behind: the device caps it
    again), at most the width."""
    out = []
    for s in slots:
        gen = len(s.tokens) - s.prompt_len
        room = min(s.rule.max_model_len - len(s.tokens), s.rule.max_tokens - gen - 1)
        out.append(max(0, min(room, width)))
    return out

