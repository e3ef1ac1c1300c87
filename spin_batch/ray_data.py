"""Ray Data: spin-batch as a `map_batches` stage, for one job spread over many GPUs or nodes.

    import ray
    from spin_batch.ray_data import generate

    ds = ray.data.read_parquet("/data/prompts/")
    out = generate(ds, "jobs/demo.yaml", concurrency=4, num_gpus=1)  # 4 actors, one engine each
    out.write_parquet("/data/completions/")

The job file is the one `spin-batch run` takes. Its target, drafters, spin, batch and sampling
sections set up each actor's engine; from `input` only the column names, `chat_template` and
`system_prompt` are used; `input.paths` and `output.dir` are not (Ray reads and writes, and
resuming or sharding is Ray's business here). `generate` checks the job and the models on the
driver, so a bad job fails before any actor starts or any weights load.

Every output row is its input row (the columns `output.keep_columns` picks: all by default, in
the same order; the id column always) plus the columns of `spin-batch run`'s outputs (`text`,
`finish_reason`, `prompt_tokens`, `completion_tokens`, `status`, `error`, the speculation counts,
`drafter_pulls`, `decode_time_s`). With ``result_names="ray_llm"`` three of them take the names Ray
Data LLM's processors give them (:data:`RAY_LLM_NAMES`: `generated_text`, `num_input_tokens`,
`num_generated_tokens`). An input column named like one of the output columns comes back as
`output.column_prefix` + its name (`input_text`), as on `spin-batch run`'s path. The messages column
comes back as a list of ``{role, content}`` structs, also where Ray read it as pickled Python objects
(a dataset whose files do not all have it); other pickled columns as plain Arrow data where their
values have a common type. A bad row (no id, no prompt, a malformed `messages`, a prompt too long,
an id repeated within the batch) becomes a row with `status` "error" and a message; the batch goes
on.

`preprocess` and `postprocess`, as in Ray Data LLM's processors, run inside each actor's batch
call. preprocess(row) -> dict maps an input row to the row spin-batch decodes: the job's id column
and its prompt or messages column (and its `input.params_column`, for the row's own sampling
settings); from there on that row is the input row (return `{**row, ...}` to keep the original
columns). A row it returns without an id gets one derived from the input row it was given:
``row-`` and a digest of its columns (:func:`derived_id`), the same for the same row in every run
(a repeat of the same row within a batch adds ``-2``, ``-3``...). A preprocess that raises makes
that row an error row (its original columns kept).
postprocess(row) -> dict maps each output row (input columns and ours, error rows included) to
what the user wants; one that raises leaves that row as it was, with `status` "error" and the
message.

One `SpinBatchPredictor` per actor keeps its engine and its bandit's statistics from batch to
batch. Each batch is a stream of its own: its last requests decode as the slots drain, so a
batch should hold many more rows than `batch.slots` (`generate` defaults to 16 times as many).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from .config import ConfigError, JobConfig, job_to_dict, load_job, parse_job
from .io import columns
from .io.reader import requests_from_rows
from .io.rows import column_problems, input_spec
from .io.schema import OUTPUT_SCHEMA, completion_row
from .records import Completion, Request

Hook = Callable[[dict], dict]

#: The output columns added to each row ("id" is the input's own column; "source" means a shard row;
#: endpoint, model and created serve the OpenAI batch output, which Ray does not write; input_digest
#: and input_key a run's resume, which is Ray's business here).
RESULT_FIELDS = [f for f in OUTPUT_SCHEMA
                 if f.name not in ("id", "source", "endpoint", "model", "created", "input_digest", "input_key")]
#: ``result_names="ray_llm"``: our columns under the names Ray Data LLM's processors write.
RAY_LLM_NAMES = {"text": "generated_text", "prompt_tokens": "num_input_tokens",
                 "completion_tokens": "num_generated_tokens"}
RESULT_NAMINGS = ("spin_batch", "ray_llm")
#: How a messages column is stored: a list of {role, content} structs (where the values fit it).
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
# Placeholders for the job keys Ray makes moot, so a job given as a mapping may leave them out.
_UNUSED = {"input": {"paths": ["<ray data>"]}, "output": {"dir": "<ray data>"}}


def prepare_job(job: str | os.PathLike | Mapping | JobConfig, overrides: Sequence[str] = ()) -> dict:
    """Check a job on the driver and return it as plain data for the actors.

    `job` is a job file, a mapping in its form (input.paths and output.dir may be left out) or a
    JobConfig. Raises ConfigError for a bad job and ValueError for missing or mismatched models,
    before any weights load. Relative model paths are made absolute here, against the driver's
    working directory, since an actor may run elsewhere.
    """
    from .preflight import check_models

    if isinstance(job, JobConfig):
        if overrides:
            job = parse_job(job_to_dict(job), overrides)
    elif isinstance(job, Mapping):
        raw = dict(job)
        for section, defaults in _UNUSED.items():
            if isinstance(raw.get(section, {}), Mapping):
                raw[section] = {**defaults, **raw.get(section, {})}
        job = parse_job(raw, overrides, source="<mapping>")
    else:
        job = load_job(job, overrides)
    problems = check_models(job)
    if problems:
        raise ValueError("invalid job:\n" + "\n".join(f"  {p}" for p in problems))
    plain = job_to_dict(job)
    for spec in [plain["target"], *plain["drafters"]]:
        ref = spec.get("model")
        if isinstance(ref, str) and not ref.startswith("builtin:") and Path(ref).exists():
            spec["model"] = str(Path(ref).resolve())
    return plain


class SpinBatchPredictor:
    """A Ray Data callable class: builds the engine once, then decodes one batch of rows per call.

    Also usable without Ray: call it with a pyarrow Table, a pandas DataFrame or a dict of columns.
    `preprocess` and `postprocess`: see the module doc.
    """

    def __init__(self, job: Mapping, overrides: Sequence[str] = (), threads: int | None = None,
                 preprocess: Hook | None = None, postprocess: Hook | None = None, result_names: str = "spin_batch"):
        import torch

        from .build import build_engine, make_encoder

        self.fields = result_fields(result_names)
        if threads is not None:  # torch's and our CPU kernels' OpenMP threads (they share one runtime)
            torch.set_num_threads(threads)
        self.job = parse_job(job, overrides, source="<ray data job>")
        if self.job.sampling.n != 1:  # a batch maps row to row: one output row per input row
            raise ValueError(f"sampling.n is {self.job.sampling.n}; the Ray Data path writes one row per input row "
                             "and takes n = 1 only (spin-batch run writes a row per sample)")
        self.engine = build_engine(self.job)
        self.encode = make_encoder(self.engine.tokenizer, self.job)
        self.preprocess, self.postprocess = preprocess, postprocess
        self.batches = 0

    def __call__(self, batch: Any) -> pa.Table:
        table = _as_table(batch)
        self.batches += 1
        failed: dict[int, str] = {}
        if self.preprocess is not None:
            table, failed = _preprocessed(table, self.preprocess, self.job.input.id_column)
        requests = self._requests(table, failed)
        results = self._decode(requests)
        out = _with_results(_input_columns(table, self.job, {f.name for f in self.fields}), results, self.fields)
        return out if self.postprocess is None else _postprocessed(out, self.postprocess)

    def _requests(self, table: pa.Table, failed: Mapping[int, str]) -> list[Request]:
        requests = requests_from_rows(table.to_pylist(), input_spec(self.job.input),
                                      source_prefix=f"batch{self.batches}")
        return [replace(r, error=failed[i]) if i in failed else r for i, r in enumerate(requests)]

    def _decode(self, requests: list[Request]) -> list[dict]:
        """Each request's output row (OUTPUT_SCHEMA's columns), in the requests' order."""
        rows: dict[str, dict] = {}

        def emit(done: Completion) -> None:
            if done.more:  # a row's own n > 1: one output row per input row here
                done = Completion.failed(done.request, "n > 1 is not supported on the Ray Data path (one output row "
                                                       "per input row); spin-batch run writes a row per sample")
            rows[done.request.source] = completion_row(done)

        t0 = time.perf_counter()
        self.engine.loop.run(iter(requests), self.encode, emit)
        seconds = time.perf_counter() - t0
        missing = [r.source for r in requests if r.source not in rows]
        if missing:  # the loop emits every request it is given; anything else is a bug worth failing on
            raise RuntimeError(f"spin-batch lost {len(missing)} rows of a batch (first: {missing[0]})")
        ordered = [rows[r.source] for r in requests]
        tokens = sum(row["completion_tokens"] for row in ordered)
        errors = sum(row["status"] != "ok" for row in ordered)
        print(f"spin-batch (pid {os.getpid()}): batch {self.batches}: {len(ordered)} rows ({errors} errors), {tokens} "
              f"tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} tok/s)", file=sys.stderr, flush=True)
        return ordered


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def result_fields(naming: str) -> list[pa.Field]:
    """The output columns added to each row, named as ``naming`` says: "spin_batch" (as `spin-batch run`
    writes them) or "ray_llm" (:data:`RAY_LLM_NAMES`)."""
    if naming not in RESULT_NAMINGS:
        raise ValueError(f"result_names must be one of {', '.join(RESULT_NAMINGS)}, got {naming!r}")
    if naming == "spin_batch":
        return list(RESULT_FIELDS)
    return [f.with_name(RAY_LLM_NAMES.get(f.name, f.name)) for f in RESULT_FIELDS]


