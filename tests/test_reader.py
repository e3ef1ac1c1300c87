"""Tests for spin_batch.io's input side: shards, rows, openai_request, reader and checks."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spin_batch.io import checks, reader
from spin_batch.io import shards as shards_module
from spin_batch.io.checks import check_columns, check_input
from spin_batch.io.reader import iter_requests
from spin_batch.io.rows import row_spec
from spin_batch.io.shards import (InputError, assign, count_rows, list_shards, shard_defaults_from_env,
                                  worker_sources)
from spin_batch.records import NO_PARAMS, Request, RowParams

from conftest import spec_of
from test_cli_e2e import _isolate_process_state  # noqa: F401  (autouse: a real run below installs signal handlers)

# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list) -> Path:
    """Write rows (dicts are JSON-encoded, str/bytes written verbatim) one per line."""
    with open(path, "wb") as handle:
        for row in rows:
            if isinstance(row, bytes):
                handle.write(row + b"\n")
            elif isinstance(row, str):
                handle.write(row.encode("utf-8") + b"\n")
            else:
                handle.write(json.dumps(row).encode("utf-8") + b"\n")
    return path


def write_parquet(path: Path, columns: dict, **kwargs) -> Path:
    pq.write_table(pa.table(columns), path, **kwargs)
    return path


def prompts_file(path: Path, start: int, count: int) -> Path:
    rows = [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(start, start + count)]
    if path.suffix == ".parquet":
        return write_parquet(path, {"id": [r["id"] for r in rows], "prompt": [r["prompt"] for r in rows]})
    return write_jsonl(path, rows)


def all_requests(path_or_paths, **kwargs) -> list[Request]:
    paths = path_or_paths if isinstance(path_or_paths, list) else [path_or_paths]
    return list(iter_requests(list_shards([str(p) for p in paths]), spec_of(kwargs), **kwargs))


# --------------------------------------------------------------------------
# list_shards
# --------------------------------------------------------------------------


def test_list_shards_files_globs_and_directories(tmp_path: Path) -> None:
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    a = prompts_file(tmp_path / "a.jsonl", 0, 1)
    b = prompts_file(tmp_path / "b.parquet", 0, 1)
    c = prompts_file(tmp_path / "sub" / "c.jsonl", 0, 1)
    d = prompts_file(tmp_path / "sub" / "deep" / "d.parquet", 0, 1)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "meta.json").write_text("{}")
    (tmp_path / ".hidden.jsonl").write_text("")

    assert list_shards([str(tmp_path)]) == sorted([a.resolve(), b.resolve()])
    assert list_shards([str(tmp_path / "**" / "*.parquet")]) == sorted([b.resolve(), d.resolve()])
    assert list_shards([str(tmp_path / "sub" / "*")]) == [c.resolve()]
    # explicit file + overlapping glob -> de-duplicated, sorted, absolute
    got = list_shards([str(c), str(tmp_path / "*.jsonl"), str(c)])
    assert got == sorted([a.resolve(), c.resolve()])
    assert all(p.is_absolute() for p in got)


def test_list_shards_format_restricts(tmp_path: Path) -> None:
    a = prompts_file(tmp_path / "a.jsonl", 0, 1)
    b = prompts_file(tmp_path / "b.parquet", 0, 1)
    assert list_shards([str(tmp_path)], fmt="jsonl") == [a.resolve()]
    assert list_shards([str(tmp_path)], fmt="parquet") == [b.resolve()]
    with pytest.raises(InputError, match="parquet"):
        list_shards([str(a)], fmt="parquet")
    with pytest.raises(InputError, match="unknown input format"):
        list_shards([str(a)], fmt="csv")


def test_list_shards_no_match_names_entry(tmp_path: Path) -> None:
    prompts_file(tmp_path / "a.jsonl", 0, 1)
    missing = str(tmp_path / "nope" / "*.jsonl")
    with pytest.raises(InputError, match="nope"):
        list_shards([str(tmp_path / "a.jsonl"), missing])
    with pytest.raises(InputError, match="missing.jsonl"):
        list_shards([str(tmp_path / "missing.jsonl")])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="empty"):
        list_shards([str(empty)])
    (tmp_path / "x.csv").write_text("id\n")
    with pytest.raises(InputError, match="unsupported"):
        list_shards([str(tmp_path / "x.csv")])


# --------------------------------------------------------------------------
# env defaults and assign
# --------------------------------------------------------------------------


def test_shard_defaults_from_env() -> None:
    assert shard_defaults_from_env({}) == (0, 1)
    assert shard_defaults_from_env({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4"}) == (2, 4)
    env = {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "5"}
    assert shard_defaults_from_env(env) == (2, 4)
    env = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "6", "SLURM_ARRAY_TASK_STEP": "2"}
    assert shard_defaults_from_env(env) == (2, 4)


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "4"},
        {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "four"},
        {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"},
        {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "0"},
        {"SLURM_ARRAY_TASK_ID": "1"},
        {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "3"},
    ],
)
def test_shard_defaults_from_env_bad_values(env: dict) -> None:
    with pytest.raises(InputError):
        shard_defaults_from_env(env)


def test_assign_file_mode_and_row_mode() -> None:
    files = [Path(f"/d/{i}.jsonl") for i in range(5)]
    assert assign(files, 1, 2) == ([files[1], files[3]], None)
    assert assign(files, 0, 5) == ([files[0]], None)
    assert assign(files, 0, 1) == (files, None)
    assert assign(files[:2], 2, 3) == (files[:2], 3)
    for index, count in [(-1, 2), (2, 2), (0, 0)]:
        with pytest.raises(InputError):
            assign(files, index, count)


@pytest.mark.parametrize("num_files", [2, 5])
def test_workers_cover_every_row_exactly_once(tmp_path: Path, num_files: int) -> None:
    for i in range(num_files):
        suffix = ".parquet" if i % 2 else ".jsonl"
        prompts_file(tmp_path / f"f{i}{suffix}", i * 100, 7 + i)
    shards = list_shards([str(tmp_path)])
    everything = [r.source for r in iter_requests(shards)]
    assert len(everything) == len(set(everything)) == sum(7 + i for i in range(num_files))

    per_worker = [[r.source for r in iter_requests(shards, shard_index=w, num_shards=3)] for w in range(3)]
    combined = [s for sources in per_worker for s in sources]
    assert sorted(combined) == sorted(everything)
    assert all(sources for sources in per_worker)


def _dealt(shards: list[Path], workers: int) -> list[list[str]]:
    return [[r.source for r in iter_requests(shards, shard_index=w, num_shards=workers)] for w in range(workers)]


def test_fewer_files_than_workers_deals_rows_evenly(tmp_path: Path) -> None:
    """3 workers over 1 file of 80 rows: 27 / 27 / 26, every row once."""
    shards = list_shards([str(prompts_file(tmp_path / "one.jsonl", 0, 80))])
    per_worker = _dealt(shards, 3)
    assert [len(s) for s in per_worker] == [27, 27, 26]
    combined = [s for sources in per_worker for s in sources]
    assert sorted(combined) == sorted(r.source for r in iter_requests(shards)) and len(set(combined)) == 80
    assert per_worker[1][:2] == [f"{shards[0]}#1", f"{shards[0]}#4"]  # the sources are the resume keys as before


@pytest.mark.parametrize("sizes", [(3, 30, 2, 5, 40), (1, 1, 1, 1, 60)])
def test_uneven_files_deal_rows(tmp_path: Path, sizes: tuple[int, ...]) -> None:
    """4 workers over 5 uneven files (dealt whole, one worker would get most of the rows): rows are
    dealt, and the workers' counts differ by at most one; JSONL and Parquet alike."""
    start = 0
    for i, n in enumerate(sizes):
        prompts_file(tmp_path / f"f{i}{'.parquet' if i % 2 else '.jsonl'}", start, n)
        start += n
    shards = list_shards([str(tmp_path)])
    assert assign(shards, 0, 4) == (shards, 4)
    per_worker = _dealt(shards, 4)
    counts = [len(s) for s in per_worker]
    assert max(counts) - min(counts) <= 1 and sum(counts) == sum(sizes)
    combined = [s for sources in per_worker for s in sources]
    assert len(set(combined)) == len(combined) == sum(sizes)
    for w in range(4):  # the rows the bar counts (runner.worker_rows) are the rows read
        assert list(worker_sources(shards, w, 4)) == per_worker[w]


