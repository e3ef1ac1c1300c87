"""Row identity by content, parts checked whole (issue 45): a rerun finds each row's output by its id
and a digest of what decides its text, never by its file's path, and a part that does not read whole
is moved aside and its rows redone. Each end-to-end case counts every input id exactly once in the
parts and in `spin-batch export`.

The end-to-end cases run the CLI in-process (click's CliRunner) on the tiny random model, 2 tokens a
row; the rest reads rows and output folders directly.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import make_job, spec_of, write_jsonl
from spin_batch.io.identity import request_key
from spin_batch.io.outputs import read_output_table, read_written
from spin_batch.io.reader import iter_requests
from spin_batch.io.schema import OutputError, completion_row, error_row
from spin_batch.io.writer import OutputWriter
from spin_batch.records import Completion
from test_cli_e2e import _isolate_process_state  # noqa: F401 (autouse: signal handlers, SLURM_*, threads)
from test_cli_e2e import _describe, invoke, part_files, prompt_rows, read_rows, read_summary, run_ok

SECTIONS = {"sampling": {"max_tokens": 2}, "output": {"rows_per_part": 4}}


def exported(out: Path, tmp_path: Path) -> list[dict]:
    dest = tmp_path / "export.jsonl"
    result = invoke("export", out, "--to", dest)
    assert result.exit_code == 0, _describe(result)
    return [json.loads(line) for line in dest.read_text().splitlines()]


def count_ids(rows: list[dict]) -> Counter:
    return Counter(r["id"] for r in rows)


def assert_once_everywhere(out: Path, tmp_path: Path, expected: Counter) -> dict:
    """Each expected id as many times as expected (once, but for a repeated id), in the parts on disk
    and in the exported file; returns the parts' rows by (id, source line)."""
    parts, export = read_rows(out), exported(out, tmp_path)
    assert count_ids(parts) == expected, (count_ids(parts) - expected, expected - count_ids(parts))
    assert count_ids(export) == expected, (count_ids(export) - expected, expected - count_ids(export))
    return {(r["id"], r["source"].rsplit("#", 1)[1]): r for r in parts}


def texts(rows: dict) -> dict:
    return {r["id"]: r["text"] for r in rows.values() if r["status"] == "ok"}


# --------------------------------------------------------------------------
# a moved, renamed, symlinked or re-globbed input
# --------------------------------------------------------------------------


def test_a_moved_renamed_or_symlinked_input_folder_is_not_decoded_again(tmp_path, tiny_dir):
    rows = prompt_rows(15)
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", rows[:8])
    # b.jsonl also holds a line that is no row and a repeated id: both error rows, keyed by their place
    write_jsonl(data / "b.jsonl", rows[8:12] + ["{not json", {"id": "r003", "prompt": "again"}] + rows[12:])
    job, out = make_job(tmp_path, tiny_dir, [data], **SECTIONS)
    assert "15 ok, 2 error rows" in run_ok(job).stderr
    expected = Counter([r["id"] for r in rows] + [None, "r003"])
    first = texts(assert_once_everywhere(out, tmp_path, expected))

    data.rename(tmp_path / "moved")  # moved, and named by a glob now
    job, _ = make_job(tmp_path, tiny_dir, [tmp_path / "moved" / "*.jsonl"], **SECTIONS)
    result = run_ok(job)
    assert "0 ok, 0 error rows" in result.stderr, result.stderr
    assert read_summary(out)["rows_skipped_as_done"] == 17 and read_summary(out)["rows_replaced"] == 0
    assert texts(assert_once_everywhere(out, tmp_path, expected)) == first

    (tmp_path / "moved" / "a.jsonl").rename(tmp_path / "moved" / "z.jsonl")  # renamed: now after b.jsonl
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "moved")
    job, _ = make_job(tmp_path, tiny_dir, [link], **SECTIONS)
    assert "0 ok, 0 error rows" in run_ok(job).stderr
    assert texts(assert_once_everywhere(out, tmp_path, expected)) == first


