"""Tests for spin_batch.io.writer, spin_batch.io.schema and spin_batch.io.outputs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spin_batch.io import columns, outputs, schema, writer
from spin_batch.io.outputs import cleanup_temp, read_done, read_output_table, read_outputs, read_stats
from spin_batch.io.schema import OUTPUT_SCHEMA, OutputError, completion_row, error_row
from spin_batch.io.writer import OutputWriter, StatsWriter, write_json_atomic
from spin_batch.records import Completion, Request


class FakeClock:
    """A manually advanced clock for flush-interval tests."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ok_row(i: int, **extra) -> dict:
    row = {"id": f"r{i}", "source": f"/in/a.jsonl#{i}", "text": f"out {i}", "finish_reason": "stop"}
    row.update(extra)
    return row


def part_files(out_dir: Path) -> list[Path]:
    return sorted((out_dir / "outputs").glob("part-*.parquet"))


# --------------------------------------------------------------------------
# OutputWriter
# --------------------------------------------------------------------------


def test_parts_written_and_readable(tmp_path: Path) -> None:
    full = ok_row(
        0,
        prompt_tokens=5,
        completion_tokens=7,
        num_spec_steps=3,
        num_draft_tokens=9,
        num_accepted_draft_tokens=4,
        mean_acceptance_length=2.33,
        drafter_pulls={"ngram": 2, "eagle": 1},
        decode_time_s=0.5,
    )
    with OutputWriter(tmp_path, worker="w0003") as out:
        out.add(full)
        out.add(ok_row(1))
    assert out.rows_written == 2
    parts = part_files(tmp_path)
    assert len(parts) == 1
    assert parts[0].name.startswith("part-w0003-") and parts[0].name.endswith("-00000.parquet")
    assert pq.read_schema(parts[0]).equals(OUTPUT_SCHEMA)

    df = read_outputs(tmp_path)
    assert df.columns == OUTPUT_SCHEMA.names
    first, second = df.to_dicts()
    assert first["id"] == "r0" and first["status"] == "ok" and first["completion_tokens"] == 7
    assert first["mean_acceptance_length"] == pytest.approx(2.33)
    assert first["drafter_pulls"] == {"eagle": 1, "ngram": 2}
    assert second["drafter_pulls"] == {}
    # defaults for missing keys
    assert second["prompt_tokens"] == 0 and second["num_spec_steps"] == 0
    assert second["mean_acceptance_length"] is None and second["error"] is None
    assert second["decode_time_s"] == 0.0


def test_atomic_flush_and_temp_files(tmp_path: Path) -> None:
    out = OutputWriter(tmp_path, rows_per_part=100)
    out.add(ok_row(0))
    assert part_files(tmp_path) == []  # nothing under a final name before flush
    assert out.rows_written == 0 and out.rows_buffered == 1
    out.flush()
    assert len(part_files(tmp_path)) == 1 and out.rows_written == 1
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == [part_files(tmp_path)[0].name]

    # simulate a run killed mid-write: a half-written temp file
    stray = tmp_path / "outputs" / ".part-w0009-x-00000.parquet.abcd.tmp"
    stray.write_bytes(b"half a parquet")
    sources, ids = read_done(tmp_path)
    assert sources == {"/in/a.jsonl#0"} and ids == {"r0"}
    assert len(read_outputs(tmp_path)) == 1

    other = tmp_path / "outputs" / ".part-w0001-x-00000.parquet.ef01.tmp"
    other.write_bytes(b"")
    assert cleanup_temp(tmp_path, worker="w0009") == 1
    assert not stray.exists() and other.exists()
    assert cleanup_temp(tmp_path) == 1
    assert not other.exists()
    assert cleanup_temp(tmp_path) == 0
    out.close()


def test_failed_write_leaves_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = OutputWriter(tmp_path)
    out.add(ok_row(0))

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", boom)
    with pytest.raises(OSError):
        out.flush()
    assert list((tmp_path / "outputs").iterdir()) == []
    assert out.rows_buffered == 1  # rows kept for a retry
    monkeypatch.undo()
    out.close()
    assert out.rows_written == 1


def test_rows_per_part_splitting(tmp_path: Path) -> None:
    with OutputWriter(tmp_path, rows_per_part=3) as out:
        for i in range(8):
            out.add(ok_row(i))
        assert len(part_files(tmp_path)) == 2 and out.rows_written == 6
    parts = part_files(tmp_path)
    assert [pq.read_metadata(p).num_rows for p in parts] == [3, 3, 2]
    assert [p.name[-13:] for p in parts] == ["00000.parquet", "00001.parquet", "00002.parquet"]
    assert parts == out.parts
    df = read_outputs(tmp_path)
    assert df["id"].to_list() == [f"r{i}" for i in range(8)]


