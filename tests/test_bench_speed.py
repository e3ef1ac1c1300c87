"""The speed-only bench (`spin-batch bench-speed`, bench_speed.py): random-weight targets at GPU shapes, the
shipped draft shapes, acceptance replayed from recorded traces on the device step (engine/replay.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from spin_batch import bench_speed as bs
from spin_batch.cli import main
from spin_batch.engine.device_step import host_reads
from spin_batch.engine.replay import Replay, replay_loop
from spin_batch.models.speed_shapes import SHAPES, SHIPPED_DRAFTS, DraftShape, random_draft, random_target, \
    target_bytes
from spin_batch.records import Request, RowParams

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_the_draft_shapes_are_the_shipped_drafts():
    shipped = {}
    for cfg in sorted((ROOT / "examples" / "drafts" / "smollm2-135m").glob("*/config.json")):
        a = json.loads(cfg.read_text())["spin_batch_draft"]["arch"]
        shipped[cfg.parent.name] = DraftShape(a["layers"], a["hidden"], a["heads"], a["kv_heads"], a["intermediate"],
                                              a["vocab"])
    assert shipped == SHIPPED_DRAFTS


def test_the_target_shapes_have_the_published_sizes():
    """Llama-3.1-8B: 8,030,261,248 parameters, Llama-3.2-1B: 1,235,814,400 (norms are not counted here)."""
    for shape, params in (("llama-3.1-8b", 8_030_261_248), ("llama-3.2-1b", 1_235_814_400)):
        s = SHAPES[shape]
        norms = (2 * s.num_layers + 1) * s.hidden_size
        assert target_bytes(s, torch.bfloat16) // 2 + norms == params


def test_the_recorded_traces_cover_every_drafter():
    traces = bs.load_traces()
    for d in bs.DRAFTERS:
        t = traces[bs.TRACE_OF[d]]
        assert len(t) >= 100 and 0 <= min(t) and max(t) <= bs.RECORDED_GAMMA
    assert sum(traces["d1x384-k4096"]) > 0


def _admit(loop, slots: int):
    for i in range(slots):  # a prompt that repeats: n-gram drafts from it
        loop.admit(Request(source="t", id=str(i), prompt="", messages=None, params=RowParams()),
                   [3 + i, 4, 5, 6] * 3)


@pytest.mark.parametrize("draft", ["d1x128-k1024", "eagle1", None])
def test_the_step_commits_the_replayed_lengths(draft):
    """Each step of a slot accepts the trace's next length from the slot's offset (capped by gamma), commits it plus
    one token, and queuing it reads nothing back. A random draft against a random target accepts ~nothing, so
    without the replay these lengths are not what the step commits."""
    target = random_target("tiny", torch.float32, CPU)
    model = None if draft is None else random_draft(draft, target)
    trace, gamma, slots = [3, 0, 4, 1, 2, 6], 4, 3
    loop = replay_loop(target, slots, 256, 12, gamma, "ngram" if model is None else model)
    loop.replay = Replay(trace, loop.P, target.spec.vocab_size, CPU)
    _admit(loop, slots)
    offsets = [(s * len(trace)) // loop.P for s in range(slots)]
    for step in range(8):
        before = [(len(s.tokens), s.accepted_tokens, s.draft_tokens) for s in loop.slots]
        with host_reads() as calls:
            loop.queue()
        assert sum(calls.values()) == 0
        loop.collect()
        for i, (s, (n, acc, drafted)) in enumerate(zip(loop.slots, before)):
            want = min(trace[(offsets[i] + step) % len(trace)], gamma, s.draft_tokens - drafted)
            assert s.accepted_tokens - acc == want, (draft, step, i)
            assert len(s.tokens) - n == want + 1
    if model is not None:
        assert all(s.draft_tokens == 8 * gamma for s in loop.slots)
    assert sum(s.accepted_tokens for s in loop.slots) >= 8


def test_bench_speed_tiny_end_to_end(tmp_path):
    out = tmp_path / "speed"
    res = CliRunner().invoke(main, ["bench-speed", "--shape", "tiny", "--slots", "1,2", "--device", "cpu",
                                    "--steps", "3", "--accept", "0,2,4", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "speed-tiny.json").read_text())
    rows = data["rows"]
    assert data["label"] == bs.LABEL and all(r["label"] == bs.LABEL for r in rows)
    assert {(r["slots"], r["drafter"]) for r in rows} == {(s, d) for s in (1, 2)
                                                        for d in ("autoregressive", *bs.DRAFTERS)}
    for r in rows:
        assert r["tok_s"] > 0 and r["speedup"] > 0
        if r["acceptance_source"] == "fixed:4" and r["drafter"] != "ngram":  # a model draft drafts all gamma
            assert r["acceptance"] == 4.0
        if r["acceptance_source"] == "fixed:0":
            assert r["acceptance"] == 0.0
    replayed = [r for r in rows if r["acceptance_source"] == "trace:d1x384-k4096" and r["drafter"] == "eagle1"]
    assert replayed and all(r["acceptance"] > 0 for r in replayed)
    lines = [x for x in res.output.splitlines() if "tok/s" in x and not x.startswith("|")]
    assert lines and all(bs.LABEL in x for x in lines)
    md = (out / "speed-tiny.md").read_text()
    assert md.count(bs.LABEL) == 2 and "Speedup against acceptance length" in md and "break-even" in md


def test_a_shape_too_big_for_memory_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(bs, "available_bytes", lambda device: 4 << 30)
    monkeypatch.setattr(bs, "random_target", lambda *a, **k: pytest.fail("built a target"))
    res = CliRunner().invoke(main, ["bench-speed", "--shape", "llama-3.1-8b", "--device", "cpu", "--dtype",
                                    "bfloat16", "--out", str(tmp_path / "o")])
    assert res.exit_code == 1
    assert "--shape llama-3.1-8b in bfloat16 needs about" in res.output and "4.0 GiB free" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("args, words", [
    (["--shape", "llama-9"], "--shape 'llama-9'"),
    (["--gamma", "9"], "--gamma must be 1..8"),
    (["--accept", "0,5", "--gamma", "4"], "--accept"),
    (["--drafters", "ngram,medusa"], "no drafter medusa"),
    (["--slots", "1,x"], "comma-separated"),
    (["--dtype", "int4"], "--dtype 'int4'"),
])
def test_bad_options_are_clear_errors(args, words, tmp_path):
    res = CliRunner().invoke(main, ["bench-speed", "--device", "cpu", *args, "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and words in res.output and "Traceback" not in res.output


def test_break_even_interpolates_between_the_sweeps_points():
    def row(slots, drafter, k, acc, speedup):
        return {"slots": slots, "drafter": drafter, "acceptance_source": f"fixed:{k}", "acceptance": acc,
                "speedup": speedup}

    rows = [row(1, "a", 0, 0.0, 0.8), row(1, "a", 2, 2.0, 1.2), row(1, "a", 4, 4.0, 1.9),
            row(16, "a", 0, 0.0, 0.5), row(16, "a", 4, 4.0, 0.9), row(1, "b", 0, 0.0, 1.05)]
    assert bs.break_even(rows) == {(1, "a"): 1.0, (16, "a"): None, (1, "b"): 0.0}


def test_the_gpu_script_runs_the_speed_bench(tmp_path):
    """scripts/gpu_bench.sh calls scripts/gpu_bench_speed.sh; its CPU dry run writes the tiny shape's results."""
    assert "scripts/gpu_bench_speed.sh" in (ROOT / "scripts" / "gpu_bench.sh").read_text()
    env = {**os.environ, "GPU_BENCH_DRY": "1", "OUT": str(tmp_path), "PYTHON": str(Path(os.sys.executable))}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench_speed.sh")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((tmp_path / "speed-tiny.json").read_text())
    assert data["label"] == bs.LABEL and data["rows"]
    assert "speed-tiny: rc=0" in (tmp_path / "status.txt").read_text()