def test_even_files_are_dealt_whole(tmp_path: Path) -> None:
    for i, n in enumerate((10, 12, 9, 11)):
        prompts_file(tmp_path / f"f{i}.jsonl", i * 100, n)
    shards = list_shards([str(tmp_path)])
    assert assign(shards, 1, 2) == ([shards[1], shards[3]], None)  # 23 and 19 rows of 42
    assert list(worker_sources(shards, 1, 2)) == [r.source for r in iter_requests(shards, shard_index=1, num_shards=2)]


def test_the_demo_prompts_are_dealt_by_rows_over_three_tasks() -> None:
    """examples/prompts holds 8 + 37 + 35 rows: whole files gave three tasks 8 / 37 / 35."""
    shards = list_shards([str(Path(__file__).resolve().parents[1] / "examples" / "prompts")])
    assert [len(s) for s in _dealt(shards, 3)] == [27, 27, 26]


def test_a_resumed_row_dealt_worker_reads_each_row_once(tmp_path: Path) -> None:
    """A worker killed part way (its written rows are done_sources on the rerun) resumes with exactly
    the rest of its own rows; together the workers read every row once."""
    shards = list_shards([str(prompts_file(tmp_path / "one.jsonl", 0, 50))])
    first = [r.source for r in itertools.islice(iter_requests(shards, shard_index=2, num_shards=3), 6)]
    skipped: list[str] = []
    rest = [r.source for r in iter_requests(shards, shard_index=2, num_shards=3, done_sources=set(first),
                                            on_skip=lambda r: skipped.append(r.source))]
    assert skipped == first and not set(first) & set(rest)
    mine = first + rest
    assert mine == _dealt(shards, 3)[2]
    others = _dealt(shards, 3)[0] + _dealt(shards, 3)[1]
    assert sorted(mine + others) == sorted(r.source for r in iter_requests(shards))


