"""The batch loop: B fixed slots, refilled from the request stream, one packed forward per step.

step() calls the named stages in order: select, draft, verify, accept, commit, learn (the
pipeline, two micro-batches overlapping one's draft with the other's verify, is _pipeline). The
verify forward is the single target forward of the step: it carries every decoding slot's
segment (last committed token + its drafts) and the prefill chunks of newly admitted
requests, under a per-step token budget.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from ..drafters.base import Drafter, DraftRequest, Proposal
from ..models.cache import KVCache
from ..models.protocol import TargetModel
from ..models.segments import Segments
from ..stats import RunStats
from ..selection.policy import NO_SPEC, Choice, Outcome, Policy, StepChoice, StepCosts
from ..records import Completion, Request
from ..sampling import SamplingParams
from .logprobs import Scored, TokenTexts, prompt_rows, score_new_tokens, score_prompts
from .controls import LogitControls, apply_controls, chain_prefixes, tree_prefixes
from .settings import LoopSettings, refusal, request_settings, structured_of
from .structured import DraftGrammar, Grammars, cut_proposal, mask_segments
from .prefill_share import PrefillShare, SampleGroup, reuse_order, sample_generator
from .prefix_cache import PrefixCache
from .stopping import Stopping, StopRule
from .tree_verify import DraftTree, accept_trees
from .slot import MicroBatch, Plan, Slot, lap, micro_batches, reach, step_record
from .verify import Verdict, accept_drafts


REUSE_WINDOW = 2  # with a prefix cache, requests read ahead to order for reuse: this many per slot
Drafted = tuple[Proposal, dict[str, float]]  # a micro-batch's proposal and its seconds per drafter (draft)



class BatchLoop:
    def __init__(
        self,
        target: TargetModel,
        tokenizer,
        settings: LoopSettings,
        policy: Policy,
        drafters: dict[str, Drafter] | None = None,
        cache: KVCache | None = None,
        stats: RunStats | None = None,
        prefix_cache: PrefixCache | None = None,
        remember: Callable[[dict | None], None] | None = None,
    ):
        self.target = target
        self.tok = tokenizer
        self.cfg = settings
        self.policy = policy
        self.cache = cache or target.allocate_cache(settings.slots, settings.max_model_len)
        self.drafters = drafters or {}
        self.stats = stats or RunStats()
        self.slots: list[Slot | None] = [None] * settings.slots
        self.finished: list[Completion] = []  # finished requests not yet handed out
        self.stopping = Stopping(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self._stream: torch.cuda.Stream | None = None
        # Target-feature buffers of the drafters that read them (one shared buffer, normally).
        self._features = list({id(d.features): d.features for d in self.drafters.values()
                               if d.features is not None}.values())
        # whether the target's forward verifies token-tree segments (the transformers backend does not)
        self.tree_segments = target.tree_segments
        self.texts = TokenTexts(tokenizer)
        self.prefix = prefix_cache
        self.remember = remember  # given the policy's snapshot (Policy.snapshot) when a stream ends (memory.py)
        self.share = PrefillShare(prefix_cache, self.cache, self._features)
        self._queued: list[SampleGroup] = []  # requests with samples not yet in a slot
        self.grammars = Grammars(tokenizer, target.spec.vocab_size)

    # -- admission ----------------------------------------------------------------------

    def admit(self, req: Request, prompt_ids: list[int], sample: int = 0, group: SampleGroup | None = None) -> None:
        idx = self.slots.index(None)
        sp, rule, controls = self.settings_of(req)
        gen = None if sp.greedy else sample_generator(self.cfg.seed, req, sample)
        ask = self.cfg.logprobs.of_row(req.params.logprobs, req.params.prompt_logprobs, rule.max_tokens)
        self.slots[idx] = Slot(idx, req, len(prompt_ids), list(prompt_ids), sp, rule, gen, controls, ask=ask,
                               sample=sample, group=group, reuse_prefix=ask.prompt_logprobs is None)
        if (constraint := structured_of(self.cfg, req)) is not None:
            self.slots[idx].grammar = self.grammars.open(constraint, rule.eos | rule.stop_ids, rule.min_tokens)
        for d in self.drafters.values():
            d.on_admit(idx)
        self.policy.on_admit(idx, req.id)

    def settings_of(self, req: Request) -> tuple[SamplingParams, StopRule, LogitControls]:
        """A request's sampling settings, stop rule and logits controls (engine/settings.py)."""
        return request_settings(self.cfg, req)

    def _admit_samples(self) -> None:
        """Queued samples of admitted requests take the free slots (before any new request)."""
        while self._queued and self.free_slots:
            g = self._queued[0]
            self.admit(g.req, g.ids, g.queued.pop(0), g)
            if not g.queued:
                self._queued.pop(0)

    @property
    def free_slots(self) -> int:
        return self.slots.count(None)

    @property
    def active(self) -> list[Slot]:
        return [s for s in self.slots if s is not None]

    # -- one step -----------------------------------------------------------------------

    def step(self) -> list[Completion]:
        """Advance every active slot by one verified segment; return the requests it finished.

        select, draft, then verify, accept, commit and learn (_finish_batch). With the pipeline on and
        a slot drafting, the decoding slots form two micro-batches instead (_pipeline).
        """
        times: dict[str, float] = {}
        t = time.perf_counter()
        decode = [s for s in self.active if s.decoding]
        chosen = self.select(decode)
        t = lap(times, "select", t)
        batches = micro_batches(decode, list(chosen.choices), self.cfg.pipeline)
        if len(batches) == 1:
            proposal, draft_s = self.draft(*batches[0])
            t = lap(times, "draft", t)
            self._finish_batch(batches[0], chosen, proposal, draft_s, times, t)
        else:
            self._pipeline(batches, chosen, times, t)
        done, self.finished = self.finished, []
        return done

    def _pipeline(self, batches: list[MicroBatch], chosen: StepChoice, times: dict[str, float], t: float) -> None:
        """The step as two micro-batches balanced by tokens: the second one drafts while the first one verifies
        (on CUDA, on a side stream; on CPU, the same order sequentially). Each micro-batch is a packed target
        forward of its own (the prefill chunks ride with the first), and learns and is recorded on its own."""
        first, second = batches
        proposal, draft_s = self.draft(*first)
        t = lap(times, "draft", t)
        second_times: dict[str, float] = {}

        def draft_second() -> Drafted:
            t0 = time.perf_counter()
            drafted = self.draft(*second)
            lap(second_times, "draft", t0)
            return drafted

        t, drafted = self._finish_batch(first, chosen, proposal, draft_s, times, t, during_verify=draft_second)
        self._overlap_end()
        self._finish_batch(second, chosen, *drafted, second_times, t, prefill=False)

    def _finish_batch(self, batch: MicroBatch, chosen: StepChoice, proposal: Proposal, draft_s: dict[str, float],
                      times: dict[str, float], t: float, prefill: bool = True,
                      during_verify: Callable[[], Drafted] | None = None) -> tuple[float, Drafted | None]:
        """Verify one micro-batch's drafts (and the step's prefill chunks, where `prefill`), accept, commit, learn
        and record it. during_verify: the pipeline's next draft, run on the side stream once this verify is
        launched (timed on its own). Returns the clock and what during_verify returned."""
        decode, choices = batch
        plan = self.plan(decode, proposal.tokens, prefill=prefill, trees=proposal.parents)
        side = self._overlap_begin() if during_verify is not None else None
        logits = self.verify(plan)
        logits = score_prompts(plan.prompt, logits) if plan.prompt else logits
        t = lap(times, "verify", t)
        during = None
        if side is not None:
            with side:
                during = during_verify()
            t = time.perf_counter()
        verdict = self.accept(plan, proposal, logits)
        served = plan.decode + plan.finishing
        scored = score_new_tokens(logits, [s.ask for s in served], [s.sp for s in served], plan.drafts, verdict)
        t = lap(times, "accept", t)
        self._charge(plan, sum(times.values()))
        generated = self.commit(plan, verdict, scored)
        t = lap(times, "commit", t)
        self._learn(plan, chosen, choices, verdict, draft_s, times)
        t = lap(times, "learn", t)
        self.stats.observe(step_record(plan, choices, verdict, generated, times))
        return t, during

    @property
    def _side_stream(self) -> torch.cuda.Stream | None:
        """The drafting stream of the pipeline (CUDA only), made on first use."""
        if self.target.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.target.device)
        return self._stream

    def _overlap_begin(self):
        """Context for drafting the next micro-batch: a side CUDA stream, or nothing on CPU."""
        if self._side_stream is None:
            return contextlib.nullcontext()
        before_verify = torch.cuda.current_stream().record_event()
        self._side_stream.wait_event(before_verify)  # see every earlier write, not this verify's
        return torch.cuda.stream(self._side_stream)

    def _overlap_end(self) -> None:
        if self._side_stream is not None:
            torch.cuda.current_stream().wait_stream(self._side_stream)

    def _learn(self, plan: Plan, chosen: StepChoice, choices: list[Choice], verdict: Verdict,
               draft_s: dict[str, float], times: dict[str, float]) -> None:
        """The policy learns what its choices for this micro-batch's slots (`choices`, of the step's record
        `chosen`) produced and cost."""
        # a tree counts as the chain of its depth: the policy prices chains (accepted of drafted)
        depths = [reach(d, t) for d, t in zip(plan.drafts, plan.trees)]
        outcomes = [Outcome(s.index, c, n, k) for s, c, n, k in zip(plan.decode, choices, depths, verdict.accepted)]
        # Draft positions each drafter ran: the tokens it proposed, plus the position where it stopped
        # short of gamma (no n-gram match, or the confidence gate), which it computed too.
        # One forward advances all of a drafter's live slots, so it ran as many as its deepest slot.
        ran: Counter = Counter()
        forwards: dict[str, int] = {}
        for c, n in zip(choices, depths):
            if c.drafter is not None and c.gamma > 0:
                n = min(n + 1, c.gamma)
                ran[c.drafter] += n
                forwards[c.drafter] = max(forwards.get(c.drafter, 0), n)
        self.policy.learn(chosen, outcomes, StepCosts(dict(times), plan.seg.num_tokens, draft_s, dict(ran), forwards,
                                              sum(n for _, n in plan.chunks)))

    def select(self, decode: list[Slot]) -> StepChoice:
        """The step's record of choices (selection/policy.py): the policy's, or plain decoding without drafters.
        Each slot counts its pull."""
        caps = [self._gamma_cap(s) for s in decode]
        if not self.drafters:
            chosen = StepChoice.of([NO_SPEC for _ in decode])
        else:
            chosen = self.policy.choose([s.index for s in decode], caps)
        for s, c in zip(decode, chosen.choices):
            s.pulls[c.drafter or "none"] += 1
        return chosen

    def draft(self, decode: list[Slot], choices: list[Choice]) -> tuple[Proposal, dict[str, float]]:
        """Each chosen drafter proposes for its slots, batched; returns the proposal and seconds per drafter."""
        tokens: list[list[int]] = [[] for _ in decode]
        seconds: dict[str, float] = {}
        probs: list[torch.Tensor | None] = [None for _ in decode]
        parents: list[list[int] | None] = [None for _ in decode]
        by_drafter: dict[str, list[int]] = {}
        for i, c in enumerate(choices):
            if c.drafter is not None and c.gamma > 0:
                by_drafter.setdefault(c.drafter, []).append(i)
        for name, idxs in by_drafter.items():
            reqs = [DraftRequest(decode[i].index, decode[i].tokens, choices[i].gamma, decode[i].gen, choices[i].min_prob,
                                 decode[i].sp, self._tree_budget(decode[i], choices[i], self.drafters[name]),
                                 room=max(self._gamma_cap(decode[i]) - choices[i].gamma, 0),
                                 grammar=None if decode[i].grammar is None else DraftGrammar(decode[i].grammar))
                    for i in idxs]
            t0 = time.perf_counter()
            prop = self.drafters[name].propose(reqs)
            seconds[name] = time.perf_counter() - t0
            for j, (i, r) in enumerate(zip(idxs, reqs)):
                d, q, tree = prop.tokens[j], prop.probs[j], prop.tree(j)
                if tree is not None and r.nodes > 1:
                    # a tree keeps its first `nodes` nodes (parents precede children, so they are a tree)
                    tokens[i], parents[i] = d[: r.nodes], tree[: r.nodes]
                else:
                    tokens[i] = d[: r.gamma + r.room]  # a chain may run past gamma (DraftRequest.room)
                probs[i] = None if q is None else q[: len(tokens[i])]
                tokens[i], parents[i], probs[i] = cut_proposal(decode[i].grammar, decode[i].sp, tokens[i], parents[i],
                                                               probs[i])
        for i, s in enumerate(decode):  # jump-forward: what the grammar forces, where nothing else is drafted
            if s.grammar is not None and not tokens[i]:
                tokens[i], parents[i], probs[i] = s.grammar.forced(self._gamma_cap(s)), None, None
        return Proposal(tokens, probs, parents), seconds

    def _tree_budget(self, s: Slot, c: Choice, drafter: Drafter) -> int:
        """The tree nodes a slot may draft: the choice's budget (decided by the policy, selection.factory.
        tree_drafters), fitted to the context (a tree of n nodes needs n cache rows past the committed tokens).
        A choice beyond what the drafter and the target declare (a policy that runs what it is told) drafts a
        chain."""
        if c.nodes <= 1 or not drafter.capabilities.trees or not self.tree_segments:
            return 0
        return min(c.nodes, self.cfg.max_model_len - len(s.tokens))

    def plan(self, decode: list[Slot], drafts: list[list[int]], prefill: bool = True,
             trees: list[list[int] | None] | None = None) -> Plan:
        """The step's packed verify batch: each decoding slot's last token and drafts (a chain or a tree,
        one segment), then prefill chunks up to the token budget."""
        trees = trees if trees is not None else [None for _ in decode]
        parts, flat, rows = [], [], []
        for s, d in zip(decode, drafts):
            n = len(s.tokens)
            rows.extend(range(len(flat), len(flat) + len(d) + 1))
            parts.append((s.index, len(d) + 1, n - 1))
            flat.append(s.tokens[-1])
            flat.extend(d)
        budget = max(self.cfg.max_num_batched_tokens - len(flat), 1)
        chunks, finishing, prompt, prompt_flat = [], [], [], []
        waiting, reused = self.share.before_plan(self.active) if prefill else (set(), 0)
        for s in self.active if prefill else []:
            if s.decoding or budget <= 0 or s.index in waiting:
                continue
            n = min(s.prompt_len - s.prefilled, budget)
            budget -= n
            parts.append((s.index, n, s.prefilled))
            if s.ask.prompt_logprobs is not None and (m := prompt_rows(s.prompt_len, s.prefilled, n)):
                prompt.append((s, s.prefilled, m))
                prompt_flat.extend(range(len(flat), len(flat) + m))
            flat.extend(s.tokens[s.prefilled : s.prefilled + n])
            chunks.append((s, n))
            if s.prefilled + n == s.prompt_len:
                rows.append(len(flat) - 1)
                finishing.append(s)
        seg_parents = None
        if any(t is not None for t in trees):
            seg_parents = [None if t is None else DraftTree(d, t).segment_parents() for d, t in zip(drafts, trees)]
            seg_parents += [None for _ in chunks]
        seg = Segments.build(parts, self.target.device, seg_parents)
        flat_t = torch.tensor(flat, dtype=torch.long, device=self.target.device)
        return Plan(decode, chunks, drafts, trees, seg, flat_t, rows + prompt_flat, finishing, prompt, reused)

    def verify(self, plan: Plan) -> torch.Tensor:
        """The step's one packed target forward; logits [len(plan.logits_rows), V]."""
        if not self._features:
            return self.target.forward(plan.flat, plan.seg, self.cache, plan.logits_rows)
        logits, hidden = self.target.forward_with_hidden(plan.flat, plan.seg, self.cache, plan.logits_rows)
        for f in self._features:
            f.write(plan.seg, hidden)
        return logits

    def accept(self, plan: Plan, proposal: Proposal, logits: torch.Tensor) -> Verdict:
        """Verdicts for decoding slots, then one per finishing prefill (an empty draft)."""
        drafts = plan.drafts + [[] for _ in plan.finishing]
        probs = proposal.probs + [None for _ in plan.finishing]
        served = plan.decode + plan.finishing
        logits = self._controlled(served, drafts, plan.trees + [None for _ in plan.finishing], logits)
        gens, sps, starts = [s.gen for s in served], [s.sp for s in served], [len(s.tokens) for s in served]
        if any(t is not None for t in plan.trees):
            return self._accept_trees(plan, drafts, probs, logits, gens, sps, starts)
        kernels = self.target.kernels  # the Triton path (CUDA, or forced on), else None
        return accept_drafts(kernels, logits, drafts, probs, gens, sps, starts)

    @staticmethod
    def _controlled(served: list[Slot], drafts: list[list[int]], trees: list[list[int] | None],
                    logits: torch.Tensor) -> torch.Tensor:
        """The logits [R, V] with each slot's controls applied (engine/controls.py), row r of a segment
        counting the draft prefix before it as generated; float32. The same logits where no slot has any."""
        if not any(s.controlled for s in served):
            return logits
        out = logits.to(torch.float32, copy=True)
        row, constrained = 0, []
        for s, d, t in zip(served, drafts, trees):
            n = len(d) + 1
            if s.controlled:
                prefixes = chain_prefixes(d) if t is None else tree_prefixes(d, t)
                apply_controls(out[row : row + n], s.controls, s.sp.temperature, s.tokens[: s.prompt_len], s.generated,
                               prefixes, s.rule.min_tokens, s.rule.eos | s.rule.stop_ids)
                if s.grammar is not None:  # the grammar state along each row's path (engine/structured.py)
                    constrained.append((s.grammar, row, prefixes))
            row += n
        mask_segments(out, logits, constrained)
        return out

    @staticmethod
    def _accept_trees(plan: Plan, drafts: list[list[int]], probs: list[torch.Tensor | None], logits: torch.Tensor,
                      gens: list[torch.Generator | None], sps: list[SamplingParams], starts: list[int]) -> Verdict:
        """A batch with token trees: every segment as a tree (a chain is the tree of one path, which the
        tree rule accepts exactly as the chain rule, randoms included), by tree_verify.accept_trees."""
        shapes = plan.trees + [None for _ in plan.finishing]
        trees = [DraftTree.chain(d, q) if t is None else DraftTree(d, t, None if q is None else list(q))
                 for d, q, t in zip(drafts, probs, shapes)]
        got = accept_trees(logits, trees, gens, sps, starts)
        return Verdict([v.accepted for v in got], [v.tokens for v in got],
                       [None if t is None else v.segment_path() for v, t in zip(got, shapes)])

    def commit(self, plan: Plan, verdict: Verdict, scored: list[list[Scored]] | None = None) -> int:
        """Append new tokens (and the logprobs of those kept), roll caches back, finish and free slots."""
        for s, n in plan.chunks:
            s.prefilled += n
        plan.reused += self.share.after_commit([s for s, _ in plan.chunks], self.active)
        if verdict.paths is not None:
            self._keep_paths(plan, verdict)
        generated = 0
        for i, (s, new, k, d) in enumerate(zip(plan.decode + plan.finishing, verdict.tokens, verdict.accepted,
                                               plan.drafts + [[] for _ in plan.finishing])):
            new = new if s.grammar is None else s.grammar.advance(new)
            kept = self._append(s, new)
            if s.grammar is not None and s.grammar.stopped and s.finish_reason is None:
                s.finish_reason = "stop"  # the grammar takes no more tokens: as at EOS
            s.logprobs.extend(scored[i][:kept] if scored is not None else ())
            if d:
                s.spec_steps += 1
                s.draft_tokens += len(d)
                # the row counts accepted drafts that reached its completion: not those past an EOS, a
                # stop string or max_tokens in the same step (the drafter's stats count what was accepted)
                s.accepted_tokens += min(k, kept)
            generated += kept
            if s.finish_reason is not None:
                self._finish(s)
            else:
                for dr in self.drafters.values():
                    dr.on_commit(s.index, s.tokens)
        return generated

    def _keep_paths(self, plan: Plan, verdict: Verdict) -> None:
        """Token trees: the accepted path's K/V (and target features) move into place in each cache."""
        for s, path in zip(plan.decode, verdict.paths):
            if path:
                cache_len = len(s.tokens) - 1  # the root's row: the slot's tokens are not yet appended
                self.cache.keep_path(s.index, cache_len, path)
                for f in self._features:
                    f.keep_path(s.index, cache_len, path)

    # -- helpers ------------------------------------------------------------------------

    def _gamma_cap(self, s: Slot) -> int:
        """Draft room: the verify segment must fit the context, and drafts past max_tokens are waste."""
        room_ctx = self.cfg.max_model_len - len(s.tokens)
        room_out = s.rule.max_tokens - len(s.generated) - 1
        return max(0, min(room_ctx, room_out))

    @staticmethod
    def _charge(plan: Plan, seconds: float) -> None:
        """Split the step's time evenly over the slots it served (per-request cost, for the oracle)."""
        served = plan.decode + [s for s, _ in plan.chunks]
        for s in served:  # a step always serves at least one slot
            s.share_s += seconds / len(served)

    def _append(self, s: Slot, new: list[int]) -> int:
        if s.rule.max_tokens == 0:  # a scoring request: its prompt is all it has
            s.finish_reason, s.text = "length", ""
            return 0
        got = self.stopping.extend(s.tokens, s.prompt_len, new, s.rule)
        if got.finish_reason is not None:
            s.finish_reason, s.text = got.finish_reason, got.text
        return got.added

    def _finish(self, s: Slot) -> None:
        gen = s.generated
        text = s.text if s.text is not None else self.stopping.text(gen, s.rule)
        done = Completion(
            s.req, text, s.finish_reason, s.prompt_len, len(gen),
            num_spec_steps=s.spec_steps, num_draft_tokens=s.draft_tokens, num_accepted_draft_tokens=s.accepted_tokens,
            drafter_pulls=dict(s.pulls), decode_time_s=time.perf_counter() - s.t_start,
            token_ids=tuple(gen), share_s=s.share_s, index=s.sample,
            logprobs=None if s.ask.logprobs is None else tuple(map(self.texts.record, s.logprobs)),
            prompt_logprobs=None if s.ask.prompt_logprobs is None else tuple(map(self.texts.record, s.prompt_logprobs)),
        )
        self.slots[s.index] = None
        if s.group is not None and (done := s.group.finish(done)) is None:
            return  # the request's other samples are still going
        self.finished.append(done)
        self.stats.observe_row("ok", s.prompt_len)

    # -- driving a stream ---------------------------------------------------------------

    def run(
        self,
        requests: Iterator[Request],
        encode: Callable[[Request], list[int]],
        emit: Callable[[Completion], None],
        should_stop: Callable[[], bool] = lambda: False,
        after_step: Callable[[], None] = lambda: None,
    ) -> None:
        """Decode every request of the stream; hand each one's Completion (or error) to emit.

        encode(req) returns the prompt token ids, or raises ValueError for a bad row (which is
        emitted as a failed Completion). When should_stop() turns true, no new request is admitted
        and the loop returns after the current step; requests in flight are not emitted (nor
        the one request read ahead: the loop reads one past a full batch, so that the policy
        learns at once when nothing is left to admit, see Policy.on_drain).
        """
        self.policy.on_stream()  # one loop may run several streams (a Ray Data actor: one per batch)
        stream = iter(requests)
        if self.prefix is not None:  # rows whose prompt starts with cached blocks first, within a window
            stream, encode = reuse_order(stream, encode, self.prefix, REUSE_WINDOW * self.cfg.slots)
        held: Request | None = None  # read ahead to learn whether the stream is done; admitted first
        exhausted = False
        while True:
            self._admit_samples()
            while not exhausted and not should_stop() and (self.free_slots or held is None):
                req, held = held or next(stream, None), None
                if req is None:
                    exhausted = True
                    self.policy.on_drain()
                elif not self.free_slots:
                    held = req  # every slot is busy: the stream has more, so this is no drain yet
                    break
                else:
                    failed = self._admit_or_error(req, encode)
                    if failed is not None:
                        emit(failed)
                    self._admit_samples()
            if not self.active or should_stop():
                if self.remember is not None:
                    self.remember(self.policy.snapshot())
                return
            for done in self.step():
                emit(done)
            after_step()

    def _admit_or_error(self, req: Request, encode: Callable[[Request], list[int]]) -> Completion | None:
        if req.error is not None:
            self.stats.observe_row("error", 0)
            return Completion.failed(req, req.error)
        try:
            ids = encode(req)
        except ValueError as e:
            self.stats.observe_row("error", 0)
            return Completion.failed(req, str(e))
        problem = (refusal(self.cfg, req, ids, self.target.spec.vocab_size)
                   or self.grammars.problem(structured_of(self.cfg, req)))
        if problem is not None:
            self.stats.observe_row("error", 0)
            return Completion.failed(req, problem, prompt_tokens=len(ids))
        n = self.cfg.n if req.params.n is None else req.params.n
        group = SampleGroup(req, ids, n, list(range(1, n))) if n > 1 else None
        self.admit(req, ids, 0, group)
        if group is not None:
            self._queued.append(group)
        return None

