"""What `run` tells a log (Slurm, cron), a sharded run's progress bar, and report.png's time axis."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq

from spin_batch import report, runner

from conftest import write_jsonl
from conftest import make_job
from test_cli_e2e import _isolate_process_state, prompt_rows, run_ok  # noqa: F401

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


def capture_bar(monkeypatch) -> list[tuple[bool, int | None, int]]:
    calls = []
    real = runner._progress

    def spy(enabled, total, already):
        calls.append((enabled, total, already))
        return real(enabled, total, already)

    monkeypatch.setattr(runner, "_progress", spy)
    return calls


def test_start_line_and_interval_lines_in_a_log(tmp_path, tiny_dir):
    write_jsonl(tmp_path / "in" / "p.jsonl", prompt_rows(6))
    job, out = make_job(tmp_path, tiny_dir, [tmp_path / "in"], output={"stats_interval_s": 0.001},
                        sampling={"max_tokens": 16})
    run_ok(job, "--limit", "2")
    err = run_ok(job).stderr
    lines = err.splitlines()
    start = [line for line in lines if " spin-batch: start " in line]
    assert len(start) == 1, err
    assert re.fullmatch(rf"{STAMP} spin-batch: start model=\S+ dtype=float32 device=cpu layers=\S+ lm_head=\S+ "
                        r"slots=3 worker=0/1 rows_done=2 rows=6", start[0]), start[0]
    intervals = [line for line in lines if re.match(rf"{STAMP} spin-batch: worker 0/1: rows ", line)]
    assert intervals, err
    assert re.fullmatch(rf"{STAMP} spin-batch: worker 0/1: rows \d+/6 \(\d+\.\d%, ETA (\d+:\d\d:\d\d|\?), "
                        r"([\d.]+ rows/s; )?\d+ this run\), \d+ tokens, [\d.]+ tok/s, \d/3 slots active",
                        intervals[-1]), intervals[-1]
    last = re.search(r"rows (\d+)/6 \((\d+\.\d)%", intervals[-1])
    assert float(last.group(2)) == round(100 * int(last.group(1)) / 6, 1)
    assert lines.index(start[0]) < lines.index(intervals[0])


def test_rows_progress_says_percent_eta_and_rate():
    assert runner.rows_progress(30, 80, 12, 40.0) == "rows 30/80 (37.5%, ETA 0:02:47, 0.30 rows/s; 12 this run)"
    assert runner.rows_progress(2, 6, 0, 3.0) == "rows 2/6 (33.3%, ETA ?, 0 this run)"  # no row yet: no rate
    assert runner.rows_progress(6, 6, 4, 2.0) == "rows 6/6 (100.0%, ETA 0:00:00, 2.00 rows/s; 4 this run)"
    assert runner.rows_progress(7, None, 7, 1.0) == "rows 7/? (7.00 rows/s; 7 this run)"
    assert runner.rows_progress(0, 0, 0, 1.0) == "rows 0/0 (100.0%, ETA 0:00:00, 0 this run)"
    assert runner.rows_progress(1, 20000, 1, 1.0).endswith("ETA 5:33:19, 1.00 rows/s; 1 this run)")
    assert runner.rows_progress(1, 2, 1, 120.0) == "rows 1/2 (50.0%, ETA 0:02:00, 0.0083 rows/s; 1 this run)"


def test_sharded_bar_counts_only_this_workers_rows(tmp_path, tiny_dir, monkeypatch):
    for f in range(3):  # worker 0: shard-0 and shard-2 (8 rows), worker 1: shard-1 (4 rows)
        write_jsonl(tmp_path / "in" / f"shard-{f}.jsonl", prompt_rows(4, prefix=f"s{f}-"))
    job, out = make_job(tmp_path, tiny_dir, [tmp_path / "in"], sampling={"max_tokens": 2})
    bars = capture_bar(monkeypatch)
    run_ok(job, "--shard-index", "0", "--num-shards", "2")
    run_ok(job, "--shard-index", "1", "--num-shards", "2", "--limit", "1")
    run_ok(job, "--shard-index", "1", "--num-shards", "2")  # the 8 rows of worker 0 are not "done earlier"
    assert [(total, already) for _, total, already in bars] == [(8, 0), (1, 0), (4, 1)]


def test_row_modulo_bar_total_and_done(tmp_path, tiny_dir, monkeypatch):
    """Fewer files than workers: every other row is this worker's (a blank line is no row)."""
    rows = prompt_rows(7)
    write_jsonl(tmp_path / "in" / "p.jsonl", rows[:3] + [""] + rows[3:])
    job, out = make_job(tmp_path, tiny_dir, [tmp_path / "in"], sampling={"max_tokens": 2})
    bars = capture_bar(monkeypatch)
    run_ok(job, "--shard-index", "1", "--num-shards", "2", "--limit", "2")
    run_ok(job, "--shard-index", "0", "--num-shards", "2")
    run_ok(job, "--shard-index", "1", "--num-shards", "2")
    assert [(total, already) for _, total, already in bars] == [(2, 0), (4, 0), (3, 2)]