def test_rows_dealt_to_other_workers_by_a_rename_stay_done(tmp_path, tiny_dir):
    """Two workers deal the files whole (shards[i::2]); a rename that reorders the files hands rows to
    the other worker, which finds them done (resume reads every worker's parts)."""
    ids = []
    for f in range(3):
        rows = prompt_rows(4, prefix=f"s{f}-")
        write_jsonl(tmp_path / "in" / f"shard-{f}.jsonl", rows)
        ids += [r["id"] for r in rows]
    job, out = make_job(tmp_path, tiny_dir, [tmp_path / "in"], **SECTIONS)
    for worker in ("0", "1"):
        run_ok(job, "--shard-index", worker, "--num-shards", "2")
    first = texts(assert_once_everywhere(out, tmp_path, Counter(ids)))

    (tmp_path / "in" / "shard-0.jsonl").rename(tmp_path / "in" / "zz-0.jsonl")  # order: 1, 2, zz-0
    for worker in ("0", "1"):
        result = run_ok(job, "--shard-index", worker, "--num-shards", "2")
        assert "0 ok, 0 error rows" in result.stderr, result.stderr
    assert texts(assert_once_everywhere(out, tmp_path, Counter(ids))) == first


# --------------------------------------------------------------------------
# an edited input: a row changed under its id is redone and replaces its old row
# --------------------------------------------------------------------------


def test_bad_lines_deleted_and_fixed_ones_appended_then_retry_errors(tmp_path, tiny_dir):
    rows = prompt_rows(10)
    bad = (3, 6)
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl",
                      [dict(r, prompt="") if i in bad else r for i, r in enumerate(rows)])
    job, out = make_job(tmp_path, tiny_dir, [src], **SECTIONS)
    assert "8 ok, 2 error rows" in run_ok(job).stderr
    ids = Counter(r["id"] for r in rows)
    assert_once_everywhere(out, tmp_path, ids)

    # the operator deletes the two bad lines and appends them fixed: every later line moves up
    write_jsonl(src, [r for i, r in enumerate(rows) if i not in bad] + [rows[i] for i in bad])
    result = run_ok(job, "--retry-errors")
    got = assert_once_everywhere(out, tmp_path, ids)  # before: r004 and r008 twice, r003 and r006 missing
    assert "2 ok, 0 error rows" in result.stderr, result.stderr
    assert "2 rows redone because their input changed under the same id" in result.stderr
    summary = read_summary(out)
    assert (summary["rows_skipped_as_done"], summary["rows_replaced"]) == (8, 2)
    assert all(r["status"] == "ok" for r in got.values())
    lines = {row_id: line for row_id, line in got}
    assert (lines["r003"], lines["r006"], lines["r009"]) == ("8", "9", "9")  # old rows keep where they were read

    # no --retry-errors needed where an ok row's input changes: it is redone too
    rows[4] = dict(rows[4], prompt="an edited prompt 4")
    write_jsonl(src, rows)
    result = run_ok(job)
    assert "1 ok, 0 error rows" in result.stderr and "1 rows redone" in result.stderr, result.stderr
    after = assert_once_everywhere(out, tmp_path, ids)
    assert read_summary(out)["rows_replaced"] == 1
    assert "0 ok, 0 error rows" in run_ok(job).stderr  # and done from then on
    assert assert_once_everywhere(out, tmp_path, ids) == after


# --------------------------------------------------------------------------
# a part garbled in a column resume does not key on
# --------------------------------------------------------------------------


def garble(part: Path, column: str) -> None:
    """Flip bytes in the middle of a column's data in a Parquet file (the footer stays readable)."""
    meta = pq.ParquetFile(part).metadata
    chunk = meta.row_group(0).column(meta.schema.to_arrow_schema().get_field_index(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(part.read_bytes())
    middle = start + chunk.total_compressed_size // 2
    for i in range(middle, middle + 8):
        data[i] ^= 0xFF
    part.write_bytes(bytes(data))


def test_a_part_garbled_in_a_non_key_column_fails_export_and_is_redone(tmp_path, tiny_dir):
    rows = prompt_rows(40)
    ids = Counter(r["id"] for r in rows)
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], **{**SECTIONS, "output": {"rows_per_part": 10}})
    run_ok(job)
    first = texts(assert_once_everywhere(out, tmp_path, ids))
    part = part_files(out)[1]
    in_part = pq.read_table(part, columns=["id"]).num_rows
    garble(part, "text")

    dest = tmp_path / "all.parquet"
    result = invoke("export", out, "--to", dest)  # never a file short of that part's rows
    assert result.exit_code == 1 and f"{part} cannot be read" in result.output, _describe(result)
    assert "run the job again" in result.output and not dest.exists()
    assert invoke("report", out).exit_code == 1

    result = run_ok(job)
    assert f"{part} cannot be read" in result.stderr and "moved aside to" in result.stderr, result.stderr
    assert f"{in_part} ok, 0 error rows" in result.stderr
    assert len(list((out / "outputs").glob(f"{part.name}.corrupt-*"))) == 1
    assert texts(assert_once_everywhere(out, tmp_path, ids)) == first
    assert "moved aside" not in run_ok(job).stderr


