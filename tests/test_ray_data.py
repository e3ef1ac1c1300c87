"""spin-batch as a Ray Data stage (spin_batch/ray_data.py), on the tiny random models.

The predictor is checked directly (as a Ray actor calls it), against `spin-batch run` on the
same rows; one test then runs it through a real local Ray cluster.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pytest
import torch

from spin_batch.config import ConfigError, parse_job
from spin_batch.ray_data import (MESSAGES_TYPE, RAY_LLM_NAMES, RESULT_FIELDS, SpinBatchPredictor, derived_id, generate,
                                  prepare_job)
from spin_batch.runner import run_job

from conftest import write_jsonl

PROMPTS = ["the quick brown fox", "list three colours", "def add(a, b):", "once upon a time there was",
           "what causes the tides?", "compute 12 * 7", "rewrite this sentence"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rows(n: int, prefix: str = "r") -> list[dict]:
    return [{"id": f"{prefix}{i:03d}", "prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}", "label": i} for i in range(n)]


def job_mapping(model_dir, **spin) -> dict:
    """A job as Ray users give it: no input.paths or output.dir."""
    return {
        "target": {"model": str(model_dir), "dtype": "float32", "device": "cpu"},
        "drafters": [{"name": "ngram", "kind": "ngram"}],
        "spin": {"selector": "ucb", "num_speculative_tokens": 3, **spin},
        "batch": {"slots": 3, "max_model_len": 128, "max_num_batched_tokens": 64},
        "sampling": {"temperature": 0.0, "max_tokens": 12, "seed": 0},
    }


def cli_texts(tmp_path, model_dir, data: list[dict]) -> dict[str, str]:
    """The same rows through `spin-batch run`'s own path: id -> text."""
    src = write_jsonl(tmp_path / "in.jsonl", [{k: v for k, v in r.items() if k != "label"} for r in data])
    raw = job_mapping(model_dir)
    raw["input"] = {"paths": [str(src)]}
    raw["output"] = {"dir": str(tmp_path / "out")}
    run_job(parse_job(raw), progress=False)
    import pyarrow.parquet as pq

    table = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "out" / "outputs").glob("*.parquet"))])
    return {r["id"]: r["text"] for r in table.to_pylist()}


def test_predictor_matches_spin_batch_run_and_keeps_rows_in_order(tmp_path, tiny_dir):
    data = rows(10)
    want = cli_texts(tmp_path, tiny_dir, data)
    pred = SpinBatchPredictor(prepare_job(job_mapping(tiny_dir)))
    out = pred(pa.Table.from_pylist(data[:6]))
    out2 = pred({k: [r[k] for r in data[6:]] for k in data[0]})  # a dict of columns; the engine is reused
    got = out.to_pylist() + out2.to_pylist()
    assert [r["id"] for r in got] == [r["id"] for r in data]
    assert [r["label"] for r in got] == list(range(10))  # input columns pass through
    assert out.column_names == ["id", "prompt", "label"] + [f.name for f in RESULT_FIELDS]
    for r in got:
        assert r["status"] == "ok" and r["error"] is None, r
        assert r["text"] == want[r["id"]], r["id"]
        assert 1 <= r["completion_tokens"] <= 12
    # the second batch was a stream of its own: its drain ended when the batch did
    assert pred.engine.loop.policy.state.draining is True
    pred.engine.loop.policy.on_stream()
    assert pred.engine.loop.policy.state.draining is False


def test_bad_rows_become_error_rows_and_the_batch_goes_on(tiny_dir):
    pred = SpinBatchPredictor(prepare_job(job_mapping(tiny_dir)))
    batch = [
        {"id": "a", "prompt": "the quick brown fox", "messages": None},
        {"id": None, "prompt": "no id", "messages": None},
        {"id": "b", "prompt": "", "messages": None},
        {"id": "a", "prompt": "the same id again", "messages": None},
        {"id": "c", "prompt": "x " * 200, "messages": None},  # longer than max_model_len
        {"id": "d", "prompt": None, "messages": [{"role": "user", "content": None}]},
        {"id": "e", "prompt": "list three colours", "messages": None},
    ]
    got = pred(pa.Table.from_pylist(batch)).to_pylist()
    assert [r["status"] for r in got] == ["ok", "error", "error", "error", "error", "error", "ok"]
    errors = [r["error"] for r in got]
    assert errors[1] == "missing id" and errors[2] == "empty prompt"
    assert errors[3] == "duplicate id 'a'" and "max_model_len" in errors[4] and "content" in errors[5]
    # a column of floats where every value is missing (NaN): how a merged dataset may spell "no messages"
    nan = float("nan")
    got = pred(pa.table({"id": ["f", "g"], "prompt": ["a prompt", None], "messages": [nan, nan]})).to_pylist()
    assert [(r["status"], r["error"]) for r in got] == [("ok", None), ("error", "missing prompt")]
    got = pred(pa.table({"id": [nan, 7.0], "prompt": ["x", "y"]})).to_pylist()
    assert [r["error"] for r in got] == ["missing id", "id must be a string or integer, got float"]
    assert all(r["text"] is None and r["finish_reason"] == "error" for r in got if r["status"] == "error")


