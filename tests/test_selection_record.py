"""Recorded scenarios: the selectors' choices, step by step, on seeded simulated jobs, against the choices
recorded in selection_record.json. A change to selection that means to keep its behaviour keeps every
choice; one that means to change it rewrites the record (`python tests/test_selection_record.py --write`)
and says why.

A scenario is a job: requests of seeded lengths and per-drafter acceptance rates in a fixed number of
slots, drafters with seeded linear costs (gated or not, growing token trees or not), the stream's end
(Policy.on_drain) partway, and for some a second stream (Policy.on_stream). Each step the selector
chooses for the decoding slots; the simulation draws what each choice accepted and what the step cost,
and the selector learns it (twice, one half of the slots each, where the loop's pipeline would split the
step into two micro-batches).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from spin_batch.drafters.base import Drafter
from spin_batch.selection.factory import make_policy
from spin_batch.selection.policy import Outcome, StepCosts

RECORD = Path(__file__).resolve().parent / "selection_record.json"


@dataclass(frozen=True)
class Sim:
    """A simulated drafter: acceptance rate, seconds per forward and per position, and what it can do."""

    rate: float
    f: float
    s: float
    gates: bool = False
    trees: bool = False
    past: bool = False  # proposes (and may have accepted) a token past gamma, as a lookahead chain does


class Named(Drafter):
    """A drafter for make_policy to read the capabilities of; it never proposes."""

    def __init__(self, name: str, sim: Sim):
        super().__init__(name)
        self.gates, self.trees = sim.gates, sim.trees

    def propose(self, reqs):
        raise AssertionError("the scenarios simulate drafting")


POOLS = {
    "mixed": {"ngram": Sim(0.35, 0.0, 0.00002), "small": Sim(0.55, 0.0015, 0.0004, gates=True),
              "copy": Sim(0.9, 0.004, 0.0012, gates=True, trees=True, past=True)},
    "one": {"d": Sim(0.7, 0.001, 0.0003, gates=True)},
    "dear": {"dear": Sim(0.45, 0.006, 0.002, gates=True), "cheap": Sim(0.3, 0.0, 0.00002)},
    "trees": {"tree": Sim(0.75, 0.002, 0.0005, gates=True, trees=True), "chain": Sim(0.5, 0.0, 0.0001)},
}

# name: (selector, pool, slots, steps, options)
SCENARIOS = {
    "ucb-mixed-1": ("ucb", "mixed", 1, 160, {"tree_nodes": 8}),
    "ucb-mixed-4-pipeline": ("ucb", "mixed", 4, 160, {"tree_nodes": 8, "pipeline": True}),
    "ucb-mixed-16": ("ucb", "mixed", 16, 90, {"tree_nodes": 8}),
    "ucb-mixed-4-no-backoff": ("ucb", "mixed", 4, 140, {"backoff": False, "two_streams": True}),
    "ucb-mixed-3-no-gate": ("ucb", "mixed", 3, 120, {"confidence_gate": False, "tree_nodes": 8}),
    "thompson-mixed-4": ("thompson", "mixed", 4, 140, {"tree_nodes": 8, "seed": 3}),
    "thompson-trees-2-pipeline": ("thompson", "trees", 2, 140, {"tree_nodes": 6, "pipeline": True}),
    "ucb-trees-1": ("ucb", "trees", 1, 160, {"tree_nodes": 6, "two_streams": True}),
    "ucb-one-8": ("ucb", "one", 8, 120, {"drain_at": 20}),
    "ucb-one-3-small-job": ("ucb", "one", 3, 60, {"drain_at": 0, "backoff": False}),
    "ucb-dear-8-long-drain": ("ucb", "dear", 8, 150, {"drain_at": 10, "length": (60, 140), "backoff": False,
                                                      "verify": (0.01, 0.0025)}),
    "fixed-copy-4": ("fixed:copy", "mixed", 4, 60, {"tree_nodes": 8}),
    "round-robin-3": ("round_robin", "mixed", 3, 40, {}),
}

CAP = 6  # num_speculative_tokens


def simulate(selector: str, pool: str, slots: int, steps: int, options: dict) -> list[str]:
    """Each step's choices, one string per step: the decoding slots and every slot's choice."""
    sims = POOLS[pool]
    drafters = {name: Named(name, sim) for name, sim in sims.items()}
    policy = make_policy(selector, drafters, CAP, seed=options.get("seed", 0),
                         confidence_gate=options.get("confidence_gate", True), backoff=options.get("backoff", True),
                         tree_nodes=options.get("tree_nodes", 0))
    rng = random.Random(f"{selector}/{pool}/{slots}/{steps}")
    drain_at = options.get("drain_at", steps * 3 // 4)
    requests: dict[int, dict] = {}  # by slot: tokens left to generate and per-drafter rate
    made = 0

    def admit(slot: int) -> None:
        nonlocal made
        made += 1
        requests[slot] = {"left": rng.randint(*options.get("length", (8, 60))),
                          "rate": {d: min(max(sim.rate + rng.uniform(-0.15, 0.15), 0.02), 0.98)
                                   for d, sim in sims.items()}}
        policy.on_admit(slot, f"r{made}")

    def stream() -> None:
        policy.on_stream()
        for slot in range(slots):
            admit(slot)
        if drain_at == 0:
            policy.on_drain()

    record = []
    stream()
    second = options.get("two_streams", False)
    for t in range(steps):
        if t == drain_at and t:
            policy.on_drain()
        if not requests:
            if not second:
                break
            second = False
            stream()
        decoding = sorted(requests)
        caps = [max(0, min(CAP + 2, requests[s]["left"] - 1)) for s in decoding]
        step = policy.choose(decoding, caps)
        choices = step.choices
        record.append(" ".join(f"{s}:{c.drafter or '-'}/{c.gamma}/{c.nodes}/{c.min_prob!r}"
                               for s, c in zip(decoding, choices)))
        outcomes, rows = [], []
        for s, c in zip(decoding, choices):
            drafted = accepted = 0
            if c.drafter is not None and c.gamma > 0:
                sim, rate = sims[c.drafter], requests[s]["rate"][c.drafter]
                drafted = c.gamma
                if c.min_prob > 0:  # the confidence gate stops a chain short, more often the higher its floor
                    while drafted > 1 and rng.random() < c.min_prob * 0.5:
                        drafted -= 1
                if c.nodes:
                    rate = min(rate + 0.05, 0.98)
                while accepted < drafted and rng.random() < rate:
                    accepted += 1
                if sim.past and accepted == drafted == c.gamma and rng.random() < 0.5:
                    drafted += 1
                    accepted += rng.random() < rate
            outcomes.append(Outcome(s, c, drafted, accepted))
            rows.append(1 + max(drafted, c.nodes))
        halves = [list(range(len(decoding)))]
        if options.get("pipeline") and len(decoding) >= 2 and any(c.drafter for c in choices):
            halves = [list(range(0, len(decoding), 2)), list(range(1, len(decoding), 2))]
        for half in halves:
            ran: dict[str, int] = {}
            forwards: dict[str, int] = {}
            for i in half:
                c, o = choices[i], outcomes[i]
                if c.drafter is not None and c.gamma > 0:
                    n = min(o.drafted + 1, c.gamma)
                    ran[c.drafter] = ran.get(c.drafter, 0) + n
                    forwards[c.drafter] = max(forwards.get(c.drafter, 0), n)
            draft_s = {d: round(sims[d].f * forwards[d] + sims[d].s * ran[d], 9) for d in ran}
            tokens = sum(rows[i] for i in half)
            c0, c1 = options.get("verify", (0.02, 0.0004))
            verify = round(c0 + c1 * tokens + 0.002 * rng.random(), 9)
            stages = {"select": 0.0002, "draft": sum(draft_s.values()), "verify": verify, "accept": 0.0003,
                      "commit": 0.0001}
            policy.learn(step, [outcomes[i] for i in half], StepCosts(stages, tokens, draft_s, ran, forwards))
        for s, o in zip(decoding, outcomes):
            requests[s]["left"] -= o.accepted + 1
            if requests[s]["left"] <= 0:
                del requests[s]
                if t < drain_at:
                    admit(s)
    return record


def recorded() -> dict[str, list[str]]:
    return json.loads(RECORD.read_text())


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_choices_match_the_record(name):
    want = recorded()[name]
    got = simulate(*SCENARIOS[name])
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{name}: step {t} chose {g!r}, the record {w!r}"


def test_the_record_covers_every_kind_of_choice():
    """The scenarios reach first trials, probes, joint choices, trees, floors, the drain and plain steps."""
    rec = recorded()
    assert sorted(rec) == sorted(SCENARIOS)
    choices = [c.split(":", 1)[1].split("/") for steps in rec.values() for step in steps for c in step.split()]
    assert {d for d, *_ in choices} >= {"ngram", "small", "copy", "d", "tree", "chain", "-"}
    assert any(int(n) > 0 for _, _, n, _ in choices)  # token trees
    assert any(float(p) > 0 for *_, p in choices)  # confidence floors
    assert len({g for _, g, _, _ in choices}) >= 6  # gammas


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_selection_record.py --write")
    RECORD.write_text(json.dumps({name: simulate(*spec) for name, spec in SCENARIOS.items()}, indent=0) + "\n")
    print(f"wrote {RECORD}")
