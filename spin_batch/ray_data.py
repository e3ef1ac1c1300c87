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

Every output row is its input row (all columns kept, in the same order) plus the columns of
`spin-batch run`'s outputs (`text`, `finish_reason`, `prompt_tokens`, `completion_tokens`,
`status`, `error`, the speculation counts, `drafter_pulls`, `decode_time_s`). A bad row (no id,
no prompt, a malformed `messages`, a prompt too long, an id repeated within the batch) becomes a
row with `status` "error" and a message; the batch goes on.

One `SpinBatchPredictor` per actor keeps its engine and its bandit's statistics from batch to
batch. Each batch is a stream of its own: its last requests decode as the slots drain, so a
batch should hold many more rows than `batch.slots` (`generate` defaults to 16 times as many).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from .config import ConfigError, JobConfig, job_to_dict, load_job, parse_job
from .io.reader import requests_from_rows
from .io.rows import column_problems
from .io.writer import OUTPUT_SCHEMA

#: The output columns added to each row ("id" is the input's own column; "source" means a shard row).
RESULT_FIELDS = [f for f in OUTPUT_SCHEMA if f.name not in ("id", "source")]
# Placeholders for the job keys Ray makes moot, so a job given as a mapping may leave them out.
_UNUSED = {"input": {"paths": ["<ray data>"]}, "output": {"dir": "<ray data>"}}


def prepare_job(job: str | os.PathLike | Mapping | JobConfig, overrides: Sequence[str] = ()) -> dict:
    """Check a job on the driver and return it as plain data for the actors.

    `job` is a job file, a mapping in its form (input.paths and output.dir may be left out) or a
    JobConfig. Raises ConfigError for a bad job and ValueError for missing or mismatched models,
    before any weights load. Relative model paths are made absolute here, against the driver's
    working directory, since an actor may run elsewhere.
    """
    from .runner import check_models

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
    """

    def __init__(self, job: Mapping, overrides: Sequence[str] = (), threads: int | None = None):
        import torch

        from .runner import build_engine, make_encoder

        if threads is not None:  # torch's and our CPU kernels' OpenMP threads (they share one runtime)
            torch.set_num_threads(threads)
        self.job = parse_job(job, overrides, source="<ray data job>")
        self.engine = build_engine(self.job)
        self.encode = make_encoder(self.engine.tokenizer, self.job)
        self.batches = 0

    def __call__(self, batch: Any) -> pa.Table:
        table = _as_table(batch)
        if clash := _clash(table.column_names):
            raise ValueError(clash)
        icfg = self.job.input
        self.batches += 1
        requests = requests_from_rows(table.to_pylist(), id_column=icfg.id_column,
                                      prompt_column=icfg.prompt_column, messages_column=icfg.messages_column,
                                      source_prefix=f"batch{self.batches}")
        rows: dict[str, dict] = {}
        t0 = time.perf_counter()
        self.engine.loop.run(iter(requests), self.encode, lambda row: rows.__setitem__(row["source"], row))
        seconds = time.perf_counter() - t0
        missing = [r.source for r in requests if r.source not in rows]
        if missing:  # the loop emits every request it is given; anything else is a bug worth failing on
            raise RuntimeError(f"spin-batch lost {len(missing)} rows of a batch (first: {missing[0]})")
        ordered = [rows[r.source] for r in requests]
        tokens = sum(row["completion_tokens"] for row in ordered)
        errors = sum(row["status"] != "ok" for row in ordered)
        print(f"spin-batch (pid {os.getpid()}): batch {self.batches}: {len(ordered)} rows ({errors} errors), {tokens} "
              f"tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} tok/s)", file=sys.stderr, flush=True)
        for f in RESULT_FIELDS:
            table = table.append_column(f, pa.array([row[f.name] for row in ordered], type=f.type))
        return table


def generate(ds, job: str | os.PathLike | Mapping | JobConfig, overrides: Sequence[str] = (), *,
             concurrency: int = 1, num_gpus: float | None = None, num_cpus: float | None = None,
             threads: int | None = None, batch_size: int | None = None, **map_batches_args):
    """`ds` with spin-batch's completions added to each row (see the module doc).

    concurrency: actors, one engine each. num_gpus / num_cpus: Ray resources per actor. Ray sets
    an actor's OpenMP threads to its num_cpus (1 by default); `threads` sets them directly. On CPU
    leave Ray a CPU for reading and writing: an actor that reserves every CPU starves the read
    and write tasks, and the dataset never finishes (on 2 cores: num_cpus=1, threads=2).
    batch_size: rows per call, by default 16 times batch.slots. Other keyword arguments go to
    Dataset.map_batches.
    """
    plain = prepare_job(job, overrides)
    _check_schema(ds, plain)
    resources = {k: v for k, v in (("num_gpus", num_gpus), ("num_cpus", num_cpus)) if v is not None}
    return ds.map_batches(
        SpinBatchPredictor, fn_constructor_kwargs={"job": plain, "threads": threads}, batch_format="pyarrow",
        concurrency=concurrency, batch_size=batch_size or 16 * plain["batch"]["slots"], **resources,
        **map_batches_args)


def _check_schema(ds, plain: dict) -> None:
    """Fail on the driver when the dataset's columns cannot work."""
    schema = ds.schema()  # from metadata where Ray has it (Parquet), else from the first block
    names = list(getattr(schema, "names", None) or [])
    if not names:
        return
    icfg = plain["input"]
    problems = column_problems(names, id_column=icfg["id_column"], prompt_column=icfg["prompt_column"],
                               messages_column=icfg["messages_column"])
    if clash := _clash(names):
        problems.append(clash)
    if problems:
        raise ConfigError(f"dataset columns {names} do not fit the job (see input.*_column):", problems)


def _clash(names: Sequence[str]) -> str | None:
    """Input columns that spin-batch's output columns would overwrite, if any."""
    clash = sorted(set(names) & {f.name for f in RESULT_FIELDS})
    return (f"input columns {clash} clash with spin-batch's output columns; rename them first "
            "(e.g. ds.rename_columns({...}))") if clash else None


def _as_table(batch: Any) -> pa.Table:
    if isinstance(batch, pa.Table):
        return batch
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # a pandas DataFrame
        return pa.Table.from_pandas(batch, preserve_index=False)
    if isinstance(batch, Mapping):
        return pa.table({k: list(v) for k, v in batch.items()})
    raise TypeError(f"a batch must be a pyarrow Table, a pandas DataFrame or a dict of columns, got {type(batch).__name__}")