def test_flush_interval_with_fake_clock(tmp_path: Path) -> None:
    clock = FakeClock()
    out = OutputWriter(tmp_path, rows_per_part=1000, flush_interval_s=60.0, clock=clock)
    out.add(ok_row(0))
    clock.now += 59.0
    out.add(ok_row(1))
    assert part_files(tmp_path) == []
    clock.now += 1.0
    out.add(ok_row(2))
    assert len(part_files(tmp_path)) == 1 and out.rows_written == 3
    out.add(ok_row(3))
    clock.now += 30.0
    assert out.maybe_flush() is False
    clock.now += 30.0
    assert out.maybe_flush() is True
    assert out.rows_written == 4 and len(part_files(tmp_path)) == 2
    out.close()


def test_close_is_idempotent_and_add_after_close_fails(tmp_path: Path) -> None:
    out = OutputWriter(tmp_path)
    out.add(ok_row(0))
    out.close()
    out.close()
    assert len(part_files(tmp_path)) == 1
    with pytest.raises(RuntimeError):
        out.add(ok_row(1))


def test_writers_never_collide(tmp_path: Path) -> None:
    for _ in range(3):
        with OutputWriter(tmp_path, worker="w0000") as out:
            out.add(ok_row(0))
    assert len(part_files(tmp_path)) == 3


def test_explicit_run_id(tmp_path: Path) -> None:
    with OutputWriter(tmp_path, worker="w0002", run_id="r1") as out:
        out.add(ok_row(0))
    assert [p.name for p in part_files(tmp_path)] == ["part-w0002-r1-00000.parquet"]
    with pytest.raises(ValueError):
        OutputWriter(tmp_path, run_id="a/b")


def test_read_done(tmp_path: Path) -> None:
    assert read_done(tmp_path) == (set(), set())
    with OutputWriter(tmp_path, rows_per_part=2) as out:
        out.add(ok_row(0))
        out.add(error_row("/in/a.jsonl#1", None, "missing id"))
        out.add(error_row("/in/a.jsonl#2", "r2", "empty prompt"))
    sources, ids = read_done(tmp_path)
    assert sources == {"/in/a.jsonl#0", "/in/a.jsonl#1", "/in/a.jsonl#2"}
    assert ids == {"r0", "r2"}


def test_read_done_moves_unreadable_parts_aside(tmp_path: Path) -> None:
    with OutputWriter(tmp_path, rows_per_part=1, run_id="r1") as out:
        for i in range(4):
            out.add(ok_row(i))
    parts = part_files(tmp_path)
    parts[0].write_bytes(b"")  # emptied
    parts[1].write_bytes(parts[1].read_bytes()[:-20])  # lost its end
    said: list[str] = []
    sources, ids = read_done(tmp_path, warn=said.append)
    assert sources == {"/in/a.jsonl#2", "/in/a.jsonl#3"} and ids == {"r2", "r3"}
    assert [p.name for p in part_files(tmp_path)] == [parts[2].name, parts[3].name]
    aside = sorted((tmp_path / "outputs").glob("*.corrupt-*"))
    assert [p.name.split(".corrupt-")[0] for p in aside] == [parts[0].name, parts[1].name]
    assert aside[1].stat().st_size > 0  # kept as it was
    assert len(said) == 2 and all("moved aside to part-w0000-r1-0000" in m and "rows will be redone" in m
                                  for m in said), said
    assert read_outputs(tmp_path)["id"].to_list() == ["r2", "r3"]


def test_output_readers_name_an_unreadable_part_and_stats_readers_leave_it_out(tmp_path: Path) -> None:
    """An output part that does not read whole fails the reader, named (its rows are never left out
    silently); a stats part is left out with a line."""
    with OutputWriter(tmp_path, rows_per_part=1) as out:
        out.add(ok_row(0))
        out.add(ok_row(1))
    bad = part_files(tmp_path)[0]
    bad.write_bytes(b"garbage")
    with StatsWriter(tmp_path) as stats:
        stats.add({"x": 1.0})
    (tmp_path / "stats" / "stats-w0000-zz-00000.parquet").write_bytes(b"")
    said: list[str] = []
    with pytest.raises(OutputError, match=f"{bad} cannot be read .*run the job again"):
        read_outputs(tmp_path)
    assert read_stats(tmp_path, warn=said.append)["x"].to_list() == [1.0]
    assert len(said) == 1 and "cannot be read" in said[0] and "left out" in said[0], said
    assert len(part_files(tmp_path)) == 2  # readers move nothing


