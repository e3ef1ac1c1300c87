"""The device step's kernels (spin_kernels.commit, spin_kernels.ngram) against their torch references and the
runtime's own Python rules: engine/verify.py's greedy acceptance with engine/stopping.py's token cuts, and the
n-gram drafter's lookup and gate. On CPU under the Triton interpreter (slow: sizes stay small)."""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402

from spin_batch.drafters.ngram import NgramDrafter, lookup_match  # noqa: E402
from spin_batch.engine.stopping import Stopping, StopRule  # noqa: E402
from spin_batch.engine.verify import accept_greedy  # noqa: E402
from spin_kernels.commit import FINISH_LENGTH, FINISH_STOP, RECORD_HEAD, accept_commit_ref  # noqa: E402
from spin_kernels.ngram import ngram_draft_ref  # noqa: E402

HAVE_TRITON = True
try:
    import triton  # noqa: F401
except Exception:  # pragma: no cover
    HAVE_TRITON = False

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu")
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
REASONS = {None: 0, "stop": FINISH_STOP, "length": FINISH_LENGTH}


# -- accept and commit ------------------------------------------------------------------------


def _commit_case(seed: int, P: int = 6, B: int = 5, G: int = 4, L: int = 24, V: int = 7):
    """Random state and a step: drafts agree with the target for a random prefix, stop tokens and limits
    land inside the step often. Slot P - 1 is the scratch slot (never live); padding rows point at it."""
    rng = random.Random(seed)
    rows = list(range(P - 1))
    rng.shuffle(rows)
    rows = rows[: rng.randint(1, min(B, P - 1))]
    rows += [P - 1] * (B - len(rows))  # padding rows
    lengths, prompts, max_tok, max_len, live = [], [], [], [], []
    hist = torch.zeros(P, L, dtype=torch.int64)
    for s in range(P):
        prompt = rng.randint(1, 6)
        n = prompt + rng.randint(0, 6)
        hist[s, :n] = torch.tensor([rng.randrange(V) for _ in range(n)])
        lengths.append(n)
        prompts.append(prompt)
        max_tok.append(rng.randint(n - prompt + 1, n - prompt + G + 2))
        max_len.append(rng.choice([L, n + rng.randint(1, G + 2)]))
        live.append(0 if s == P - 1 else int(rng.random() < 0.85))
    stops = torch.full((P, 3), -1, dtype=torch.int64)
    for s in range(P):
        for i in range(rng.randint(0, 3)):
            stops[s, i] = rng.randrange(V)
    target = torch.tensor([[rng.randrange(V) for _ in range(G + 1)] for _ in range(B)])
    drafts = torch.tensor([[rng.randrange(V) for _ in range(G)] for _ in range(B)])
    dlen = torch.tensor([rng.randint(0, G) for _ in range(B)])
    for r in range(B):
        agree = rng.randint(0, G)
        drafts[r, :agree] = target[r, :agree]
    state = dict(history=hist, lengths=torch.tensor(lengths), prompt_lens=torch.tensor(prompts),
                 max_tokens=torch.tensor(max_tok), max_len=torch.tensor(max_len), stops=stops,
                 live=torch.tensor(live, dtype=torch.int32), counters=torch.zeros(P, 3, dtype=torch.int64),
                 record=torch.full((P, RECORD_HEAD + G + 1), 99, dtype=torch.int32))
    return torch.tensor(rows), drafts, dlen, target, state


