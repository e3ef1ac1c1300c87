"""`spin-batch run` when a row, an output part, the job or the operator does something unexpected
(issue 30): huge rows, corrupt parts, a typo in a column, retrying error rows, a changed job,
Ctrl-C during start-up, paths with $VAR and ~, and the stats parts' schema.

Each test runs the CLI on the tiny random model, in-process through click's CliRunner.
"""

from __future__ import annotations

import json
import re
import time

import pyarrow.parquet as pq

from conftest import write_jsonl
from test_cli_e2e import _isolate_process_state  # noqa: F401 (autouse: signal handlers, SLURM_*, threads)
from conftest import make_job
from test_cli_e2e import (_describe, assert_each_id_once, invoke, part_files, prompt_rows, read_rows,
                          read_summary, run_ok)


# --------------------------------------------------------------------------
# 2. a huge row costs what the job's settings allow, not what the row holds
# --------------------------------------------------------------------------


def test_a_huge_prompt_is_an_error_row_without_being_tokenized(tmp_path, tiny_dir):
    rows = prompt_rows(3)
    huge = "the quick brown fox jumps over the lazy dog " * (8_000_000 // 44)  # 8 MB of text, 2 M tokens
    over_line = "x" * 10_000_000
    src = write_jsonl(tmp_path / "in" / "big.jsonl", [
        rows[0], {"id": "huge", "prompt": huge}, rows[1], {"id": "line", "prompt": over_line},
        {"id": "chat", "messages": [{"role": "user", "content": huge[:3_000_000]}]}, rows[2]])
    job, out = make_job(tmp_path, tiny_dir, [src], batch={"max_model_len": 64}, sampling={"max_tokens": 4},
                        input={"max_line_bytes": 9_000_000})
    t0 = time.perf_counter()
    result = run_ok(job)
    elapsed = time.perf_counter() - t0
    got = {r["id"]: r for r in read_rows(out)}
    assert sorted(got, key=str) == sorted([r["id"] for r in rows] + ["huge", "chat", None], key=str)
    assert "3 ok, 3 error rows" in result.stderr
    # (the chat template wraps the prompt: a few characters more)
    assert got["huge"]["status"] == "error" and re.fullmatch(
        r"prompt has (\d+) characters, more than max_model_len 64 can hold \(63 tokens of at most \d+ characters, "
        r"the longest in this tokenizer's vocabulary\); not tokenized", got["huge"]["error"]), got["huge"]
    assert got["chat"]["status"] == "error" and "characters, more than max_model_len 64" in got["chat"]["error"]
    line = got[None]
    assert line["source"].endswith("#3") and line["error"] == (
        f"line is {len(json.dumps({'id': 'line', 'prompt': over_line}))} bytes, more than input.max_line_bytes "
        "(9000000); not read")
    # tokenizing the 8 MB prompt alone took about 15 s (and 1.6 GB) before it was found too long
    assert elapsed < 12, f"the run took {elapsed:.1f}s"


# --------------------------------------------------------------------------
# 4a. a JSONL column that none of the first rows has is a job error
# --------------------------------------------------------------------------


def test_a_jsonl_column_typo_fails_before_any_model_loads(tmp_path, tiny_dir, monkeypatch):
    import spin_batch.runner as runner

    def no_engine(*a, **k):
        raise AssertionError("the engine was built before the columns were checked")

    monkeypatch.setattr(runner, "build_engine", no_engine)
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", prompt_rows(3))
    for key, value, message in [
        ("prompt_column", "promt", "needs a prompt column 'promt' or a messages column 'messages'"),
        ("id_column", "uid", "missing id column 'uid'"),
    ]:
        job, out = make_job(tmp_path, tiny_dir, [src], name=key, input={key: value})
        for command in ("run", "validate"):
            result = invoke(command, job)
            assert result.exit_code == 1, _describe(result)
            expected = f"{message}: none of its first 3 rows has it (fields: id, prompt)"
            assert expected in result.output, _describe(result)
        assert not out.exists()


# --------------------------------------------------------------------------
# 3. an output part that cannot be read is moved aside and its rows redone
# --------------------------------------------------------------------------


def test_corrupt_truncated_or_empty_parts_are_moved_aside_and_redone(tmp_path, tiny_dir):
    rows = prompt_rows(8)
    ids = [r["id"] for r in rows]
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], output={"rows_per_part": 2}, sampling={"max_tokens": 4})
    run_ok(job)
    first = assert_each_id_once(out, ids)
    parts = part_files(out)
    assert len(parts) == 4
    truncated, emptied, garbled = parts[0], parts[1], parts[2]
    lost = {r["id"] for p in (truncated, emptied, garbled) for r in pq.read_table(p).to_pylist()}
    truncated.write_bytes(truncated.read_bytes()[:100])
    emptied.write_bytes(b"")
    garbled.write_bytes(b"\0" * garbled.stat().st_size)
    stats_part = sorted((out / "stats").glob("*.parquet"))[0]
    stats_part.write_bytes(b"not parquet")

    result = run_ok(job)
    moved = sorted((out / "outputs").glob("part-*.parquet.corrupt-*"))
    assert sorted(p.name.split(".corrupt-")[0] for p in moved) == sorted(p.name for p in (truncated, emptied, garbled))
    lines = [line for line in result.stderr.splitlines() if "moved aside" in line]
    assert len(lines) == 3, result.stderr
    assert all("cannot be read (" in line and "its rows will be redone" in line for line in lines), lines
    assert f"{len(lost)} ok, 0 error rows" in result.stderr
    again = assert_each_id_once(out, ids)  # nothing lost, nothing twice
    assert {i: again[i]["text"] for i in ids} == {i: first[i]["text"] for i in ids}

    report = invoke("report", out, "--png", tmp_path / "r.png")  # a stats part that cannot be read: left out
    assert report.exit_code == 0, _describe(report)
    assert "rows: 8  ok=8" in report.output and f"{stats_part} cannot be read" in report.stderr
    assert run_ok(job).stderr.count("moved aside") == 0  # the next run finds nothing to move


