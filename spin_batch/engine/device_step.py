"""A greedy step whose state lives on the device, so queuing it never waits on the host.

DeviceLoop decodes a request stream like BatchLoop (engine/loop.py), greedy only, with plain
decoding, n-gram drafts (chains, or token trees: engine/device_tree.py), a model drafter's chains
(engine/device_draft.py; engine/device_feature.py for drafts that read the target's features), or a cascade
or a vote of those (engine/device_compose.py); or several drafters at once, each slot with its own drafter
and gamma per step, given or chosen by a selection policy such as the SPIN bandit (`mix`, `policy`:
engine/device_mix.py; the chains then run before the step at padded sub-buckets of their own rows, and the
policy learns from each step's record, one step behind). The token history, lengths, prompt lengths,
limits, stop-token table, live flags and counters are device tensors, per slot. One step, all on the device:

1. each live slot's draft, up to its gamma, capped on the device by the room left (context and
   max_tokens): the n-gram lookup over its history (spin_kernels.ngram_draft), or the draft model's
   chain (device_draft.DraftChain: a catch-up forward, then one-row forwards, argmax on the device;
   its cache rolled back by length arithmetic on the device lengths), or every member's draft of a cascade
   or a vote, picked per row on the device;
2. the verify forward at a padded bucket (models/buckets.py): B rows (the slots the host believes
   live, padded with rows of a scratch slot) of G + 1 tokens, inputs gathered from the history;
   the final norm, the LM head and a batched argmax on every row;
3. the accept and commit kernel (spin_kernels.accept_commit): first mismatch, append, EOS / stop
   token / length cuts, lengths, live flags, counters, and a small int32 record per slot.
The drafter's hooks run in the step too: a feature-reading draft keeps the verify rows' features, a vote's
weights learn from the committed tokens.

Where the target runs on the Triton kernels, steps 1 and 3 are the Triton kernels, else their torch
references (also without a host read). On CUDA the whole step is replayed from a graph per bucket.
The only inputs from the host are the rows' slots and gammas (and with a mix, each row's drafter and each
chain's rows), copied from pinned memory.

With DeviceDrafting.nodes > 1 a step that drafts is a tree step instead (engine/device_tree.py): the n-gram
drafter's tree per row at a tree bucket, verified with the tree attention mask, the greedy walk and keep_path
on the device, then the same accept and commit on the accepted path.

The host is one step behind: it queues step t + 1, then reads step t's record (copied to pinned
memory after the step), and only then updates its mirror of each slot's tokens, finishes slots and
admits requests. A slot that the device finished at step t is therefore still in step t + 1's rows;
it is not live there, so that row changes nothing. Stop strings are applied on the mirror: a stop
string costs at most one wasted step, cut on the host.

Admission (prefill of the prompt and the first token) runs on the host's schedule between steps and
reads its first token at once: it is outside the step (a draft model with a cache of its own prefills
the prompt there too). What the device step does not do yet: sampling, logprobs, logits controls, stop
strings before min_tokens, n > 1, prefix caching, grammars, model drafters' token trees, trees, feature
drafts, cascades and votes in a mix, the confidence gate (the n-gram gate's caps are taken from the n-gram
drafter once, at construction, and not in a mix; model drafters draft without a gate and without lookahead),
a cascade's and a vote's counters (drafted_by, overrides); drafts whose model is not a native Llama-family
model on the C or Triton kernels are refused.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..drafters.base import Drafter
from ..drafters.ngram import NgramDrafter
from ..models.buckets import DRAFT_BUCKETS, SLOT_BUCKETS, Bucket, BucketGraphs, PaddedSegments, bucket_of, \
    padded_hidden, padded_problem, step_ops
from ..models.cache import KVCache
from ..models.cpu_decoder import argmax
from ..models.segments import Segments
from ..records import Completion, Request
from .device_compose import step_draft
from .device_draft import StepDraft
from .device_mix import DraftMix, MixStep
from .device_tree import TreeStep
from .settings import LoopSettings, refusal, request_settings
from .stopping import Stopping, StopRule

STOP_IDS = 8  # stop-token table width: a request with more EOS and stop token ids together is refused
HEAD = 5  # spin_kernels.commit.RECORD_HEAD: accepted, kept, finish, length, drafted
FINISH = {1: "stop", 2: "length"}
HOST_READS = ("item", "tolist", "cpu", "__bool__", "nonzero", "numpy")  # tensor methods that read back on the host


@contextmanager
def host_reads():
    """The sync audit (docs/gpu.md): counts, per name, the calls of HOST_READS on any tensor inside the block."""
    calls = {name: 0 for name in HOST_READS}
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name):
        def call(self, *a, **k):
            calls[name] += 1
            return saved[name](self, *a, **k)
        return call

    for name in HOST_READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield calls
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)


@dataclass(frozen=True)
class DeviceDrafting:
    """What every slot drafts with: nothing (gamma 0), or gamma tokens of the n-gram lookup with these settings
    (min_ngram, max_ngram, min_prob) or of the drafter given to DeviceLoop (a model, a cascade or a vote; an
    n-gram member's gate takes min_prob, its lookup its drafter's own settings)."""

    gamma: int = 0
    min_ngram: int = 1
    max_ngram: int = 3
    min_prob: float = 0.0  # the n-gram drafter's confidence floor (its gate), 0: off
    nodes: int = 0  # n-gram token trees of at most this many nodes a row (engine/device_tree.py); <= 1: chains

    @property
    def name(self) -> str:
        return "ngram" if self.gamma else "none"


@dataclass
class DeviceSlot:
    """The host's mirror of one request in flight (its tokens lag the device by one step)."""

    index: int
    req: Request
    prompt_len: int
    tokens: list[int]
    rule: StopRule
    t_start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    spec_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    done: bool = False
    pulls: dict[str, int] = field(default_factory=dict)  # with a draft mix: steps per drafter ("none": no draft)


