"""n samples per prompt, and the prefix cache through a job's runs.

- the loop: n samples per row, the prompt prefilled once (the counters), each sample its own stream;
  the samples' first tokens follow the target's distribution (and a wrong temperature is caught);
- a job: one Parquet row per sample with `index`, OpenAI results with n choices per line, a stopped run
  resumed (a row's samples are written together, so a resume redoes a row whole or not at all), and
  greedy text with the prefix cache equal to text without it through a resume and --retry-errors.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from spin_batch.config import load_job
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.engine.prefix_cache import PrefixCache
from spin_batch.models import execution
from spin_batch.models.loader import load_model, load_tokenizer
from spin_batch.models.segments import Segments
from spin_batch.records import Completion, Request, RowParams
from spin_batch.runner import StopFlag, run_job
from spin_batch.sampling import SamplingParams
from spin_batch.selection.fixed import NoSpeculation

from conftest import build_tiny_model, write_jsonl
from conftest import make_job
from test_cli_e2e import _isolate_process_state, read_rows, run_ok  # noqa: F401

PROMPT = "once upon a time there was"
SIGMAS = 5.0  # per-token bound, as in test_verify.py: |freq - p| < 5 sqrt(p (1 - p) / N)


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny model with larger weights: its next-token distribution is peaked enough to test against."""
    d = build_tiny_model(tmp_path_factory.mktemp("peaked"), init_std=0.5)
    return load_model(d, plan=execution.forced("c")), load_tokenizer(d)


def loop_of(target, slots: int, n: int, temperature: float, max_tokens: int, prefix=None) -> BatchLoop:
    model, tok = target
    settings = LoopSettings(slots=slots, max_model_len=64, max_num_batched_tokens=64, max_tokens=max_tokens,
                            sampling=SamplingParams(temperature), ignore_eos=True, n=n)
    return BatchLoop(model, tok, settings, NoSpeculation(), prefix_cache=prefix)


def run(loop: BatchLoop, reqs: list[Request]) -> list[Completion]:
    done: list[Completion] = []
    loop.run(iter(reqs), lambda r: loop.tok.encode(r.prompt), done.append)
    return done


def rows(n: int, prompt: str = PROMPT) -> list[Request]:
    return [Request(f"mem#{i}", f"r{i}", prompt, None) for i in range(n)]


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_n_samples_prefill_the_prompt_once(peaked, slots):
    loop = loop_of(peaked, slots, 4, 0.8, 5)
    done = run(loop, rows(6) + [Request("mem#6", "own", PROMPT, None, params=RowParams(n=2))])
    L = len(peaked[1].encode(PROMPT))
    assert len(done) == 7  # one completion per request, carrying its samples
    for c in done:
        samples = (c, *c.more)
        assert [s.index for s in samples] == list(range(2 if c.request.id == "own" else 4))
        assert all(s.completion_tokens == 5 and s.request is c.request for s in samples)
        assert len({s.token_ids for s in samples}) > 1  # each its own stream
    totals = loop.stats.totals
    # each prompt prefilled once; a sample after the first feeds only the last prompt token (its logits)
    assert totals["prefill_tokens"] == 7 * L + 6 * 3 + 1
    assert totals["reused_tokens"] == (6 * 3 + 1) * (L - 1)
    assert totals["rows_ok"] == 7 and totals["generated_tokens"] == (6 * 4 + 2) * 5


def test_sample_streams_do_not_depend_on_slots_or_the_cache(peaked):
    """Sample i's stream is derived from the row's seed and i: the same text at any batch size, and with
    the samples forked from each other or from cached blocks."""
    want = {c.request.id: [s.token_ids for s in (c, *c.more)] for c in run(loop_of(peaked, 1, 3, 0.8, 4), rows(4))}
    for slots, prefix in ((2, None), (5, PrefixCache(1 << 20))):
        got = run(loop_of(peaked, slots, 3, 0.8, 4, prefix), rows(4))
        assert {c.request.id: [s.token_ids for s in (c, *c.more)] for c in got} == want
    one = run(loop_of(peaked, 2, 1, 0.8, 4), rows(4))  # n 1: sample 0's stream, as before samples existed
    assert {c.request.id: c.token_ids for c in one} == {k: v[0] for k, v in want.items()}