def test_a_clashing_input_column_comes_back_with_the_prefix(tiny_dir):
    """The rule of `spin-batch run`'s path: our columns keep their names, the input's get the prefix."""
    pred = SpinBatchPredictor(prepare_job(job_mapping(tiny_dir)))
    out = pred(pa.Table.from_pylist([{"id": "a", "prompt": "hi", "text": "already here", "input_text": "me too"}]))
    assert out.column_names[:4] == ["id", "prompt", "input_text", "input_input_text"]
    row = out.to_pylist()[0]
    assert row["input_text"] == "already here" and row["input_input_text"] == "me too"
    assert row["status"] == "ok" and row["text"] != "already here"
    pred = SpinBatchPredictor(prepare_job({**job_mapping(tiny_dir), "output": {"column_prefix": "src."}}))
    assert pred(pa.Table.from_pylist([{"id": "a", "prompt": "hi", "status": 1}])).column_names[:3] == \
        ["id", "prompt", "src.status"]


def test_keep_columns_none_or_a_list_keeps_the_id(tiny_dir):
    data = pa.Table.from_pylist(rows(2))
    none = SpinBatchPredictor(prepare_job({**job_mapping(tiny_dir), "output": {"keep_columns": "none"}}))
    assert none(data).column_names == ["id"] + [f.name for f in RESULT_FIELDS]
    listed = SpinBatchPredictor(prepare_job({**job_mapping(tiny_dir), "output": {"keep_columns": ["label"]}}))
    out = listed(data)
    assert out.column_names[:2] == ["id", "label"] and out.column("label").to_pylist() == [0, 1]


def test_preprocess_and_postprocess_run_in_the_batch_call(tmp_path, tiny_dir):
    data = rows(4)
    want = cli_texts(tmp_path, tiny_dir, data)

    def preprocess(row: dict) -> dict:
        if row["label"] == 2:
            raise KeyError("no question")
        return {"id": row["id"], "question": row["prompt"], "prompt": row["prompt"], "sampling": {"max_tokens": 3}}

    def postprocess(row: dict) -> dict:
        if row["id"] == "r003":
            raise RuntimeError("cannot shape this one")
        return {"key": row["id"], "question": row["question"], "answer": row["text"], "ok": row["status"] == "ok",
                "why": row["error"], "tokens": row["completion_tokens"]}

    job = {**job_mapping(tiny_dir), "input": {"params_column": "sampling"}}
    pred = SpinBatchPredictor(prepare_job(job), preprocess=preprocess, postprocess=postprocess)
    table = pred(pa.Table.from_pylist(data))
    got = table.to_pylist()
    assert [r.get("key") for r in got] == ["r000", "r001", "r002", None]
    for r in got[:2]:  # decoded with the row's own max_tokens: the greedy text's first 3 tokens
        assert r["ok"] and r["why"] is None and r["tokens"] == 3 and r["question"] == data[int(r["key"][1:])]["prompt"]
        assert want[r["key"]].startswith(r["answer"]) and len(r["answer"]) < len(want[r["key"]])
    assert got[2]["ok"] is False and got[2]["why"] == "preprocess failed: KeyError: 'no question'"
    assert got[2]["question"] is None and got[2]["answer"] is None
    last = got[3]  # postprocess raised: the row as it was, an error row saying why
    assert last["status"] == "error" and last["error"] == "postprocess failed: RuntimeError: cannot shape this one"
    assert last["id"] == "r003" and last["text"] == want["r003"][:len(last["text"])] and last["key"] is None
    assert table.schema.field("drafter_pulls").type == pa.map_(pa.string(), pa.int32())  # its own type kept


class FakeDataset:
    """What generate needs of a Ray Dataset: its schema, and map_batches (recorded, not run)."""

    def __init__(self):
        self.calls = []

    def schema(self):
        return pa.schema([("id", pa.string()), ("prompt", pa.string())])

    def map_batches(self, fn, **kwargs):
        self.calls.append(kwargs)
        return self