# --------------------------------------------------------------------------
# parts written before rows had a digest
# --------------------------------------------------------------------------


def strip_identity(out: Path) -> None:
    """Rewrite the parts as spin-batch wrote them before rows carried input_digest and input_key."""
    for part in part_files(out):
        table = pq.read_table(part)
        if "input_digest" in table.column_names:
            pq.write_table(table.drop_columns(["input_digest", "input_key"]), part)


def test_parts_without_a_digest_keep_resuming_and_a_move_replaces_their_rows(tmp_path, tiny_dir):
    rows = prompt_rows(6)
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows + ["{not json", {"id": "r001", "prompt": "again"}])
    job, out = make_job(tmp_path, tiny_dir, [src], **SECTIONS)
    run_ok(job)
    strip_identity(out)
    expected = Counter([r["id"] for r in rows] + [None, "r001"])
    result = run_ok(job)  # found by their old key, the source
    assert "0 ok, 0 error rows" in result.stderr, result.stderr
    assert_once_everywhere(out, tmp_path, expected)

    # moved: an old row is never given to a row read elsewhere, so the moved rows are redone once,
    # and each replaces its old row (one row per id); from then on they are found by their digest
    strip_identity(out)
    (tmp_path / "in").rename(tmp_path / "in2")
    job, _ = make_job(tmp_path, tiny_dir, [tmp_path / "in2"], **SECTIONS)
    result = run_ok(job, "--limit", "6")  # the id rows only (old rows without an id stay by their source)
    assert "6 ok, 0 error rows" in result.stderr and "6 rows redone" in result.stderr, result.stderr
    assert count_ids(exported(out, tmp_path)) == expected
    assert "0 ok, 0 error rows" in run_ok(job, "--limit", "6").stderr


# --------------------------------------------------------------------------
# the digest: what decides a row's text, nothing else
# --------------------------------------------------------------------------


def keys_by_id(path: Path, **kw) -> dict:
    return {r.id: (request_key(r), r.digest) for r in iter_requests([path], spec_of(kw), **kw)}


def test_the_digest_covers_prompt_messages_params_and_an_openai_body_only(tmp_path):
    base = [{"id": "a", "prompt": "hi", "tag": 1}, {"id": "b", "messages": [{"role": "user", "content": "x"}]},
            {"id": "c", "prompt": "yo", "p": {"temperature": 0.5}}]
    first = keys_by_id(write_jsonl(tmp_path / "one.jsonl", base), params_column="p")
    # another file, another place, another kept column value, a null params field: the same keys
    same = [{"tag": 2, "prompt": "hi", "id": "a"}, {"id": "b", "messages": [{"role": "user", "content": "x"}]},
            {"id": "c", "prompt": "yo", "p": {"temperature": 0.5, "seed": None}}]
    assert keys_by_id(write_jsonl(tmp_path / "sub" / "two.jsonl", [""] + same), params_column="p") == first
    for i, changed in ((0, {"prompt": "hi!"}), (1, {"messages": [{"role": "user", "content": "y"}]}),
                       (2, {"p": {"temperature": 0.6}})):
        rows = [dict(r) for r in base]
        rows[i].update(changed)
        again = keys_by_id(write_jsonl(tmp_path / f"c{i}.jsonl", rows), params_column="p")
        assert [k for k in first if again[k] != first[k]] == [base[i]["id"]]
        assert again[base[i]["id"]][0] == first[base[i]["id"]][0]  # the same id key, another digest

    line = {"custom_id": "q", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 3}}
    q = keys_by_id(write_jsonl(tmp_path / "o1.jsonl", [line]))["q"]
    assert keys_by_id(write_jsonl(tmp_path / "o2.jsonl", [dict(line, extra=1)]))["q"] == q
    other = dict(line, body={"prompt": "hi", "max_tokens": 4})
    assert keys_by_id(write_jsonl(tmp_path / "o3.jsonl", [other]))["q"][1] != q[1]