def derived_id(row: Mapping) -> str:
    """An id for a row that has none: ``row-`` and the first 16 hex digits of the SHA-256 of its columns
    (as sorted JSON; a value JSON cannot hold by its repr), the same for the same row in every run."""
    text = json.dumps(row, sort_keys=True, ensure_ascii=False, default=repr)
    return "row-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _preprocessed(table: pa.Table, preprocess: Hook, id_column: str) -> tuple[pa.Table, dict[int, str]]:
    """The rows preprocess makes, and ``{row index: error}`` of those where it raised (such a row keeps
    its original columns). A row made without an id gets :func:`derived_id` of its input row (``-2``,
    ``-3``... for a repeat within the batch)."""
    rows, failed = [], {}
    made: dict[str, int] = {}
    for i, row in enumerate(table.to_pylist()):
        try:
            new = preprocess(dict(row))
            if not isinstance(new, Mapping):
                raise TypeError(f"preprocess must return a dict, got {type(new).__name__}")
            new = dict(new)
            if new.get(id_column) is None:
                key = derived_id(row)
                made[key] = made.get(key, 0) + 1
                new[id_column] = key if made[key] == 1 else f"{key}-{made[key]}"
            rows.append(new)
        except Exception as e:  # noqa: BLE001  the user's function: its failure is this row's error
            rows.append(row)
            failed[i] = f"preprocess failed: {_short(e)}"
    return _table_of(rows, "preprocess", table.schema), failed


