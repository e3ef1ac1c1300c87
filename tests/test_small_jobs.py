"""Small jobs still speculate: a job with fewer rows than slots is in the drain from its first step (the
loop hears the stream is done before it decodes), and the drain must still try and probe the drafters it
knows nothing of, or a job of 3 rows never drafts where one of 300 would (docs/selection.md, Drain)."""

from __future__ import annotations

from collections import Counter

import pytest

from spin_batch.records import Completion, Request
from spin_batch.selection.bandit import PROBE_PULLS, BanditPolicy
from spin_batch.selection.factory import make_policy
from spin_batch.selection.fixed import NoSpeculation

from test_bandit import World
from test_spec_equality import (PROMPTS, early_exit_1, early_exit_all, make_loop, ngram,  # noqa: F401
                                reference, target)


def drain_from_the_start(world: World, drafters: list[str], slots: int, steps: int,
                         backoff: bool = True) -> tuple[BanditPolicy, list[list]]:
    """A job with `slots` rows, all admitted before its first step and the stream done at once (as BatchLoop
    runs one with fewer rows than slots): every step's choices."""
    policy = BanditPolicy(drafters, max_gamma=6, seed=0, backoff=backoff)
    for s in range(slots):
        policy.on_admit(s)
    policy.on_drain()
    return policy, [world.step(policy, list(range(slots))) for _ in range(steps)]


@pytest.mark.parametrize("slots", [3, 8])
def test_a_job_with_fewer_rows_than_slots_tries_probes_and_then_drafts(slots):
    """3 rows at 4 slots, 8 at 16: each drafter gets its first trial and its probes, and once they are in the
    drain drafts for every slot with the drafter that pays (before: 0 drafts in the whole job)."""
    world = World({"good": 0.85, "poor": 0.2}, {"good": 0.0005, "poor": 0.0002}, c0=0.03, c1=0.001)
    policy, steps = drain_from_the_start(world, ["poor", "good"], slots, steps=40)
    assert policy.state.pulls["good"] >= PROBE_PULLS and policy.state.pulls["poor"] >= 1
    first = steps[0]  # both unmeasured: one slot each, short drafts
    assert Counter(c.drafter for c in first if c.drafter) == {"poor": 1, "good": 1}
    assert all(c.gamma <= 2 for c in first if c.drafter)
    late = [step for step in steps[-10:] if any(c.drafter for c in step)]  # aside from the gate's plain bursts
    assert len(late) >= 6
    assert all(c.drafter == "good" and c.gamma > 0 for step in late for c in step)  # the drain's all-or-none


def test_in_the_drain_the_other_slots_draft_only_as_deep_as_the_slowest_needs():
    """Only the least gain counts in the drain: at each slot's own best gamma, the slot whose mean came out low
    set the worth while the others paid for chains of 6, and the drain would not draft; paced to the slow
    slot (gamma 2 where its 5 gains as much), every slot drafts."""
    from spin_batch.selection.joint import JointChoice

    means = [{"d": 0.6}] + [{"d": 0.9}] * 7
    joint = JointChoice(caps=[6] * 8, rates=means, means=means, coeffs={"d": (0.001, 0.0002)},
                        goes_on={"d": None}, verify_price=0.3, lam=200.0)
    own_best = [("d", joint._best(k, "d", m["d"], 0.0, True)[1]) for k, m in enumerate(means)]
    assert [g for _, g in own_best] == [1] + [6] * 7 and joint.drain_value(own_best) < joint.n
    drained = joint.drain_picks(joint.solve())
    assert drained == [("d", 5)] + [("d", 2)] * 7 and joint.drain_value(drained) > joint.n


def test_the_drain_drafts_as_soon_as_its_probes_are_in():
    """A verdict against drafting reached before the probes (the pool knew little) is not kept for the drain's
    DRAIN_RECHECK steps: the steps that probe choose again with what was just measured."""
    world = World({"good": 0.9}, {"good": 0.0005}, c0=0.03, c1=0.001)
    policy, steps = drain_from_the_start(world, ["good"], 3, steps=8, backoff=False)
    assert [sum(c.drafter is not None for c in step) for step in steps[:2]] == [1, 0]  # first trial; verify unfit
    assert policy.state.pulls["good"] >= PROBE_PULLS
    assert all(c.drafter == "good" and c.gamma > 0 for step in steps[3:] for c in step)


def test_the_drain_still_drafts_nothing_where_speculation_does_not_pay():
    """At 16 slots with dear verification the first trial and the probes run (one slot), then nothing drafts."""
    world = World({"d": 0.6}, {"d": 0.001}, c0=0.01, c1=0.02)
    policy, steps = drain_from_the_start(world, ["d"], 16, steps=40)
    assert all(sum(c.drafter is not None for c in step) <= 1 for step in steps)
    assert policy.state.pulls["d"] == PROBE_PULLS
    assert all(c.drafter is None for step in steps[2 * PROBE_PULLS:] for c in step)


def run_rows(loop, prompts: list[str]) -> list[Completion]:
    reqs = [Request(source=f"mem#{i}", id=str(i), prompt=p, messages=None) for i, p in enumerate(prompts)]
    done: list[Completion] = []
    loop.run(iter(reqs), lambda r: loop.tok.encode(r.prompt), done.append)
    assert len(done) == len(prompts) and all(c.status == "ok" for c in done)
    return done


@pytest.mark.parametrize("rows,slots", [(3, 4), (8, 16)])
def test_a_short_job_drafts_and_stays_lossless(target, reference, rows, slots):
    """The loop with the bandit on the tiny target: rows fewer than slots, so the whole job is a drain. Its rows
    drafted (drafter_pulls beyond "none") and every output equals autoregressive."""
    loop = make_loop(target, slots, NoSpeculation(), [early_exit_all, early_exit_1, ngram])
    loop.policy = make_policy("ucb", loop.drafters, 4, seed=0)
    done = run_rows(loop, PROMPTS[:rows])
    assert {c.request.id: list(c.token_ids) for c in done} == {str(i): reference[str(i)] for i in range(rows)}
    pulls = Counter()
    for c in done:
        pulls.update(c.drafter_pulls)
    assert set(pulls) - {"none"}, pulls
