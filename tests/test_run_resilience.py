"""`spin-batch run` when a row, an output part, the job or the operator does something unexpected
(issue 30): huge rows, corrupt parts, a typo in a column, retrying error rows, a changed job,
Ctrl-C during start-up, paths with $VAR and ~, and the stats parts' schema.

Each test runs the CLI on the tiny random model, in-process through click's CliRunner.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from conftest import write_jsonl
from test_cli_e2e import (_describe, _isolate_process_state, assert_each_id_once, invoke, make_job,  # noqa: F401
                          part_files, prompt_rows, read_rows, read_summary, run_ok)


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
            assert f"{message}: none of its first 3 rows has it (fields: id, prompt)" in result.output, _describe(result)
        assert not out.exists()