def test_worker_sources_pass_rows_over_unparsed(tmp_path: Path) -> None:
    """A bad line counts as a row (it is an error row) wherever it is dealt; blank lines do not."""
    path = write_jsonl(tmp_path / "a.jsonl", [{"id": "a", "prompt": "p"}, "", b"{broken", {"id": "b", "prompt": "q"}])
    shards = list_shards([str(path)])
    assert list(worker_sources(shards, 1, 2)) == [f"{shards[0]}#2"]
    assert [r.error for r in iter_requests(shards, shard_index=1, num_shards=2)] == [
        "invalid JSON: Expecting property name enclosed in double quotes (column 2)"]
    assert count_rows(shards[0]) == 3


# --------------------------------------------------------------------------
# iter_requests: good rows
# --------------------------------------------------------------------------


def test_jsonl_rows_sources_and_blank_lines(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": 1, "prompt": "hello"}, "", "   ", {"id": "b", "prompt": "world"}],
    )
    got = all_requests(path)
    base = str(path.resolve())
    assert got == [
        Request(f"{base}#0", "1", "hello", None),
        Request(f"{base}#3", "b", "world", None),
    ]
    assert all(r.ok for r in got)


def test_jsonl_utf8_bom_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "x"}\r\n{"id": "b", "prompt": "y"}\r\n')
    got = all_requests(path)
    assert [(r.id, r.prompt, r.ok) for r in got] == [("a", "x", True), ("b", "y", True)]