def test_generate_passes_rays_compute_strategy_not_the_deprecated_concurrency(tiny_dir):
    from ray.data import ActorPoolStrategy

    ds = FakeDataset()
    generate(ds, job_mapping(tiny_dir), concurrency=3, num_cpus=1)
    generate(ds, job_mapping(tiny_dir))
    generate(ds, job_mapping(tiny_dir), concurrency=(1, 4))
    generate(ds, job_mapping(tiny_dir), compute=ActorPoolStrategy(min_size=2, max_size=2))
    assert all("concurrency" not in call for call in ds.calls)  # deprecated in map_batches since Ray 2.51
    sizes = [(c["compute"].min_size, c["compute"].max_size) for c in ds.calls]
    assert sizes == [(3, 3), (1, 1), (1, 4), (2, 2)]
    assert ds.calls[0]["num_cpus"] == 1 and ds.calls[0]["batch_size"] == 48
    for bad in (0, (1,), "4", True):
        with pytest.raises(ValueError, match="concurrency must be"):
            generate(ds, job_mapping(tiny_dir), concurrency=bad)
    with pytest.raises(ValueError, match="not both"):
        generate(ds, job_mapping(tiny_dir), concurrency=2, compute=ActorPoolStrategy(size=2))
    with pytest.raises(ValueError, match="result_names"):
        generate(ds, job_mapping(tiny_dir), result_names="vllm")


def test_messages_come_back_as_structs_not_pickled_objects(tiny_dir):
    """Ray reads a messages column that only some files have as pickled Python objects; the output holds
    it as a list of {role, content} structs, in every batch alike (all-null ones too)."""
    from ray.data._internal.object_extensions.arrow import ArrowPythonObjectArray

    pred = SpinBatchPredictor(prepare_job(job_mapping(tiny_dir)))
    chat = [{"role": "user", "content": "the quick brown fox"}]
    pickled = ArrowPythonObjectArray.from_objects([float("nan"), chat])  # as Ray reads a row without messages
    assert isinstance(pickled.type, pa.ExtensionType)
    out = pred(pa.table({"id": ["a", "b"], "prompt": ["list three colours", None], "messages": pickled}))
    assert out.schema.field("messages").type == MESSAGES_TYPE
    assert out.column("messages").to_pylist() == [None, chat]
    assert [r["status"] for r in out.to_pylist()] == ["ok", "ok"]
    # a batch of prompts only: the column still has the messages type, so Ray's blocks agree
    nulls = pred(pa.table({"id": ["c"], "prompt": ["hi"], "messages": pa.nulls(1)}))
    assert nulls.schema.field("messages").type == MESSAGES_TYPE
    # another pickled column: plain Arrow data where its values have a common type
    other = pred(pa.table({"id": ["d"], "prompt": ["hi"], "meta": ArrowPythonObjectArray.from_objects([{"k": 1}])}))
    assert other.schema.field("meta").type == pa.struct([("k", pa.int64())])


def test_ray_data_llm_column_names_on_request(tiny_dir):
    data = rows(3)
    spin = SpinBatchPredictor(prepare_job(job_mapping(tiny_dir)))(pa.Table.from_pylist(data))
    pred = SpinBatchPredictor(prepare_job(job_mapping(tiny_dir)), result_names="ray_llm")
    out = pred(pa.Table.from_pylist([{**r, "text": "mine"} for r in data]))
    assert {"generated_text", "num_generated_tokens", "num_input_tokens"} <= set(out.column_names)
    assert not {"completion_tokens", "prompt_tokens"} & set(out.column_names)
    assert out.column("text").to_pylist() == ["mine"] * 3  # no clash under these names: kept as it is
    for ours, theirs in RAY_LLM_NAMES.items():
        assert out.column(theirs).to_pylist() == spin.column(ours).to_pylist()
    clash = pred(pa.Table.from_pylist([{"id": "a", "prompt": "hi", "generated_text": "old"}]))
    assert clash.column("input_generated_text").to_pylist() == ["old"]


def test_a_preprocess_that_makes_no_id_gets_one_derived_from_the_row(tiny_dir):
    data = [{"question": "the quick brown fox"}, {"question": "list three colours"}, {"question": "the quick brown fox"}]
    pred = SpinBatchPredictor(prepare_job(job_mapping(tiny_dir)), preprocess=lambda row: {"prompt": row["question"]})
    got = pred(pa.Table.from_pylist(data)).to_pylist()
    assert [r["status"] for r in got] == ["ok", "ok", "ok"], got
    first = derived_id(data[0])
    assert re.fullmatch(r"row-[0-9a-f]{16}", first)
    assert [r["id"] for r in got] == [first, derived_id(data[1]), f"{first}-2"]  # a repeat within the batch
    assert got[0]["text"] == got[2]["text"]
    again = pred(pa.Table.from_pylist(data[1:2])).to_pylist()  # the same row, another batch: the same id
    assert again[0]["id"] == derived_id(data[1])
    # an id the preprocess gives (or the row's own, kept by {**row}) is used as it is
    keep = SpinBatchPredictor(prepare_job(job_mapping(tiny_dir)), preprocess=lambda row: {**row, "prompt": "hi"})
    assert [r["id"] for r in keep(pa.Table.from_pylist(rows(2))).to_pylist()] == ["r000", "r001"]