def _z(counts: Counter, p: torch.Tensor, n: int) -> float:
    """The largest |freq - p| / sigma over the tokens expected at least 10 times, and the rest as one bin (the
    normal approximation holds there: rare tokens alone would give heavy-tailed counts)."""
    freq = torch.zeros_like(p)
    for tok, k in counts.items():
        freq[tok] = k / n
    common = p * n >= 10
    bins_p = torch.cat((p[common], p[~common].sum()[None]))
    bins_f = torch.cat((freq[common], freq[~common].sum()[None]))
    return ((bins_f - bins_p).abs() / torch.sqrt(bins_p * (1 - bins_p) / n)).max().item()


def test_first_tokens_of_n_samples_follow_the_target(peaked):
    """n: 4 at T = 0.8 over 600 rows: every sample's first token, pooled and per sample index, has the
    target's tempered distribution; two samples of one row collide as often as independent draws do; and
    the same counts are far off the distribution at T = 1 (the test can tell)."""
    model, tok = peaked
    ids = tok.encode(PROMPT)
    cache = model.allocate_cache(1, 64)
    logits = model.forward(torch.tensor(ids), Segments.build([(0, len(ids), 0)], model.device), cache,
                           [len(ids) - 1])[0]
    p = (logits / 0.8).softmax(-1)
    rows_n = 600
    done = run(loop_of(peaked, 16, 4, 0.8, 1), rows(rows_n))
    firsts = [[s.token_ids[0] for s in (c, *c.more)] for c in done]
    assert len(firsts) == rows_n and all(len(f) == 4 for f in firsts)
    pooled = Counter(t for f in firsts for t in f)
    assert (z := _z(pooled, p, 4 * rows_n)) < SIGMAS, f"off by {z:.1f} sigma"
    for i in range(4):
        assert (z := _z(Counter(f[i] for f in firsts), p, rows_n)) < SIGMAS, f"sample {i} off by {z:.1f} sigma"
    collide = sum(f[0] == f[1] for f in firsts) / rows_n
    expect = (p ** 2).sum().item()
    assert abs(collide - expect) < SIGMAS * (expect * (1 - expect) / rows_n) ** 0.5, (collide, expect)
    assert _z(pooled, (logits / 1.0).softmax(-1), 4 * rows_n) > SIGMAS


# -- a job -------------------------------------------------------------------------------------

INSTRUCTION = ("label the sentence below as one of: weather, food, sport, music. answer with the label, "
               "then one short reason. the quick brown fox jumps over the lazy dog. ")
TEXTS = ["it rained all day", "the soup was cold", "a goal in the last minute", "the band played late",
         "snow on the hills", "fresh bread and jam", "the match was a draw", "a slow song on the radio"]


class StopAfter(StopFlag):
    """Stops the run once `emitted` returns at least `rows` (the loop finishes its step and returns)."""

    def __init__(self, emitted, rows: int):
        super().__init__()
        self.emitted, self.rows = emitted, rows

    def __call__(self) -> bool:
        if self.signum is None and self.emitted() >= self.rows:
            self.signum = 15  # as a SIGTERM would (the run is not finished)
        return self.signum is not None


