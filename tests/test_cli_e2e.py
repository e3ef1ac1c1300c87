"""End-to-end tests of the `spin-batch` command line on tiny random models.

In-process runs go through click's CliRunner; kill -9 and SIGTERM use a real
`spin-batch` process. Outputs are read back with pyarrow directly (not with the
product's own reader) so the files on disk are what is checked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from spin_batch.cli import main

from conftest import CORPUS, build_tiny_model, make_job, write_jsonl

DESIGN_COLUMNS = [
    "id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "status", "error",
    "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "mean_acceptance_length",
    "drafter_pulls",
]

PROMPTS = [
    "the quick brown fox",
    "list three colours",
    "def add(a, b):",
    "once upon a time there was",
    "what causes the tides?",
    "compute 12 * 7",
    "rewrite this sentence",
    "the moon pulls on the oceans",
]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _isolate_process_state(monkeypatch):
    """`spin-batch run` installs SIGTERM/SIGINT handlers; restore pytest's afterwards.

    Also drop any SLURM array variables of the surrounding environment, which
    would otherwise pick a shard for every run. Torch runs single-threaded (restored after).
    """
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    # One intra-op thread: these models are tiny, and on a busy 2-core machine OpenMP threads
    # fighting over the cores make every matmul an order of magnitude slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    for s, handler in saved.items():
        signal.signal(s, handler)


def prompt_rows(n: int, prefix: str = "r") -> list[dict]:
    return [{"id": f"{prefix}{i:03d}", "prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}"} for i in range(n)]


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def _describe(result) -> str:
    exc = ""
    if result.exc_info is not None and not isinstance(result.exception, SystemExit):
        exc = "".join(traceback.format_exception(*result.exc_info))
    return f"exit {result.exit_code}\n--- output ---\n{result.output}\n{exc}"


def run_ok(job: Path, *args: str, env: dict | None = None):
    result = invoke("run", job, "--no-progress", *args, env=env)
    assert result.exit_code == 0, _describe(result)
    return result


def part_files(out: Path) -> list[Path]:
    return sorted((out / "outputs").glob("part-*.parquet"))


def read_rows(out: Path) -> list[dict]:
    parts = part_files(out)
    if not parts:
        return []
    return pa.concat_tables([pq.read_table(p) for p in parts]).to_pylist()


def by_id(rows: list[dict]) -> dict[str, dict]:
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), f"duplicate ids in outputs: {sorted(i for i in ids if ids.count(i) > 1)}"
    return {r["id"]: r for r in rows}


def assert_each_id_once(out: Path, expected_ids) -> dict[str, dict]:
    rows = read_rows(out)
    ids = sorted(r["id"] for r in rows)
    assert ids == sorted(expected_ids), (
        f"missing={sorted(set(expected_ids) - set(ids))} "
        f"duplicated={sorted({i for i in ids if ids.count(i) > 1})} extra={sorted(set(ids) - set(expected_ids))}"
    )
    return {r["id"]: r for r in rows}


def temp_files(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def read_summary(out: Path, name: str = "summary.json") -> dict:
    return json.loads((out / name).read_text())


def cli_command() -> list[str]:
    exe = Path(sys.executable).with_name("spin-batch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "spin_batch.cli"]


def start_run(job: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """Start `spin-batch run` in a real process; stdout/stderr go to files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # see _isolate_process_state
    stdout, stderr = tmp_path / "proc.stdout", tmp_path / "proc.stderr"
    with open(stdout, "wb") as o, open(stderr, "wb") as e:
        proc = subprocess.Popen([*cli_command(), "run", str(job), "--no-progress"], stdout=o, stderr=e, env=env)
    return proc, stdout, stderr


def wait_for_parts(proc: subprocess.Popen, out: Path, n: int, stderr: Path, timeout: float = 60.0) -> None:
    """Poll until at least n output parts exist; fail if the process ends or it takes too long."""
    deadline = time.monotonic() + timeout
    while len(part_files(out)) < n:
        if proc.poll() is not None:
            pytest.fail(f"spin-batch ended (rc {proc.returncode}) before {n} parts existed:\n{stderr.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no output parts after {timeout}s:\n{stderr.read_text()}")
        time.sleep(0.005)


# --------------------------------------------------------------------------
# 1. a plain run
# --------------------------------------------------------------------------


def test_run_writes_outputs_summary_and_stats(tmp_path, tiny_dir):
    rows = prompt_rows(12)
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    job, out = make_job(
        tmp_path, tiny_dir, [src],
        drafters=[{"name": "ngram", "kind": "ngram", "min_ngram": 1, "max_ngram": 3}],
        spin={"selector": "fixed:ngram", "num_speculative_tokens": 3},
    )
    result = run_ok(job)
    assert "12 ok, 0 error rows" in result.stderr

    parts = part_files(out)
    assert parts, "no outputs/part-*.parquet written"
    names = set(pq.read_schema(parts[0]).names)
    assert set(DESIGN_COLUMNS) <= names, f"missing columns: {set(DESIGN_COLUMNS) - names}"

    got = assert_each_id_once(out, [r["id"] for r in rows])
    for r in got.values():
        assert r["status"] == "ok" and r["error"] is None, r
        assert isinstance(r["text"], str)
        assert r["finish_reason"] in ("stop", "length")
        assert r["prompt_tokens"] > 0
        assert 1 <= r["completion_tokens"] <= 12
        assert 0 <= r["num_accepted_draft_tokens"] <= r["num_draft_tokens"]
        if r["num_spec_steps"]:
            expected = (r["num_accepted_draft_tokens"] + r["num_spec_steps"]) / r["num_spec_steps"]
            assert r["mean_acceptance_length"] == pytest.approx(expected)
        else:
            assert r["mean_acceptance_length"] is None
        assert set(dict(r["drafter_pulls"])) <= {"ngram", "none"}
        assert r["source"].endswith(f"#{int(r['id'][1:])}")

    summary = read_summary(out)
    assert summary["generated_tokens"] > 0
    assert summary["generated_tokens"] == sum(r["completion_tokens"] for r in got.values())
    assert summary["rows_ok"] == 12 and summary["rows_error"] == 0
    assert summary["finished"] is True
    assert list((out / "stats").glob("*.parquet")), "no stats parts written"
    assert pq.read_table(next((out / "stats").glob("*.parquet"))).num_rows >= 1
    assert not temp_files(out)