def test_latest_row_of_a_source_counts_and_older_ones_are_dropped(tmp_path: Path) -> None:
    """A --retry-errors run writes a new row for a source whose row was an error: the newer row
    (by run id, whatever the worker) counts, and drop_superseded rewrites the older parts."""
    with OutputWriter(tmp_path, worker="w0001", run_id="20250101T000000000000_aaaaaa", rows_per_part=2) as out:
        out.add(ok_row(0))
        out.add(error_row("/in/a.jsonl#1", "r1", "too long"))
        out.add(error_row("/in/a.jsonl#2", "r2", "too long"))
    assert read_done(tmp_path, retry_errors=True)[0] == {"/in/a.jsonl#0"}
    with OutputWriter(tmp_path, worker="w0000", run_id="20250102T000000000000_bbbbbb") as out:
        out.add(ok_row(1))
        out.add(error_row("/in/a.jsonl#2", "r2", "still too long"))
    assert len(pl.concat([pl.read_parquet(p) for p in part_files(tmp_path)])) == 5
    view = read_outputs(tmp_path)
    assert sorted(view["id"].to_list()) == ["r0", "r1", "r2"]
    assert dict(zip(view["id"], view["status"])) == {"r0": "ok", "r1": "ok", "r2": "error"}
    assert view.filter(pl.col("id") == "r2")["error"].to_list() == ["still too long"]
    assert read_done(tmp_path, retry_errors=True)[0] == {"/in/a.jsonl#0", "/in/a.jsonl#1"}
    assert read_done(tmp_path)[0] == {"/in/a.jsonl#0", "/in/a.jsonl#1", "/in/a.jsonl#2"}

    assert outputs.drop_superseded(tmp_path) == 2
    names = [p.name for p in part_files(tmp_path)]  # the second part held only replaced rows: gone
    assert names == ["part-w0000-20250102T000000000000_bbbbbb-00000.parquet",
                     "part-w0001-20250101T000000000000_aaaaaa-00000.parquet"]
    on_disk = pl.concat([pl.read_parquet(p) for p in part_files(tmp_path)]).sort("id")
    assert on_disk["id"].to_list() == ["r0", "r1", "r2"] and on_disk["status"].to_list() == ["ok", "ok", "error"]
    assert outputs.drop_superseded(tmp_path) == 0


def test_error_row_schema(tmp_path: Path) -> None:
    row = error_row("/in/a.jsonl#4", "x", "invalid JSON", prompt_tokens=3)
    assert set(row) == set(OUTPUT_SCHEMA.names)
    assert row["status"] == "error" and row["finish_reason"] == "error" and row["text"] is None
    assert row["error"] == "invalid JSON" and row["prompt_tokens"] == 3
    with OutputWriter(tmp_path) as out:
        out.add(row)
    df = read_outputs(tmp_path)
    assert df.row(0, named=True)["status"] == "error"
    assert df.row(0, named=True)["prompt_tokens"] == 3


def test_status_defaults_from_error(tmp_path: Path) -> None:
    with OutputWriter(tmp_path) as out:
        out.add({"source": "s#0", "error": "boom"})
        out.add({"source": "s#1"})
    assert read_outputs(tmp_path)["status"].to_list() == ["error", "ok"]


@pytest.mark.parametrize(
    "row",
    [
        {"id": "a"},  # no source
        {"source": "s#0", 5: 1},  # a kept column's name must be a string
        {"source": "s#0", "endpoint": "embeddings"},
        {"source": "s#0", "created": "today"},
        {"source": "s#0", "model": 3},
        {"source": "s#0", "status": "maybe"},
        {"source": "s#0", "finish_reason": "eos"},
        {"source": "s#0", "prompt_tokens": "3"},
        {"source": "s#0", "prompt_tokens": True},
        {"source": "s#0", "completion_tokens": 2**31},
        {"source": "s#0", "drafter_pulls": [1]},
        {"source": "s#0", "text": 5},
    ],
)
def test_invalid_rows_rejected(tmp_path: Path, row: dict) -> None:
    out = OutputWriter(tmp_path)
    with pytest.raises(OutputError):
        out.add(row)
    out.close()
    assert part_files(tmp_path) == []