@dataclass
class _Queued:
    slots: list[DeviceSlot]  # the live slots of the step, in row order
    buffer: int  # which pinned record it lands in
    event: torch.cuda.Event | None
    mix: MixStep | None = None  # with a draft mix: the step's drafters, gammas and replay timings


class DeviceLoop:
    """Greedy decoding with device-owned step state; see the module docstring."""

    def __init__(self, target, tokenizer, settings: LoopSettings, drafting: DeviceDrafting = DeviceDrafting(),
                 drafter: Drafter | None = None, graphs: bool | None = None,
                 slot_buckets: tuple[int, ...] = SLOT_BUCKETS, draft_buckets: tuple[int, ...] = DRAFT_BUCKETS,
                 mix=None, policy=None):
        problem = padded_problem(target) or _settings_problem(settings)
        if problem:
            raise ValueError(f"device step: {problem}")
        self.target, self.tok, self.cfg, self.drafting = target, tokenizer, settings, drafting
        self.slot_buckets, self.draft_buckets = slot_buckets, draft_buckets
        self.width = bucket_of(1, drafting.gamma, slot_buckets, draft_buckets).width  # the widest a step drafts
        self.tree = TreeStep.of(target, drafting, drafter)  # None: chains
        if self.tree is not None and mix is not None:
            raise ValueError("device step: token trees draft with one n-gram drafter, not in a draft mix")
        if drafter is not None and mix is not None:
            raise ValueError("device step: one drafter for every slot, or a draft mix, not both")
        bucket_of(settings.slots, 0, slot_buckets, draft_buckets)  # raises if the slots outgrow the buckets
        self.P = P = settings.slots + 1  # slot P - 1: the scratch slot of padding rows
        dev = self.device = target.device
        past = self.width if self.tree is None else max(self.width, self.tree.nodes)  # a padded row's rows
        self.L = L = settings.max_model_len + past + 1  # history: room for a padded row past the limit
        self.cache: KVCache = target.allocate_cache(P, L)
        i64 = dict(dtype=torch.long, device=dev)
        self.history = torch.zeros(P, L, **i64)
        self.lengths = torch.ones(P, **i64)
        self.prompt_lens = torch.zeros(P, **i64)
        self.max_tokens = torch.zeros(P, **i64)
        self.max_len = torch.full((P,), settings.max_model_len, **i64)
        self.stops = torch.full((P, STOP_IDS), -1, **i64)
        self.live = torch.zeros(P, dtype=torch.int32, device=dev)
        self.counters = torch.zeros(P, 3, **i64)
        self.record = torch.zeros(P, HEAD + self.width + 1, dtype=torch.int32, device=dev)
        self.first_record = torch.zeros_like(self.record)  # admissions' first tokens
        pin = dev.type == "cuda"
        # rows' slots, rows' gammas: as many rows as the widest bucket the slots can ask for (5 slots: 8 rows)
        self.row_width = max(P, bucket_of(settings.slots, 0, slot_buckets, draft_buckets).rows)
        self.inputs = torch.zeros(2, self.row_width, **i64)
        self.inputs_host = [torch.zeros(2, self.row_width, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.records_host = [torch.zeros(P, HEAD + self.width + 1, dtype=torch.int32, pin_memory=pin)
                             for _ in range(2)]
        keep = [self.width] * (drafting.max_ngram + 1)
        if isinstance(drafter, NgramDrafter):  # the gate's cap per match length, at the drafter's current rates
            keep = [len(drafter.gated(n, [0] * self.width, drafting.min_prob)) if n in drafter.outcomes
                    else self.width for n in range(drafting.max_ngram + 1)]
        self.keep = torch.tensor(keep, **i64)
        self.commit_op, self.ngram_op = step_ops(target)
        self.chain: StepDraft | None = None if drafter is None or isinstance(drafter, NgramDrafter) or \
            not drafting.gamma else step_draft(drafter, target, self.cache, P, L, self.width, drafting.min_prob,
                                               self.ngram_op)  # a model's chains, a cascade's or a vote's members
        self.name = drafter.name if drafter is not None and drafting.gamma else drafting.name  # drafter_pulls' key
        self.graphs = BucketGraphs(dev, target.device.type == "cuda" if graphs is None else graphs)
        # several drafters, each slot with its own drafter and gamma (engine/device_mix.py), up to drafting.gamma
        self.mix = None if mix is None else DraftMix(self, mix, policy)
        self.stopping = Stopping(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self.slots: list[DeviceSlot | None] = [None] * settings.slots
        self.finished: list[Completion] = []
        self.queued: list[_Queued] = []
        self.steps = 0
        self.host_reads = 0  # step records read (the host's waits on the device, outside the step)
        self.admission_reads = 0  # first tokens read at admission (outside the step too)
        self.replay = None  # engine/replay.Replay: acceptance replayed from a trace (the speed-only bench)

    # -- one step -----------------------------------------------------------------------

    def queue(self, gammas: list[int] | None = None, drafters: list[str | None] | None = None) -> Bucket | None:
        """Queue one step for every slot the host believes live; reads nothing back. None: no slot to step.

        gammas: the draft length each of those slots asks for, in slot order (default: drafting.gamma each),
        at most the drafting's gamma bucket. drafters: with a draft mix, each slot's drafter (None: no draft);
        both None: the mix's policy chooses."""
        rows = [s for s in self.slots if s is not None and not s.done]
        if not rows:
            return None
        mixed = None if self.mix is None else self.mix.choose(rows, drafters, gammas, self.steps % 2)
        gammas = gammas if mixed is None else mixed.gammas
        gammas = [self.drafting.gamma] * len(rows) if gammas is None else gammas
        if len(gammas) != len(rows) or max(gammas) > self.width or min(gammas) < 0:
            raise ValueError(f"gammas: one per live slot ({len(rows)}), each 0..{self.width}, got {gammas}")
        bucket = bucket_of(len(rows), gammas, self.slot_buckets, self.draft_buckets)
        if self.tree is not None:
            bucket = self.tree.bucket(bucket)
        which = self.steps % 2
        host = self.inputs_host[which]
        host[0].fill_(self.P - 1)
        host[1].zero_()
        host[0, : len(rows)] = torch.as_tensor([s.index for s in rows])
        host[1, : len(rows)] = torch.as_tensor(gammas)
        self.inputs.copy_(host, non_blocking=True)
        if mixed is not None:  # the chosen model chains first, each at its own sub-bucket; everything timed
            self.mix.queue_chains(self, mixed, which)
            self.mix.time_step(mixed, lambda: self.graphs.run(bucket, lambda: self._body(bucket)))
        else:
            self.graphs.run(bucket, lambda: self._body(bucket))
        self.records_host[which].copy_(self.record, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.queued.append(_Queued(rows, which, event, mixed))
        for s in rows:
            s.steps += 1
        self.steps += 1
        return bucket

    def _body(self, bucket: Bucket) -> None:
        """The step on the device, at the bucket's shape: draft, gather, forward, argmax, accept and commit."""
        if bucket.tree:
            return self.tree.step(self, bucket)
        B, G = bucket.rows, bucket.width
        rows, asked = self.inputs[0, :B], self.inputs[1, :B]
        n = self.lengths[rows]  # [B] committed tokens
        room = torch.minimum(self.max_len[rows] - n, self.max_tokens[rows] - (n - self.prompt_lens[rows]) - 1)
        gamma = torch.where(self.live[rows] != 0, torch.minimum(asked, room.clamp(min=0)), 0)
        if self.mix is not None:  # each row's own drafter (the chains' drafts were queued before this graph)
            drafts, counts = self.mix.drafts(self, rows, gamma, G)
        elif self.chain is not None:  # at width 0 too: a draft with its own cache catches up at every step
            drafts, counts = self.chain.draft(rows, self.history, self.lengths, gamma, G)
        elif G > 0:
            drafts, counts, _ = self.ngram_op(rows, self.history, self.lengths, gamma, self.keep, G,
                                              self.drafting.min_ngram, self.drafting.max_ngram)
        else:
            drafts = torch.zeros(B, 0, dtype=torch.long, device=self.device)
            counts = torch.zeros(B, dtype=torch.long, device=self.device)
        last = self.history[rows, (n - 1).clamp(min=0)][:, None]  # [B, 1]: each row's last committed token
        tokens = torch.cat([last, drafts], 1).reshape(-1)  # [B (G + 1)]
        seg = PaddedSegments(rows, (n - 1).clamp(min=0), G)
        h = padded_hidden(self.target, tokens, seg, self.cache)
        if self.chain is not None:  # a feature-reading draft keeps the target's features
            self.chain.verified(rows, (n - 1).clamp(min=0), h, G)
        best = argmax(self.target.logits(h)).view(B, G + 1)
        if self.replay is not None:
            best = self.replay.verdicts(rows, drafts, best)
        self.commit_op(rows, drafts, counts, best, self.history, self.lengths, self.prompt_lens, self.max_tokens,
                       self.max_len, self.stops, self.live, self.counters, self.record)
        if self.chain is not None:  # a vote's weights learn from the committed tokens
            self.chain.committed(rows, n, gamma, self.lengths, self.live, self.history)

    def collect(self) -> list[Completion]:
        """Read the oldest queued step's record (waiting for it), update the mirrors; the requests it finished."""
        q = self.queued.pop(0)
        if q.event is not None:
            q.event.synchronize()
        rec = self.records_host[q.buffer].tolist()
        self.host_reads += 1
        if q.mix is not None:  # what the rows the host still follows drafted and accepted, and the replay times
            self.mix.learn(q.mix, [(i, s.index, rec[s.index]) for i, s in enumerate(q.slots)
                                   if self.slots[s.index] is s and not s.done])
        for s in q.slots:
            if self.slots[s.index] is s and not s.done:
                self._apply(s, rec[s.index])
        done, self.finished = self.finished, []
        return done

    def _apply(self, s: DeviceSlot, rec: list[int]) -> None:
        """One slot's record onto its mirror: its kept tokens, its counters, its finish (stop strings here)."""
        accepted, kept, finish, _, drafted = rec[:HEAD]
        new = rec[HEAD : HEAD + kept]
        got = self.stopping.extend(s.tokens, s.prompt_len, new, s.rule)
        if drafted:
            s.spec_steps += 1
            s.draft_tokens += drafted
            s.accepted_tokens += min(accepted, got.added)
        reason = got.finish_reason or FINISH.get(finish)
        if reason is not None:
            if finish == 0:  # a stop string, cut on the host: the device stops the slot at its next step
                self.live[s.index] = 0
            self._finish(s, reason, got.text)

    # -- admission ----------------------------------------------------------------------

    def admit(self, req: Request, ids: list[int]) -> None:
        """Prefill a request into a free slot and commit its first token (reads it back: outside the step)."""
        idx = self.slots.index(None)
        _, rule, _ = request_settings(self.cfg, req)
        s = self.slots[idx] = DeviceSlot(idx, req, len(ids), list(ids), rule)
        n, dev = len(ids), self.device
        self.history[idx, :n] = torch.as_tensor(ids, device=dev)
        stop = sorted(rule.eos | rule.stop_ids)
        self.stops[idx] = torch.as_tensor(stop + [-1] * (STOP_IDS - len(stop)), device=dev)
        for t, v in ((self.lengths, n), (self.prompt_lens, n), (self.max_tokens, rule.max_tokens),
                     (self.max_len, rule.max_model_len), (self.live, 1), (self.counters, 0)):
            t[idx] = v
        budget = max(self.cfg.max_num_batched_tokens, 1)
        features = self.chain is not None and self.chain.reads_features
        hidden = []  # the prompt's residuals, for a draft that reads the target's features
        for a in range(0, n, budget):
            b = min(a + budget, n)
            seg = Segments.build([(idx, b - a, a)], dev)
            logits, h = self.target.forward_with_hidden(torch.as_tensor(ids[a:b], device=dev), seg, self.cache,
                                                        [b - a - 1])
            hidden += [h] if features else []
        if self.chain is not None:
            self.chain.admit(idx, ids, budget, torch.cat(hidden) if features else None)
        if self.mix is not None:
            self.mix.admit(idx, ids, budget)
            self.mix.on_admit(idx, req.id)
        rows = torch.tensor([idx], device=dev)
        none = torch.zeros(1, 0, dtype=torch.long, device=dev)
        self.commit_op(rows, none, torch.zeros(1, dtype=torch.long, device=dev), argmax(logits).view(1, 1),
                       self.history, self.lengths, self.prompt_lens, self.max_tokens, self.max_len, self.stops,
                       self.live, self.counters, self.first_record)
        self.admission_reads += 1
        self._apply(s, self.first_record[idx].tolist())

    def _finish(self, s: DeviceSlot, reason: str, text: str | None) -> None:
        s.done = True
        gen = s.tokens[s.prompt_len:]
        self.finished.append(Completion(
            s.req, text if text is not None else self.stopping.text(gen, s.rule), reason, s.prompt_len, len(gen),
            num_spec_steps=s.spec_steps, num_draft_tokens=s.draft_tokens, num_accepted_draft_tokens=s.accepted_tokens,
            drafter_pulls=dict(s.pulls) if s.pulls else {self.name: s.steps} if s.steps else {}, decode_time_s=time.perf_counter() - s.t_start,
            token_ids=tuple(gen)))
        self.slots[s.index] = None

    def _refusal(self, req: Request, ids: list[int]) -> str | None:
        problem = refusal(self.cfg, req, ids, self.target.spec.vocab_size)
        if problem:
            return problem
        sp, rule, controls = request_settings(self.cfg, req)
        if not sp.greedy or controls.active(sp.temperature):
            return "the device step decodes greedily without logits controls"
        if req.params.logprobs is not None or req.params.prompt_logprobs is not None or (req.params.n or 1) > 1:
            return "the device step returns no logprobs and one sample per request"
        if rule.max_tokens == 0:
            return "the device step does not score prompts (max_tokens 0)"
        if rule.min_tokens:
            return "the device step does not hold EOS and stops back for min_tokens"
        if len(rule.eos | rule.stop_ids) > STOP_IDS:
            return f"the device step takes at most {STOP_IDS} EOS and stop token ids together"
        return None

    # -- driving a stream ---------------------------------------------------------------

    def run(self, requests, encode, emit) -> None:
        """Decode every request of the stream, handing each Completion (or error) to emit; as BatchLoop.run."""
        stream = iter(requests)
        exhausted = False
        if self.mix is not None:
            self.mix.on_stream(drain=False)
        while True:
            while not exhausted and None in self.slots:
                req = next(stream, None)
                if req is None:
                    exhausted = True
                    if self.mix is not None:
                        self.mix.on_stream(drain=True)
                    break
                failed = self._admit_or_error(req, encode)
                if failed is not None:
                    emit(failed)
                done, self.finished = self.finished, []  # a request may finish at its first token
                for c in done:
                    emit(c)
            queued = self.queue() is not None
            if self.queued and (len(self.queued) > 1 or not queued):
                for c in self.collect():
                    emit(c)
            if not queued and not self.queued and exhausted:
                return

    def _admit_or_error(self, req: Request, encode) -> Completion | None:
        if req.error is not None:
            return Completion.failed(req, req.error)
        try:
            ids = encode(req)
        except ValueError as e:
            return Completion.failed(req, str(e))
        problem = self._refusal(req, ids)
        if problem is not None:
            return Completion.failed(req, problem, prompt_tokens=len(ids))
        self.admit(req, ids)
        return None

    def stats(self) -> dict:
        """Steps queued, records read, and the graph inventory (buckets asked for, captured, replays)."""
        out = {"steps": self.steps, "host_reads": self.host_reads, "admission_reads": self.admission_reads,
               **self.graphs.inventory()}
        if self.mix is not None:  # each model chain's sub-buckets, and the replay times per bucket
            out.update(chains=self.mix.inventory(), replay_ms=self.mix.times.summary())
        return out


def _settings_problem(cfg: LoopSettings) -> str | None:
    if not cfg.sampling.greedy:
        return "it decodes greedily (sampling.temperature 0)"
    if cfg.n > 1 or cfg.logprobs.logprobs is not None or cfg.logprobs.prompt_logprobs is not None:
        return "it returns no logprobs and one sample per request"
    return None