@pytest.mark.parametrize("with_drafter", [False, True], ids=["no-drafter", "ngram"])
def test_row_drafter_pulls_count_every_decode_step(tmp_path, tiny_dir, with_drafter):
    rows = prompt_rows(6)
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    extra = dict(drafters=[{"name": "ngram", "kind": "ngram"}], spin={"selector": "fixed:ngram"}) if with_drafter else {}
    job, out = make_job(tmp_path, tiny_dir, [src], sampling={"max_tokens": 10, "ignore_eos": True}, **extra)
    run_ok(job)
    got = assert_each_id_once(out, [r["id"] for r in rows])
    name = "ngram" if with_drafter else "none"
    # The first token comes from the prefill step; every later step is one pull (of the chosen
    # drafter, or "none" when there is no room to draft) and commits its accepted drafts plus one
    # target token.
    for r in got.values():
        steps = r["completion_tokens"] - 1 - r["num_accepted_draft_tokens"]
        pulls = dict(r["drafter_pulls"])
        assert set(pulls) <= {name, "none"}, r
        assert sum(pulls.values()) == steps, (pulls, steps, r)
    summary_pulls = {k: v["pulls"] for k, v in read_summary(out)["drafters"].items()}
    row_pulls = {k: sum(dict(r["drafter_pulls"]).get(k, 0) for r in got.values()) for k in summary_pulls}
    assert row_pulls == summary_pulls


# --------------------------------------------------------------------------
# 2. bad rows become error rows
# --------------------------------------------------------------------------


def test_bad_rows_become_error_rows(tmp_path, tiny_dir):
    # over max_model_len in tokens, but short enough to be tokenized (longer ones are turned away unread)
    long_prompt = "the quick brown fox jumps over the lazy dog " * 12
    lines: list[bytes] = [
        b"\xef\xbb\xbf" + json.dumps({"id": "g0", "prompt": "the quick brown fox"}).encode(),  # 0 BOM, ok
        json.dumps({"prompt": "no id here"}).encode(),                 # 1 missing id
        json.dumps({"id": None, "prompt": "null id"}).encode(),        # 2 null id
        json.dumps({"id": "b3"}).encode(),                             # 3 missing prompt
        json.dumps({"id": "b4", "prompt": 42}).encode(),               # 4 non-string prompt
        json.dumps({"id": "b5", "prompt": ""}).encode(),               # 5 empty prompt
        b'{"id": "b6", "prompt": "unterminated',                       # 6 not JSON
        b'{"id": "b7", "prompt": "caf\xff\xfe"}',                      # 7 invalid UTF-8
        b"   ",                                                        # 8 blank: no row
        json.dumps({"id": "g0", "prompt": "same id again"}).encode(),  # 9 duplicate id
        json.dumps({"id": "b10", "prompt": long_prompt}).encode(),     # 10 longer than max_model_len
        json.dumps({"id": "g1", "prompt": "list three colours"}).encode(),  # 11 ok
        b"[1, 2, 3]",                                                  # 12 not an object
        json.dumps({"id": True, "prompt": "bool id"}).encode(),        # 13 bad id type
        json.dumps({"id": 7, "prompt": "integer id"}).encode(),        # 14 ok, id "7"
    ]
    src = tmp_path / "in" / "mixed.jsonl"
    src.parent.mkdir()
    src.write_bytes(b"\n".join(lines) + b"\n\n")
    pq_src = tmp_path / "in" / "nulls.parquet"
    pq.write_table(pa.table({"id": ["p0", "p1", "p2"], "prompt": ["hello world", None, "the lazy dog"]}), pq_src)

    job, out = make_job(tmp_path, tiny_dir, [src, pq_src],
                        batch={"max_model_len": 64}, sampling={"max_tokens": 8})
    result = run_ok(job)

    rows = read_rows(out)
    non_blank = sum(1 for line in lines if line.strip())
    assert len(rows) == non_blank + 3
    by_source = {}
    for r in rows:
        assert r["source"] not in by_source, f"two rows for {r['source']}"
        by_source[r["source"]] = r
    jl = lambda i: f"{src.resolve()}#{i}"  # noqa: E731

    expected_errors = {
        jl(1): (None, "missing id"),
        jl(2): (None, "missing id"),
        jl(3): ("b3", "missing prompt"),
        jl(4): ("b4", "prompt must be a string, got int"),
        jl(5): ("b5", "empty prompt"),
        jl(6): (None, "invalid JSON"),
        jl(7): (None, "invalid UTF-8"),
        jl(9): ("g0", "duplicate id 'g0'"),
        jl(10): ("b10", "max_model_len 64"),
        jl(12): (None, "must be a JSON object"),
        jl(13): (None, "id must be a string or integer"),
        f"{pq_src.resolve()}#1": ("p1", "missing prompt"),
    }
    for source, (row_id, message) in expected_errors.items():
        r = by_source[source]
        assert r["status"] == "error", r
        assert r["id"] == row_id, r
        assert message in r["error"], (message, r["error"])
        assert r["finish_reason"] == "error" and r["text"] is None and r["completion_tokens"] == 0
    assert by_source[jl(10)]["prompt_tokens"] > 64  # the error row says how long the prompt was

    ok_sources = {jl(0): "g0", jl(11): "g1", jl(14): "7",
                  f"{pq_src.resolve()}#0": "p0", f"{pq_src.resolve()}#2": "p2"}
    assert set(by_source) == set(expected_errors) | set(ok_sources)
    for source, row_id in ok_sources.items():
        r = by_source[source]
        assert r["status"] == "ok" and r["error"] is None and r["id"] == row_id, r
        assert r["completion_tokens"] >= 1

    summary = read_summary(out)
    assert (summary["rows_ok"], summary["rows_error"]) == (len(ok_sources), len(expected_errors))
    assert f"{len(ok_sources)} ok, {len(expected_errors)} error rows" in result.stderr


