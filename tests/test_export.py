"""`spin-batch export`: all workers' parts merged into one file, in input order, latest row per source."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from spin_batch.io.schema import error_row
from spin_batch.io.writer import OutputWriter

from conftest import write_jsonl
from conftest import make_job
from test_cli_e2e import _describe, _isolate_process_state, invoke, prompt_rows, run_ok  # noqa: F401


def ok_row(source: str, id: str, text: str) -> dict:
    return {"id": id, "source": source, "text": text, "finish_reason": "stop", "prompt_tokens": 3,
            "completion_tokens": 2, "drafter_pulls": {"ngram": 2}}


def write_parts(out: Path, worker: str, rows: list[dict], run_id: str, rows_per_part: int = 2) -> None:
    with OutputWriter(out, worker=worker, run_id=run_id, rows_per_part=rows_per_part) as w:
        for row in rows:
            w.add(row)


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def two_worker_out(tmp_path) -> Path:
    """Worker 0 wrote b.jsonl's rows, worker 1 a.jsonl's (rows 2, 10 and 9: 10 must follow 9, not 1),
    and a later run of worker 1 retried a.jsonl#10, whose first row was an error."""
    out = tmp_path / "out"
    write_parts(out, "w0000", [ok_row("/in/b.jsonl#1", "b1", "B1"), ok_row("/in/b.jsonl#0", "b0", "B0")],
                run_id="20260101T000000000000_aaaaaa")
    write_parts(out, "w0001", [ok_row("/in/a.jsonl#2", "a2", "A2"), error_row("/in/a.jsonl#10", "a10", "boom"),
                               ok_row("/in/a.jsonl#9", "a9", "A9"), error_row("/in/a.jsonl#3", "a3", "bad row")],
                run_id="20260101T000001000000_bbbbbb")
    write_parts(out, "w0001", [ok_row("/in/a.jsonl#10", "a10", "A10 retried")], run_id="20260101T000002000000_cccccc")
    return out


def test_export_parquet_orders_by_shard_then_row_and_keeps_the_latest_row(tmp_path, two_worker_out):
    dest = tmp_path / "merged" / "all.parquet"
    result = invoke("export", two_worker_out, "--to", dest)
    assert result.exit_code == 0, _describe(result)
    assert "6 rows written" in result.output
    rows = pq.read_table(dest).to_pylist()
    assert [r["source"] for r in rows] == ["/in/a.jsonl#2", "/in/a.jsonl#3", "/in/a.jsonl#9", "/in/a.jsonl#10",
                                           "/in/b.jsonl#0", "/in/b.jsonl#1"]
    assert rows[3]["text"] == "A10 retried" and rows[3]["status"] == "ok"
    assert rows[1]["status"] == "error" and rows[1]["error"] == "bad row"
    assert [p.name for p in dest.parent.iterdir()] == ["all.parquet"]  # no temp file left


def test_export_jsonl_without_errors(tmp_path, two_worker_out):
    dest = tmp_path / "all.jsonl"
    result = invoke("export", two_worker_out, "--to", dest, "--no-errors")
    assert result.exit_code == 0, _describe(result)
    rows = jsonl_rows(dest)
    assert [r["id"] for r in rows] == ["a2", "a9", "a10", "b0", "b1"]
    assert rows[0]["drafter_pulls"] == {"ngram": 2}
    assert all(r["status"] == "ok" for r in rows)


def test_export_replaces_an_existing_file_atomically(tmp_path, two_worker_out):
    dest = tmp_path / "all.jsonl"
    dest.write_text("old\n")
    assert invoke("export", two_worker_out, "--to", dest).exit_code == 0
    assert len(jsonl_rows(dest)) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.jsonl", "out"]


def test_export_errors(tmp_path, two_worker_out):
    missing = invoke("export", tmp_path / "nope", "--to", tmp_path / "x.parquet")
    assert missing.exit_code == 1 and "no such output folder" in missing.output
    (tmp_path / "empty").mkdir()
    empty = invoke("export", tmp_path / "empty", "--to", tmp_path / "x.parquet")
    assert empty.exit_code == 1 and "no output parts" in empty.output
    bad = invoke("export", two_worker_out, "--to", tmp_path / "x.csv")
    assert bad.exit_code == 1 and "unknown extension '.csv'" in bad.output
    assert not (tmp_path / "x.parquet").exists() and not (tmp_path / "x.csv").exists()


def test_export_of_a_sharded_run_with_a_retried_row(tmp_path, tiny_dir):
    """Two workers over three shards, a bad row fixed and redone with --retry-errors: the export has
    each input row once, in input order, with the retried row's new text."""
    files = []
    for f in range(3):
        rows = prompt_rows(3, prefix=f"s{f}-")
        if f == 1:
            rows[2] = {"id": "s1-002"}  # no prompt: an error row
        files.append(write_jsonl(tmp_path / "in" / f"shard-{f}.jsonl", rows))
    job, out = make_job(tmp_path, tiny_dir, [str(tmp_path / "in")], sampling={"max_tokens": 3})
    run_ok(job, "--shard-index", "1", "--num-shards", "2")
    run_ok(job, "--shard-index", "0", "--num-shards", "2")
    write_jsonl(files[1], prompt_rows(3, prefix="s1-"))  # fix the bad row, redo it
    run_ok(job, "--shard-index", "1", "--num-shards", "2", "--retry-errors")

    dest = tmp_path / "all.jsonl"
    result = invoke("export", out, "--to", dest)
    assert result.exit_code == 0, _describe(result)
    rows = jsonl_rows(dest)
    assert [r["id"] for r in rows] == [f"s{f}-{i:03d}" for f in range(3) for i in range(3)]
    assert [r["source"] for r in rows] == [f"{p.resolve()}#{i}" for p in files for i in range(3)]
    assert all(r["status"] == "ok" for r in rows)


def test_a_run_keeps_the_input_columns_across_parts(tmp_path, tiny_dir):
    """output.keep_columns on `spin-batch run`'s path: a column named like an output column comes back
    with the prefix; a column whose type changes between parts exports as JSON text; none keeps none."""
    rows = [{"id": f"r{i}", "prompt": p["prompt"], "text": f"source {i}", "label": i, "score": i}
            for i, p in enumerate(prompt_rows(4))]
    rows[3]["label"] = "four"  # the second part's label is a string
    rows[3]["score"] = 3.5  # and its score a float
    src = write_jsonl(tmp_path / "in" / "rows.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], name="keep", output={"rows_per_part": 2},
                        batch={"slots": 1}, sampling={"max_tokens": 3})
    run_ok(job)
    dest = tmp_path / "all.parquet"
    assert invoke("export", out, "--to", dest).exit_code == 0
    table = pq.read_table(dest)
    assert table.column_names[-3:] == ["input_text", "label", "score"]
    assert table.column("input_text").to_pylist() == [f"source {i}" for i in range(4)]
    assert all(t is not None and not t.startswith("source") for t in table.column("text").to_pylist())
    assert table.column("label").to_pylist() == ["0", "1", "2", '"four"']
    assert table.column("score").to_pylist() == [0.0, 1.0, 2.0, 3.5]
    job, out = make_job(tmp_path, tiny_dir, [src], name="none", output={"keep_columns": "none"},
                        sampling={"max_tokens": 3})
    run_ok(job)
    assert invoke("export", out, "--to", dest).exit_code == 0
    assert "label" not in pq.read_table(dest).column_names and "input_text" not in pq.read_table(dest).column_names