def test_a_jsonl_line_over_max_line_bytes_is_an_error_row_never_read_whole(tmp_path: Path) -> None:
    import tracemalloc

    limit = 1 << 20
    ok = json.dumps({"id": "a", "prompt": "x" * (limit - 40)}).encode()
    ok = ok[:-2] + b"x" * (limit - len(ok)) + ok[-2:]  # exactly max_line_bytes, newline excluded
    path = tmp_path / "long.jsonl"
    with open(path, "wb") as f:
        f.write(ok + b"\n")
        big = b'{"id": "big", "prompt": "' + b"y" * (24 << 20) + b'"}'  # 24 MiB
        f.write(big + b"\n\n" + json.dumps({"id": "c", "prompt": "after"}).encode() + b"\n")
        tail = b'{"id": "tail", "prompt": "' + b"z" * limit + b'"}'
        f.write(tail)  # no newline at the end
    tracemalloc.start()
    try:
        got = all_requests(path, max_line_bytes=limit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 * limit, f"peak {peak / 2**20:.1f} MiB while reading a 24 MiB line with a 1 MiB bound"
    base = str(path.resolve())
    assert [(r.source, r.id, r.ok) for r in got] == [
        (f"{base}#0", "a", True), (f"{base}#1", None, False), (f"{base}#3", "c", True), (f"{base}#4", None, False)]
    assert got[0].prompt == "x" * (len(got[0].prompt))
    assert got[1].error == f"line is {len(big)} bytes, more than input.max_line_bytes ({limit}); not read"
    assert got[3].error.startswith(f"line is {len(tail)} bytes")
    assert any("1 bad row (line too long)" in p for p in check_input([path.resolve()], max_line_bytes=24 << 20))


def test_jsonl_columns_checked_from_the_first_rows(tmp_path: Path) -> None:
    """A JSONL job whose prompt_column (or id/messages column) names a field none of the first
    rows has is a job error before any model loads, as a Parquet shard's missing column is."""
    rows = [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(150)]
    path = write_jsonl(tmp_path / "a.jsonl", ["", b"not json", *rows])
    shards = [path.resolve()]
    check_columns(shards)  # fine as it is
    with pytest.raises(InputError, match=r"a.jsonl: needs a prompt column 'promt' or a messages column 'messages': "
                                         r"none of its first 99 rows has it \(fields: id, prompt\)"):
        check_columns(shards, row_spec(prompt_column="promt"))
    with pytest.raises(InputError, match="missing id column 'uid'"):
        check_columns(shards, row_spec(id_column="uid"))
    # a field that only later rows have is not looked for past the first rows
    late = write_jsonl(tmp_path / "late.jsonl", [{"id": "x", "messages": None}] * 3 + [{"id": "y", "prompt": "p"}])
    check_columns([late.resolve()], jsonl_rows=4)
    with pytest.raises(InputError, match="none of its first 3 rows"):
        check_columns([late.resolve()], row_spec(messages_column="chat"), jsonl_rows=3)
    # nothing to judge by: no JSON objects among the first rows
    junk = write_jsonl(tmp_path / "junk.jsonl", [b"[1]", b"{bad"])
    check_columns([junk.resolve()], row_spec(prompt_column="promt"))


def test_parquet_rows_and_custom_columns(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "in.parquet",
        {"uid": [10, 11], "text": ["a", "b"], "other": [1.0, 2.0]},
    )
    got = all_requests(path, id_column="uid", prompt_column="text")
    base = str(path.resolve())
    assert got == [Request(f"{base}#0", "10", "a", None), Request(f"{base}#1", "11", "b", None)]


def test_messages_rows_jsonl_and_parquet(tmp_path: Path) -> None:
    chat = [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]
    jsonl = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"id": "a", "messages": chat, "prompt": None}, {"id": "b", "messages": None, "prompt": "plain"}],
    )
    got = all_requests(jsonl)
    assert got[0].messages == tuple(chat) and got[0].prompt is None and got[0].ok
    assert got[1].prompt == "plain" and got[1].messages is None

    parquet = write_parquet(tmp_path / "chat.parquet", {"id": ["c", "d"], "messages": [chat, None]})
    got = all_requests(parquet)
    assert got[0].ok and got[0].messages == tuple(chat)
    assert got[1].error == "missing prompt" and got[1].id == "d"


def test_a_row_with_both_prompt_and_messages_is_an_error_row(tmp_path: Path) -> None:
    """Which of the two to decode would be a guess (a dataset may hold a flattened prompt beside a
    whole conversation): the row says so, and a row with one of them null is fine."""
    chat = [{"role": "user", "content": "hi"}]
    jsonl = write_jsonl(tmp_path / "both.jsonl", [{"id": "a", "messages": chat, "prompt": "other"},
                                                  {"id": "b", "messages": chat, "prompt": None}])
    parquet = write_parquet(tmp_path / "both.parquet", {"id": ["c", "d"], "prompt": ["other", None],
                                                        "messages": [chat, chat]})
    for path in (jsonl, parquet):
        both, one = all_requests(path)
        assert not both.ok and both.messages is None and both.prompt is None
        assert both.error == "row has both 'prompt' and 'messages'; give one of them (the other null or absent)"
        assert one.ok and one.messages == tuple(chat)
    ray = reader.requests_from_rows([{"id": "e", "text": "x", "chat": chat}],
                                    row_spec(prompt_column="text", messages_column="chat"))
    assert ray[0].error.startswith("row has both 'text' and 'chat'")


def test_params_column_jsonl_and_parquet(tmp_path: Path) -> None:
    """input.params_column: an object (a Parquet struct) of sampling fields; null or a field left
    out takes the job's value."""
    params = [{"max_tokens": 5, "temperature": 0.5, "stop": ["\n"]}, None, {"top_k": 3, "seed": 9, "top_p": 0.5}]
    jsonl = write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": "x", "sampling": v} for i, v in enumerate(params)])
    struct = pa.struct([("max_tokens", pa.int64()), ("temperature", pa.float64()), ("top_p", pa.float64()),
                        ("top_k", pa.int32()), ("stop", pa.list_(pa.string())), ("seed", pa.int64())])
    parquet = write_parquet(tmp_path / "p.parquet", {"id": ["r0", "r1", "r2"], "prompt": ["x"] * 3,
                                                     "sampling": pa.array(params, struct)})
    expected = [RowParams(max_tokens=5, temperature=0.5, stop=("\n",)), NO_PARAMS, RowParams(top_p=0.5, top_k=3, seed=9)]
    for path in (jsonl, parquet):
        got = all_requests(path, params_column="sampling")
        assert [r.params for r in got] == expected and all(r.ok for r in got)
        assert all(r.params == NO_PARAMS for r in all_requests(path))  # not read unless named