# --------------------------------------------------------------------------
# 3. resume after kill -9
# --------------------------------------------------------------------------

# Long enough (about 1-2 s of decoding on 2 cores) that the process is reliably killed mid-run.
RESUME_ROWS = 100
RESUME_SECTIONS = dict(
    output={"rows_per_part": 1},
    batch={"slots": 2, "max_model_len": 128, "max_num_batched_tokens": 64},
    sampling={"max_tokens": 40, "ignore_eos": True},
)


@pytest.mark.slow
def test_resume_after_kill_9_loses_and_duplicates_nothing(tmp_path, tiny_dir):
    rows = prompt_rows(RESUME_ROWS)
    ids = [r["id"] for r in rows]
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], name="killed", **RESUME_SECTIONS)

    proc, _, stderr = start_run(job, tmp_path)
    try:
        wait_for_parts(proc, out, 2, stderr)
        # cron firing again while the first run goes on: the second run stops at the lock, writes nothing
        second = invoke("run", job, "--no-progress")
        assert proc.poll() is None, "the run finished before a second one could be started beside it"
        assert second.exit_code == 75, _describe(second)
        assert "another run of this job (worker w0000) is still going: pid" in second.output
        assert "rows_ok" not in second.output and not (out / "summary.json").exists()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    partial = read_rows(out)
    assert 1 <= len(partial) < RESUME_ROWS, "kill -9 did not interrupt the run"
    assert not (out / "summary.json").exists()

    run_ok(job)  # the killed run's lock went with its process
    resumed = assert_each_id_once(out, ids)
    assert not temp_files(out)
    summary = read_summary(out)
    assert summary["finished"] is True
    assert summary["rows_skipped_as_done"] == len(partial)
    assert summary["rows_ok"] == RESUME_ROWS - len(partial)

    # the report counts both runs, and the tokens and time of both (summary.json holds the last run only)
    report = invoke("report", out)
    assert report.exit_code == 0, _describe(report)
    assert "runs: 2 (finished)" in report.output, report.output
    decode = float(report.output.split("decode time ")[1].split("s")[0])
    stats = pa.concat_tables([pq.read_table(p) for p in sorted((out / "stats").glob("*.parquet"))])
    assert decode == pytest.approx(sum(stats.column("interval_s").to_pylist()), abs=0.06)

    ref_job, ref_out = make_job(tmp_path, tiny_dir, [src], name="reference", **RESUME_SECTIONS)
    run_ok(ref_job)
    reference = assert_each_id_once(ref_out, ids)
    for i in ids:
        assert resumed[i]["status"] == "ok"
        assert (resumed[i]["text"], resumed[i]["completion_tokens"]) == (
            reference[i]["text"], reference[i]["completion_tokens"]), i


def test_run_lock_is_per_worker_released_on_close_and_skipped_where_locks_fail(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    from spin_batch.runner import RunLock, RunLocked

    first = RunLock(tmp_path, "w0000")
    other = RunLock(tmp_path, "w0001")  # another worker of the same job: its own lock
    with pytest.raises(RunLocked, match=r"worker w0000\) is still going: pid %d on " % os.getpid()):
        RunLock(tmp_path, "w0000")
    first.release()
    RunLock(tmp_path, "w0000").release()
    other.release()

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    RunLock(tmp_path, "w0000").release()
    assert "cannot lock" in capsys.readouterr().err


# --------------------------------------------------------------------------
# 4. SIGTERM: graceful stop, then resume
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_rerun_completes(tmp_path, tiny_dir):
    rows = prompt_rows(RESUME_ROWS)
    ids = [r["id"] for r in rows]
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], **RESUME_SECTIONS)

    proc, _, stderr = start_run(job, tmp_path)
    try:
        wait_for_parts(proc, out, 1, stderr)
        assert proc.poll() is None, "the run finished before SIGTERM could be sent"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = stderr.read_text()
    assert rc == 128 + signal.SIGTERM, err
    assert "SIGTERM" in err and "resume" in err.lower(), err
    assert not temp_files(out), temp_files(out)

    partial = by_id(read_rows(out))
    assert 1 <= len(partial) < RESUME_ROWS
    assert all(r["status"] == "ok" for r in partial.values())
    stopped = read_summary(out)
    assert stopped["finished"] is False
    assert stopped["rows_ok"] == len(partial)

    run_ok(job)
    assert_each_id_once(out, ids)
    assert read_summary(out)["finished"] is True
    assert not temp_files(out)