# --------------------------------------------------------------------------
# 4b. --retry-errors: error rows redone, each source's new row replaces its old one
# --------------------------------------------------------------------------


def test_retry_errors_redoes_error_rows_and_keeps_one_row_per_source(tmp_path, tiny_dir):
    long = "the quick brown fox jumps over the lazy dog and the moon pulls on the oceans"
    rows = prompt_rows(4) + [{"id": f"long{i}", "prompt": f"{long} {i}"} for i in range(3)]
    rows.append({"id": "bad", "prompt": ""})
    ids = [r["id"] for r in rows]
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], output={"rows_per_part": 3}, sampling={"max_tokens": 4},
                        input={"chat_template": False})
    run_ok(job, "--set", "batch.max_model_len=20")
    before = assert_each_id_once(out, ids)
    errors = sorted(i for i, r in before.items() if r["status"] == "error")
    assert errors == ["bad", "long0", "long1", "long2"], before
    assert "0 ok, 0 error rows" in run_ok(job).stderr  # a plain rerun: error rows count as done

    result = run_ok(job, "--retry-errors")  # max_model_len back at 128
    assert "3 ok, 1 error rows" in result.stderr
    after = assert_each_id_once(out, ids)  # in the files themselves: the old error rows are gone
    assert [i for i in ids if after[i]["status"] == "error"] == ["bad"]
    assert all(after[i] == before[i] for i in ids if i not in errors)
    assert read_summary(out)["rows_skipped_as_done"] == 4
    report = invoke("report", out)
    assert "rows: 8  error=1  ok=7" in report.output, report.output

    # a retry killed after writing its rows but before dropping the rows they replace: readers
    # take each source's latest row, and the next run drops the older one
    from spin_batch.io.outputs import read_outputs
    from spin_batch.io.schema import error_row
    from spin_batch.io.writer import OutputWriter

    late = after["long0"]
    with OutputWriter(out, worker="w0000") as w:  # a newer part: an error row for a source that was ok
        w.add(error_row(late["source"], "long0", "made up"))
    assert len(read_rows(out)) == 9
    view = {r["id"]: r for r in read_outputs(out).to_dicts()}
    assert len(view) == 8 and view["long0"]["error"] == "made up"
    run_ok(job)
    assert assert_each_id_once(out, ids)["long0"]["error"] == "made up"


# --------------------------------------------------------------------------
# 4c. a resume with settings that change a row's text is refused before any model loads
# --------------------------------------------------------------------------


def test_a_resume_with_a_changed_job_is_refused_unless_allowed(tmp_path, tiny_dir, monkeypatch):
    import spin_batch.runner as runner

    rows = prompt_rows(6)
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], sampling={"max_tokens": 4})
    run_ok(job, "--limit", "0")  # no rows yet: the next run may still change anything
    run_ok(job, "--limit", "2", "--set", "sampling.max_tokens=5")
    recorded = json.loads((out / "job-fingerprint.json").read_text())["fingerprint"]
    assert recorded["sampling.max_tokens"] == 5 and "sampling.seed" not in recorded  # greedy: no seed

    build_engine = runner.build_engine

    def no_engine(*a, **k):
        raise AssertionError("the engine was built before the job's fingerprint was checked")

    monkeypatch.setattr(runner, "build_engine", no_engine)
    parts = part_files(out)
    result = invoke("run", job, "--no-progress", "--set", "sampling.temperature=0.7", "--set", "sampling.seed=3")
    assert result.exit_code == 1, _describe(result)
    assert "holds rows of a job with other settings: sampling.temperature 0.0 -> 0.7; sampling.max_tokens 5 -> 4. " \
        in result.output, result.output
    assert "--allow-changed-job" in result.output and part_files(out) == parts
    model = tmp_path / "model-link"
    model.symlink_to(tiny_dir)
    result = invoke("run", job, "--no-progress", "--set", f"target.model={model}", "--set", "target.dtype=bf16")
    assert result.exit_code == 1 and "target.dtype 'float32' -> 'bfloat16'" in result.output, result.output
    assert "target.model" not in result.output  # the same directory under another name

    monkeypatch.setattr(runner, "build_engine", build_engine)
    run_ok(job, "--set", "sampling.max_tokens=5", "--set", "batch.slots=2")  # slots: same text, fine
    result = run_ok(job, "--allow-changed-job", "--limit", "4")
    assert "job settings changed (sampling.max_tokens 5 -> 4)" in result.stderr
    run_ok(job)  # the new settings are the recorded ones now
    assert_each_id_once(out, [r["id"] for r in rows])
    doc = json.loads((out / "job-fingerprint.json").read_text())
    assert doc["fingerprint"]["sampling.max_tokens"] == 4 and doc["previous"][0]["sampling.max_tokens"] == 5