def test_a_jobs_input_spec_is_read_whole(tmp_path: Path) -> None:
    """One Spec from the job (io.rows.input_spec) carries every input option: the columns, the params
    column, the kept columns and the format; run, validate, bench and distill all read with it, so a
    row has the same params and digest in each (bench and distill once passed the three columns alone)."""
    from spin_batch.config import parse_job
    from spin_batch.io.rows import input_spec

    path = write_jsonl(tmp_path / "p.jsonl", [{"key": "a", "text": "x", "sampling": {"max_tokens": 5}, "topic": "t"}])
    job = parse_job({"input": {"paths": [str(path)], "id_column": "key", "prompt_column": "text",
                               "params_column": "sampling", "format": "jsonl"},
                     "output": {"dir": str(tmp_path / "out"), "keep_columns": ["topic"]}})
    spec = input_spec(job.input, job.output.keep_columns)
    assert spec == row_spec("key", "text", "messages", "sampling", ["topic"], "jsonl")
    (req,) = iter_requests([path], spec)
    assert req.ok and req.id == "a" and req.params == RowParams(max_tokens=5) and req.keep == {"topic": "t"}
    (bare,) = iter_requests([path], row_spec("key", "text"))  # the columns alone: no params, another digest
    assert bare.params == NO_PARAMS and bare.digest != req.digest


@pytest.mark.parametrize("value, message", [
    ({"temperature": -1}, "sampling.temperature must be a number >= 0, got -1"),
    ({"top_p": 0.0}, "sampling.top_p must be a number in (0, 1], got 0.0"),
    ({"top_k": -3}, "sampling.top_k must be -1 or 0 (off) or an integer >= 1, got -3"),
    ({"max_tokens": -1}, "sampling.max_tokens must be an integer >= 0, got -1"),  # 0: score the prompt only
    ({"seed": 1.5}, "sampling.seed must be an integer, got 1.5"),
    ({"stop": ""}, 'sampling.stop must be a non-empty string, got ""'),
    ({"temperature": "0.7"}, 'sampling.temperature must be a number, got "0.7"'),
    ({"temperature": float("inf")}, "sampling.temperature must be a finite number, got Infinity"),
    ({"temp": 0.7}, "sampling.temp is not a sampling field; the fields are max_tokens, max_completion_tokens, "),
    ("hot", 'sampling must be an object with sampling fields'),
])
def test_a_bad_params_value_is_an_error_row(tmp_path: Path, value, message: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "x", "sampling": value}, {"id": "b", "prompt": "y"}])
    bad, fine = all_requests(path, params_column="sampling")
    assert message in bad.error, bad.error
    assert bad.id == "a" and bad.prompt is None and fine.ok


def test_nan_in_a_params_column_is_an_error_row(tmp_path: Path) -> None:
    path = tmp_path / "nan.jsonl"
    path.write_text('{"id": "a", "prompt": "x", "sampling": {"top_p": NaN}}\n')
    assert all_requests(path, params_column="sampling")[0].error == "sampling.top_p must be a finite number, got NaN"
    parquet = write_parquet(tmp_path / "nan.parquet", {"id": ["a"], "prompt": ["x"],
                                                       "sampling": [{"temperature": float("nan")}]})
    assert "sampling.temperature must be a finite number" in all_requests(parquet, params_column="sampling")[0].error


def test_a_parquet_shard_without_the_params_column_is_an_input_error(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "a.parquet", {"id": ["a"], "prompt": ["x"]})
    with pytest.raises(InputError, match=r"missing params column 'sampling' \(input.params_column\)"):
        all_requests(path, params_column="sampling")
    with pytest.raises(InputError, match="missing params column"):
        check_columns([path.resolve()], row_spec(params_column="sampling"))


def test_keep_columns_jsonl(tmp_path: Path) -> None:
    rows = [{"id": "a", "prompt": "x", "topic": "t", "n": 1, "sampling": None}, {"id": "b", "prompt": "y", "extra": [1]},
            {"prompt": "z", "topic": "u"}]
    path = write_jsonl(tmp_path / "k.jsonl", rows)
    a, b, bad = all_requests(path, keep_columns="all", params_column="sampling")
    assert a.keep == {"topic": "t", "n": 1} and b.keep == {"extra": [1]}  # not the request's own columns
    assert not bad.ok and bad.keep is None  # no id: the row is not read further
    a, b, _ = all_requests(path, keep_columns=["topic", "prompt"])
    assert a.keep == {"topic": "t", "prompt": "x"} and b.keep == {"topic": None, "prompt": "y"}
    assert all(r.keep is None for r in all_requests(path)) and all_requests(path, keep_columns="none")[0].keep is None


