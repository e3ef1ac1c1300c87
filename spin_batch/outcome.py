"""Whether a finished run failed for its rows: `spin-batch run --max-error-rate`.

A run writes every row, error rows included, and then exits EXIT_ERROR_ROWS (65, EX_DATAERR) where
its error rows are too many: more than ``max_rate`` of the rows this run wrote (rows an earlier run
wrote are not counted), or, by default (``max_rate`` None), all of them. So cron, Slurm or a
pipeline sees a job whose every row failed (a tokenizer, template or input that turns every row
away) without reading its outputs.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from .io.writer import OUTPUTS_DIR

EXIT_ERROR_ROWS = 65  # EX_DATAERR (sysexits.h): the input data was bad


def error_rate_failure(summary: dict, out_dir: str | Path, max_rate: float | None) -> str | None:
    """Why this run counts as failed (one line, with an example error), or None. ``summary`` is the run's
    summary.json (rows_ok, rows_error: this run's rows; run_id)."""
    errors, rows = summary["rows_error"], summary["rows_ok"] + summary["rows_error"]
    if rows == 0 or (errors < rows if max_rate is None else errors <= max_rate * rows):
        return None
    bound = "every row failed" if max_rate is None else f"more than --max-error-rate {max_rate:g}"
    example = first_error(out_dir, summary.get("run_id"))
    return (f"{errors} of {rows} rows of this run are error rows ({errors / rows:.0%}, {bound})"
            + (f"; the first: {example}" if example else "")
            + ". Every row was written; fix the job or its input and rerun with --retry-errors")


def first_error(out_dir: str | Path, run_id: str | None, limit: int = 300) -> str | None:
    """The first error message among the rows the run ``run_id`` wrote (cut to ``limit`` characters)."""
    if not run_id:
        return None
    for part in sorted((Path(out_dir) / OUTPUTS_DIR).glob(f"part-*-{run_id}-*.parquet")):
        try:
            errors = pq.read_table(part, columns=["error"]).column("error").drop_null()
        except (OSError, ValueError, KeyError):  # an unreadable part: the next run moves it aside
            continue
        if len(errors):
            text = str(errors[0].as_py())
            return text if len(text) <= limit else text[: limit - 3] + "..."
    return None
