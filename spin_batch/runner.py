"""Glue from a validated JobConfig to a running BatchLoop: models, drafters, reader, writers."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from .config import (
    COMPOSITE_KINDS,
    CascadeDrafterConfig,
    EarlyExitDrafterConfig,
    JobConfig,
    ModelDrafterConfig,
    NgramDrafterConfig,
    VoteDrafterConfig,
    job_to_dict,
)
from .drafters.base import Drafter
from .drafters.cascade import CascadeDrafter
from .drafters.early_exit import EarlyExitDrafter, check_layers
from .drafters.model import FeatureDrafter, ModelDrafter
from .drafters.ngram import NgramDrafter
from .drafters.vote import VoteDrafter
from .engine.loop import BatchLoop, LoopSettings
from .selection.factory import make_policy
from .records import Completion, Request
from .sampling import SamplingParams
from .export import write_results
from .fingerprint import check_fingerprint
from .io.checks import check_columns, check_input
from .io.outputs import cleanup_temp, drop_superseded, read_done
from .io.reader import iter_requests
from .io.schema import completion_row
from .io.shards import (InputError, assign, count_rows, file_format, list_shards, shard_defaults_from_env,
                        worker_sources)
from .io.writer import OutputWriter, StatsWriter, make_run_id, write_json_atomic
from .models import cpu_plan, loader
from .models.distilled import TargetFeatures, check_pairing, draft_meta, load_draft
from .models.hf_backend import TransformersModel
from .models.llama import LlamaModel
from .models.spec import window_problem
from .stats import RunStats


# -- checks that need no weights -------------------------------------------------------


def dir_problem(path: Path) -> list[str]:
    """Why `path` cannot be made a directory to write in (it, or a folder above it, is a file; it, or
    the folder it would be made in, is not writable), if it cannot."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                return [f"{p} exists and is not a directory"]
            if not os.access(p, os.W_OK | os.X_OK):
                return [f"{p} is not writable" if p == path else f"cannot create {path}: {p} is not writable"]
            return []
    return []


def check_output(job: JobConfig) -> list[str]:
    """Whether output.dir can be a directory this process writes in."""
    return [f"output.dir: {p}" for p in dir_problem(Path(job.output.dir))]


