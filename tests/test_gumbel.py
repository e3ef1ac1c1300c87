"""The Gumbel sampler (spin_batch/gumbel.py): its noise, its law, the verify rule on chains and trees, and
the cheap top-p nucleus it shares with rejection sampling."""

from __future__ import annotations

import pytest
import torch

from spin_batch import gumbel, sampling
from spin_batch.engine import verify
from spin_batch.engine.tree_verify import DraftTree, accept_trees
from spin_batch.gumbel import gumbel_max, gumbel_tokens, key_tensor, noise, position_key
from spin_batch.sampling import SamplingParams, filtered_logits, nucleus_floor, probs_from_logits

from test_verify import N_SAMPLES, SIGMAS, V, _problem, _within_bound


def _keys(seed: int, n: int, position: int = 0) -> torch.Tensor:
    return key_tensor([position_key(seed + i, position) for i in range(n)], torch.device("cpu"))


def test_noise_is_a_fixed_function_of_key_and_id():
    """The same (key, id) gives the same value in any tensor; the values are standard Gumbel; and they are
    pinned, so a change to the hash (which would change every seeded text) is noticed."""
    keys = _keys(3, 4)
    ids = torch.arange(V).repeat(4, 1)
    whole = noise(keys, ids)
    assert torch.equal(noise(keys[2:3], ids[2:3]), whole[2:3])
    assert torch.equal(noise(keys[:, None].expand(4, V).reshape(-1), ids.reshape(-1, 1))[:, 0], whole.reshape(-1))
    assert position_key(0, 0) == 0xA706DD2F4D197E6F
    pinned = noise(key_tensor([position_key(7, 12)], torch.device("cpu")), torch.tensor([[0, 1, 49151]]))[0]
    assert pinned.tolist() == pytest.approx([3.797766612004218, 1.3751615123300291, -0.176956348439881], abs=1e-12)
    g = noise(_keys(11, 2000), torch.arange(100).repeat(2000, 1)).flatten()
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - 1.6449) < 0.03


@pytest.mark.parametrize("candidates", [64, 2], ids=["candidates", "tail"])
@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)], ids=["plain", "filtered"])
def test_gumbel_max_draws_from_softmax(candidates, sp, monkeypatch):
    """Over many keys, the Gumbel-max token of a fixed row follows softmax of its filtered logits, with the
    tail competing as one (2 candidates of 8 tokens: the tail often wins) or not."""
    monkeypatch.setattr(gumbel, "CANDIDATES", candidates)
    p_logits, _ = _problem()
    x = filtered_logits(p_logits[:1], sp)
    toks = gumbel_max(x.expand(N_SAMPLES, V).contiguous(), _keys(0, N_SAMPLES))
    ok, z = _within_bound(probs_from_logits(p_logits[:1], sp)[0], torch.bincount(toks, minlength=V).float())
    assert ok, f"off by {z:.1f} sigma"


def test_a_draft_head_over_a_subset_takes_the_targets_noise_per_token():
    """vocab_ids maps the columns to token ids: the token and its noise are the id's."""
    ids = torch.tensor([5, 1, 7, 2])
    x = torch.randn(300, 4, generator=torch.Generator().manual_seed(1))
    keys = _keys(9, 300)
    full = torch.full((300, V), float("-inf"))
    full[:, ids] = x
    assert torch.equal(gumbel_max(x, keys, ids), gumbel_max(full, keys))


# -- the verify rule: chains ---------------------------------------------------------------------


def _chain_outputs(rule, sp, n, seed):
    """n speculative steps of gamma 2, each its own request (seed + i): the draft takes q's Gumbel-max tokens
    with the step's noise, the rule decides; returns p, first and second output tokens, and acceptances."""
    p_logits, q_probs = _problem()
    gens = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    starts = [5] * n
    logq = torch.log(q_probs)
    d1 = gumbel_tokens(logq[:1].expand(n, V), [sp] * n, [position_key(seed + i, 5) for i in range(n)])
    d2 = gumbel_tokens(logq[1:].expand(n, V), [sp] * n, [position_key(seed + i, 6) for i in range(n)])
    drafts = [[a, b] for a, b in zip(d1, d2)]
    v = rule(p_logits.repeat(n, 1), drafts, gens, [sp] * n, starts)
    first = torch.bincount(torch.tensor([t[0] for t in v.tokens]), minlength=V).float()
    second = torch.bincount(torch.tensor([t[1] for t in v.tokens if len(t) > 1]), minlength=V).float()
    return probs_from_logits(p_logits, sp), first, second, sum(v.accepted)