def _input_columns(table: pa.Table, job: JobConfig, taken: set[str]) -> pa.Table:
    """The input columns an output row keeps (output.keep_columns, the id column always), renamed with
    output.column_prefix where they clash with our columns (``taken``); a named column the batch lacks
    is null. The messages column as :data:`MESSAGES_TYPE`, pickled objects as Arrow data (:func:`_plain`)."""
    id_column = job.input.id_column
    names = columns.selected(table.column_names, job.output.keep_columns)
    if id_column in table.column_names and id_column not in names:
        names.insert(0, id_column)
    renamed = columns.output_names(names, taken, job.output.column_prefix)
    arrays = [_plain(table.column(n), n == job.input.messages_column) if n in table.column_names
              else pa.nulls(table.num_rows) for n in names]
    return pa.Table.from_arrays(arrays, names=[renamed[n] for n in names])


def _plain(column: pa.ChunkedArray, messages: bool) -> pa.ChunkedArray | pa.Array:
    """A column as plain Arrow data: a messages column as :data:`MESSAGES_TYPE` where its values fit it
    (every batch alike, so that Ray never falls back to pickling it), a column of pickled Python objects
    (Ray's object extension type) as the type its values infer; else as it is. A NaN there (how a merged
    dataset may spell a missing value) is null."""
    pickled = isinstance(column.type, pa.ExtensionType)
    if not (messages or pickled):
        return column
    values = [None if isinstance(v, float) and v != v else v for v in column.to_pylist()]  # NaN: missing
    for kind in ([MESSAGES_TYPE, None] if messages else [None]):
        try:
            return pa.array(values, type=kind)
        except (pa.ArrowException, TypeError, ValueError):
            continue
    return column


def _with_results(table: pa.Table, rows: list[dict], fields: list[pa.Field]) -> pa.Table:
    for ours, f in zip(RESULT_FIELDS, fields):
        table = table.append_column(f, pa.array([row[ours.name] for row in rows], type=f.type))
    return table


def _postprocessed(table: pa.Table, postprocess: Hook) -> pa.Table:
    """postprocess applied to each output row (``drafter_pulls`` as a dict); a row where it raises stays
    as it was, as an error row. A column that keeps its name keeps its type where its values fit it."""
    rows = []
    for row in table.to_pylist():
        row["drafter_pulls"] = dict(row["drafter_pulls"] or [])
        try:
            new = postprocess(dict(row))
            if not isinstance(new, Mapping):
                raise TypeError(f"postprocess must return a dict, got {type(new).__name__}")
            rows.append(dict(new))
        except Exception as e:  # noqa: BLE001  the user's function: its failure is this row's error
            rows.append({**row, "status": "error", "error": f"postprocess failed: {_short(e)}"})
    return _table_of(rows, "postprocess", table.schema)


def _table_of(rows: list[dict], made_by: str, before: pa.Schema | None = None) -> pa.Table:
    """Rows as a table over the union of their keys (first seen first; null where a row lacks one), a
    column named as in ``before`` with its type there where the values fit, else the type inferred."""
    names = dict.fromkeys(key for row in rows for key in row)
    arrays = {}
    for name in names:
        values = [row.get(name) for row in rows]
        if before is not None and name in before.names:
            try:
                arrays[name] = pa.array(values, type=before.field(name).type)
                continue
            except (pa.ArrowException, TypeError, ValueError):
                pass
        try:
            arrays[name] = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise ValueError(f"{made_by} returned rows whose {name!r} values have no common type: {e}") from e
    return pa.table(arrays)


