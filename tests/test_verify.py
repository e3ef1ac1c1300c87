"""The verifier on hand-built logits, and the statistical proof that sampling stays lossless."""

from __future__ import annotations

import math

import pytest
import torch

from spin_batch.drafters.model import ModelDrafter
from spin_batch.engine import verify
from spin_batch.sampling import SamplingParams, probs_from_logits
from spin_batch.engine.verify import accept_greedy, accept_sampling

V = 8


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    """Rows whose argmax is the given token."""
    x = torch.zeros(len(tokens), V)
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return x


def test_greedy_full_accept_takes_bonus():
    v = accept_greedy(one_hot_logits([3, 4, 5, 6]), [[3, 4, 5]])
    assert v.accepted == [3] and v.tokens == [[3, 4, 5, 6]]


def test_greedy_first_token_reject_takes_correction():
    v = accept_greedy(one_hot_logits([1, 4, 5, 6]), [[3, 4, 5]])
    assert v.accepted == [0] and v.tokens == [[1]]


def test_greedy_empty_draft_is_plain_decoding():
    v = accept_greedy(one_hot_logits([7]), [[]])
    assert v.accepted == [0] and v.tokens == [[7]]


def test_greedy_mixed_batch():
    # segment 0: gamma 2, reject at 2nd; segment 1: empty; segment 2: gamma 3, all accepted
    rows = [2, 5, 0] + [6] + [1, 1, 2, 3]
    v = accept_greedy(one_hot_logits(rows), [[2, 4], [], [1, 1, 2]])
    assert v.accepted == [1, 0, 3]
    assert v.tokens == [[2, 5], [6], [1, 1, 2, 3]]


def test_sampling_with_certain_target_behaves_like_greedy():
    logits = one_hot_logits([2, 5, 0, 6, 1, 1, 2, 3]) * 20  # p is one-hot up to e^-100
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    v = accept_sampling(logits, [[2, 4], [], [1, 1, 2]], [None, None, None], gens, [SamplingParams(1.0)] * 3)
    assert v.accepted == [1, 0, 3]
    assert v.tokens == [[2, 5], [6], [1, 1, 2, 3]]


# -- distribution test --------------------------------------------------------------------

N_SAMPLES = 60_000
SIGMAS = 5.0  # per-token bound: |freq - p| < 5 * sqrt(p (1 - p) / N); a false alarm has odds ~1e-6 per token


def _accept_one(p, d, q, gen):
    """verify's rule on one segment, with the randoms drawn from gen as the loop draws them."""
    return verify.rejection_sample(p, d, q, verify.Uniforms.from_generator(gen))


def _draft_sample(q: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(q, 1, generator=gen))


def _first_and_second(accept_one, p_logits, q_probs, sp, n, seed):
    """Run n independent speculative steps with gamma 2; count the first output token, and
    the second one when the first draft token was accepted."""
    gen = torch.Generator().manual_seed(seed)
    p = probs_from_logits(p_logits, sp)  # [3, V]
    first = torch.zeros(V)
    second = torch.zeros(V)
    for _ in range(n):
        d = [_draft_sample(q_probs[0], gen), _draft_sample(q_probs[1], gen)]
        k, nxt = accept_one(p, d, q_probs, gen)
        out = d[:k] + [nxt]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return p, first, second


def _within_bound(p: torch.Tensor, counts: torch.Tensor) -> tuple[bool, float]:
    n = counts.sum().item()
    freq = counts / n
    sigma = torch.sqrt(p * (1 - p) / n).clamp_min(1.0 / n)
    z = ((freq - p).abs() / sigma).max().item()
    return z < SIGMAS, z


def _problem():
    g = torch.Generator().manual_seed(3)
    p_logits = torch.randn(3, V, generator=g) * 1.5
    q_probs = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)  # a draft that disagrees a lot
    return p_logits, q_probs


@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)],
                         ids=["plain", "temp-topk-topp"])