def request(i: int, **fields) -> Request:
    return Request(f"/in/a.jsonl#{i}", f"r{i}", fields.pop("prompt", "hello"), fields.pop("messages", None), **fields)


def test_completion_row_fills_the_openai_columns() -> None:
    chat = Request("/in/a.jsonl#0", "r0", None, ({"role": "user", "content": "hi"},))
    row = completion_row(Completion(chat, "hey", "stop", 4, 1), model="builtin:tiny", created=1700000000)
    assert (row["endpoint"], row["model"], row["created"]) == ("chat", "builtin:tiny", 1700000000)
    row = completion_row(Completion(request(1), "x", "length", 2, 3), model="builtin:tiny")
    assert row["endpoint"] == "completion" and abs(row["created"] - time.time()) < 60
    own = request(2, endpoint="chat", model="my-model")  # an OpenAI batch line: its endpoint and body.model
    row = completion_row(Completion.failed(own, "too long", 9), model="builtin:tiny", created=5)
    assert (row["endpoint"], row["model"], row["status"], row["error"], row["prompt_tokens"]) == \
        ("chat", "my-model", "error", "too long", 9)
    assert set(row) == set(OUTPUT_SCHEMA.names)  # the request keeps no columns


def test_kept_columns_come_back_and_a_clash_gets_the_prefix() -> None:
    keep = {"label": 3, "text": "the input's text", "input_text": "taken too", "meta": {"a": 1}}
    done = Completion(request(0, keep=keep), "generated", "stop", 2, 1)
    row = completion_row(done)
    assert row["text"] == "generated"  # ours keeps its name
    assert {k: row[k] for k in ("label", "meta")} == {"label": 3, "meta": {"a": 1}}
    # text -> input_text, and an input column already called input_text -> input_input_text, whichever
    # columns the row has (one name per input column across the job's rows)
    assert row["input_text"] == "the input's text" and row["input_input_text"] == "taken too"
    assert set(row) - set(OUTPUT_SCHEMA.names) == {"label", "input_text", "input_input_text", "meta"}
    named = completion_row(Completion(request(1, keep={"text": "t", "absent": None}), "g", "stop", 2, 1), prefix="in.")
    assert set(named) - set(OUTPUT_SCHEMA.names) == {"in.text", "absent"}
    assert named["in.text"] == "t" and named["absent"] is None
    assert columns.selected(["a", "b"], "all") == ["a", "b"] and columns.selected(["a", "b"], "none") == []
    assert columns.selected(["a", "b"], ("c", "a")) == ["c", "a"]


def test_kept_columns_round_trip_with_their_types_across_parts(tmp_path: Path) -> None:
    rows = [
        {"source": "s#0", "n": 1, "score": 1, "label": 7, "tags": ["a"]},
        {"source": "s#1", "n": 2, "score": 2, "label": 8, "mixed": 1},
        # part 2: score turns float (promoted), label a string (JSON text in every part),
        # mixed holds a number and a string within the part (JSON text), extra is new (null before)
        {"source": "s#2", "n": 3, "score": 2.5, "label": "x", "mixed": "one", "extra": True},
        {"source": "s#3", "n": 4, "score": None, "label": None, "mixed": 2},
    ]
    with OutputWriter(tmp_path, rows_per_part=2) as out:
        for row in rows:
            out.add(row)
    first, second = (pq.read_schema(p) for p in part_files(tmp_path))
    assert first.names == OUTPUT_SCHEMA.names + ["n", "score", "label", "tags", "mixed"]
    assert first.field("n").type == pa.int64() and first.field("tags").type == pa.list_(pa.string())
    assert second.field("mixed").metadata == {b"spin_batch.encoding": b"json"}
    table = read_output_table(tmp_path)
    assert table.column_names == OUTPUT_SCHEMA.names + ["n", "score", "label", "tags", "mixed", "extra"]
    got = {name: table.column(name).to_pylist() for name in ["n", "score", "label", "tags", "mixed", "extra"]}
    assert got == {
        "n": [1, 2, 3, 4],
        "score": [1.0, 2.0, 2.5, None],
        "label": ["7", "8", '"x"', None],
        "tags": [["a"], None, None, None],
        "mixed": [None, "1", '"one"', "2"],
        "extra": [None, None, True, None],
    }
    assert read_outputs(tmp_path)["n"].to_list() == [1, 2, 3, 4]
    assert read_done(tmp_path)[0] == {"s#0", "s#1", "s#2", "s#3"}