def test_keep_columns_ride_along_on_error_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "k.jsonl", [{"id": "a", "prompt": "", "topic": "t"}])
    (row,) = all_requests(path, keep_columns="all")
    assert row.error == "empty prompt" and row.keep == {"topic": "t"}


def test_a_kept_value_that_is_not_valid_text_is_an_error_row(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": "a", "prompt": "x", "note": {"k": ["\\ud800"]}}\n')
    (row,) = all_requests(path, keep_columns="all")
    assert row.error.startswith("column 'note' holds a lone surrogate")
    assert all_requests(path)[0].ok  # not kept: not looked at


def test_keep_columns_parquet_reads_what_it_keeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_parquet(tmp_path / "k.parquet", {"id": ["a"], "prompt": ["x"], "topic": ["t"], "big": [b"\0" * 9]})
    calls = []
    original = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        calls.append(kwargs["columns"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    assert all_requests(path)[0].keep is None
    assert all_requests(path, keep_columns="all")[0].keep == {"topic": "t", "big": b"\0" * 9}
    assert all_requests(path, keep_columns=["topic"])[0].keep == {"topic": "t"}
    assert calls == [["id", "prompt"], ["id", "prompt", "topic", "big"], ["id", "prompt", "topic"]]
    with pytest.raises(InputError, match="missing column 'topc' named in output.keep_columns"):
        all_requests(path, keep_columns=["topc"])


# --------------------------------------------------------------------------
# iter_requests: bad rows
# --------------------------------------------------------------------------

BAD_ROWS = [
    (b'{"id": "a", "prompt": ', "invalid JSON", None),
    (b"[1, 2]", "row must be a JSON object, got list", None),
    (b'{"id": "\xff\xfe", "prompt": "x"}', "invalid UTF-8", None),
    (b'{"prompt": "x"}', "missing id", None),
    (b'{"id": null, "prompt": "x"}', "missing id", None),
    (b'{"id": true, "prompt": "x"}', "id must be a string or integer, got bool", None),
    (b'{"id": 1.5, "prompt": "x"}', "id must be a string or integer, got float", None),
    (b'{"id": "", "prompt": "x"}', "empty id", None),
    (b'{"id": "m1"}', "missing prompt", "m1"),
    (b'{"id": "m2", "prompt": null, "messages": null}', "missing prompt", "m2"),
    (b'{"id": "t", "prompt": 5}', "prompt must be a string, got int", "t"),
    (b'{"id": "e", "prompt": ""}', "empty prompt", "e"),
    (b'{"id": "w", "prompt": " \\n\\t"}', "empty prompt", "w"),
    (b'{"id": "g1", "messages": []}', "messages must not be empty", "g1"),
    (b'{"id": "g2", "messages": "hi"}', "messages must be a list", "g2"),
    (b'{"id": "g3", "messages": ["hi"]}', "messages[0] must be an object", "g3"),
    (b'{"id": "g4", "messages": [{"role": "user"}]}', "messages[0].content must be a string", "g4"),
    (b'{"id": "g5", "messages": [{"content": "x"}]}', "messages[0].role", "g5"),
    (b'{"id": "g6", "messages": [{"role": "user", "content": 3}]}', "messages[0].content", "g6"),
    # JSON escapes can spell lone surrogates, which are not Unicode text (a tokenizer raises on them)
    (b'{"id": "s1", "prompt": "bad \\ud800 here"}', "prompt holds a lone surrogate ('\\ud800' at character 4)", "s1"),
    (b'{"id": "s\\udc00", "prompt": "x"}', "id holds a lone surrogate", None),
    (b'{"id": "s2", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content holds a lone", "s2"),
]


@pytest.mark.parametrize(("line", "message", "row_id"), BAD_ROWS)
def test_bad_row_becomes_error_and_stream_continues(tmp_path: Path, line: bytes, message: str, row_id) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"id": "before", "prompt": "ok"}, line, {"id": "after", "prompt": "ok"}])
    got = all_requests(path)
    assert [r.ok for r in got] == [True, False, True]
    bad = got[1]
    assert bad.source.endswith("#1")
    assert message in bad.error
    assert bad.id == row_id
    assert bad.prompt is None and bad.messages is None


def test_all_bad_rows_in_one_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [line for line, _, _ in BAD_ROWS] + [{"id": "z", "prompt": "ok"}])
    got = all_requests(path)
    assert len(got) == len(BAD_ROWS) + 1
    assert [r.ok for r in got] == [False] * len(BAD_ROWS) + [True]