@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)],
                         ids=["plain", "temp-topk-topp"])
def test_gumbel_rule_reproduces_target_distribution(sp):
    p, first, second, accepted = _chain_outputs(verify.accept_gumbel, sp, N_SAMPLES, seed=11)
    ok1, z1 = _within_bound(p[0], first)
    ok2, z2 = _within_bound(p[1], second)
    assert ok1, f"first token off by {z1:.1f} sigma"
    assert ok2, f"second token off by {z2:.1f} sigma"
    assert second.sum() > 5_000  # enough accepted first tokens to test the second position
    assert accepted > 0.1 * N_SAMPLES


def _accept_likely_drafts(target_logits, drafts, gens, sps, starts):
    """A wrong rule: also accept a draft token the target finds at least as likely as its own token."""
    v = verify.accept_gumbel(target_logits, drafts, gens, sps, starts)
    p = probs_from_logits(target_logits, sps[0])
    tokens, accepted = [], []
    for i, (d, toks, k) in enumerate(zip(drafts, v.tokens, v.accepted)):
        row = 3 * i + k
        if k < len(d) and p[row, d[k]] >= p[row, toks[k]]:
            toks = d[: k + 1] + toks[k + 1 :] if k + 1 < len(toks) else d[: k + 1] + [toks[k]]
            k += 1
        tokens.append(toks), accepted.append(k)
    return verify.Verdict(accepted, tokens)


def test_the_bound_catches_a_wrong_gumbel_rule():
    p, first, _, _ = _chain_outputs(_accept_likely_drafts, SamplingParams(1.0), N_SAMPLES, seed=11)
    ok, z = _within_bound(p[0], first)
    assert not ok and z > 2 * SIGMAS, f"the wrong rule was off by only {z:.1f} sigma"


def test_gumbel_verdicts_do_not_depend_on_the_drafts():
    """The target's token at each position is the same whatever was drafted: the text of plain decoding."""
    p_logits, _ = _problem()
    sp = SamplingParams(0.9)
    gens = [torch.Generator().manual_seed(4)]
    plain = [verify.accept_gumbel(p_logits[i : i + 1], [[]], gens, [sp], [9 + i]).tokens[0][0] for i in range(3)]
    for drafts in ([plain[0], plain[1]], [plain[0], (plain[1] + 1) % V], [(plain[0] + 1) % V, plain[1]]):
        v = verify.accept_gumbel(p_logits, [drafts], gens, [sp], [9])
        assert v.tokens[0] == plain[: v.accepted[0] + 1]
    # greedy rows beside sampled ones take the argmax
    v = verify.accept_gumbel(p_logits.repeat_interleave(2, 0), [[], [], [], [], [], []], [None, gens[0]] * 3,
                             [SamplingParams(), sp] * 3, [9, 9, 10, 10, 11, 11])
    assert [t[0] for t in v.tokens] == [int(p_logits[0].argmax()), plain[0], int(p_logits[1].argmax()), plain[1],
                                        int(p_logits[2].argmax()), plain[2]]


def test_accept_drafts_takes_the_gumbel_rule_unless_asked_for_rejection():
    p_logits, _ = _problem()
    gens = [torch.Generator().manual_seed(4)]
    want = verify.accept_gumbel(p_logits, [[1, 2]], gens, [SamplingParams(1.0)], [3])
    assert verify.accept_drafts(None, p_logits, [[1, 2]], [None], gens, [SamplingParams(1.0)], [3]) == want
    with pytest.raises(ValueError, match="position"):
        verify.accept_drafts(None, p_logits, [[1, 2]], [None], gens, [SamplingParams(1.0)])
    rejection = SamplingParams(1.0, sampler="rejection")
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    assert (verify.accept_drafts(None, p_logits, [[1, 2]], [None], [g1], [rejection], [3])
            == verify.accept_sampling(p_logits, [[1, 2]], [None], [g2], [rejection]))


