"""Drafting with a Llama-family model: a separate small checkpoint, or the target's own first layers.

A separate model keeps its own KV cache and catches up lazily: at each proposal it first feeds
the committed tokens it has not seen (the whole prompt the first time), then drafts one token
at a time. The early-exit drafter (early_exit.py) is this same loop run on the target's first
L layers and the target's cache.

Lookahead: a chain's forward may also check tokens guessed from the text, the draft of a draft. At one
slot a draft model reads all of its weights for each token it drafts, however few rows it feeds, so a
forward that feeds k guesses after its real token costs little more than one that does not (docs/trees.md,
"Lookahead", has the measurements). Each guess the draft's own pick confirms is one more draft token from
the same forward. The guesses are a prompt lookup's: what followed the latest earlier occurrence of the
last 3, 2 or 1 tokens, committed and drafted (ngram.py). The proposal does not change: every draft token
is still the draft's own pick from a row whose inputs are the committed tokens and its earlier picks; a
guess row the pick did not confirm holds K/V the next forward overwrites. Sampling requests get no guesses (their draws would depend on
which rows ran), and neither do drafts that read the target's features (a fed row needs the feature the
draft predicted at the row before).

Under a grammar (DraftRequest.grammar): every row's logits are masked by the grammar state along its draft
path before anything is picked or drawn (mask_by_grammar; q is then the masked distribution), a chain stops
where the grammar allows nothing more, and the tokens the grammar forces join a chain with no forward (fed
with the next one; one-hot q), except in drafts that read the target's features. Unconstrained rows pay
nothing.
"""

from __future__ import annotations

import torch

from ..gumbel import gumbel_tokens, position_key, seed_of
from ..sampling import probs_per_row, sample
from ..models.cache import KVCache
from ..models.cpu_decoder import argmax
from ..models.distilled import TargetFeatures
from ..models.llama import LlamaModel
from ..models.protocol import TargetModel
from ..models.segments import Segments
from .base import Drafter, DraftRequest, Proposal
from .ngram import lookup_matches
from .tree_growth import TREE_TOP_K, TreeGrowth