def test_a_job_writes_a_row_per_sample_and_resumes_whole_rows(tmp_path, tiny_dir):
    src = write_jsonl(tmp_path / "in" / "rows.jsonl",
                      [{"id": f"r{i}", "prompt": INSTRUCTION + t} for i, t in enumerate(TEXTS)]
                      + [{"id": "two", "prompt": "once upon a time", "params": {"n": 2}},
                         {"id": "bad", "prompt": "x", "params": {"n": 0}}])
    sections = dict(sampling={"temperature": 0.8, "max_tokens": 4, "n": 3}, input={"chat_template": False,
                    "params_column": "params"}, batch={"slots": 4, "max_model_len": 128},
                    output={"format": "both", "rows_per_part": 1})
    whole_job, whole = make_job(tmp_path, tiny_dir, [src], name="whole", **sections)
    run_ok(whole_job)
    want = read_rows(whole)
    assert Counter(r["id"] for r in want) == {**{f"r{i}": 3 for i in range(len(TEXTS))}, "two": 2, "bad": 1}
    assert sorted(r["index"] for r in want if r["id"] == "r0") == [0, 1, 2]
    import json

    lines = [json.loads(x) for x in (whole / "results.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"r{i}" for i in range(len(TEXTS))] + ["two", "bad"]
    body = lines[0]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    r0 = sorted((r for r in want if r["id"] == "r0"), key=lambda r: r["index"])
    assert [c["text"] for c in body["choices"]] == [r["text"] for r in r0]
    assert body["usage"]["completion_tokens"] == sum(r["completion_tokens"] for r in r0)
    assert body["usage"]["prompt_tokens"] == r0[0]["prompt_tokens"]
    assert lines[-1]["error"]["message"].startswith("params.n must be an integer in 1..128")
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["prompt_tokens_reused"] > summary["prompt_tokens_prefilled"]  # samples and the instruction

    # the same job stopped part way, then resumed: every row's samples, each once, the same texts
    job_path, out = make_job(tmp_path, tiny_dir, [src], name="stopped", **sections)
    job = load_job(job_path)
    first = run_job(job, progress=False, stop=StopAfter(lambda: _emitted(out), 3))
    assert not first.summary["finished"]
    partial = read_rows(out)
    assert 0 < len({r["id"] for r in partial}) < len(TEXTS) + 2
    counts = Counter(r["id"] for r in partial)
    assert all(counts[i] == (3 if i.startswith("r") else 2 if i == "two" else 1) for i in counts)  # whole rows
    run_job(job, progress=False)
    got = read_rows(out)
    key = lambda r: (r["id"], r["index"])  # noqa: E731
    assert sorted((key(r), r["text"]) for r in got) == sorted((key(r), r["text"]) for r in want)


def _emitted(out: Path) -> int:
    """Rows in the output parts so far (a job with a small rows_per_part writes them as they come)."""
    return len(read_rows(out)) if (out / "outputs").exists() else 0


def test_prefix_cache_greedy_text_through_resume_and_retry_errors(tmp_path, tiny_dir):
    long = INSTRUCTION + "and then it rained again on the hills for a long time"
    rows_in = [{"id": f"r{i}", "prompt": INSTRUCTION + t} for i, t in enumerate(TEXTS)]
    rows_in += [{"id": f"long{i}", "prompt": f"{long} {i}"} for i in range(3)]
    src = write_jsonl(tmp_path / "in" / "rows.jsonl", rows_in)
    common = dict(input={"chat_template": False}, sampling={"max_tokens": 6}, output={"rows_per_part": 2})
    off_job, off = make_job(tmp_path, tiny_dir, [src], name="off", batch={"prefix_cache": "off", "max_model_len": 256},
                            **common)
    run_ok(off_job)
    want = {r["id"]: r["text"] for r in read_rows(off)}

    on_job, on = make_job(tmp_path, tiny_dir, [src], name="on",
                          batch={"prefix_cache": "on", "slots": 4, "max_model_len": 256}, **common)
    n_long = min(len(load_tokenizer(tiny_dir).encode(f"{long} {i}")) for i in range(3))  # each of them errs
    # the long rows do not fit at first (error rows); then a stopped run, a resume, and --retry-errors
    job = load_job(on_job, [f"batch.max_model_len={n_long}"])
    first = run_job(job, progress=False, stop=StopAfter(lambda: _emitted(on), 4))
    assert not first.summary["finished"]
    run_job(job, progress=False)
    mid = {r["id"]: r for r in read_rows(on)}
    assert {i for i, r in mid.items() if r["status"] == "error"} == {"long0", "long1", "long2"}
    run_ok(on_job, "--retry-errors")
    after = read_rows(on)
    assert len(after) == len(rows_in)  # the error rows the retry replaced are gone
    assert {r["id"]: r["text"] for r in after} == want
    import json

    summary = json.loads((on / "summary.json").read_text())
    assert summary["prefix_cache"]["enabled"] and summary["prompt_tokens_reused"] > 0