def test_parquet_bad_rows(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "bad.parquet",
        {"id": ["a", None, "", "d"], "prompt": ["x", "y", "z", "   "]},
    )
    assert [r.error for r in all_requests(path)] == [None, "missing id", "empty id", "empty prompt"]


def test_parquet_strings_that_are_not_utf8_become_error_rows(tmp_path: Path) -> None:
    """Parquet stores strings as bytes it does not check; pyarrow fails a whole batch on one bad value."""
    path = tmp_path / "bytes.parquet"
    raw = pa.array([b"ok", b"bad \xff here", b"fine", b"\xfe"], type=pa.binary())
    ids = pa.array([b"a", b"b", b"c\xff", b"d"], type=pa.binary())
    pq.write_table(pa.table({"id": ids.cast(pa.string(), safe=False), "prompt": raw.cast(pa.string(), safe=False)}), path)
    got = all_requests(path)
    assert [(r.id, r.error) for r in got] == [
        ("a", None),
        ("b", "invalid UTF-8 in column 'prompt' at byte 4"),
        (None, "invalid UTF-8 in column 'id' at byte 1"),
        ("d", "invalid UTF-8 in column 'prompt' at byte 0"),
    ]


# --------------------------------------------------------------------------
# duplicates, resume, limit
# --------------------------------------------------------------------------


def test_duplicate_ids_within_run_and_prefilled(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "dup.jsonl",
        [
            {"id": "a", "prompt": "1"},
            {"id": "a", "prompt": "2"},
            {"id": 7, "prompt": "3"},
            {"id": "7", "prompt": "4"},
            {"id": "b", "prompt": ""},
            {"id": "b", "prompt": "5"},
            {"id": "old", "prompt": "6"},
        ],
    )
    seen = {"old"}
    got = all_requests(path, seen_ids=seen)
    assert [r.error for r in got] == [
        None,
        "duplicate id 'a'",
        None,
        "duplicate id '7'",
        "empty prompt",
        None,
        "duplicate id 'old'",
    ]
    assert got[1].id == "a"
    assert seen == {"a", "7", "b", "old"}


def test_done_sources_are_skipped(tmp_path: Path) -> None:
    path = prompts_file(tmp_path / "in.jsonl", 0, 5)
    first = all_requests(path)
    done = {first[0].source, first[2].source}
    again = all_requests(path, done_sources=done)
    assert [r.id for r in again] == ["r1", "r3", "r4"]


def test_resume_keeps_duplicate_detection(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "1"}, {"id": "a", "prompt": "2"}])
    first = all_requests(path)
    resumed = all_requests(path, done_sources={first[0].source})
    assert [r.error for r in resumed] == ["duplicate id 'a'"]


def test_limit_counts_rows_before_resume_skipping(tmp_path: Path) -> None:
    path = prompts_file(tmp_path / "in.jsonl", 0, 20)
    first = all_requests(path, limit=10)
    assert [r.id for r in first] == [f"r{i}" for i in range(10)]
    done = {r.source for r in first}
    assert all_requests(path, limit=10, done_sources=done) == []
    assert [r.id for r in all_requests(path, limit=12, done_sources=done)] == ["r10", "r11"]
    assert all_requests(path, limit=0) == []


def test_limit_applies_to_this_workers_rows(tmp_path: Path) -> None:
    path = prompts_file(tmp_path / "in.jsonl", 0, 20)
    got = all_requests(path, shard_index=1, num_shards=2, limit=3)
    assert [r.id for r in got] == ["r1", "r3", "r5"]


def test_limit_stops_before_opening_next_file(tmp_path: Path) -> None:
    prompts_file(tmp_path / "a.jsonl", 0, 3)
    (tmp_path / "b.parquet").write_bytes(b"not parquet")
    assert len(all_requests([tmp_path / "a.jsonl", tmp_path / "b.parquet"], limit=3)) == 3


# --------------------------------------------------------------------------
# file-level errors and streaming
# --------------------------------------------------------------------------


def test_parquet_missing_columns_raise(tmp_path: Path) -> None:
    no_id = write_parquet(tmp_path / "noid.parquet", {"prompt": ["x"]})
    with pytest.raises(InputError, match="noid.parquet"):
        all_requests(no_id)
    no_prompt = write_parquet(tmp_path / "noprompt.parquet", {"id": ["x"], "text": ["y"]})
    with pytest.raises(InputError, match="noprompt.parquet"):
        all_requests(no_prompt)


def test_unreadable_parquet_raises_input_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"garbage")
    with pytest.raises(InputError, match="broken.parquet"):
        all_requests(path)