def test_speculative_sampling_reproduces_target_distribution(sp):
    p_logits, q_probs = _problem()
    # the draft distribution goes through the same transform, as drafters do
    q = probs_from_logits(torch.log(q_probs), sp)
    p, first, second = _first_and_second(_accept_one, p_logits, q, sp, N_SAMPLES, seed=11)
    ok1, z1 = _within_bound(p[0], first)
    ok2, z2 = _within_bound(p[1], second)
    assert ok1, f"first token off by {z1:.1f} sigma"
    assert ok2, f"second token off by {z2:.1f} sigma"
    assert second.sum() > 5_000  # enough accepted first tokens to test the second position


def test_subset_head_draft_is_lossless():
    """A distilled draft's q is zero outside its kept ids (models/distilled.py): still lossless."""
    p_logits, q_probs = _problem()
    sp = SamplingParams(1.0)
    kept = torch.zeros(V, dtype=torch.bool)
    kept[::2] = True
    kept[int(p_logits[0].argmax())] = False  # the target's likeliest first token is never drafted
    q = q_probs * kept
    q = q / q.sum(-1, keepdim=True)
    p, first, second = _first_and_second(_accept_one, p_logits, q, sp, N_SAMPLES, seed=13)
    ok1, z1 = _within_bound(p[0], first)
    ok2, z2 = _within_bound(p[1], second)
    assert ok1, f"first token off by {z1:.1f} sigma"
    assert ok2, f"second token off by {z2:.1f} sigma"


def test_deterministic_draft_is_lossless():
    """q = None (n-gram, vote): the draft token is fixed; the output must still follow p."""
    p_logits, _ = _problem()
    sp = SamplingParams(1.0)
    p = probs_from_logits(p_logits, sp)
    gen = torch.Generator().manual_seed(5)
    counts = torch.zeros(V)
    for _ in range(N_SAMPLES):
        k, nxt = _accept_one(p, [int(p[0].argmax())], None, gen)
        counts[int(p[0].argmax()) if k else nxt] += 1
    ok, z = _within_bound(p[0], counts)
    assert ok, f"off by {z:.1f} sigma"


def _wrong_accept_one(p, d, q, gen):
    """A deliberately wrong rule: on rejection, resample from p instead of norm(max(p - q, 0))."""
    for i, x in enumerate(d):
        if torch.rand((), generator=gen).item() < min(1.0, float(p[i, x] / q[i, x])):
            continue
        return i, int(torch.multinomial(p[i], 1, generator=gen))
    return len(d), int(torch.multinomial(p[len(d)], 1, generator=gen))


def test_the_bound_catches_a_wrong_rule():
    p_logits, q_probs = _problem()
    sp = SamplingParams(1.0)
    p, first, _ = _first_and_second(_wrong_accept_one, p_logits, q_probs, sp, N_SAMPLES, seed=11)
    ok, z = _within_bound(p[0], first)
    assert not ok and z > 2 * SIGMAS, f"the wrong rule was off by only {z:.1f} sigma"


def test_probs_transform_top_k_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    p = probs_from_logits(logits, SamplingParams(1.0, top_k=3))
    assert (p[0, 3:] == 0).all() and math.isclose(p.sum().item(), 1.0, rel_tol=1e-6)
    p = probs_from_logits(logits, SamplingParams(1.0, top_p=0.5))
    assert p[0, 0].item() == pytest.approx(1.0)  # the top token alone has ~64% mass
    p = probs_from_logits(logits, SamplingParams(1.0, top_p=0.7))
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all()