# --------------------------------------------------------------------------
# 5. rerunning a finished job
# --------------------------------------------------------------------------


def test_rerun_of_finished_job_does_nothing(tmp_path, tiny_dir):
    rows = prompt_rows(10) + [{"id": "bad", "prompt": ""}]
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src])
    run_ok(job)
    parts_before = part_files(out)
    first = assert_each_id_once(out, [r["id"] for r in rows])

    result = run_ok(job)
    assert "0 ok, 0 error rows" in result.stderr
    assert part_files(out) == parts_before, "a rerun of a finished job wrote new output parts"
    assert assert_each_id_once(out, [r["id"] for r in rows]) == first
    summary = read_summary(out)
    assert summary["rows_skipped_as_done"] == len(rows)
    assert (summary["rows_ok"], summary["rows_error"], summary["generated_tokens"]) == (0, 0, 0)
    assert summary["finished"] is True


def test_resume_does_not_turn_original_into_duplicate(tmp_path, tiny_dir):
    """A duplicate-id error row written before the first row with that id must not, on resume,
    make the first row a duplicate too (its id is only 'seen' through rows that were ok)."""
    from spin_batch.io.schema import error_row
    from spin_batch.io.writer import OutputWriter

    rows = [{"id": "a", "prompt": "the quick brown fox"}, {"id": "a", "prompt": "again"},
            {"id": "b", "prompt": "list three colours"}]
    src = write_jsonl(tmp_path / "in" / "dups.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src])
    # What an interrupted run leaves behind: the duplicate's error row (emitted at admission)
    # was flushed while row 0 was still being decoded.
    with OutputWriter(out, worker="w0000") as w:
        w.add(error_row(f"{src.resolve()}#1", "a", "duplicate id 'a'"))
    run_ok(job)
    got = {r["source"].rsplit("#", 1)[1]: r for r in read_rows(out)}
    assert sorted(got) == ["0", "1", "2"]
    assert got["0"]["status"] == "ok", got["0"]
    assert got["1"]["status"] == "error"
    assert got["2"]["status"] == "ok"


# --------------------------------------------------------------------------
# 6. sharding across workers
# --------------------------------------------------------------------------


def _three_shards(tmp_path: Path) -> tuple[list[Path], list[list[str]]]:
    paths, ids = [], []
    for f in range(3):
        rows = prompt_rows(4, prefix=f"s{f}-")
        paths.append(write_jsonl(tmp_path / "in" / f"shard-{f}.jsonl", rows))
        ids.append([r["id"] for r in rows])
    return paths, ids


def test_shard_flags_split_work_between_workers(tmp_path, tiny_dir):
    paths, ids = _three_shards(tmp_path)
    job, out = make_job(tmp_path, tiny_dir, [str(tmp_path / "in" / "shard-*.jsonl")])

    run_ok(job, "--shard-index", "1", "--num-shards", "2")
    assert sorted(r["id"] for r in read_rows(out)) == sorted(ids[1])
    run_ok(job, "--shard-index", "0", "--num-shards", "2")
    got = assert_each_id_once(out, ids[0] + ids[1] + ids[2])

    workers = {p.name.split("-")[1] for p in part_files(out)}
    assert workers == {"w0000", "w0001"}
    for i, worker in ((0, "w0000"), (1, "w0001")):
        s = read_summary(out, f"summary-{worker}.json")
        assert (s["shard_index"], s["num_shards"]) == (i, 2)
    assert not (out / "summary.json").exists()
    assert all(r["status"] == "ok" for r in got.values())


def test_slurm_array_env_picks_the_shard(tmp_path, tiny_dir):
    paths, ids = _three_shards(tmp_path)
    job, out = make_job(tmp_path, tiny_dir, [str(tmp_path / "in")])

    run_ok(job, env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"})
    assert sorted(r["id"] for r in read_rows(out)) == sorted(ids[1])
    s = read_summary(out, "summary-w0001.json")
    assert (s["shard_index"], s["num_shards"]) == (1, 2)

    run_ok(job, env={"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"})
    assert_each_id_once(out, ids[0] + ids[1] + ids[2])

    # Explicit flags win over the environment: worker 1 of 2 again, so nothing new is done.
    result = run_ok(job, "--shard-index", "1", "--num-shards", "2",
                    env={"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"})
    assert "0 ok, 0 error rows" in result.stderr
    assert_each_id_once(out, ids[0] + ids[1] + ids[2])


def test_sharded_summary_counts_only_this_workers_skipped_rows(tmp_path, tiny_dir):
    _three_shards(tmp_path)
    job, out = make_job(tmp_path, tiny_dir, [str(tmp_path / "in")], sampling={"max_tokens": 2})
    run_ok(job, "--shard-index", "1", "--num-shards", "2")
    run_ok(job, "--shard-index", "0", "--num-shards", "2")
    summary = read_summary(out, "summary-w0000.json")
    assert summary["rows_ok"] == 8
    assert summary["rows_skipped_as_done"] == 0


def test_chunked_prefill_gives_the_same_greedy_texts(tmp_path, tiny_dir):
    rows = prompt_rows(6) + [{"id": "long", "prompt": "the quick brown fox jumps over the lazy dog " * 4}]
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    texts = []
    for budget in (64, 3):  # 3 = slots: prompts are prefilled a few tokens per step, beside decodes
        job, out = make_job(tmp_path, tiny_dir, [src], name=f"budget{budget}",
                            batch={"max_num_batched_tokens": budget})
        run_ok(job)
        texts.append({i: (r["text"], r["prompt_tokens"]) for i, r in
                      assert_each_id_once(out, [r["id"] for r in rows]).items()})
    assert texts[0] == texts[1]


# --------------------------------------------------------------------------
# 7. --limit
# --------------------------------------------------------------------------


def test_limit_processes_only_n_rows(tmp_path, tiny_dir):
    rows = prompt_rows(12)
    ids = [r["id"] for r in rows]
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src])

    run_ok(job, "--limit", "5")
    assert_each_id_once(out, ids[:5])
    assert read_summary(out)["rows_ok"] == 5

    # The limit counts this worker's first N rows, done or not: a rerun with 8 adds 3.
    run_ok(job, "--limit", "8")
    assert_each_id_once(out, ids[:8])
    assert read_summary(out)["rows_ok"] == 3