def _python_commit(rows, drafts, dlen, target, state):
    """The runtime's rule in Python: accept_greedy on logits whose argmax is the target's tokens, then
    Stopping.extend with each slot's rule, then the loop's counters (BatchLoop.commit)."""
    st = {k: v.clone() for k, v in state.items()}
    V = int(max(target.max(), drafts.max())) + 1
    stopping = Stopping(lambda ids: "")
    for r, s in enumerate(rows.tolist()):
        n = int(st["lengths"][s])
        if not st["live"][s]:
            st["record"][s, :RECORD_HEAD] = torch.tensor([0, 0, 0, n, 0])
            st["record"][s, RECORD_HEAD:] = -1
            continue
        d = drafts[r, : int(dlen[r])].tolist()
        logits = torch.nn.functional.one_hot(target[r, : len(d) + 1], V).float()
        verdict = accept_greedy(logits, [d])
        k, new = verdict.accepted[0], verdict.tokens[0]
        rule = StopRule(max_tokens=int(st["max_tokens"][s]), max_model_len=int(st["max_len"][s]),
                        stop_ids=frozenset(t for t in st["stops"][s].tolist() if t >= 0))
        tokens = st["history"][s, :n].tolist()
        got = stopping.extend(tokens, int(st["prompt_lens"][s]), new, rule)
        st["history"][s, : len(tokens)] = torch.tensor(tokens)
        st["lengths"][s] = len(tokens)
        if got.finish_reason is not None:
            st["live"][s] = 0
        if d:
            st["counters"][s] += torch.tensor([1, len(d), min(k, got.added)])
        rec = [k, got.added, REASONS[got.finish_reason], len(tokens), len(d)] + new[: got.added]
        st["record"][s] = torch.tensor(rec + [-1] * (st["record"].shape[1] - len(rec)), dtype=torch.int32)
    return st


def _run(fn, rows, drafts, dlen, target, state, device=torch.device("cpu")):
    st = {k: v.clone().to(device) for k, v in state.items()}
    fn(rows.to(device), drafts.to(device), dlen.to(device), target.to(device), **st)
    return {k: v.cpu() for k, v in st.items()}


def _same(a: dict, b: dict) -> None:
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("seed", range(40))
def test_commit_ref_equals_the_python_rule(seed):
    case = _commit_case(seed)
    _same(_run(accept_commit_ref, *case), _python_commit(*case))


def test_commit_cases_reach_every_outcome():
    """The random cases cover what the rule decides: partial and full acceptance, stop and length cuts."""
    seen = set()
    for seed in range(40):
        rows, drafts, dlen, target, state = case = _commit_case(seed)
        out = _python_commit(*case)
        for r, s in enumerate(rows.tolist()):
            if state["live"][s]:
                k, _, finish = out["record"][s, :3].tolist()
                seen.add(("full" if k == dlen[r] else "partial", finish))
    assert {("partial", 0), ("full", 0), ("partial", FINISH_STOP), ("partial", FINISH_LENGTH)} <= seen


@needs_triton
@pytest.mark.parametrize("seed", range(12))
def test_commit_kernel_equals_its_reference(seed):
    from spin_kernels.commit import accept_commit

    case = _commit_case(seed, G=3 + seed % 3)
    _same(_run(accept_commit, *case, device=DEVICE), _run(accept_commit_ref, *case))


# -- n-gram lookup --------------------------------------------------------------------------


def _python_ngram(history, lengths, rows, gamma, width, lo, hi, drafter=None, min_prob=0.0):
    out_d, out_c, out_n = [], [], []
    for r, s in enumerate(rows):
        tokens = history[s, : lengths[s]].tolist()
        n, d = lookup_match(tokens, gamma[r], lo, hi)
        if drafter is not None:
            d = drafter.gated(n, d, min_prob)
        if gamma[r] == 0:
            d = []
        out_d.append(d + [0] * (width - len(d)))
        out_c.append(len(d))
        out_n.append(n)
    return torch.tensor(out_d, dtype=torch.int64).view(len(rows), width), torch.tensor(out_c), torch.tensor(out_n)


def _keep(drafter, width, min_prob):
    """[max_ngram + 1] the gate's draft length cap after a match of length n (width where n never matches)."""
    return torch.tensor([len(drafter.gated(n, [0] * width, min_prob)) if n in drafter.outcomes else width
                         for n in range(drafter.max_ngram + 1)])


def _ngram_case(seed, P=5, L=40, V=4):
    rng = random.Random(seed)
    history = torch.tensor([[rng.randrange(V) for _ in range(L)] for _ in range(P)])
    lengths = [rng.randint(1, L) for _ in range(P)]
    rows = [rng.randrange(P) for _ in range(rng.randint(1, 6))]
    width = rng.choice([0, 1, 4, 8])
    gamma = [rng.randint(0, width) for _ in rows]
    lo = rng.randint(1, 2)
    hi = rng.randint(lo, 4)
    return history, lengths, rows, gamma, width, lo, hi