def check_models(job: JobConfig) -> list[str]:
    """Model-level problems of a job, without loading weights: the device, missing or unreadable model
    folders, checkpoints whose tensors do not fit their config.json (safetensors headers only), missing
    tokenizers, a context past a sliding window, early-exit depth, tokenizer mismatch, draft pairing."""
    try:
        device = loader.resolve_device(job.target.device)
    except RuntimeError as e:
        return [f"target.device: {e}"]
    try:  # the kernels target.kernels asks for (and the environment's overrides) can run here
        loader.resolve_execution(job.target.kernels, device)
    except loader.ExecutionError as e:
        return [str(e)]
    target = job.target
    problems = loader.check_model_ref(target.model, target.backend, target.trust_remote_code,
                                      job.batch.max_model_len)
    if problems:
        return problems
    target_dir = loader.resolve_model_dir(job.target.model)
    if draft_meta(target_dir) is not None:
        return [f"target.model: {job.target.model} is a distilled draft; it runs only as a `kind: model` drafter "
                "next to the target it was distilled for"]
    backend = loader.resolve_backend(target.backend, target_dir)
    if backend == loader.TRANSFORMERS and target.kernels == "c":
        problems.append("target.kernels: c is the native decoder's C path; the transformers backend runs "
                        "transformers' own layers (use auto or torch)")
    if backend == loader.NATIVE:
        spec = loader.read_spec(target_dir)
        window = window_problem(spec, job.batch.max_model_len)
        if window:
            problems.append(f"target.model: {window}; set batch.max_model_len to {spec.sliding_window} or less, "
                            "or target.backend: transformers")
    try:
        target_vocab = loader.load_tokenizer(target_dir).get_vocab()
    except loader.TokenizerError as e:
        problems.append(f"target.model: {e}")
        target_vocab = None
    for d in job.drafters:
        if isinstance(d, EarlyExitDrafterConfig):
            p = check_layers(d.layers, loader.model_layers(target_dir, backend, target.trust_remote_code))
            if p:
                problems.append(f"drafters.{d.name}: {p}")
        elif isinstance(d, ModelDrafterConfig):
            refs = loader.check_model_ref(d.model, d.backend, d.trust_remote_code, job.batch.max_model_len)
            if refs:
                problems.extend(f"drafters.{d.name}: {r}" for r in refs)
                continue
            draft_dir = loader.resolve_model_dir(d.model)
            if loader.resolve_backend(d.backend, draft_dir) == loader.NATIVE:
                window = window_problem(loader.read_spec(draft_dir), job.batch.max_model_len)
                if window:
                    problems.append(f"drafters.{d.name}: {window}")
            if draft_meta(draft_dir) is not None and backend != loader.NATIVE:
                problems.append(f"drafters.{d.name}: a distilled draft reads the target's embeddings and runs next "
                                "to a native target only (target.backend: auto or native)")
                continue
            if draft_meta(draft_dir) is None:  # a plain model: its token ids must mean the target's tokens
                try:
                    draft_vocab = loader.load_tokenizer(draft_dir).get_vocab()
                except loader.TokenizerError as e:
                    problems.append(f"drafters.{d.name}: {e} (needed to check it against the target's)")
                    continue
                if target_vocab is not None and draft_vocab != target_vocab:
                    problems.append(f"drafters.{d.name}: tokenizer of {d.model} does not match the target's tokenizer")
                continue
            # a distilled draft reads the target's tokens and embeddings: the fingerprint pairs them
            try:
                why = check_pairing(draft_dir, target_dir)
            except ValueError as e:  # the target has no embeddings a draft can pair with
                why = str(e)
            if why is not None:
                problems.append(f"drafters.{d.name}: {why}")
    return problems


def validate_job(job: JobConfig, check_models_too: bool = True) -> list[str]:
    """Everything `spin-batch validate` checks: input files and rows, then models."""
    try:
        shards = list_shards(job.input.paths, job.input.format)
    except ValueError as e:
        return [str(e)]
    problems = check_input(shards, id_column=job.input.id_column, prompt_column=job.input.prompt_column,
                           messages_column=job.input.messages_column, max_line_bytes=job.input.max_line_bytes,
                           params_column=job.input.params_column, fmt=job.input.format,
                           keep_columns=job.output.keep_columns)
    try:  # a column that none of the first rows of the first JSONL shard has (check_input counts bad rows)
        check_columns([p for p in shards if p.suffix != ".parquet"], id_column=job.input.id_column,
                      prompt_column=job.input.prompt_column, messages_column=job.input.messages_column,
                      max_line_bytes=job.input.max_line_bytes, fmt=job.input.format)
    except InputError as e:
        problems.append(str(e))
    problems += check_output(job)
    if check_models_too:
        problems += check_models(job)
    return problems


# -- building the engine ---------------------------------------------------------------


@dataclass
class Engine:
    model_dir: Path
    target: LlamaModel
    tokenizer: object
    loop: BatchLoop
    load_time_s: float