# --------------------------------------------------------------------------
# 8. --set overrides and config errors
# --------------------------------------------------------------------------


def test_set_overrides_apply(tmp_path, tiny_dir):
    rows = prompt_rows(6)
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src])
    run_ok(job, "--set", "sampling.max_tokens=3", "--set", "batch.slots=2", "--set", "sampling.ignore_eos=true")
    got = assert_each_id_once(out, [r["id"] for r in rows])
    assert all(r["completion_tokens"] <= 3 for r in got.values())
    assert all(r["completion_tokens"] == 3 and r["finish_reason"] == "length" for r in got.values())
    recorded = read_summary(out)["job"]
    assert recorded["sampling"]["max_tokens"] == 3 and recorded["batch"]["slots"] == 2


def test_unknown_key_fails_before_any_model_loads(tmp_path):
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", prompt_rows(3))
    missing_model = tmp_path / "no-such-model"
    job, out = make_job(tmp_path, missing_model, [src], batch={"slot": 4})

    for command in ("run", "validate"):
        result = invoke(command, job)
        assert result.exit_code != 0, _describe(result)
        assert isinstance(result.exception, SystemExit), _describe(result)
        assert "batch.slot" in result.output and "did you mean 'slots'" in result.output, result.output
        assert "no-such-model" not in result.output and "config.json" not in result.output, result.output
    assert not out.exists(), "a job with a config error must not create its output dir"

    # The same mistake through --set on an otherwise good job.
    good, _ = make_job(tmp_path, missing_model, [src], name="good")
    result = invoke("run", good, "--set", "batch.slot=4")
    assert result.exit_code != 0 and "did you mean 'slots'" in result.output, _describe(result)
    assert "config.json" not in result.output

    # Without the config error, the missing model is what gets reported.
    result = invoke("run", good)
    assert result.exit_code != 0 and "no-such-model" in result.output, _describe(result)


def test_bad_run_arguments_and_outputs_fail_before_any_model_loads(tmp_path, tiny_dir, monkeypatch):
    """Shard flags, --limit, a Parquet shard without the columns, and an output.dir that is a file are
    all reported before the engine is built, and leave nothing behind."""
    import spin_batch.runner as runner

    def no_engine(*a, **k):
        raise AssertionError("the engine was built before the arguments were checked")

    monkeypatch.setattr(runner, "build_engine", no_engine)
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", prompt_rows(3))
    job, out = make_job(tmp_path, tiny_dir, [src])
    for args, message in [
        (("--shard-index", "5", "--num-shards", "2"), "shard_index must be in [0, 2), got 5"),
        (("--shard-index", "-1", "--num-shards", "2"), "shard_index must be in [0, 2), got -1"),
        (("--num-shards", "0"), "num_shards must be >= 1, got 0"),
        (("--limit", "-3"), "--limit must be an integer >= 0, got -3"),
    ]:
        result = invoke("run", job, "--no-progress", *args)
        assert result.exit_code == 1 and message in result.output, _describe(result)
    no_prompt = tmp_path / "in" / "ids-only.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": ["x"]}), no_prompt)
    late, late_out = make_job(tmp_path, tiny_dir, [src, no_prompt], name="late")  # the bad file comes second
    result = invoke("run", late, "--no-progress")
    assert result.exit_code == 1 and "needs a prompt column 'prompt'" in result.output, _describe(result)
    assert not out.exists() and not late_out.exists()

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for target in (blocker, blocker / "below"):
        bad, _ = make_job(tmp_path, tiny_dir, [src], name="blocked", output={"dir": str(target)})
        for command in ("validate", "run"):
            result = invoke(command, bad)
            assert result.exit_code == 1, _describe(result)
            assert f"output.dir: {blocker} exists and is not a directory" in result.output, _describe(result)