def _drafter_with_rates(lo, hi, seed):
    d = NgramDrafter("ngram", lo, hi)
    rng = random.Random(seed)
    for n in d.outcomes:
        d.outcomes[n] = [rng.uniform(0, 10), rng.uniform(0.1, 5)]
    return d


def _device_args(history, lengths, rows, gamma):
    return torch.tensor(rows), history, torch.tensor(lengths), torch.tensor(gamma)


@pytest.mark.parametrize("seed", range(60))
def test_ngram_ref_equals_lookup(seed):
    history, lengths, rows, gamma, width, lo, hi = _ngram_case(seed)
    gated = seed % 2 == 1
    drafter = _drafter_with_rates(lo, hi, seed) if gated else NgramDrafter("ngram", lo, hi)
    min_prob = 0.3 if gated else 0.0
    want = _python_ngram(history, lengths, rows, gamma, width, lo, hi, drafter, min_prob)
    got = ngram_draft_ref(*_device_args(history, lengths, rows, gamma), _keep(drafter, width, min_prob), width, lo, hi)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.fixture(scope="module")
def real_histories(tiny_dir):
    """Token histories of real text: the test prompts through the tiny model's tokenizer."""
    from spin_batch.models.loader import load_tokenizer
    from test_spec_equality import PROMPTS

    tok = load_tokenizer(tiny_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    L = max(map(len, ids))
    history = torch.zeros(len(ids), L, dtype=torch.int64)
    for i, x in enumerate(ids):
        history[i, : len(x)] = torch.tensor(x)
    return history, [len(x) for x in ids]


def test_ngram_ref_equals_lookup_on_real_text(real_histories):
    history, full = real_histories
    drafter = NgramDrafter("ngram", 1, 3)
    keep = _keep(drafter, 8, 0.0)
    checked = found = 0
    for cut in range(1, max(full) + 1):  # every prefix of every prompt
        lengths = [min(cut, n) for n in full]
        rows = list(range(len(full)))
        want = _python_ngram(history, lengths, rows, [8] * len(rows), 8, 1, 3)
        got = ngram_draft_ref(*_device_args(history, lengths, rows, [8] * len(rows)), keep, 8, 1, 3)
        for w, g in zip(want, got):
            assert torch.equal(w, g)
        checked += len(rows)
        found += int((got[1] > 0).sum())
    assert found > checked // 4  # real text repeats: most prefixes find a match


@needs_triton
@pytest.mark.parametrize("seed", range(10))
def test_ngram_kernel_equals_its_reference(seed):
    from spin_kernels.ngram import ngram_draft

    history, lengths, rows, gamma, width, lo, hi = _ngram_case(seed, L=24)
    keep = _keep(_drafter_with_rates(lo, hi, seed), width, 0.3 if seed % 2 else 0.0)
    args = _device_args(history, lengths, rows, gamma)
    want = ngram_draft_ref(*args, keep, width, lo, hi)
    got = ngram_draft(*(a.to(DEVICE) for a in args), keep.to(DEVICE), width, lo, hi)
    for w, g in zip(want, got):
        assert torch.equal(w, g.cpu())


@needs_triton
def test_ngram_kernel_on_real_text(real_histories):
    from spin_kernels.ngram import ngram_draft

    history, full = real_histories
    keep = _keep(NgramDrafter("ngram", 1, 3), 4, 0.0)
    for cut in (2, 5, 9, max(full)):
        lengths = [min(cut, n) for n in full]
        args = _device_args(history, lengths, list(range(len(full))), [4] * len(full))
        want = _python_ngram(history, lengths, list(range(len(full))), [4] * len(full), 4, 1, 3)
        got = ngram_draft(*(a.to(DEVICE) for a in args), keep.to(DEVICE), 4, 1, 3)
        for w, g in zip(want, got):
            assert torch.equal(w, g.cpu())