# -- trees ---------------------------------------------------------------------------------------


def test_tree_gumbel_rule_is_the_chain_rule_per_node_with_the_noise_of_its_depth():
    """A node stands iff its token is its parent row's target token, the noise that of the node's depth:
    the tree's tokens are plain decoding's, and a chain as a tree gets the chain rule's verdict."""
    torch.manual_seed(0)
    sp = SamplingParams(1.0)
    for trial in range(200):
        gen = torch.Generator().manual_seed(trial)
        rows = torch.randn(6, V) * 0.5
        # plain decoding's tokens at positions 20, 21, 22 along whichever path: each row's own token
        own = [verify.accept_gumbel(rows[r : r + 1], [[]], [gen], [sp], [20 + d]).tokens[0][0]
               for r, d in enumerate([0, 1, 1, 2, 2, 1])]
        # root -> a (0), b (1); a -> c (2), d (3); root -> e (4): rows 1 + i per node
        tokens = [own[0], (own[0] + 1) % V, own[1], (own[1] + 3) % V, (own[0] + 2) % V]
        if trial % 2:
            tokens[0], tokens[1] = tokens[1], tokens[0]
        tree = DraftTree(tokens, [-1, -1, 0, 0, -1])
        got = accept_trees(rows, [tree], [gen], [sp], [20])[0]
        a = tokens.index(own[0])
        assert got.path[0] == a
        if a == 0:
            assert got.path == [0, 2] and got.tokens == [own[0], own[1], own[3]]
        else:
            assert got.path == [1] and got.tokens == [own[0], own[2]]
    chain = DraftTree.chain([1, 2, 3])
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(4, V)
    assert (accept_trees(rows, [chain], [gen], [sp], [7])[0].tokens
            == verify.accept_gumbel(rows, [[1, 2, 3]], [gen], [sp], [7]).tokens[0])


# -- top-p without a full sort -------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0], ids=["flat", "lm-like", "peaked"])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95, 0.999])
def test_nucleus_from_candidates_equals_a_full_sort(scale, top_p, monkeypatch):
    """The nucleus floor found among candidates (64, then 1024) equals the full sort's, ties included."""
    g = torch.Generator().manual_seed(int(scale * 10))
    x = torch.randn(24, 4096, generator=g) * scale
    x[3, :200] = x[3, 0]  # a tie straddling the candidates
    x[5, 10:80] = x[5].max()  # the largest logit many times over
    x[7, 50:] = float("-inf")  # top-k already applied
    fast = nucleus_floor(x, top_p)
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", ())
    assert torch.equal(fast, nucleus_floor(x, top_p))


def test_a_row_is_filtered_alike_alone_or_in_a_batch():
    x = torch.randn(20, 49152, generator=torch.Generator().manual_seed(2)) * 4
    sp = SamplingParams(0.7, top_p=0.95)
    batch = filtered_logits(x, sp)
    keys = [position_key(1, i) for i in range(20)]
    toks = gumbel_tokens(x, [sp] * 20, keys)
    for i in (0, 7, 19):
        assert torch.equal(filtered_logits(x[i : i + 1], sp)[0], batch[i])
        assert gumbel_tokens(x[i : i + 1], [sp], [keys[i]]) == [toks[i]]


def test_the_sampler_is_a_job_key():
    from spin_batch.config import ConfigError, parse_job

    from test_config import minimal

    assert parse_job(minimal()).sampling.sampler == "gumbel"
    assert parse_job(minimal(), ["sampling.sampler=rejection"]).sampling.sampler == "rejection"
    with pytest.raises(ConfigError, match="sampler"):
        parse_job(minimal(), ["sampling.sampler=multinomial"])