def test_vote_proposal_is_lossless_under_sampling():
    """The vote's path is verified as a deterministic draft (q one-hot)."""
    from spin_batch.drafters.base import Drafter, DraftRequest, Proposal
    from spin_batch.drafters.vote import VoteDrafter

    class Fixed(Drafter):
        def __init__(self, name, path):
            super().__init__(name)
            self.path = path

        def propose(self, reqs):
            return Proposal([list(self.path) for _ in reqs], [None] * len(reqs))

    p_logits, _ = _problem()
    sp = SamplingParams(1.0)
    p = probs_from_logits(p_logits, sp)
    vote = VoteDrafter("v", {"a": Fixed("a", [1, 2]), "b": Fixed("b", [1, 5]), "c": Fixed("c", [4])}, beta=0.5)
    gen = torch.Generator().manual_seed(9)
    counts = torch.zeros(V)
    for _ in range(N_SAMPLES):
        prop = vote.propose([DraftRequest(0, [0], 2, gen, sp=sp)])
        v = accept_sampling(p_logits[: len(prop.tokens[0]) + 1], prop.tokens, prop.probs, [gen], [sp])
        counts[v.tokens[0][0]] += 1
    ok, z = _within_bound(p[0], counts)
    assert ok, f"off by {z:.1f} sigma"


# -- the draft confidence gate (DraftRequest.min_prob) ----------------------------------------

class _TableDraft(ModelDrafter):
    """ModelDrafter's own proposal loop over a fixed two-position draft: q1 first, then q2[d1]."""

    START = V  # the token fed in the first round (not a vocabulary row)

    def __init__(self, q1: torch.Tensor, q2: torch.Tensor):
        self.name, self.vocab_ids, self.lens = "table", None, None
        self.model = type("M", (), {"device": torch.device("cpu")})()
        self.logq1, self.logq2 = q1.log(), q2.log()

    def _catch_up(self, reqs):
        return [0] * len(reqs), [[self.START] for _ in reqs], None

    def _step(self, flat, seg, extra, rows):
        first = flat == self.START
        logits = torch.where(first[:, None], self.logq1.expand(len(flat), V), self.logq2[flat.clamp_max(V - 1)])
        return logits[rows], None

    def _seen(self, req, end, first):
        pass


def _gated_problem():
    g = torch.Generator().manual_seed(7)
    p_logits = torch.randn(3, V, generator=g) * 1.5
    q1 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q2 = torch.softmax(torch.randn(V, V, generator=g) * torch.linspace(0.5, 3.0, V)[:, None], -1)
    conf = q1.max() * q2.max(-1).values  # the chain's confidence after its second token, per first token
    return p_logits, q1, q2, float(conf.median())


def _gated_outputs(propose, p, q1, q2, n, seed):
    """Output tokens 1 and 2 of n speculative steps whose drafts come from `propose`."""
    gen = torch.Generator().manual_seed(seed)
    drafts, qs = propose(gen)
    first, second = torch.zeros(V), torch.zeros(V)
    lengths = torch.zeros(3)
    for d, q in zip(drafts, qs):
        lengths[len(d)] += 1
        k, nxt = _accept_one(p, d, q, gen)
        out = d[:k] + [nxt]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second, lengths


def test_confidence_gate_keeps_sampling_exact():
    """The gate stops a chain on the draft's distribution alone, before drawing from it: the output
    still follows p, while the gate does drop second draft tokens."""
    from spin_batch.drafters.base import DraftRequest

    p_logits, q1, q2, floor = _gated_problem()
    sp = SamplingParams(1.0, sampler="rejection")  # the drafter draws from its q
    p = probs_from_logits(p_logits, sp)
    drafter = _TableDraft(q1, q2)

    def propose(gen):
        reqs = [DraftRequest(i, [0], 2, gen, min_prob=floor, sp=sp) for i in range(N_SAMPLES)]
        prop = drafter.propose(reqs)
        return prop.tokens, prop.probs

    first, second, lengths = _gated_outputs(propose, p, q1, q2, N_SAMPLES, seed=17)
    assert lengths[0] == 0 and lengths[1] > 0.2 * N_SAMPLES and lengths[2] > 0.2 * N_SAMPLES, lengths
    ok1, z1 = _within_bound(p[0], first)
    ok2, z2 = _within_bound(p[1], second)
    assert ok1, f"first token off by {z1:.1f} sigma"
    assert ok2, f"second token off by {z2:.1f} sigma"