class ModelDrafter(Drafter):
    kind = "model"
    gates = True
    trees = True
    lookahead = 0  # guessed tokens a chain's forward may check past its real one (see the module docstring)

    def __init__(self, name: str, model: TargetModel, cache: KVCache, num_layers: int | None = None):
        super().__init__(name)
        self.model = model
        self.cache = cache
        self.num_layers = num_layers
        # A distilled draft's head covers a subset of the target vocabulary: row k is target id vocab_ids[k].
        self.vocab_ids = model.vocab_ids
        self.lens = [0] * cache.slots  # [slots] tokens of each slot held in this drafter's cache
        self.trees = model.tree_segments  # a tree's later rounds are tree segments

    def on_admit(self, slot: int) -> None:
        self.lens[slot] = 0

    def on_commit(self, slot: int, tokens: list[int]) -> None:
        # Cache rows past the last committed-and-seen token are stale; the next write overwrites them.
        self.lens[slot] = min(self.lens[slot], len(tokens) - 1)

    def _start(self, r: DraftRequest) -> int:
        """First token position this proposal must feed."""
        return self.lens[r.slot]

    @torch.inference_mode()
    def propose(self, reqs: list[DraftRequest]) -> Proposal:
        """Chains for the requests with no tree budget, trees (grow_trees) for the others."""
        tree = [i for i, r in enumerate(reqs) if r.nodes > 1]
        if not tree:
            return self._chains(reqs)
        chain = [i for i, r in enumerate(reqs) if r.nodes <= 1]
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[torch.Tensor | None] = [None for _ in reqs]
        parents: list[list[int] | None] = [None for _ in reqs]
        if chain:
            got = self._chains([reqs[i] for i in chain])
            for i, d, q in zip(chain, got.tokens, got.probs):
                tokens[i], probs[i] = d, q
        for i, t in zip(tree, self.grow_trees([reqs[i] for i in tree])):
            # a tree that grew one path is a chain: verified as one, on the chain rule's faster path
            tokens[i], parents[i] = t.tokens, None if t.parents == list(range(-1, len(t.parents) - 1)) else t.parents
        return Proposal(tokens, probs, None if all(x is None for x in parents) else parents)

    def _chains(self, reqs: list[DraftRequest]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        # Round 0 feeds what each slot's cache has not seen; later rounds feed the last draft token,
        # each followed by the tokens guessed to come next where the drafter takes guesses (lookahead).
        starts, feeds, extras = self._catch_up(reqs)
        guessing = self.lookahead > 0 and extras is None
        live = list(range(len(reqs)))
        if extras is None:  # what the grammar forces first is drafted with no forward, and fed with the catch-up
            live = [i for i in live
                    if self._force(reqs[i], drafts[i], qs[i], feeds[i]) and len(drafts[i]) < reqs[i].gamma]
        conf = [1.0] * len(reqs)  # product of the draft's top probabilities along each chain
        first = True
        while live:
            # Only a forward for one chain takes guesses: with several chains a fed row is no longer nearly free
            # (docs/trees.md, "Lookahead").
            guesses = [self._guess(reqs[i], drafts[i]) if guessing and len(live) == 1 else [] for i in live]
            fed = [feeds[i] + g for i, g in zip(live, guesses)]
            seg = Segments.build([(reqs[i].slot, len(f), starts[i]) for i, f in zip(live, fed)], self.model.device)
            flat = torch.tensor([t for f in fed for t in f], dtype=torch.long, device=self.model.device)
            # per live request, its rows of logits: the last real token's, then each guess's
            at = [seg.starts[k] + len(feeds[i]) - 1 for k, i in enumerate(live)]
            rows = [a + j for a, g in zip(at, guesses) for j in range(1 + len(g))]
            owner = [k for k, g in enumerate(guesses) for _ in range(1 + len(g))]
            logits, nxt = self._step(flat, seg, None if extras is None else torch.cat([extras[i] for i in live]), rows)
            row_reqs = [reqs[live[k]] for k in owner]
            # row n of a request's: its draft so far and its first n guesses
            logits, dead = mask_by_grammar(logits, row_reqs, [drafts[i] + g[:n] for i, g in zip(live, guesses)
                                                              for n in range(1 + len(g))], self.vocab_ids)
            top = self._top_prob(logits, row_reqs) if any(reqs[i].min_prob > 0 for i in live) else None
            # a row is picked from unless it is a sampling request's and the floor stops its chain there:
            # decided from q alone, before any token is drawn from it (greedy rows are all picked, which draws nothing)
            keep = [j for j, r in enumerate(row_reqs) if j not in dead and (
                    r.sp.greedy or top is None or r.min_prob <= 0 or conf[live[owner[j]]] * top[j] >= r.min_prob)]
            picked = self._pick(logits[keep] if len(keep) < len(rows) else logits, [row_reqs[j] for j in keep],
                                [qs[live[owner[j]]] for j in keep],
                                [len(row_reqs[j].tokens) + len(drafts[live[owner[j]]]) for j in keep])
            picks = dict(zip(keep, picked))
            still, j = [], 0
            for k, i in enumerate(live):
                r, g, going = reqs[i], guesses[k], True
                confirmed = 0  # guesses the draft's picks confirmed: their rows' K/V are the draft's own
                forced: list[int] = []  # tokens the grammar forces after the last pick: drafted with no forward
                for n in range(1 + len(g)):
                    row = j + n
                    if row in dead:  # the grammar allows nothing here (or nothing this draft's vocabulary holds)
                        going = False
                        break
                    if top is not None and r.min_prob > 0:
                        conf[i] *= top[row]
                        if conf[i] < r.min_prob:
                            going = False
                            break
                    drafts[i].append(picks[row])
                    if extras is None and r.grammar is not None:
                        forced = [drafts[i][-1]]  # the pick and what the grammar forces after it: the next feed
                        if not self._force(r, drafts[i], qs[i], forced):
                            going = False
                            break
                        forced = forced[1:]
                    if len(drafts[i]) >= r.gamma:
                        going = False  # no forward past gamma, but this one's confirmed guesses run on
                    if len(drafts[i]) >= r.gamma + self._past(r) or n == len(g) or forced or picks[row] != g[n]:
                        break
                    confirmed += 1
                j += 1 + len(g)
                self._seen(r, starts[i] + len(feeds[i]) + confirmed, first=first)
                if going:
                    starts[i] += len(feeds[i]) + confirmed
                    feeds[i] = drafts[i][-1 - len(forced):]
                    if extras is not None:
                        extras[i] = nxt[k : k + 1]
                    still.append(i)
            live, first = still, False
        return Proposal(drafts, [torch.stack(q) if q else None for q in qs])

    def _force(self, r: DraftRequest, draft: list[int], q: list[torch.Tensor], feed: list[int]) -> bool:
        """Append to the draft (and to the feed) the tokens r's grammar forces after it, within gamma + room: no
        forward picks them, so a sampling request's q is one-hot there. Whether the grammar allows more after them."""
        if r.grammar is None:
            return True
        forced = r.grammar.forced(draft, r.gamma + r.room - len(draft))
        draft.extend(forced)
        feed.extend(forced)
        if not r.sp.greedy and r.sp.sampler != "gumbel":
            q.extend(self._one_hot(forced))
        return not r.grammar.ends(draft)

    def _one_hot(self, tokens: list[int]) -> list[torch.Tensor]:
        """A q row [V] per token a rejection-sampling chain drafted deterministically (one-hot: exact)."""
        rows = torch.zeros(len(tokens), self.model.spec.vocab_size, dtype=torch.float32)  # [n, V]
        rows[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
        return list(rows.to(self.model.device))

    def _past(self, r: DraftRequest) -> int:
        """Draft tokens a chain may run past gamma: up to `lookahead`, within the request's room."""
        return min(self.lookahead, r.room)

    def _guess(self, r: DraftRequest, draft: list[int]) -> list[int]:
        """Tokens guessed to follow the draft so far: what followed the latest earlier occurrence of its last
        3, 2 or 1 tokens (greedy requests only; up to _past tokens past gamma)."""
        k = min(self.lookahead, r.gamma + self._past(r) - len(draft) - 1)
        if k <= 0 or not r.sp.greedy:
            return []
        return next(lookup_matches(r.tokens + draft, k, 1, 3, limit=1), (0, []))[1]

    @staticmethod
    def _top_prob(logits: torch.Tensor, reqs: list[DraftRequest]) -> list[float]:
        """Per row, the draft's largest probability: of its greedy pick, or the mode of the q it samples from."""
        greedy = [i for i, r in enumerate(reqs) if r.sp.greedy]
        if len(greedy) == len(reqs):  # the common case: no one-hot rows built only to be replaced
            return logits.float().softmax(-1).max(-1).values.tolist()
        probs = probs_per_row(logits, [r.sp for r in reqs])  # [M, V]
        if greedy:  # the softmax of a greedy row (its probs_per_row row is one-hot)
            probs[greedy] = logits[greedy].float().softmax(-1)
        return probs.max(-1).values.tolist()

    def _catch_up(self, reqs: list[DraftRequest]) -> tuple[list[int], list[list[int]], list[torch.Tensor] | None]:
        """Per request: the first cache position to write, the tokens to feed there, and extra inputs."""
        starts = [self._start(r) for r in reqs]
        return starts, [r.tokens[s:] for r, s in zip(reqs, starts)], None

    def grow_trees(self, reqs: list[DraftRequest]) -> list[TreeGrowth]:
        """Each request's draft tree, grown best first (tree_growth.py), one batched draft forward per round.

        Round 0 feeds what each slot's cache has not seen, as a chain proposal does; its last row is
        the tree's root (the last committed token). Every later round feeds each growing tree whole,
        root included, as one tree segment written above the root's row (scratch rows the next
        catch-up overwrites), and reads the logits of the nodes added last. The cache counts the
        committed tokens only, so nothing needs rolling back.
        """
        starts, feeds, extras = self._catch_up(reqs)
        seg = Segments.build([(r.slot, len(f), s) for r, f, s in zip(reqs, feeds, starts)], self.model.device)
        flat = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=self.model.device)
        logits, out = self._step(flat, seg, None if extras is None else torch.cat(extras), seg.last_rows())
        for r, s, f in zip(reqs, starts, feeds):
            self._seen(r, s + len(f), first=True)
        trees = [TreeGrowth(r.nodes, r.gamma, r.min_prob) for r in reqs]
        roots = [(s + len(f) - 1, f[-1]) for s, f in zip(starts, feeds)]  # (cache row, token)
        # the extra input of each fed row (a feature-reading draft): the root's own, and per node its parent's output
        ins = None if extras is None else [[e[-1:]] for e in extras]
        outs = None if out is None else [{-1: out[i : i + 1]} for i in range(len(reqs))]
        self._offer(trees, [[-1] for _ in reqs], logits, reqs)  # the root's children
        expand = [_advance(t) for t in trees]
        while live := [i for i, e in enumerate(expand) if e]:
            if ins is not None:
                for i in live:
                    ins[i].extend(outs[i][trees[i].parents[n]] for n in range(len(ins[i]) - 1, len(trees[i].tokens)))
            seg = Segments.build([(reqs[i].slot, 1 + len(trees[i].tokens), roots[i][0]) for i in live],
                                 self.model.device, [trees[i].segment_parents() for i in live])
            flat = torch.tensor([t for i in live for t in [roots[i][1], *trees[i].tokens]], dtype=torch.long,
                                device=self.model.device)
            rows = [seg.starts[k] + 1 + n for k, i in enumerate(live) for n in expand[i]]
            logits, out = self._step(flat, seg, None if ins is None else torch.cat([x for i in live for x in ins[i]]),
                                     rows)
            if outs is not None:
                for j, (i, n) in enumerate((i, n) for i in live for n in expand[i]):
                    outs[i][n] = out[j : j + 1]
            self._offer([trees[i] for i in live], [expand[i] for i in live], logits, [reqs[i] for i in live])
            expand = [_advance(trees[i]) if i in live else [] for i in range(len(reqs))]
        return trees

    def _offer(self, trees: list[TreeGrowth], expand: list[list[int]], logits: torch.Tensor,
               reqs: list[DraftRequest]) -> None:
        """Offer each expanded node's top-k children: logits row j is the j-th expanded node's, in order."""
        owners = [(t, n, r) for t, e, r in zip(trees, expand, reqs) for n in e]
        logits, dead = mask_by_grammar(logits, [r for _, _, r in owners], [t.path(n) for t, n, _ in owners],
                                       self.vocab_ids)
        probs = self._probs(logits, [r for _, _, r in owners])  # [M, K]
        top = probs.topk(min(TREE_TOP_K, probs.shape[-1]), dim=-1)
        ids = top.indices if self.vocab_ids is None else self.vocab_ids[top.indices]
        for j, ((t, n, _), toks, ps) in enumerate(zip(owners, ids.tolist(), top.values.tolist())):
            if j not in dead:  # a refused child has probability 0: never offered
                t.offer(n, list(zip(toks, ps)))

    def _probs(self, logits: torch.Tensor, reqs: list[DraftRequest]) -> torch.Tensor:
        """[M, K] the draft's distribution per row over its head's ids: a greedy request's softmax, a
        sampling request's q under its own settings."""
        if all(r.sp.greedy for r in reqs):
            return logits.float().softmax(-1)
        probs = probs_per_row(logits, [r.sp for r in reqs])
        greedy = [i for i, r in enumerate(reqs) if r.sp.greedy]
        if greedy:
            probs[greedy] = logits[greedy].float().softmax(-1)
        return probs

    def _step(self, flat: torch.Tensor, seg: Segments, extra: torch.Tensor | None, rows: list[int]):
        """One draft forward: logits at `rows` of the flat batch, and the extra inputs they predict (or None)."""
        return self.model.forward(flat, seg, self.cache, rows, self.num_layers), None

    def _seen(self, req: DraftRequest, end: int, first: bool) -> None:
        """The cache now holds this slot's tokens up to `end` (drafts included; on_commit trims them)."""
        self.lens[req.slot] = end

    def _pick(self, logits: torch.Tensor, reqs: list[DraftRequest], qs: list[list[torch.Tensor]],
              positions: list[int]) -> list[int]:
        """One draft token per row of logits (target ids), the row's token at positions[j]: a greedy request's
        argmax; under the Gumbel sampler, the Gumbel-max token of the draft's logits with the target's noise
        there (gumbel.py: no q, the verifier compares tokens); under rejection sampling, a draw from its q,
        which is appended to its qs."""
        rows = argmax(logits)  # [M]
        best = (rows if self.vocab_ids is None else self.vocab_ids[rows]).tolist()
        if all(r.sp.greedy for r in reqs):
            return best
        noisy = [j for j, r in enumerate(reqs) if not r.sp.greedy and r.sp.sampler == "gumbel"]
        if noisy:
            at = torch.tensor(noisy, device=logits.device)
            got = gumbel_tokens(logits[at], [reqs[j].sp for j in noisy],
                                [position_key(seed_of(reqs[j].gen), positions[j]) for j in noisy], self.vocab_ids)
            for j, t in zip(noisy, got):
                best[j] = t
        drawn = [j for j, r in enumerate(reqs) if not r.sp.greedy and r.sp.sampler != "gumbel"]
        if not drawn:
            return best
        probs = self._full_vocab(probs_per_row(logits, [r.sp for r in reqs]))  # [M, V]
        for j in drawn:
            qs[j].append(probs[j])
            best[j] = sample(probs[j], reqs[j].gen)
        return best

    def _full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """[M, K] over the head's rows -> [M, V] over target ids (zero outside the subset)."""
        if self.vocab_ids is None:
            return probs
        full = probs.new_zeros(probs.shape[0], self.model.spec.vocab_size)
        return full.index_copy_(1, self.vocab_ids, probs)


class FeatureDrafter(ModelDrafter):
    """A distilled draft that also reads the target's last hidden state (EAGLE-style).

    Its cache holds one entry per verified position p: the pair (token p + 1, the target's
    feature at p). A proposal first feeds the pairs committed since the last one, whose features
    the target wrote into `features` while verifying; each further draft token is fed with the
    feature the draft itself predicted. Those draft pairs are never counted as seen, so the
    next proposal overwrites them with the target's real features.
    """

    def __init__(self, name: str, model: LlamaModel, cache: KVCache, features: TargetFeatures):
        super().__init__(name, model, cache)
        if model.feature_head is None:
            raise ValueError(f"drafter {name!r}: the model does not read target features")
        self.features = features
        self.head = model.feature_head

    def on_commit(self, slot: int, tokens: list[int]) -> None:
        """Nothing to roll back: the cache counts only pairs whose feature came from the target."""

    def _catch_up(self, reqs: list[DraftRequest]) -> tuple[list[int], list[list[int]], list[torch.Tensor]]:
        """Pairs (token p + 1, target feature p) for the positions p verified since the last proposal."""
        starts = [self.lens[r.slot] for r in reqs]
        feeds = [r.tokens[s + 1:] for r, s in zip(reqs, starts)]
        gs = [self.features.g[r.slot, s : len(r.tokens) - 1].to(self.model.dtype) for r, s in zip(reqs, starts)]
        return starts, feeds, gs

    def _step(self, flat: torch.Tensor, seg: Segments, extra: torch.Tensor | None, rows: list[int]):
        h = self.model.hidden(flat, seg, self.cache, extra=extra)
        return self.head(self.model.normed(h[rows], self.model.norm))  # logits, predicted features

    def _seen(self, req: DraftRequest, end: int, first: bool) -> None:
        if first:  # only pairs with the target's own features count: positions < len(tokens) - 1
            self.lens[req.slot] = len(req.tokens) - 1


def mask_by_grammar(logits: torch.Tensor, reqs: list[DraftRequest], paths: list[list[int]],
                    vocab_ids: torch.Tensor | None) -> tuple[torch.Tensor, set[int]]:
    """logits [M, K] (row j: reqs[j]'s next draft token after paths[j], the head's K ids target ids vocab_ids or
    the first K) with every token the row's grammar refuses at -inf, and the rows where it allows none of the K
    (left as they were: nothing is drafted there). Unconstrained rows are untouched, and with no constrained
    row nothing is done at all."""
    if all(r.grammar is None for r in reqs):
        return logits, set()
    by_slot: dict[int, list[int]] = {}  # each request's rows in one call, in order, so its walk shares their prefixes
    for j, r in enumerate(reqs):
        if r.grammar is not None:
            by_slot.setdefault(r.slot, []).append(j)
    order = [j for js in by_slot.values() for j in js]
    refused = torch.cat([reqs[js[0]].grammar.refused([paths[j] for j in js]) for js in by_slot.values()])  # [m, V]
    width = logits.shape[-1]
    if vocab_ids is not None:
        refused = refused[:, vocab_ids.cpu()]  # [m, K]
    elif refused.shape[1] != width:  # a head wider than the target's vocabulary: its extra ids are refused
        refused = torch.nn.functional.pad(refused[:, :width], (0, max(width - refused.shape[1], 0)), value=True)
    none = refused.all(-1)  # [m]
    refused &= ~none[:, None]
    refused = refused.to(logits.device)
    if order == list(range(logits.shape[0])):  # every row constrained, in order (one slot, or a constrained job)
        masked = logits.masked_fill(refused, -torch.inf)
    else:
        at = torch.tensor(order, dtype=torch.long, device=logits.device)
        masked = logits.index_put((at,), logits[at].masked_fill(refused, -torch.inf))
    return masked, {order[k] for k in torch.nonzero(none).flatten().tolist()}


def _advance(t: TreeGrowth) -> list[int]:
    """Grow the tree by its best candidates until some new node needs expanding (returned) or none is left."""
    while new := t.grow():
        if expand := t.to_expand(new):
            return expand
    return []