def test_large_parquet_is_streamed_lazily(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 200_000
    path = write_parquet(
        tmp_path / "big.parquet",
        {"id": pa.array(range(n), pa.int64()), "prompt": pa.array(["p"] * n), "unused": pa.array([0] * n)},
        row_group_size=50_000,
    )
    calls = []
    original = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("read_table must not be used"))
    stream = iter_requests(list_shards([str(path)]), batch_rows=8)
    first = list(itertools.islice(stream, 3))
    assert [r.id for r in first] == ["0", "1", "2"]
    assert len(calls) == 1
    assert calls[0]["batch_size"] == 8
    assert "unused" not in calls[0]["columns"]
    stream.close()


def test_iter_requests_is_lazy_about_files(tmp_path: Path) -> None:
    prompts_file(tmp_path / "a.jsonl", 0, 2)
    (tmp_path / "b.parquet").write_bytes(b"garbage")
    stream = iter_requests(list_shards([str(tmp_path)]))
    assert next(stream).id == "r0"
    assert next(stream).id == "r1"
    with pytest.raises(InputError):
        next(stream)


# --------------------------------------------------------------------------
# check_input
# --------------------------------------------------------------------------


def test_check_input_ok(tmp_path: Path) -> None:
    prompts_file(tmp_path / "a.jsonl", 0, 3)
    prompts_file(tmp_path / "b.parquet", 3, 3)
    assert check_input(list_shards([str(tmp_path)])) == []


def test_check_input_reports_problems(tmp_path: Path) -> None:
    a = write_jsonl(
        tmp_path / "a.jsonl",
        [{"id": "x", "prompt": "1"}, {"id": "y", "prompt": ""}, {"id": "z", "prompt": " "}, "{oops"],
    )
    b = write_parquet(tmp_path / "b.parquet", {"id": ["q", "x"], "prompt": ["2", "3"]})
    write_parquet(tmp_path / "c.parquet", {"id": ["w"], "body": ["4"]})
    problems = check_input(list_shards([str(tmp_path)]))
    text = "\n".join(problems)
    assert f"duplicate id 'x': {a.resolve()}#0 and {b.resolve()}#1" in text
    assert "c.parquet" in text and "'prompt'" in text
    assert f"2 bad rows (empty prompt); first at {a.resolve()}#1" in text
    assert "1 bad row (invalid JSON)" in text
    assert len(problems) == 4


def test_check_input_max_rows(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "prompt": "1"}, {"id": "x", "prompt": "2"}])
    shards = list_shards([str(tmp_path)])
    assert check_input(shards, max_rows_scanned=1) == []
    assert len(check_input(shards)) == 1


def test_reader_module_exports() -> None:
    assert set(shards_module.__all__) >= {"InputError", "list_shards", "assign", "count_rows", "worker_sources"}
    assert set(reader.__all__) >= {"iter_requests", "requests_from_rows"}
    assert set(checks.__all__) >= {"check_input", "check_columns"}


# --------------------------------------------------------------------------
# a row-dealt worker killed and resumed (a real run)
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_row_dealt_worker_killed_and_resumed_writes_each_row_once(tmp_path: Path, tiny_dir: Path) -> None:
    """3 workers over one file (rows dealt): worker 1 is killed with SIGKILL part way and rerun; with
    workers 0 and 2 every row is written once, worker 1 wrote exactly its dealt rows."""
    import os
    import signal
    import subprocess

    from conftest import make_job
    from test_cli_e2e import (RESUME_SECTIONS, _describe, cli_command, invoke, part_files, prompt_rows,
                              read_rows, wait_for_parts)

    rows = prompt_rows(90)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], **RESUME_SECTIONS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    stderr = tmp_path / "proc.stderr"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen([*cli_command(), "run", str(job), "--no-progress", "--shard-index", "1",
                                 "--num-shards", "3"], stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        wait_for_parts(proc, out, 2, stderr)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    partial = len(read_rows(out))
    assert 1 <= partial < 30, "kill -9 did not interrupt the run"
    mine = {r["id"] for r in rows[1::3]}
    assert {r["id"] for r in read_rows(out)} <= mine
    for w in (1, 0, 2):
        result = invoke("run", job, "--no-progress", "--shard-index", w, "--num-shards", 3)
        assert result.exit_code == 0, _describe(result)
        if w == 1:
            written = [r["id"] for r in read_rows(out)]
            assert sorted(written) == sorted(mine)  # the killed worker's own rows, each once
    ids = [r["id"] for r in read_rows(out)]
    assert sorted(ids) == sorted(r["id"] for r in rows)
    assert {p.name.split("-")[1] for p in part_files(out)} == {"w0000", "w0001", "w0002"}