# --------------------------------------------------------------------------
# 6. Ctrl-C during start-up, $VAR and ~ in paths, one stats schema
# --------------------------------------------------------------------------


def test_ctrl_c_during_start_up_exits_130_at_once(tmp_path, tiny_dir, monkeypatch):
    import os
    import signal

    import spin_batch.runner as runner

    def slow_load(*a, **k):  # a model that takes long to load, and an operator who presses Ctrl-C
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(20)
        raise AssertionError("Ctrl-C did not interrupt the start-up")

    monkeypatch.setattr(runner, "build_engine", slow_load)
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", prompt_rows(3))
    job, out = make_job(tmp_path, tiny_dir, [src])
    t0 = time.perf_counter()
    result = invoke("run", job, "--no-progress")
    assert result.exit_code == 130, _describe(result)
    assert time.perf_counter() - t0 < 10
    assert "Aborted!" not in result.output and "interrupted; rows already written are kept" in result.stderr
    assert not part_files(out)

    def interrupted(*a, **k):  # Ctrl-C before the handler is installed (Python's own KeyboardInterrupt)
        raise KeyboardInterrupt

    import spin_batch.preflight as preflight

    monkeypatch.setattr(preflight, "check_models", interrupted)
    result = invoke("run", job, "--no-progress")
    assert result.exit_code == 130 and "Aborted!" not in result.output, _describe(result)


def test_home_and_environment_variables_in_job_paths(tmp_path, tiny_dir):
    src = write_jsonl(tmp_path / "data" / "prompts.jsonl", prompt_rows(2))
    job, _ = make_job(tmp_path, "$MODELS/" + tiny_dir.name, ["${DATA}/prompts.jsonl"], output={"dir": "~/out"},
                      sampling={"max_tokens": 2})
    env = {"HOME": str(tmp_path / "home"), "DATA": str(src.parent), "MODELS": str(tiny_dir.parent)}
    run_ok(job, env=env)
    assert_each_id_once(tmp_path / "home" / "out", ["r000", "r001"])
    result = invoke("run", job, "--no-progress", env={**env, "DATA": None})
    assert result.exit_code == 1, _describe(result)
    assert "input.paths: environment variable $DATA is not set (or empty) in '${DATA}/prompts.jsonl'" in result.output


def test_stats_parts_share_one_schema_after_a_resume_with_nothing_to_do(tmp_path, tiny_dir):
    import polars as pl

    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", prompt_rows(4))
    job, out = make_job(tmp_path, tiny_dir, [src], sampling={"max_tokens": 3},
                        drafters=[{"name": "ngram", "kind": "ngram"}], spin={"selector": "fixed:ngram"})
    run_ok(job)
    run_ok(job)  # nothing left to do
    parts = sorted((out / "stats").glob("*.parquet"))
    assert len(parts) == 2
    schemas = [pq.read_schema(p) for p in parts]
    assert schemas[0].equals(schemas[1]), (schemas[0].names, schemas[1].names)
    assert {"rows_ok", "generated_tokens", "pulls.ngram", "pulls.none", "drafted.ngram"} <= set(schemas[0].names)
    stats = pl.read_parquet(str(out / "stats" / "*.parquet"))
    assert stats.height == 2 and stats["rows_ok"].to_list()[1] == 0


def test_the_fingerprint_holds_the_row_settings_sources(tmp_path, tiny_dir):
    """input.format and input.params_column change the text; with a params column a greedy job's rows may
    sample, so the seed and the filters count too."""
    from spin_batch.config import load_job
    from spin_batch.fingerprint import fingerprint

    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", prompt_rows(2))
    job, _ = make_job(tmp_path, tiny_dir, [src])
    plain = fingerprint(load_job(job))
    assert plain["input.params_column"] is None and "sampling.seed" not in plain
    own = fingerprint(load_job(job, ["input.params_column=params"]))
    assert own["input.params_column"] == "params" and {"sampling.seed", "sampling.top_k"} <= set(own)
    assert fingerprint(load_job(job, ["input.format=openai"]))["input.format"] == "openai"