def test_a_device_that_is_not_there_is_a_job_problem(tmp_path, tiny_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", prompt_rows(2))
    job, out = make_job(tmp_path, tiny_dir, [src], target={"device": "cuda"})
    for command in ("validate", "run"):
        result = invoke(command, job)
        assert result.exit_code == 1, _describe(result)
        assert "target.device: device 'cuda' requested but CUDA is not available" in result.output
    assert not out.exists()


# --------------------------------------------------------------------------
# 9. validate
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def other_tokenizer_model_dir(tmp_path_factory) -> Path:
    """A tiny model whose tokenizer is trained on a different corpus (different vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok_dir = tmp_path_factory.mktemp("other-tokenizer")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([line[::-1].upper() for line in CORPUS], trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
    ).save_pretrained(str(tok_dir))
    return build_tiny_model(tmp_path_factory.mktemp("other-vocab-model"), layers=1, hidden=32, heads=2,
                            kv_heads=1, seed=3, tokenizer_dir=tok_dir)


def _validate(job: Path, *args: str):
    return invoke("validate", job, *args)


def test_validate_ok_and_input_problems(tmp_path, tiny_dir):
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", prompt_rows(5))
    good, good_out = make_job(tmp_path, tiny_dir, [src], name="good")
    result = _validate(good)
    assert result.exit_code == 0, _describe(result)
    assert f"{good}: OK" in result.output
    assert not good_out.exists(), "validate must not create the output dir"

    missing, _ = make_job(tmp_path, tiny_dir, [tmp_path / "in" / "nope.jsonl"], name="missing")
    result = _validate(missing)
    assert result.exit_code != 0 and "nope.jsonl: no such file or directory" in result.output, _describe(result)

    no_prompt = tmp_path / "in2" / "noprompt.parquet"
    no_prompt.parent.mkdir()
    pq.write_table(pa.table({"id": ["a", "b"], "text": ["x", "y"]}), no_prompt)
    job, _ = make_job(tmp_path, tiny_dir, [no_prompt], name="nocol")
    result = _validate(job)
    assert result.exit_code != 0, _describe(result)
    assert "needs a prompt column 'prompt'" in result.output and "text" in result.output, result.output

    no_id = tmp_path / "in2" / "noid.parquet"
    pq.write_table(pa.table({"key": ["a"], "prompt": ["x"]}), no_id)
    job, _ = make_job(tmp_path, tiny_dir, [no_id], name="noid")
    result = _validate(job)
    assert result.exit_code != 0 and "missing id column 'id'" in result.output, _describe(result)

    dups = write_jsonl(tmp_path / "in3" / "dups.jsonl", [
        {"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}, {"id": "a", "prompt": "three"}, "{not json",
    ])
    job, _ = make_job(tmp_path, tiny_dir, [dups], name="dups")
    result = _validate(job)
    assert result.exit_code != 0, _describe(result)
    assert "duplicate id 'a'" in result.output and f"{dups.resolve()}#0" in result.output, result.output
    assert "1 bad row (invalid JSON)" in result.output, result.output


def test_validate_model_checks(tmp_path, tiny_dir, tiny_draft_dir, other_tokenizer_model_dir, monkeypatch):
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", prompt_rows(3))

    def job_with(name: str, drafters: list[dict], model: Path = tiny_dir) -> Path:
        job, _ = make_job(tmp_path, model, [src], name=name, drafters=drafters)
        return job

    ok = job_with("ok", [{"name": "exit2", "kind": "early_exit", "layers": 2},
                         {"name": "small", "kind": "model", "model": str(tiny_draft_dir)}])
    result = _validate(ok)
    assert result.exit_code == 0, _describe(result)

    deep = job_with("deep", [{"name": "exit9", "kind": "early_exit", "layers": 9}])
    result = _validate(deep)
    assert result.exit_code != 0, _describe(result)
    assert "exit9" in result.output and "1..3" in result.output and "got 9" in result.output, result.output
    assert _validate(deep, "--no-models").exit_code == 0  # --no-models skips model checks

    mismatch = job_with("mismatch", [{"name": "other", "kind": "model", "model": str(other_tokenizer_model_dir)}])
    result = _validate(mismatch)
    assert result.exit_code != 0, _describe(result)
    assert "other" in result.output and "does not match the target's tokenizer" in result.output, result.output
    # `run` applies the same model checks before loading anything.
    result = invoke("run", mismatch, "--no-progress")
    assert result.exit_code != 0 and "does not match the target's tokenizer" in result.output, _describe(result)
    assert not part_files(tmp_path / "out-mismatch")

    # the int8 copy: all layers by default; its layers checked like any early exit; a native target only
    assert _validate(job_with("q8", [{"name": "q8", "kind": "early_exit", "quantize": "int8"}])).exit_code == 0
    result = _validate(job_with("q8deep", [{"name": "q8", "kind": "early_exit", "quantize": "int8", "layers": 9}]))
    assert result.exit_code != 0 and "got 9" in result.output, _describe(result)
    job, _ = make_job(tmp_path, tiny_dir, [src], name="q8hf", target={"backend": "transformers"},
                      drafters=[{"name": "q8", "kind": "early_exit", "quantize": "int8"}])
    result = _validate(job)
    assert result.exit_code != 0 and "quantize: int8 copies a native target's weights" in result.output, \
        _describe(result)
    job, _ = make_job(tmp_path, tiny_dir, [src], name="q8bf16", target={"dtype": "bfloat16"},
                      drafters=[{"name": "q8", "kind": "early_exit", "quantize": "int8"}])
    assert _validate(job).exit_code == 0  # a bfloat16 target's int8 copy runs on the C int8 GEMM too
    job, _ = make_job(tmp_path, tiny_dir, [src], name="q8fp16", target={"dtype": "float16"},
                      drafters=[{"name": "q8", "kind": "early_exit", "quantize": "int8"}])
    result = _validate(job)
    assert result.exit_code != 0 and "with a float32 or bfloat16 target only" in result.output, _describe(result)

    # target.quantize: int8: the C int8 GEMM on CPU, float32 or bfloat16 weights, no int8-copy drafter beside it
    job, _ = make_job(tmp_path, tiny_dir, [src], name="t8", target={"quantize": "int8"},
                      drafters=[{"name": "exit1", "kind": "early_exit", "layers": 1}])
    assert _validate(job).exit_code == 0
    for name, target, drafters, says in (
            ("t8q8", {"quantize": "int8"}, [{"name": "q8", "kind": "early_exit", "quantize": "int8"}],
             "the target already is that copy"),
            ("t8hf", {"quantize": "int8", "backend": "transformers"}, [], "runs on the C int8 GEMM"),
            ("t8torch", {"quantize": "int8", "kernels": "torch"}, [], "kernels torch"),
            ("t8fp16", {"quantize": "int8", "dtype": "float16"}, [], "target.dtype is float16")):
        job, _ = make_job(tmp_path, tiny_dir, [src], name=name, target=target, drafters=drafters)
        result = _validate(job)
        assert result.exit_code != 0 and says in result.output, (name, _describe(result))
    with monkeypatch.context() as m:  # kernels auto, but the C kernels held off: refused before any weight loads
        m.setenv("SPIN_BATCH_CPU_GEMM", "off")
        job, _ = make_job(tmp_path, tiny_dir, [src], name="t8off", target={"quantize": "int8"})
        result = _validate(job)
        assert result.exit_code != 0 and "the C kernels do not run here" in result.output, _describe(result)

    no_model = job_with("nomodel", [], model=tmp_path / "no-such-model")
    result = _validate(no_model)
    assert result.exit_code != 0 and "not a model directory" in result.output, _describe(result)


# --------------------------------------------------------------------------
# 10. sampling reproducibility
# --------------------------------------------------------------------------


def test_sampling_is_reproducible_per_seed(tmp_path, tiny_dir):
    rows = prompt_rows(12)
    ids = [r["id"] for r in rows]
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)

    def texts(name: str, seed: int, slots: int = 3) -> dict[str, str]:
        job, out = make_job(tmp_path, tiny_dir, [src], name=name, batch={"slots": slots},
                            sampling={"temperature": 0.8, "seed": seed, "max_tokens": 12})
        run_ok(job)
        return {i: r["text"] for i, r in assert_each_id_once(out, ids).items()}

    a = texts("a", 1)
    b = texts("b", 1)
    assert a == b
    c = texts("c", 2)
    assert any(a[i] != c[i] for i in ids)
    # Each row has its own generator, so the batch layout does not change what is sampled.
    assert texts("d", 1, slots=1) == a


# --------------------------------------------------------------------------
# 11. chat rows
# --------------------------------------------------------------------------


def test_chat_messages_rendered_with_template(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))

    def n_tokens(messages: list[dict]) -> int:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert "<|im_start|>assistant" in text
        return len(tok.encode(text, add_special_tokens=False))

    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "list three colours"}]
    user_only = [{"role": "user", "content": "what causes the tides?"}]
    rows = [
        {"id": "chat", "messages": messages},
        {"id": "chat-user", "messages": user_only},
        {"id": "plain", "prompt": "the quick brown fox"},
        {"id": "bad-chat", "messages": [{"content": "no role"}]},
    ]
    src = write_jsonl(tmp_path / "in" / "chat.jsonl", rows)
    pq_src = tmp_path / "in" / "chat.parquet"  # messages as list<struct>, null where a prompt is used
    pq.write_table(pa.table({
        "id": ["pq-chat", "pq-plain"],
        "prompt": [None, "the lazy dog"],
        "messages": [messages, None],
    }), pq_src)

    job, out = make_job(tmp_path, tiny_dir, [src, pq_src], name="auto")
    run_ok(job)
    got = by_id(read_rows(out))
    assert got["pq-chat"]["status"] == "ok" and got["pq-chat"]["prompt_tokens"] == n_tokens(messages)
    assert got["pq-plain"]["prompt_tokens"] == n_tokens([{"role": "user", "content": "the lazy dog"}])
    assert got["chat"]["status"] == "ok" and got["chat"]["completion_tokens"] >= 1
    assert got["chat"]["prompt_tokens"] == n_tokens(messages)
    assert got["chat-user"]["prompt_tokens"] == n_tokens(user_only)
    # chat_template: auto wraps plain prompts as a user turn too
    assert got["plain"]["prompt_tokens"] == n_tokens([{"role": "user", "content": "the quick brown fox"}])
    assert got["bad-chat"]["status"] == "error" and "messages[0].role" in got["bad-chat"]["error"]

    job, out = make_job(tmp_path, tiny_dir, [src, pq_src], name="sys",
                        input={"chat_template": False, "system_prompt": "be nice"})
    run_ok(job)
    got = by_id(read_rows(out))
    assert got["plain"]["prompt_tokens"] == len(tok.encode("the quick brown fox"))  # no template
    assert got["chat"]["prompt_tokens"] == n_tokens(messages)  # has its own system turn
    assert got["chat-user"]["prompt_tokens"] == n_tokens([{"role": "system", "content": "be nice"}, *user_only])


# --------------------------------------------------------------------------
# 12. stop strings
# --------------------------------------------------------------------------


def test_stop_strings_truncate_text(tmp_path, tiny_dir):
    rows = prompt_rows(8)
    ids = [r["id"] for r in rows]
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    sampling = {"max_tokens": 16, "ignore_eos": True}
    job, out = make_job(tmp_path, tiny_dir, [src], name="free", sampling=sampling)
    run_ok(job)
    free = assert_each_id_once(out, ids)

    # A printable ASCII stop string from the middle of one row's greedy text.
    stop = target = None
    for i in ids:
        text = free[i]["text"]
        for k in range(2, len(text) - 2):
            cand = text[k:k + 2]
            if cand.isascii() and cand.isprintable() and cand.strip() == cand and cand:
                stop, target = cand, i
                break
        if stop:
            break
    assert stop is not None, f"no usable stop string in {[free[i]['text'] for i in ids]}"

    job, out = make_job(tmp_path, tiny_dir, [src], name="stopped", sampling={**sampling, "stop": [stop, "@@never@@"]})
    run_ok(job)
    stopped = assert_each_id_once(out, ids)
    r = stopped[target]
    expected = free[target]["text"][: free[target]["text"].find(stop)]
    assert r["finish_reason"] == "stop", r
    assert r["text"] == expected and stop not in r["text"]
    assert r["completion_tokens"] <= free[target]["completion_tokens"]
    for i in ids:  # every row: cut at its first stop-string occurrence, or untouched
        f = free[i]["text"]
        if stop in f:
            assert (stopped[i]["finish_reason"], stopped[i]["text"]) == ("stop", f[: f.find(stop)]), i
        else:
            assert (stopped[i]["finish_reason"], stopped[i]["text"]) == ("length", f), i

    # Speculation that accepts several tokens a step (a draft made of all the target's layers is always
    # right) ends each row on the same token as plain decoding: the token that completes the stop string.
    # The rows count only accepted drafts that reached the completion.
    job, out = make_job(tmp_path, tiny_dir, [src], name="stopped-spec", sampling={**sampling, "stop": [stop, "@@never@@"]},
                        drafters=[{"name": "all", "kind": "early_exit", "layers": 3}],
                        spin={"selector": "fixed:all", "num_speculative_tokens": 4, "confidence_gate": False})
    run_ok(job)
    spec = assert_each_id_once(out, ids)
    for i in ids:
        key = ("text", "finish_reason", "completion_tokens")
        assert [spec[i][k] for k in key] == [stopped[i][k] for k in key], i
        steps = sum(dict(spec[i]["drafter_pulls"]).values())  # decode steps; the prefill gave the first token
        assert steps + spec[i]["num_accepted_draft_tokens"] <= spec[i]["completion_tokens"] <= \
            steps + 1 + spec[i]["num_accepted_draft_tokens"], spec[i]
    assert any(spec[i]["num_accepted_draft_tokens"] > spec[i]["num_spec_steps"] for i in ids)  # several a step


def test_an_int8_target_writes_the_int8_models_text_whatever_drafts_it_and_at_any_batch_size(tmp_path, tiny_dir):
    """`target.quantize: int8` through `run`: the text of plain decoding at one slot, at 4 slots, and with
    speculation (the int8 target's first layer and n-gram drafts) is the same; it differs from the float32
    target's somewhere; the fingerprint tells the two jobs apart."""
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", prompt_rows(6))
    q8 = {"quantize": "int8"}
    drafts = [{"name": "exit1", "kind": "early_exit", "layers": 1}, {"name": "ngram", "kind": "ngram"}]
    one, one_out = make_job(tmp_path, tiny_dir, [src], name="one", target=q8, batch={"slots": 1})
    four, four_out = make_job(tmp_path, tiny_dir, [src], name="four", target=q8, batch={"slots": 4})
    spec, spec_out = make_job(tmp_path, tiny_dir, [src], name="spec", target=q8, drafters=drafts,
                              spin={"num_speculative_tokens": 4}, batch={"slots": 4})
    full, full_out = make_job(tmp_path, tiny_dir, [src], name="full")
    for job in (one, four, spec, full):
        run_ok(job)
    ids = [f"r{i:03d}" for i in range(6)]
    want = assert_each_id_once(one_out, ids)
    for out in (four_out, spec_out):
        got = assert_each_id_once(out, ids)
        assert all(got[i]["text"] == want[i]["text"] for i in ids), out
    stats = json.loads((spec_out / "summary.json").read_text())["drafters"]
    assert sum(d["draft_tokens"] * (d["acceptance_rate"] or 0) for d in stats.values()) > 0, stats
    float32 = assert_each_id_once(full_out, ids)
    assert any(float32[i]["text"] != want[i]["text"] for i in ids)
    fp = json.loads((one_out / "job-fingerprint.json").read_text())["fingerprint"]
    assert fp["target.quantize"] == "int8"
    assert "target.quantize" not in json.loads((full_out / "job-fingerprint.json").read_text())["fingerprint"]


def test_the_int8_copy_of_the_target_drafts_and_the_text_is_the_targets(tmp_path, tiny_dir):
    """`quantize: int8` end to end through `run`: the copy is built from the target's checkpoint, drafts
    most of the tokens, and every row's text is plain decoding's."""
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", prompt_rows(6))
    plain, plain_out = make_job(tmp_path, tiny_dir, [src], name="plain")
    q8, q8_out = make_job(tmp_path, tiny_dir, [src], name="q8",
                          drafters=[{"name": "q8", "kind": "early_exit", "quantize": "int8"}],
                          spin={"selector": "fixed:q8", "num_speculative_tokens": 4})
    run_ok(plain)
    run_ok(q8)
    ids = [f"r{i:03d}" for i in range(6)]
    want, got = assert_each_id_once(plain_out, ids), assert_each_id_once(q8_out, ids)
    assert all(got[i]["text"] == want[i]["text"] for i in ids)
    stats = json.loads((q8_out / "summary.json").read_text())["drafters"]["q8"]
    assert stats["draft_tokens"] > 0 and stats["acceptance_rate"] > 0.5, stats
