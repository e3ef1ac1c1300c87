"""A job end to end: the lock, resume, the loop over this worker's rows, progress and log lines, the
outputs and summary.json. The engine comes from build.py, the checks from preflight.py."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .build import Engine, backends, build_engine, make_encoder, model_backend, prefix_summary
from .config import JobConfig, job_to_dict
from .export import write_results
from .fingerprint import check_fingerprint, check_workers
from .io.checks import check_columns
from .io.outputs import cleanup_temp, drop_superseded, read_written
from .io.reader import iter_requests
from .io.rows import input_spec
from .io.schema import completion_row
from .io.shards import assign, count_rows, file_format, list_shards, resolve_workers, worker_sources
from .io.writer import OutputWriter, StatsWriter, make_run_id, write_json_atomic
from .preflight import check_output, resolve_dtype
from .records import Completion, Request
from .stats import RunStats


# -- running a job -----------------------------------------------------------------------


class StopFlag:
    """Set by SIGTERM/SIGINT: the loop finishes its step, outputs are flushed, the job exits.

    A SIGINT before the loop runs (start-up: loading models), or a second one, interrupts at once
    (KeyboardInterrupt): nothing is in flight yet to finish."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.running = False  # set once the loop starts

    def __call__(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        def handler(signum, frame):
            if signum == signal.SIGINT and (self.signum is not None or not self.running):
                raise KeyboardInterrupt
            self.signum = signum
            print(f"\nspin-batch: got {signal.Signals(signum).name}; finishing the current step, flushing outputs. "
                  "Rerun the same command to resume.", file=sys.stderr)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


@dataclass
class RunResult:
    summary: dict
    stopped_by: int | None  # signal number, or None when the input was finished


def run_job(
    job: JobConfig,
    *,
    shard_index: int | None = None,
    num_shards: int | None = None,
    limit: int | None = None,
    progress: bool = True,
    stop: StopFlag | None = None,
    engine: Engine | None = None,
    retry_errors: bool = False,
    allow_changed_job: bool = False,
) -> RunResult:
    """Run (or resume) this worker's part of the job. ``retry_errors``: redo the rows whose latest row
    is an error. ``allow_changed_job``: resume even though the settings that change a row's text
    differ from those the output folder's rows were made with (fingerprint.py)."""
    shard_index, num_shards = resolve_workers(shard_index, num_shards)
    job = resolve_dtype(job)  # target.dtype auto: the fingerprint and the engine see what it means here
    # everything that can be checked without weights is, before any model loads
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"--limit must be an integer >= 0, got {limit!r}")
    shards = list_shards(job.input.paths, job.input.format)
    mine, _ = assign(shards, shard_index, num_shards)
    check_columns(mine, input_spec(job.input, job.output.keep_columns), max_line_bytes=job.input.max_line_bytes)
    problems = check_output(job)
    if problems:
        raise ValueError(problems[0])
    out = Path(job.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    check_fingerprint(out, job, allow_changed=allow_changed_job)
    check_workers(out, shard_index, num_shards)  # a one-task Slurm array redoing task 2 of 4 is refused
    worker = f"w{shard_index:04d}"
    lock = RunLock(out, worker)  # a second run of this worker stops here while this one goes on
    try:
        return _run_locked(job, out, worker, shards, shard_index, num_shards, limit, progress, stop, engine,
                           retry_errors)
    finally:
        lock.release()


def _run_locked(job: JobConfig, out: Path, worker: str, shards: list[Path], shard_index: int, num_shards: int,
                limit: int | None, progress: bool, stop: StopFlag | None, engine: Engine | None,
                retry_errors: bool = False) -> RunResult:
    cleanup_temp(out, worker=worker)
    # unreadable parts are moved aside (their rows redone); rows a retried row replaced are dropped
    done = read_written(out, retry_errors=retry_errors, tidy=True)
    run_id = make_run_id()
    stats = RunStats()
    engine = engine or build_engine(job, stats)
    engine.loop.stats = stats
    stats.declare_drafters(["none", *engine.loop.drafters])  # one stats schema for every run of the job
    stats.restart_clock()  # throughput excludes model load
    stop = stop or StopFlag()
    skipped = 0  # rows of this worker's input already written by an earlier run
    replaced = 0  # rows written this run for an id whose older row was made from other input

    def count_skip(req: Request) -> None:
        nonlocal skipped, done_mine
        skipped += 1
        if not upfront:
            bar.update(1)
        elif req.source not in done.sources:  # done, but written when it was read from elsewhere
            done_mine += 1
            bar.update(1)

    requests = iter_requests(
        shards, input_spec(job.input, job.output.keep_columns), shard_index=shard_index, num_shards=num_shards,
        is_done=done, limit=limit, on_skip=count_skip, max_line_bytes=job.input.max_line_bytes,
    )
    writer = OutputWriter(out, worker=worker, run_id=run_id, rows_per_part=job.output.rows_per_part,
                          flush_interval_s=job.output.flush_interval_s)
    stats_writer = StatsWriter(out, worker=worker, run_id=run_id)
    # this worker's rows, and how many of them earlier runs wrote (not the other workers' rows)
    total, done_mine = worker_rows(shards, shard_index, num_shards, done.sources, job.input.max_line_bytes)
    if limit is not None:
        total = limit if total is None else min(total, limit)
    upfront = done_mine is not None and limit is None  # else the bar counts skipped rows as they are passed
    tty = sys.stderr.isatty()
    log_lines = not (progress and tty)  # a log file (Slurm, cron) gets one timestamped line an interval
    bar = _progress(progress and tty, total, done_mine if upfront else 0)
    worker_text = f"{shard_index}/{num_shards}"
    _log(start_line(job, engine, worker_text, done_mine, total))
    last_interval = [time.monotonic()]
    emitted = [0]

    def emit(completion: Completion) -> None:
        nonlocal replaced, done_mine
        writer.add_many([completion_row(c, model=job.target.served_names[0], prefix=job.output.column_prefix)
                         for c in (completion, *completion.more)])  # a request's samples, in one part
        replaced += done.replaces(completion.request)
        emitted[0] += 1
        if upfront and completion.request.source in done.sources:  # counted done, but its input changed
            done_mine -= 1
        else:
            bar.update(1)

    def after_step() -> None:
        writer.maybe_flush()
        now = time.monotonic()
        bar.set_postfix_str(f"{stats.tokens_per_s():.1f} tok/s, {len(engine.loop.active)} active", refresh=False)
        if now - last_interval[0] >= job.output.stats_interval_s:
            record = stats.interval_record()
            record["wall_time"] = time.time()  # for report.png's time axis, across runs and workers
            stats_writer.add(record)
            last_interval[0] = now
            if log_lines:
                done_now = emitted[0] + (done_mine if upfront else skipped)
                _log(f"spin-batch: worker {worker_text}: {rows_progress(done_now, total, emitted[0], stats.elapsed())}"
                     f", {int(stats.totals['generated_tokens'])} tokens, "
                     f"{record['tokens_per_s']:.1f} tok/s, {len(engine.loop.active)}/{job.batch.slots} slots active")

    try:
        encode = make_encoder(engine.tokenizer, job)
        stop.running = True
        engine.loop.run(requests, encode, emit, stop, after_step)
    finally:
        writer.close()
        stats_writer.add({**stats.interval_record(), "wall_time": time.time()})
        stats_writer.close()
        bar.close()
    if retry_errors or replaced:
        drop_superseded(out)  # the rows this run's rows replaced
    if replaced:
        _log(f"spin-batch: worker {worker_text}: {replaced} rows redone because their input changed under the "
             "same id; each replaced its older row")
    summary = {
        "run_id": run_id,
        "job": job_to_dict(job),
        "shard_index": shard_index,
        "num_shards": num_shards,
        "model_load_s": engine.load_time_s,
        "rows_skipped_as_done": skipped,
        "rows_replaced": replaced,
        "finished": stop.signum is None,
        **stats.summary(),
        "drafter_stats": {n: d.stats() for n, d in engine.loop.drafters.items() if d.stats()},
        "prefix_cache": prefix_summary(engine.loop.prefix),
        "backends": backends(engine),
    }
    name = "summary.json" if num_shards == 1 else f"summary-{worker}.json"
    write_json_atomic(out / name, summary)
    if stop.signum is None:  # this worker is done: the merged files of every worker's rows so far
        write_results(out, job.output.format, job.target.served_names[0])
    return RunResult(summary, stop.signum)


class RunLocked(RuntimeError):
    """Another run of the same job and worker holds the output directory."""


class RunLock:
    """An exclusive lock per output directory and worker, so cron or a requeued Slurm task starting a
    second run while the first one is still going cannot decode (and write) every row twice.

    flock on OUT/.lock-<worker>: the kernel drops it when the process ends, kill -9 included, so a
    stale lock file never blocks a resume. (On NFS, flock works where the mount supports locks.)
    """

    def __init__(self, out: Path, worker: str):
        import fcntl

        self.path = out / f".lock-{worker}"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise RunLocked(f"another run of this job (worker {worker}) is still going: {holder}; it holds "
                            f"{self.path}. Wait for it to finish or stop it; rerunning then resumes.") from None
        except OSError as e:  # a file system without locks (some NFS mounts): run unguarded, and say so
            print(f"spin-batch: warning: cannot lock {self.path} ({e.strerror or e}); a second run of this "
                  "worker started meanwhile would not be stopped", file=sys.stderr)
            return
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                  .encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def _progress(enabled: bool, total: int | None, already: int):
    """This worker's bar: ``total`` its rows (None where not cheap to know), ``already`` those of them
    earlier runs wrote. Off in a log file (Slurm, cron): there the interval lines take its place."""
    from tqdm import tqdm

    return tqdm(total=total, initial=already, unit="row", desc="spin-batch", disable=not enabled,
                dynamic_ncols=True, mininterval=0.1, postfix=f"{already} done earlier" if already else None)


def _log(line: str) -> None:
    """One line on stderr, with a UTC ISO timestamp first."""
    print(f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ} {line}", file=sys.stderr, flush=True)


def rows_progress(done: int, total: int | None, this_run: int, elapsed: float) -> str:
    """``rows 30/80 (37.5%, ETA 0:01:40, 0.30 rows/s; 12 this run)``: a log line's progress, as a bar shows
    it. The rate is this run's rows over its time since the models loaded; the ETA is the rows left at
    that rate (``?`` before the run's first row, or where the total is not known)."""
    rate = this_run / elapsed if this_run and elapsed > 0 else None
    speed = "" if rate is None else f"{rate:.2f} rows/s; " if rate >= 0.1 else f"{rate:.2g} rows/s; "
    if total is None:
        return f"rows {done}/? ({speed}{this_run} this run)"
    left = max(total - done, 0)
    eta = _clock(left / rate) if rate else "0:00:00" if not left else "?"
    percent = 100.0 * done / total if total else 100.0
    return f"rows {done}/{total} ({percent:.1f}%, ETA {eta}, {speed}{this_run} this run)"


def _clock(seconds: float) -> str:
    """H:MM:SS, rounded up to the second."""
    whole = int(-(-seconds // 1))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def start_line(job: JobConfig, engine: Engine, worker: str, done: int | None, total: int | None) -> str:
    """What a log needs to tell runs apart: model, dtype, device, the target's CPU path, slots, worker."""
    target = engine.target
    plan = getattr(target, "plan", None)
    path = (f"layers={plan.cpu.layers} lm_head={plan.cpu.lm_head}" if plan is not None and plan.backend == "native"
            else f"backend={model_backend(target)['backend']}")
    dtype = str(getattr(target, "dtype", job.target.dtype)).removeprefix("torch.")
    return (f"spin-batch: start model={job.target.model} dtype={dtype} "
            f"device={getattr(target, 'device', job.target.device)} {path} "
            f"slots={job.batch.slots} worker={worker} rows_done={'?' if done is None else done} "
            f"rows={'?' if total is None else total}")


JSONL_COUNT_BYTES = 256 << 20  # this worker's JSONL input up to this size is counted for the bar's total


def worker_rows(shards: list[Path], shard_index: int, num_shards: int, done_sources, max_line_bytes: int,
                jsonl_budget: int = JSONL_COUNT_BYTES) -> tuple[int | None, int | None]:
    """``(rows, done)``: how many input rows are this worker's, and how many of them ``done_sources``
    holds; None where it is not cheap to know (JSONL past ``jsonl_budget`` bytes, a file that cannot be
    read: the run reports that when it gets there). The rows are those the reader deals this worker
    (io.shards.assign: whole files, or every num_shards-th row): Parquet rows come from the file
    metadata, JSONL rows are counted as the reader yields them (a non-blank line, or one over
    max_line_bytes, is a row), unparsed."""
    files, modulo = assign(shards, shard_index, num_shards)
    done = None
    if modulo is None:  # whole files: their rows' sources start with their paths
        names = {str(Path(p).resolve()) for p in files}
        done = sum(1 for s in done_sources if s.rpartition("#")[0] in names)
    try:
        if sum(Path(p).stat().st_size for p in files if file_format(Path(p)) != "parquet") > jsonl_budget:
            return None, done
        if modulo is None:
            return sum(count_rows(p, max_line_bytes) for p in files), done
        total = done_mine = 0
        for source in worker_sources(shards, shard_index, num_shards, max_line_bytes):
            total += 1
            done_mine += source in done_sources
    except Exception:  # noqa: BLE001  an unreadable file is the run's to report, when it gets there
        return None, done
    return total, done_mine
