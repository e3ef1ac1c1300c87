"""Hostile or odd inputs that must be refused cleanly or become error rows (issue 45, item 4 and the
read-time half of item 3): YAML alias bombs and duplicate keys, chat roles no template takes, an OpenAI
custom_id that is not a string, input columns that collide once renamed, column names or values the
output cannot store."""

from __future__ import annotations

import json
import resource
import time

import pyarrow.parquet as pq
import pytest

from spin_batch.config import ConfigError, apply_overrides, load_job
from spin_batch.io import columns
from spin_batch.io.outputs import read_output_table
from spin_batch.io.reader import iter_requests, requests_from_rows
from spin_batch.io.schema import OUTPUT_SCHEMA, completion_row
from spin_batch.io.writer import OutputWriter
from spin_batch.records import Completion

from conftest import spec_of, write_jsonl

BASE = "input: {paths: p.jsonl}\noutput: {dir: out}\n"


def bomb(levels: int = 9, width: int = 9) -> str:
    """The billion laughs: level i is a list of `width` aliases to level i-1 (width ** levels strings)."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join(f'*a{i - 1}' for _ in range(width))}]")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# YAML: alias bombs and duplicate keys
# --------------------------------------------------------------------------


def test_an_alias_bomb_in_a_valid_key_is_refused_fast_and_small(tmp_path):
    # the bomb sits in sampling.stop, a key that takes a list of strings: its first item is a list of
    # the bomb's levels, which the message about that item spelt out in full (validate: 200 s, 16 GB)
    text = BASE + "sampling:\n  stop:\n    -\n" + "\n".join(
        f"      - {line.split(': ', 1)[1]}" for line in bomb().splitlines())
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="aliases expand to more than 100000 values"):
        load_job(path)
    assert time.perf_counter() - t0 < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB: under 100 MB more


def test_an_alias_bomb_in_a_set_value_is_refused():
    with pytest.raises(ConfigError, match="aliases expand to more than"):
        apply_overrides({}, ["sampling.stop={" + bomb().replace("\n", ", ") + "}"])


def test_a_recursive_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text(BASE + "sampling:\n  stop: &x [a, *x]\n")
    with pytest.raises(ConfigError, match="recursive alias"):
        load_job(path)


def test_small_anchors_and_merges_still_load(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text(BASE + "sampling: &s {max_tokens: 20, stop: &w [END, STOP]}\n"
                    "drafters:\n  - &ng {name: a, kind: ngram, max_ngram: 3}\n  - {<<: *ng, name: b}\n")
    job = load_job(path)
    assert job.sampling.stop == ("END", "STOP") and [d.name for d in job.drafters] == ["a", "b"]
    assert job.drafters[1].max_ngram == 3


@pytest.mark.parametrize("text, key, lines", [
    (BASE + "batch: {slots: 4}\nbatch: {slots: 8}\n", "batch", (4, 3)),
    (BASE + "batch:\n  slots: 4\n  slots: 8\n", "slots", (5, 4)),
    (BASE + "drafters:\n  - name: a\n    kind: ngram\n    kind: ngram\n", "kind", (6, 5)),
])
def test_a_duplicate_key_at_any_level_is_an_error_naming_it(tmp_path, text, key, lines):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_job(path)
    assert f"duplicate key {key!r} at line {lines[0]} (first at line {lines[1]})" in str(err.value)


def test_a_duplicate_key_in_a_set_value_is_an_error():
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        apply_overrides({}, ["x={a: 1, a: 2}"])


def test_a_merge_may_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(BASE + "batch:\n  <<: {slots: 4, max_model_len: 256}\n  slots: 8\n")
    assert load_job(path).batch.slots == 8


# --------------------------------------------------------------------------
# rows: chat roles, custom_id, column names and values the output cannot store
# --------------------------------------------------------------------------


def _one(rows: list[dict], **kw):
    return requests_from_rows(rows, spec_of(kw), **kw)


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_the_openai_chat_roles_are_accepted(role):
    (req,) = _one([{"id": "a", "messages": [{"role": role, "content": "hi"}]}])
    assert req.ok, req.error


def test_a_chat_role_no_template_takes_is_an_error_row(tmp_path):
    (req,) = _one([{"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}])
    assert not req.ok and req.error == ("messages[1].role 'wizard' is not a chat role (system, developer, user, "
                                        "assistant, tool)")
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "Wizard", "content": "x"}]}}
    src = write_jsonl(tmp_path / "batch.jsonl", [line])
    (req,) = iter_requests([src])
    assert req.id == "c" and "body.messages[0].role 'Wizard' is not a chat role" in req.error


@pytest.mark.parametrize("custom_id, kept", [(7, "7"), (0, "0"), (1.5, "1.5"), (True, "true"), ("x 1", "x 1"),
                                             ([1, "a"], '[1,"a"]'), ({"k": 1}, '{"k":1}')])
def test_any_custom_id_is_kept_as_a_string(tmp_path, custom_id, kept):
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": "hello"}}
    src = write_jsonl(tmp_path / "batch.jsonl", [line])
    (req,) = iter_requests([src])
    assert req.ok and req.id == kept, (req.id, req.error)


def test_a_null_custom_id_is_still_an_error_row(tmp_path):
    line = {"custom_id": None, "method": "POST", "url": "/v1/completions", "body": {"prompt": "hello"}}
    (req,) = iter_requests([write_jsonl(tmp_path / "batch.jsonl", [line])])
    assert not req.ok and req.error == "missing custom_id"


@pytest.mark.parametrize("row, message", [
    ({"id": "a", "prompt": "p", "": "x"}, "column name '' is empty"),
    ({"id": "a", "prompt": "p", 3: "x"}, "column name 3 is not a string (int)"),
])
def test_a_row_with_an_empty_or_non_string_key_is_an_error_row(row, message):
    (req,) = _one([row], keep_columns="all")
    assert not req.ok and message in req.error, req.error
    (req,) = _one([row], keep_columns="none")  # not kept: nothing to store, the row is fine
    assert req.ok


def _row(values: dict) -> dict:
    from spin_batch.records import Request

    req = Request("s#0", "a", "p", None, keep=values)
    return completion_row(Completion(req, "t", "stop", 1, 1), model="m")


def test_values_parquet_cannot_store_are_stored_as_json_text(tmp_path):
    # an empty object is a struct with no fields, which Parquet cannot write
    values = [{}, {"a": {}}, [{}], {"a": [{"b": {}}]}]
    writer = OutputWriter(tmp_path, rows_per_part=1)  # a part each: one type per part, none JSON for mixing
    for v in values:
        writer.add(_row({"meta": v}))
    writer.close()
    for part, value in zip(writer.parts, values, strict=True):
        table = pq.read_table(part)
        assert columns.is_json(table.schema.field("meta"))
        assert json.loads(table.column("meta")[0].as_py()) == value


def test_every_kept_row_of_a_job_is_written(tmp_path, tiny_dir):
    """The issue's case: one row with an empty-string key among 13; every run exited 1 at each flush."""
    from test_cli_e2e import _isolate_process_state  # noqa: F401
    from conftest import make_job
    from test_cli_e2e import prompt_rows, run_ok

    rows = prompt_rows(13)
    rows[4] = {**rows[4], "": "x"}
    rows[7] = {**rows[7], "meta": {}}
    src = write_jsonl(tmp_path / "in" / "p.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], output={"rows_per_part": 2}, sampling={"max_tokens": 2})
    result = run_ok(job)
    got = {r["id"]: r for r in read_output_table(out).to_pylist()}  # the parts, merged as export merges them
    assert sorted(got) == sorted(r["id"] for r in rows)
    assert got["r004"]["status"] == "error" and "column name '' is empty" in got["r004"]["error"]
    assert got["r007"]["status"] == "ok"
    assert "12 ok, 1 error rows" in result.output


# --------------------------------------------------------------------------
# input columns renamed with output.column_prefix
# --------------------------------------------------------------------------


def test_renamed_columns_never_collide_across_rows():
    taken = OUTPUT_SCHEMA.names
    a = columns.kept_values({"text": "A's text"}, "input_", taken)
    b = columns.kept_values({"input_text": "B's input_text"}, "input_", taken)
    c = columns.kept_values({"input_input_text": "C"}, "input_", taken)
    assert a == {"input_text": "A's text"}
    assert b == {"input_input_text": "B's input_text"}
    assert c == {"input_input_input_text": "C"}
    # a column named like no output column, with or without the prefix, keeps its name
    assert columns.kept_values({"input_topic": 1, "topic": 2}, "input_", taken) == {"input_topic": 1, "topic": 2}


def test_a_row_text_never_lands_in_another_rows_input_text_column(tmp_path, tiny_dir):
    from test_cli_e2e import _isolate_process_state  # noqa: F401
    from conftest import make_job
    from test_cli_e2e import read_rows, run_ok

    rows = [{"id": "a", "prompt": "the quick brown fox", "text": "a's text"},
            {"id": "b", "prompt": "list three colours", "input_text": "b's input_text"}]
    src = write_jsonl(tmp_path / "in" / "p.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], sampling={"max_tokens": 2})
    run_ok(job)
    got = {r["id"]: r for r in read_rows(out)}
    assert got["a"]["input_text"] == "a's text" and got["a"]["input_input_text"] is None
    assert got["b"]["input_input_text"] == "b's input_text" and got["b"]["input_text"] is None