def test_a_bad_job_fails_on_the_driver_before_any_model_loads(tmp_path, tiny_dir):
    with pytest.raises(ConfigError, match="slotz"):
        prepare_job({**job_mapping(tiny_dir), "batch": {"slotz": 3}})
    bad = job_mapping(tiny_dir)
    bad["drafters"] = [{"name": "d", "kind": "model", "model": str(tmp_path / "nowhere")}]
    with pytest.raises(ValueError, match="drafters.d"):
        prepare_job(bad)


def test_relative_model_paths_are_made_absolute(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.chdir(tiny_dir.parent)
    plain = prepare_job(job_mapping(tiny_dir.name))
    assert plain["target"]["model"] == str(tiny_dir.resolve())
    assert plain["input"]["paths"] and plain["output"]["dir"]  # placeholders, unused under Ray


def test_generate_through_a_local_ray_cluster(tmp_path, tiny_dir):
    import ray  # in the test extra: this test must run, not skip
    data = rows(7)
    want = cli_texts(tmp_path, tiny_dir, data)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        ds = ray.data.from_items(data)
        with pytest.raises(ConfigError, match="missing id column 'key'"):
            generate(ds, {**job_mapping(tiny_dir), "input": {"id_column": "key"}})
        got = generate(ds, job_mapping(tiny_dir), concurrency=1, num_cpus=1, batch_size=4,
                       preprocess=lambda row: {**row, "label": row["label"] * 10},  # the hooks reach the actor
                       postprocess=lambda row: {**row, "chars": len(row["text"])}).take_all()
        # files that do not all have a messages column: Ray reads it as pickled objects; written back, it
        # is a list of structs, and the results carry Ray Data LLM's names where asked
        write_jsonl(tmp_path / "mixed" / "a.jsonl", data[:3])
        write_jsonl(tmp_path / "mixed" / "b.jsonl", [{"id": "chat", "messages": [{"role": "user", "content": "hi"}]}])
        mixed = ray.data.read_json([str(tmp_path / "mixed" / "a.jsonl"), str(tmp_path / "mixed" / "b.jsonl")],
                                   lines=True)
        generate(mixed, job_mapping(tiny_dir), num_cpus=1, result_names="ray_llm").write_parquet(
            str(tmp_path / "written"))
    finally:
        ray.shutdown()
    import pyarrow.parquet as pq

    written = pq.read_table(tmp_path / "written")
    assert written.schema.field("messages").type == MESSAGES_TYPE
    by_id = {r["id"]: r for r in written.to_pylist()}
    assert sorted(by_id) == ["chat", "r000", "r001", "r002"]
    assert by_id["chat"]["messages"] == [{"role": "user", "content": "hi"}] and by_id["r000"]["messages"] is None
    assert all(r["status"] == "ok" and r["generated_text"] for r in by_id.values())
    assert by_id["r001"]["generated_text"] == want["r001"]
    assert sorted(r["id"] for r in got) == [r["id"] for r in data]
    for r in got:
        assert r["status"] == "ok" and r["text"] == want[r["id"]], r
        assert r["label"] == 10 * int(r["id"][1:]) and r["chars"] == len(r["text"])


@pytest.mark.slow
def test_the_repository_root_on_sys_path_does_not_hide_transformers_kernels():
    """A Ray worker's sys.path holds the driver's working directory. Started in the repository, with
    transformers imported before anything of ours, it must still see the PyPI package `kernels` (or,
    where that is not installed, no `kernels` at all), never our top-level kernels/ folder."""
    import subprocess
    import sys
    from pathlib import Path

    import spin_batch

    root = Path(spin_batch.__file__).resolve().parent.parent
    code = ("import sys; sys.path.insert(0, {root!r}); from transformers import LlamaConfig; "
            "from transformers.utils.import_utils import is_kernels_available; import kernels, spin_kernels; "
            "print(getattr(kernels, '__file__', None), is_kernels_available(), spin_kernels.__name__)"
            ).format(root=str(root))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, available, ours = proc.stdout.split()
    assert ours == "spin_kernels"
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("kernels")
    except PackageNotFoundError:  # our folder is at most a namespace portion, which transformers ignores
        assert (where, available) == ("None", "False"), proc.stdout
        return
    assert not where.startswith(str(root / "kernels")) and available == "True", proc.stdout