def generate(ds, job: str | os.PathLike | Mapping | JobConfig, overrides: Sequence[str] = (), *,
             concurrency: int | tuple[int, ...] | None = None, num_gpus: float | None = None,
             num_cpus: float | None = None, threads: int | None = None, batch_size: int | None = None,
             preprocess: Hook | None = None, postprocess: Hook | None = None, result_names: str = "spin_batch",
             **map_batches_args):
    """`ds` with spin-batch's completions added to each row (see the module doc).

    concurrency: actors, one engine each (default 1), passed to Ray as ``compute=ActorPoolStrategy(size=n)``;
    a tuple ``(min, max)`` or ``(min, max, initial)`` makes an autoscaling pool. Or pass Ray's own
    ``compute=`` (not both). num_gpus / num_cpus: Ray resources per actor. Ray sets
    an actor's OpenMP threads to its num_cpus (1 by default); `threads` sets them directly. On CPU
    leave Ray a CPU for reading and writing: an actor that reserves every CPU starves the read
    and write tasks, and the dataset never finishes (on 2 cores: num_cpus=1, threads=2).
    batch_size: rows per call, by default 16 times batch.slots. preprocess / postprocess: row -> row
    functions run in the actors (see the module doc). result_names: "spin_batch", or "ray_llm" for
    Ray Data LLM's column names (:data:`RAY_LLM_NAMES`). Other keyword arguments go to
    Dataset.map_batches.
    """
    result_fields(result_names)  # a bad naming fails here, not in the actors
    compute = _compute(concurrency, map_batches_args.pop("compute", None))
    plain = prepare_job(job, overrides)
    if preprocess is None:  # else the columns are preprocess's to make
        _check_schema(ds, plain)
    resources = {k: v for k, v in (("num_gpus", num_gpus), ("num_cpus", num_cpus)) if v is not None}
    hooks = {"preprocess": preprocess, "postprocess": postprocess, "result_names": result_names}
    return ds.map_batches(
        SpinBatchPredictor, fn_constructor_kwargs={"job": plain, "threads": threads, **hooks}, batch_format="pyarrow",
        compute=compute, batch_size=batch_size or 16 * plain["batch"]["slots"], **resources, **map_batches_args)


def _compute(concurrency: int | tuple[int, ...] | None, compute: Any):
    """Ray's compute strategy for the actors: ``compute`` as given, else an ActorPoolStrategy of
    ``concurrency`` actors (an int: that many; (min, max) or (min, max, initial): autoscaling)."""
    from ray.data import ActorPoolStrategy

    if compute is not None:
        if concurrency is not None:
            raise ValueError("pass concurrency or compute, not both")
        return compute
    if concurrency is None:
        concurrency = 1
    if isinstance(concurrency, int) and not isinstance(concurrency, bool) and concurrency >= 1:
        return ActorPoolStrategy(size=concurrency)
    if isinstance(concurrency, tuple) and len(concurrency) in (2, 3) and all(
            isinstance(c, int) and not isinstance(c, bool) for c in concurrency):
        return ActorPoolStrategy(**dict(zip(("min_size", "max_size", "initial_size"), concurrency)))
    raise ValueError(f"concurrency must be a number of actors >= 1, or (min, max) or (min, max, initial), "
                     f"got {concurrency!r}")


def _check_schema(ds, plain: dict) -> None:
    """Fail on the driver when the dataset's columns cannot work."""
    schema = ds.schema()  # from metadata where Ray has it (Parquet), else from the first block
    names = list(getattr(schema, "names", None) or [])
    if not names:
        return
    icfg = plain["input"]
    keep = plain["output"]["keep_columns"]
    problems = column_problems(names, id_column=icfg["id_column"], prompt_column=icfg["prompt_column"],
                               messages_column=icfg["messages_column"], params_column=icfg["params_column"],
                               keep_columns=keep if isinstance(keep, list) else ())
    if problems:
        raise ConfigError(f"dataset columns {names} do not fit the job (see input.*_column):", problems)


def _as_table(batch: Any) -> pa.Table:
    if isinstance(batch, pa.Table):
        return batch
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # a pandas DataFrame
        return pa.Table.from_pandas(batch, preserve_index=False)
    if isinstance(batch, Mapping):
        return pa.table({k: list(v) for k, v in batch.items()})
    raise TypeError(f"a batch must be a pyarrow Table, a pandas DataFrame or a dict of columns, got {type(batch).__name__}")