def eos_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """The ids that end a completion: the tokenizer's eos token, plus the eos_token_id (an int or a list)
    that transformers' generate stops at: generation_config.json's where the folder has one, else
    config.json's (GenerationConfig.from_pretrained falls back to config.json, as from_model_config does)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_cfg = Path(model_dir) / "generation_config.json"
    source = gen_cfg if gen_cfg.exists() else Path(model_dir) / "config.json"
    e = json.loads(source.read_text()).get("eos_token_id")
    ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    return frozenset(ids)


def make_encoder(tokenizer, job: JobConfig) -> Callable[[Request], list[int]]:
    """Request -> prompt token ids; raises ValueError for a row that cannot be encoded."""
    icfg = job.input
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if icfg.chat_template is True and not has_template:
        raise ValueError("input.chat_template is true but the target tokenizer has no chat template")
    template_prompts = icfg.chat_template is True or (icfg.chat_template == "auto" and has_template)
    # A token covers at most as many characters as its vocabulary string has (a byte-level token's
    # string has one character per byte, an added token's is its text), so a text longer than
    # (max_model_len - 1) x the longest cannot fit. It is turned away before tokenizing, whose time
    # and memory grow with the text (a 20 MB prompt took 40 s and 4 GB to be told it was too long).
    longest = max(max((len(t) for t in tokenizer.get_vocab()), default=1), 1)
    max_chars = (job.batch.max_model_len - 1) * longest

    def tokenize(text: str, **kwargs) -> list[int]:
        if len(text) > max_chars:
            raise ValueError(f"prompt has {len(text)} characters, more than max_model_len {job.batch.max_model_len} "
                             f"can hold ({job.batch.max_model_len - 1} tokens of at most {longest} characters, the "
                             "longest in this tokenizer's vocabulary); not tokenized")
        return tokenizer.encode(text, **kwargs)

    def render(messages: list[dict]) -> list[int]:
        if not has_template:
            raise ValueError("row has messages but the target tokenizer has no chat template")
        if icfg.system_prompt is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": icfg.system_prompt}] + messages
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template may raise anything (jinja errors, role checks)
            raise ValueError(f"chat template failed: {e}") from e
        return tokenize(text, add_special_tokens=False)

    def encode(req: Request) -> list[int]:
        if req.messages is not None:
            ids = render([dict(m) for m in req.messages])
        elif template_prompts and req.endpoint != "completion":  # an OpenAI /v1/completions prompt is raw text
            ids = render([{"role": "user", "content": req.prompt}])
        else:
            ids = tokenize(req.prompt)
        if not ids:
            raise ValueError("prompt is empty after tokenization")
        return ids

    return encode


def distilled_draft_dtype(target_dtype: str, device: torch.device) -> str:
    """A distilled draft's default dtype: bfloat16 where bf16 matmuls are native (GPUs with bf16,
    CPUs with AVX512-BF16/AMX), which halves the weights it streams per draft token; else the
    target's. A draft's precision never changes the output, only how often its tokens are accepted."""
    return "bfloat16" if loader.native_bf16(device) else target_dtype


def build_drafters(job: JobConfig, target: LlamaModel, target_cache, device: torch.device) -> dict[str, Drafter]:
    drafters: dict[str, Drafter] = {}
    features: TargetFeatures | None = None  # shared by the drafters that read the target's features
    embeds: dict[torch.dtype, torch.Tensor] = {}  # the target's embedding per draft dtype, shared by drafts
    for d in job.drafters:
        if isinstance(d, EarlyExitDrafterConfig):
            drafters[d.name] = EarlyExitDrafter(d.name, target, target_cache, d.layers)
        elif isinstance(d, ModelDrafterConfig):
            draft_dir = loader.resolve_model_dir(d.model)
            meta = draft_meta(draft_dir)
            loop = cpu_plan.workloads(job.batch.slots, 0)  # a draft decodes one token a slot at a time
            if meta is not None and not isinstance(target, LlamaModel):
                raise ValueError(f"drafter {d.name!r}: a distilled draft runs next to a native target only")
            if meta is not None:  # distilled: reads the target's embeddings (and maybe its features)
                dtype = d.dtype or distilled_draft_dtype(job.target.dtype, device)
                model = load_draft(draft_dir, target, loader.DTYPES[dtype], device, embeds, loop)
            else:
                model = loader.load_model(draft_dir, d.dtype or job.target.dtype, device, loop,
                                          execution=target.execution, backend=d.backend,
                                          trust_remote_code=d.trust_remote_code)
            if model.spec.vocab_size != target.spec.vocab_size:
                raise ValueError(f"drafter {d.name!r}: vocab size {model.spec.vocab_size} differs from the "
                                 f"target's {target.spec.vocab_size}")
            cache = model.allocate_cache(job.batch.slots, job.batch.max_model_len)
            if model.feature_head is not None:
                if features is None:
                    features = TargetFeatures(job.batch.slots, job.batch.max_model_len, target.spec.hidden_size,
                                              target.spec.rms_norm_eps, target.dtype, device)
                drafters[d.name] = FeatureDrafter(d.name, model, cache, features)
            else:
                drafters[d.name] = ModelDrafter(d.name, model, cache)
        elif isinstance(d, NgramDrafterConfig):
            drafters[d.name] = NgramDrafter(d.name, d.min_ngram, d.max_ngram)
        elif d.kind not in COMPOSITE_KINDS:  # a kind added to config.py but not here
            raise ValueError(f"drafter kind {d.kind!r} has no implementation")
    for d in job.drafters:  # votes and cascades last: they reuse the drafters above
        members = {m: drafters[m] for m in getattr(d, "members", ())}
        if isinstance(d, VoteDrafterConfig):
            drafters[d.name] = VoteDrafter(d.name, members, d.beta, job.batch.slots)
        elif isinstance(d, CascadeDrafterConfig):
            drafters[d.name] = CascadeDrafter(d.name, members, d.min_tokens)
    return {d.name: drafters[d.name] for d in job.drafters}


def loop_settings(job: JobConfig, eos: frozenset[int], device: torch.device) -> LoopSettings:
    s = job.sampling
    pipeline = job.spin.pipeline == "on" or (job.spin.pipeline == "auto" and device.type == "cuda")
    return LoopSettings(
        slots=job.batch.slots,
        max_model_len=job.batch.max_model_len,
        max_num_batched_tokens=job.batch.max_num_batched_tokens,
        max_tokens=s.max_tokens,
        sampling=SamplingParams(s.temperature, s.top_k, s.top_p),
        seed=s.seed,
        stop=s.stop,
        ignore_eos=s.ignore_eos,
        eos_token_ids=eos,
        pipeline=pipeline,
    )


def build_engine(job: JobConfig, stats: RunStats | None = None) -> Engine:
    t0 = time.perf_counter()
    device = loader.resolve_device(job.target.device)
    target_dir = loader.resolve_model_dir(job.target.model)
    tokenizer = loader.load_tokenizer(target_dir)
    loop = cpu_plan.workloads(job.batch.slots, job.spin.num_speculative_tokens if job.drafters else 0)
    target = loader.load_model(target_dir, job.target.dtype, device, loop,
                               execution=loader.resolve_execution(job.target.kernels, device),
                               backend=job.target.backend, trust_remote_code=job.target.trust_remote_code)
    cache = target.allocate_cache(job.batch.slots, job.batch.max_model_len)
    drafters = build_drafters(job, target, cache, device)
    policy = make_policy(job.spin.selector, drafters, job.spin.num_speculative_tokens, job.sampling.seed,
                         job.spin.confidence_gate, backoff=job.spin.backoff)
    loop = BatchLoop(target, tokenizer, loop_settings(job, eos_ids(target_dir, tokenizer), device), policy, drafters,
                     cache, stats)
    return Engine(target_dir, target, tokenizer, loop, time.perf_counter() - t0)


def backends(engine: Engine) -> dict:
    """Which backend and path each model runs on and why (native: cpu_plan.py, execution.py; transformers:
    hf_backend.py): the target's, and each model drafter's."""
    out = {"target": model_backend(engine.target)}
    for name, d in engine.loop.drafters.items():
        model = getattr(d, "model", None)
        if isinstance(model, (LlamaModel, TransformersModel)) and model is not engine.target:
            out[name] = model_backend(model)
    return out


def model_backend(model: LlamaModel | TransformersModel) -> dict:
    """A model's backend() led by the backend's name (a TransformersModel's names itself)."""
    return {"backend": loader.NATIVE, **model.backend()}


def model_backends(job: JobConfig) -> dict[str, str]:
    """The backend each model of a job will run on (validate says it), for a job check_models passed."""
    out = {"target": loader.resolve_backend(job.target.backend, loader.resolve_model_dir(job.target.model))}
    for d in job.drafters:
        if isinstance(d, ModelDrafterConfig):
            out[d.name] = loader.resolve_backend(d.backend, loader.resolve_model_dir(d.model))
    return out


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
    if shard_index is None or num_shards is None:
        env_index, env_count = shard_defaults_from_env()
        shard_index = env_index if shard_index is None else shard_index
        num_shards = env_count if num_shards is None else num_shards
    # everything that can be checked without weights is, before any model loads
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"--limit must be an integer >= 0, got {limit!r}")
    shards = list_shards(job.input.paths, job.input.format)
    mine, _ = assign(shards, shard_index, num_shards)
    check_columns(mine, id_column=job.input.id_column, prompt_column=job.input.prompt_column,
                  messages_column=job.input.messages_column, max_line_bytes=job.input.max_line_bytes,
                  params_column=job.input.params_column, fmt=job.input.format,
                  keep_columns=job.output.keep_columns)
    problems = check_output(job)
    if problems:
        raise ValueError(problems[0])
    out = Path(job.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    check_fingerprint(out, job, allow_changed=allow_changed_job)
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
    done_sources, _ = read_done(out, retry_errors=retry_errors, tidy=True)
    run_id = make_run_id()
    stats = RunStats()
    engine = engine or build_engine(job, stats)
    engine.loop.stats = stats
    stats.declare_drafters(["none", *engine.loop.drafters])  # one stats schema for every run of the job
    stats.restart_clock()  # throughput excludes model load
    stop = stop or StopFlag()
    skipped = 0  # rows of this worker's input already written by an earlier run

    def count_skip(_req: Request) -> None:
        nonlocal skipped
        skipped += 1
        if not upfront:
            bar.update(1)

    requests = iter_requests(
        shards, id_column=job.input.id_column, prompt_column=job.input.prompt_column,
        messages_column=job.input.messages_column, shard_index=shard_index, num_shards=num_shards,
        done_sources=done_sources, limit=limit, on_skip=count_skip, max_line_bytes=job.input.max_line_bytes,
        params_column=job.input.params_column, fmt=job.input.format,
        keep_columns=job.output.keep_columns,
    )
    writer = OutputWriter(out, worker=worker, run_id=run_id, rows_per_part=job.output.rows_per_part,
                          flush_interval_s=job.output.flush_interval_s)
    stats_writer = StatsWriter(out, worker=worker, run_id=run_id)
    # this worker's rows, and how many of them earlier runs wrote (not the other workers' rows)
    total, done_mine = worker_rows(shards, shard_index, num_shards, done_sources, job.input.max_line_bytes)
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

    def emit(done: Completion) -> None:
        writer.add(completion_row(done, model=job.target.model, prefix=job.output.column_prefix))
        emitted[0] += 1
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
                _log(f"spin-batch: worker {worker_text}: rows {done_now}/{'?' if total is None else total} "
                     f"({emitted[0]} this run), {int(stats.totals['generated_tokens'])} tokens, "
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
    if retry_errors:
        drop_superseded(out)  # the error rows this run's rows replaced
    summary = {
        "run_id": run_id,
        "job": job_to_dict(job),
        "shard_index": shard_index,
        "num_shards": num_shards,
        "model_load_s": engine.load_time_s,
        "rows_skipped_as_done": skipped,
        "finished": stop.signum is None,
        **stats.summary(),
        "drafter_stats": {n: d.stats() for n, d in engine.loop.drafters.items() if d.stats()},
        "backends": backends(engine),
    }
    name = "summary.json" if num_shards == 1 else f"summary-{worker}.json"
    write_json_atomic(out / name, summary)
    if stop.signum is None:  # this worker is done: the merged files of every worker's rows so far
        write_results(out, job.output.format, job.target.model)
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


def start_line(job: JobConfig, engine: Engine, worker: str, done: int | None, total: int | None) -> str:
    """What a log needs to tell runs apart: model, dtype, device, the target's CPU path, slots, worker."""
    target = engine.target
    plan = getattr(target, "plan", None)
    path = (f"layers={plan.layers} lm_head={plan.lm_head}" if plan is not None
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
