"""What a job's rows depend on, kept in its output folder, so that a resume cannot quietly mix the
rows of two different jobs (say, greedy rows with rows sampled at temperature 0.7).

The first run writes ``OUT/job-fingerprint.json``: the settings that change a row's text (the
target model and dtype, the sampling settings, the prompt and messages columns, the chat template
and system prompt). A later run whose settings differ, while the folder holds output rows, is
refused before any model loads, naming what changed, unless it is allowed (``run
--allow-changed-job``): then the new settings are recorded, and the old ones kept under
``previous``. Settings that only change speed (drafters, selector, slots, device) or which rows
fail (``batch.max_model_len``, ``input.max_line_bytes``) are not part of it. In a greedy job the
seed, top_p and top_k change nothing and are left out.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import JobConfig
from .io.writer import OUTPUTS_DIR, write_json_atomic

FILE = "job-fingerprint.json"


class JobChanged(ValueError):
    """The job's settings differ from those the output folder's rows were made with."""


def _model_ref(ref: str) -> str:
    """A local model directory by its real path (so ./m and /abs/m are one model); other refs as given."""
    return os.path.realpath(ref) if os.path.exists(ref) else ref


def fingerprint(job: JobConfig) -> dict[str, Any]:
    """The settings that change a row's text (or its logprobs columns), as plain JSON data."""
    s, i = job.sampling, job.input
    fp: dict[str, Any] = {
        "target.model": _model_ref(job.target.model),
        "target.dtype": job.target.dtype,
        "sampling.temperature": s.temperature,
        "sampling.max_tokens": s.max_tokens,
        "sampling.stop": list(s.stop),
        "sampling.ignore_eos": s.ignore_eos,
        "input.prompt_column": i.prompt_column,
        "input.messages_column": i.messages_column,
        "input.chat_template": i.chat_template,
        "input.system_prompt": i.system_prompt,
        "input.format": i.format,
        "input.params_column": i.params_column,
    }
    # rows may sample on their own (an OpenAI body, a params column) even when the job is greedy; a
    # greedy job with format auto that finds OpenAI files is not told apart here (left: docs/jobs.md)
    rows_may_sample = i.format == "openai" or i.params_column is not None
    if not s.greedy or rows_may_sample:
        fp.update({"sampling.seed": s.seed, "sampling.top_p": s.top_p, "sampling.top_k": s.top_k,
                   "sampling.sampler": s.sampler})
    if s.logprobs is not None or s.prompt_logprobs is not None:  # the rows' logprobs columns
        fp.update({"sampling.logprobs": s.logprobs, "sampling.prompt_logprobs": s.prompt_logprobs,
                   "sampling.logprobs_mode": s.logprobs_mode})
    if rows_may_sample:  # what an OpenAI line's omitted temperature takes
        fp["sampling.openai_defaults"] = s.openai_defaults
    # the controls, where set (a job that sets none keeps the fingerprint it had before they existed)
    controls = {"sampling.stop_token_ids": list(s.stop_token_ids), "sampling.min_tokens": s.min_tokens,
                "sampling.min_p": s.min_p, "sampling.presence_penalty": s.presence_penalty,
                "sampling.frequency_penalty": s.frequency_penalty, "sampling.repetition_penalty": s.repetition_penalty,
                "sampling.logit_bias": [list(p) for p in s.logit_bias],
                "input.chat_template_kwargs": i.chat_template_kwargs}
    unset = {"sampling.repetition_penalty": 1.0, "input.chat_template_kwargs": None}
    fp.update({k: v for k, v in controls.items() if v != unset.get(k, 0 if isinstance(v, float | int) else [])})
    if job.target.quantize != "none":  # the int8 target's text (absent when none: older outputs keep theirs)
        fp["target.quantize"] = job.target.quantize
    if s.n != 1:  # samples per prompt (absent at 1, so older outputs keep their fingerprint)
        fp["sampling.n"] = s.n
    return json.loads(json.dumps(fp))


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_fingerprint(out: Path, job: JobConfig, *, allow_changed: bool = False,
                      warn: Callable[[str], None] = _warn) -> None:
    """Record the job's fingerprint in ``out``, or compare it with the one recorded there.

    Raises:
        JobChanged: ``out`` holds output rows made with other settings and ``allow_changed`` is false.
    """
    path = out / FILE
    new = fingerprint(job)
    old: dict[str, Any] | None = None
    history: list = []
    if path.exists():
        try:
            doc = json.loads(path.read_text())
            old, history = dict(doc["fingerprint"]), list(doc.get("previous", []))
        except (OSError, ValueError, KeyError, TypeError) as e:
            warn(f"spin-batch: warning: cannot read {path} ({e}); writing this job's settings there anew")
    has_rows = any((out / OUTPUTS_DIR).glob("part-*.parquet"))
    if old is not None and has_rows:
        changes = [f"{k} {old[k]!r} -> {new[k]!r}" for k in new if k in old and old[k] != new[k]]
        if not changes:
            return
        if not allow_changed:
            raise JobChanged(f"{out} holds rows of a job with other settings: {'; '.join(changes)}. Rerun with "
                             "the old settings, use another output.dir, or pass --allow-changed-job to add rows "
                             f"made with the new ones (recorded in {path})")
        warn(f"spin-batch: warning: job settings changed ({'; '.join(changes)}); going on as --allow-changed-job "
             f"asks: rows made before and after the change are mixed in {out}")
        history.append(old)
    elif old == new:
        return
    write_json_atomic(path, {"fingerprint": new, "previous": history,
                             "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


WORKERS_FILE = "workers.json"


class WorkersChanged(ValueError):
    """A worker's count of workers differs from the one the output folder's rows were dealt by."""


def _recorded_workers(out: Path) -> int | None:
    """The worker count ``out`` records (``workers.json``); for a folder from before that file, the count its
    summaries agree on; None where neither says."""
    try:
        return int(json.loads((out / WORKERS_FILE).read_text())["num_shards"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError):
        return None
    counts = set()
    for path in out.glob("summary*.json"):
        try:
            counts.add(int(json.loads(path.read_text())["num_shards"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return counts.pop() if len(counts) == 1 else None


def check_workers(out: Path, shard_index: int, num_shards: int) -> None:
    """Record the number of workers in ``out`` on its first run (``OUT/workers.json``), or compare it with
    the one recorded there while the folder holds rows.

    Raises:
        WorkersChanged: ``out`` holds rows dealt among another number of workers. Which rows a worker
            takes follows from the count, so a worker with another count would take rows that the old
            split's workers take too (``sbatch --array=2`` alone runs a one-task array: worker 0 of 1).
    """
    path = out / WORKERS_FILE
    old = _recorded_workers(out)
    if old == num_shards:
        if not path.exists():
            write_json_atomic(path, {"num_shards": num_shards})
        return
    if old is not None and any((out / OUTPUTS_DIR).glob("part-*.parquet")):
        raise WorkersChanged(
            f"{out} holds rows dealt among {old} worker(s), but this run is worker {shard_index} of {num_shards}. "
            f"Pass --num-shards {old} and this worker's --shard-index (0 to {old - 1}); under Slurm, `sbatch "
            f"--array=I` alone runs a one-task array, so give the count explicitly, as "
            "examples/slurm/spin_batch_array.sbatch does. To split the rows left among "
            f"{num_shards} worker(s) instead, first let every worker of the old split stop, then delete {path}")
    write_json_atomic(path, {"num_shards": num_shards})