def test_a_part_without_the_newer_columns_reads_them_as_null(tmp_path: Path) -> None:
    """A part written before endpoint, model and created were added to OUTPUT_SCHEMA."""
    old_schema = pa.schema([f for f in OUTPUT_SCHEMA if f.name not in ("endpoint", "model", "created")])
    with OutputWriter(tmp_path, run_id="20250101T000000000000_aaaaaa") as out:
        out.add(ok_row(0))
    old = tmp_path / "outputs" / "part-w0000-20240101T000000000000_old-00000.parquet"  # the earlier run
    row = schema.normalize_row(ok_row(1))
    pq.write_table(pa.Table.from_pylist([{k: row[k] for k in old_schema.names}], schema=old_schema), old)
    table = read_output_table(tmp_path)
    assert table.schema.equals(OUTPUT_SCHEMA)
    assert table.column("id").to_pylist() == ["r1", "r0"]
    assert table.column("endpoint").to_pylist()[0] is None and table.column("created").to_pylist()[0] is None
    assert read_done(tmp_path)[1] == {"r0", "r1"}


def test_read_outputs_empty(tmp_path: Path) -> None:
    df = read_outputs(tmp_path)
    assert df.height == 0 and df.columns == OUTPUT_SCHEMA.names
    assert df.schema["prompt_tokens"] == pl.Int32


def test_bad_constructor_args(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        OutputWriter(tmp_path, rows_per_part=0)
    with pytest.raises(ValueError):
        OutputWriter(tmp_path, worker="w/0")


# --------------------------------------------------------------------------
# StatsWriter
# --------------------------------------------------------------------------


def test_stats_union_of_keys(tmp_path: Path) -> None:
    with StatsWriter(tmp_path, worker="w0001", run_id="run1") as stats:
        stats.add({"t": 1.0, "tokens_per_s": 10.5, "pulls.ngram": 3})
        stats.add({"t": 2.0, "tokens_per_s": 11.0, "pulls.eagle": 1, "note": None})
        stats.flush()
        stats.add({"t": 3.0, "queue": 4})
    parts = sorted((tmp_path / "stats").glob("*.parquet"))
    assert [p.name for p in parts] == ["stats-w0001-run1-00000.parquet", "stats-w0001-run1-00001.parquet"]

    df = read_stats(tmp_path)
    assert df.height == 3
    assert set(df.columns) == {"t", "tokens_per_s", "pulls.ngram", "pulls.eagle", "note", "queue"}
    assert df["pulls.ngram"].to_list() == [3, None, None]
    assert df["pulls.eagle"].to_list() == [None, 1, None]
    assert df["queue"].to_list() == [None, None, 4]


def test_stats_type_widening_across_parts(tmp_path: Path) -> None:
    stats = StatsWriter(tmp_path)
    stats.add({"x": 1})
    stats.flush()
    stats.add({"x": 2.5})
    stats.close()
    stats.close()
    assert read_stats(tmp_path)["x"].to_list() == [1.0, 2.5]


def test_stats_empty(tmp_path: Path) -> None:
    assert read_stats(tmp_path).height == 0
    with StatsWriter(tmp_path):
        pass
    assert list((tmp_path / "stats").iterdir()) == []


def test_stats_default_run_id_unique(tmp_path: Path) -> None:
    assert StatsWriter(tmp_path).run_id != StatsWriter(tmp_path).run_id


# --------------------------------------------------------------------------
# write_json_atomic
# --------------------------------------------------------------------------


def test_write_json_atomic(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "manifest.json"
    write_json_atomic(target, {"b": 1, "a": {"z": [1, 2], "path": tmp_path}})
    text = target.read_text()
    assert json.loads(text) == {"a": {"path": str(tmp_path), "z": [1, 2]}, "b": 1}
    assert text.index('"a"') < text.index('"b"')
    assert '\n  "a": {' in text
    write_json_atomic(target, {"c": 3})
    assert json.loads(target.read_text()) == {"c": 3}
    assert [p.name for p in target.parent.iterdir()] == ["manifest.json"]


def test_write_json_atomic_failure_keeps_old_file(tmp_path: Path) -> None:
    target = tmp_path / "m.json"
    write_json_atomic(target, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(target, {"a": object()})
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_io_module_exports() -> None:
    assert {"OutputWriter", "StatsWriter"} <= set(writer.__all__)
    assert {"read_done", "drop_superseded"} <= set(outputs.__all__)
    assert {"OUTPUT_SCHEMA", "error_row"} <= set(schema.__all__)
    for module in (writer, outputs, schema):
        assert all(hasattr(module, name) for name in module.__all__), module.__name__