def test_rows_without_a_usable_id_are_keyed_by_their_content_and_order(tmp_path):
    lines = ["{bad", {"id": "a", "prompt": "x"}, "{bad", {"id": "a", "prompt": "x"}, {"prompt": "no id"}]
    one = [request_key(r) for r in iter_requests([write_jsonl(tmp_path / "one.jsonl", lines)])]
    assert one[1] == ("id", "a") and len(set(one)) == 5
    assert one[0][3] == "0" and one[2][3] == "1" and one[0][:3] == one[2][:3]  # the same bad line twice
    moved = [request_key(r) for r in iter_requests([write_jsonl(tmp_path / "x" / "two.jsonl", ["", *lines])])]
    assert moved == one
    split = [request_key(r) for r in iter_requests([tmp_path / "one.jsonl"], shard_index=0, num_shards=2)]
    assert [k[3] for k in split if k[0] == "at"] == ["0/w0000", "1/w0000", "0/w0000"]  # rows 0, 2 and 4 of 5


def test_done_skips_by_digest_and_old_rows_by_their_source(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    a, b = list(iter_requests([src]))
    with OutputWriter(tmp_path / "out") as w:
        w.add(completion_row(Completion(a, "out a", "stop", 1)))
        w.add(error_row(b.source, "b", "made before digests"))  # no digest: an old part's row
    done = read_written(tmp_path / "out")
    assert done(a) and done(b) and not done.replaces(a) and not done.replaces(b)
    moved = write_jsonl(tmp_path / "moved.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    a2, b2 = list(iter_requests([moved]))
    assert done(a2) and not done(b2) and done.replaces(b2)  # an old row is never given to another place
    assert not read_written(tmp_path / "out", retry_errors=True)(b)
    changed = write_jsonl(tmp_path / "changed.jsonl", [{"id": "a", "prompt": "z"}])
    (a3,) = iter_requests([changed])
    assert not done(a3) and done.replaces(a3)
    with OutputWriter(tmp_path / "out") as w:  # a later run's rows replace the older ones: one per id
        w.add(completion_row(Completion(a3, "out z", "stop", 1)))
        w.add(completion_row(Completion(b2, "out b", "stop", 1)))
    table = read_output_table(tmp_path / "out")
    assert sorted(zip(table.column("id").to_pylist(), table.column("text").to_pylist())) == [
        ("a", "out z"), ("b", "out b")]


def test_an_output_row_carries_its_digest_and_key(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["{bad", {"id": "a", "prompt": "x"}])
    bad, a = list(iter_requests([src]))
    row, bad_out = completion_row(Completion(a, "t", "stop", 1)), completion_row(Completion.failed(bad, "no"))
    assert (row["input_digest"], row["input_key"]) == (a.digest, None) and len(a.digest) == 32
    assert (bad_out["input_digest"], bad_out["input_key"]) == (bad.digest, "0")
    with OutputWriter(tmp_path / "out") as w:
        with pytest.raises(OutputError, match="input_key"):
            w.add(dict(row, input_key=3))


def test_a_part_without_checksums_whose_text_is_not_utf8_is_moved_aside(tmp_path):
    """Parts written before page checksums: a flipped byte that still decodes is found where it breaks
    a string's UTF-8 (every column is checked, not only the key columns)."""
    with OutputWriter(tmp_path, rows_per_part=2) as w:
        for i in range(4):
            w.add({"id": f"r{i}", "source": f"/in/a.jsonl#{i}", "text": f"zzzzzzzz{i}", "input_digest": f"{i:032x}"})
    part = part_files(tmp_path)[0]
    pq.write_table(pq.read_table(part), part, compression="NONE", use_dictionary=False, write_statistics=False)
    data = bytearray(part.read_bytes())
    data[data.index(b"zzzzzzzz0")] = 0xFF
    part.write_bytes(bytes(data))
    assert pq.read_table(part).num_rows == 2  # it reads, but its text is not UTF-8
    with pytest.raises(OutputError, match=f"{part} cannot be read .*UTF8"):
        read_output_table(tmp_path)
    said: list[str] = []
    done = read_written(tmp_path, warn=said.append)
    assert sorted(w.id for w in done.latest.values()) == ["r2", "r3"]
    assert len(said) == 1 and "moved aside" in said[0] and not part.exists()