def test_worker_rows_of_parquet_and_jsonl(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["x", "y", "z"]}), tmp_path / "a.parquet")
    write_jsonl(tmp_path / "b.jsonl", [{"id": "d", "prompt": "w"}, "", {"id": "e", "prompt": "v"}])
    shards = [(tmp_path / "a.parquet").resolve(), (tmp_path / "b.jsonl").resolve()]
    done = {f"{shards[0]}#1", f"{shards[1]}#2"}
    assert runner.worker_rows(shards, 0, 1, done, 1 << 20) == (5, 2)
    assert runner.worker_rows(shards, 1, 2, done, 1 << 20) == (2, 1)  # whole files: b.jsonl
    # fewer files than workers: rows a#0 a#1 a#2 b#0 b#2 are numbered 0..4 (line 1 of b.jsonl is blank)
    assert runner.worker_rows(shards, 0, 3, done, 1 << 20) == (2, 0)  # a#0, b#0
    assert runner.worker_rows(shards, 1, 3, done, 1 << 20) == (2, 2)  # a#1, b#2
    assert runner.worker_rows(shards, 0, 1, done, 1 << 20, jsonl_budget=1) == (None, 2)


def test_report_time_axis_has_one_line_per_worker(tmp_path, tiny_dir):
    for f in range(3):
        write_jsonl(tmp_path / "in" / f"shard-{f}.jsonl", prompt_rows(4, prefix=f"s{f}-"))
    job, out = make_job(tmp_path, tiny_dir, [tmp_path / "in"], output={"stats_interval_s": 0.001},
                        sampling={"max_tokens": 8})
    run_ok(job, "--shard-index", "0", "--num-shards", "2", "--limit", "2")
    run_ok(job, "--shard-index", "1", "--num-shards", "2")
    run_ok(job, "--shard-index", "0", "--num-shards", "2")
    info = report.load(out)
    lines, unit = report.timelines(info["stats"])
    assert sorted(lines) == ["w0000", "w0001"] and unit == "s"
    xs0 = lines["w0000"][0]
    assert sum(x != x for x in xs0) == 1  # two runs of worker 0: one gap
    xs = [x for worker in lines.values() for x in worker[0] if x == x]
    assert min(xs) >= 0 and max(xs) < 600
    assert xs0[-1] > lines["w0001"][0][0]  # worker 0's second run came after worker 1's first interval
    assert report.plot(info, tmp_path / "r.png") == tmp_path / "r.png"
    counts, unit = report.row_timelines(info["stats"])
    assert sorted(counts) == ["all", "w0000", "w0001"] and unit == "s"
    assert [counts[w][1][-1] for w in ("w0000", "w0001", "all")] == [8, 4, 12]  # both runs of worker 0
    assert all(c[1] == sorted(c[1]) and c[1][0] == 0 and not any(c[2]) for c in counts.values())


def test_report_picture_shows_rows_errors_and_speed_over_time(tmp_path, tiny_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = prompt_rows(5)
    rows[2]["prompt"] = ""  # an error row
    write_jsonl(tmp_path / "in" / "p.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [tmp_path / "in"], output={"stats_interval_s": 0.001},
                        sampling={"max_tokens": 6})
    run_ok(job)
    info = report.load(out)
    counts, _ = report.row_timelines(info["stats"])
    assert list(counts) == ["w0000"] and (counts["w0000"][1][-1], counts["w0000"][2][-1]) == (5, 1)
    fig = report.figure(info, plt)
    rows_ax, speed_ax, _, pulls_ax = fig.axes
    assert rows_ax.get_title() == "Rows written: 5 (1 errors)" and speed_ax.get_title().startswith("Throughput")
    labels = {line.get_label(): line for line in rows_ax.get_lines()}
    assert set(labels) == {"w0000 rows", "w0000 error rows"}
    assert list(labels["w0000 rows"].get_ydata())[-1] == 5 and list(labels["w0000 error rows"].get_ydata())[-1] == 1
    assert len(speed_ax.get_lines()) == 1 and pulls_ax.get_title() == "Drafter usage (pulls)"
    plt.close(fig)


def test_report_time_axis_from_run_ids_without_wall_time():
    import polars as pl

    stats = pl.DataFrame({"time_s": [10.0, 20.0, 5.0], "interval_s": [10.0, 10.0, 5.0],
                          "tokens_per_s": [1.0, 2.0, 3.0], "worker": ["w0000", "w0000", "w0001"],
                          "run_id": ["20260101T000000000000_aaaaaa"] * 2 + ["20260101T001500000000_bbbbbb"]})
    lines, unit = report.timelines(stats)
    assert unit == "min"
    assert lines["w0000"] == ([10 / 60, 20 / 60], [1.0, 2.0])
    assert lines["w0001"] == ([15.0 + 5 / 60], [3.0])  # started 15 minutes later