def test_the_bound_catches_a_gate_that_looks_at_the_drawn_token():
    """A wrong gate: draw the second draft token, then drop it when its own q is low."""
    p_logits, q1, q2, _ = _gated_problem()
    p = probs_from_logits(p_logits, SamplingParams(1.0))

    def propose(gen):
        drafts, qs = [], []
        for _ in range(N_SAMPLES):
            d1 = _draft_sample(q1, gen)
            d2 = _draft_sample(q2[d1], gen)
            if q2[d1, d2] < 0.3:
                drafts.append([d1]), qs.append(q1[None])
            else:
                drafts.append([d1, d2]), qs.append(torch.stack((q1, q2[d1])))
        return drafts, qs

    _, second, lengths = _gated_outputs(propose, p, q1, q2, N_SAMPLES, seed=17)
    assert lengths[1] > 0.1 * N_SAMPLES and lengths[2] > 0.1 * N_SAMPLES, lengths
    ok, z = _within_bound(p[1], second)
    assert not ok and z > 2 * SIGMAS, f"the wrong gate was off by only {z:.1f} sigma"


def test_sample_draws_from_the_given_distribution_and_never_a_zero_token():
    """sample() inverts a float64 CDF: frequencies within the bound of p (given unnormalised), no draw
    of a probability-0 token, and a one-token distribution always gives that token."""
    from spin_batch.sampling import sample

    g = torch.Generator().manual_seed(2)
    w = torch.rand(V, generator=g)
    w[::3] = 0  # every third token impossible
    p = w / w.sum()
    gen = torch.Generator().manual_seed(9)
    counts = torch.zeros(V)
    for _ in range(N_SAMPLES):
        counts[sample(w * 7.0, gen)] += 1
    ok, z = _within_bound(p, counts)
    assert ok, f"off by {z:.1f} sigma"
    assert counts[::3].sum() == 0
    one = torch.zeros(V)
    one[V - 1] = 0.5
    assert {sample(one, gen) for _ in range(50)} == {V - 1}
    # and the bound catches a sampler that is off by one token
    shifted = torch.zeros(V)
    for _ in range(N_SAMPLES // 4):
        shifted[(sample(w, gen) + 1) % V] += 1
    assert not _within_bound(p, shifted)[0]


def test_cascade_of_a_lookup_and_a_gated_model_is_lossless_under_sampling():
    """A cascade verifies one member's proposal per slot: a deterministic lookup's (q one-hot) where it
    kept at least min_tokens tokens, else the gated model draft's with its q. Both output tokens follow p."""
    from spin_batch.drafters.base import Drafter, DraftRequest, Proposal
    from spin_batch.drafters.cascade import CascadeDrafter

    class Lookup(Drafter):
        gates = True

        def propose(self, reqs):  # two tokens for even slots, one (too few) for odd ones
            return Proposal([[1, 2] if r.slot % 2 == 0 else [3] for r in reqs], [None] * len(reqs))

    p_logits, q1, q2, floor = _gated_problem()
    sp = SamplingParams(1.0, sampler="rejection")  # the model member draws from its q
    p = probs_from_logits(p_logits, sp)
    cascade = CascadeDrafter("c", {"lookup": Lookup("lookup"), "table": _TableDraft(q1, q2)}, min_tokens=2)
    assert cascade.gates

    def propose(gen):
        reqs = [DraftRequest(i, [0], 2, gen, min_prob=floor, sp=sp) for i in range(N_SAMPLES)]
        prop = cascade.propose(reqs)
        assert prop.tokens[0] == [1, 2] and prop.probs[0] is None and prop.probs[1] is not None
        return prop.tokens, prop.probs

    first, second, lengths = _gated_outputs(propose, p, q1, q2, N_SAMPLES, seed=23)
    assert cascade.stats() == {"drafted_by.lookup": N_SAMPLES // 2, "drafted_by.table": N_SAMPLES // 2}
    assert lengths[1] > 0.1 * N_SAMPLES and lengths[2] > 0.5 * N_SAMPLES, lengths
    ok1, z1 = _within_bound(p[0], first)
    ok2, z2 = _within_bound(p[1], second)
    assert ok1, f"first token off by {z1:.1f} sigma"
    assert ok2, f"second token off by {z2:.1f} sigma"


# -- per-row settings: one batch, each request its own temperature / top-k / top-p ------------

_MIXED = [SamplingParams(), SamplingParams(1.0), SamplingParams(0.6, top_k=5, top_p=0.9)]


def _mixed_batch_outputs(sps_of, n_per, seed):
    """n_per speculative steps (gamma 2, drafts drawn from each request's own q) per setting, run as
    batches in which the settings alternate segment by segment; the output tokens per setting."""
    p_logits, q_raw = _problem()
    gen = torch.Generator().manual_seed(seed)
    q_of = [None if sp.greedy else probs_from_logits(torch.log(q_raw), sp) for sp in _MIXED]
    out = {i: [] for i in range(len(_MIXED))}
    per_call = 300
    kinds = [j % len(_MIXED) for j in range(per_call)]
    logits = torch.cat([p_logits for _ in kinds])  # [3 * per_call, V]
    for _ in range(n_per * len(_MIXED) // per_call):
        drafts, qs, gens = [], [], []
        for j, k in enumerate(kinds):
            q = q_of[k]
            if q is None:  # a greedy request: alternately the argmax path (accepted) and a miss
                drafts.append(p_logits[:2].argmax(-1).tolist() if j % 2 else [1, 2])
            else:
                drafts.append([_draft_sample(q[0], gen), _draft_sample(q[1], gen)])
            qs.append(q)
            gens.append(None if q is None else gen)
        v = verify.accept_sampling(logits, drafts, qs, gens, sps_of(kinds))
        for k, toks in zip(kinds, v.tokens):
            out[k].append(toks)
    return p_logits, out


def test_mixed_settings_in_one_batch_each_follow_their_own_distribution():
    """Greedy, T=1 and T=0.6 with top-k/top-p requests verified together: greedy ones decode the
    argmax path exactly, the others' first and second tokens follow their own p."""
    p_logits, out = _mixed_batch_outputs(lambda kinds: [_MIXED[k] for k in kinds], 12_000, seed=31)
    best = p_logits.argmax(-1).tolist()
    assert all(t == best[: len(t)] for t in out[0])
    assert any(len(t) == 3 for t in out[0]) and any(len(t) == 1 for t in out[0])
    for k in (1, 2):
        p = probs_from_logits(p_logits, _MIXED[k])
        first = torch.bincount(torch.tensor([t[0] for t in out[k]]), minlength=V).float()
        second = torch.bincount(torch.tensor([t[1] for t in out[k] if len(t) > 1]), minlength=V).float()
        for pos, counts in ((0, first), (1, second)):
            ok, z = _within_bound(p[pos], counts)
            assert ok, f"setting {k}, position {pos}: off by {z:.1f} sigma"


def test_the_bound_catches_one_setting_applied_to_a_mixed_batch():
    """The wrong rule: the first request's temperature for every row of the batch."""
    p_logits, out = _mixed_batch_outputs(lambda kinds: [_MIXED[1]] * len(kinds), 3_000, seed=31)
    p = probs_from_logits(p_logits, _MIXED[2])
    first = torch.bincount(torch.tensor([t[0] for t in out[2]]), minlength=V).float()
    ok, z = _within_bound(p[0], first)
    assert not ok and z > 2 * SIGMAS, f"off by only {z:.1f} sigma"


def test_probs_per_row_is_each_rows_own_transform():
    from spin_batch.sampling import probs_per_row

    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(4)) * 2
    sps = [_MIXED[i % 3] for i in range(7)]
    got = probs_per_row(logits, sps)
    for i, sp in enumerate(sps):
        want = (torch.nn.functional.one_hot(logits[i].argmax(), V).float() if sp.greedy
                else probs_from_logits(logits[i : i + 1], sp)[0])
        assert torch.equal(got[i], want), i
