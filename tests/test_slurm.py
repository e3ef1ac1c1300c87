"""Slurm as operators use it: a task redone alone (`sbatch --array=2`) runs as worker 2 of N, a worker
count that differs from the output folder's is refused, and the example array script passes the
count, requeues at the time limit and appends its logs (run here with fake Slurm variables and a
fake `spin-batch` and `scontrol` on PATH)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from spin_batch.fingerprint import WORKERS_FILE, WorkersChanged, check_workers
from spin_batch.io.shards import InputError, resolve_workers, shard_defaults_from_env

from conftest import make_job

from test_cli_e2e import (_isolate_process_state, _three_shards, assert_each_id_once, invoke, # noqa: F401
                          read_rows, run_ok)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "slurm" / "spin_batch_array.sbatch"

# `sbatch --array=2`: a one-task array
REDO_TASK_2 = {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "1", "SLURM_ARRAY_TASK_MIN": "2",
               "SLURM_ARRAY_TASK_MAX": "2", "SLURM_ARRAY_TASK_STEP": "1"}


# --------------------------------------------------------------------------
# which worker a process is
# --------------------------------------------------------------------------


def test_a_one_task_array_past_task_0_is_refused_without_a_count():
    with pytest.raises(InputError, match=r"one task .*--num-shards N"):
        shard_defaults_from_env(REDO_TASK_2)
    # --array=0 alone is a plain one-worker job
    assert shard_defaults_from_env({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "1"}) == (0, 1)


def test_resolve_workers_takes_the_task_id_as_the_index_when_the_count_is_given():
    assert resolve_workers(None, 4, REDO_TASK_2) == (2, 4)
    assert resolve_workers(None, 4, {}) == (0, 4)
    assert resolve_workers(3, 4, REDO_TASK_2) == (3, 4)  # flags win
    assert resolve_workers(None, None, {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"}) == (1, 2)
    assert resolve_workers(1, None, {}) == (1, 1)  # the count from the environment (checked later)
    with pytest.raises(InputError, match=r"SLURM_ARRAY_TASK_ID=2 is not a shard index of --num-shards 2"):
        resolve_workers(None, 2, REDO_TASK_2)


def _folder_with_rows(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    (out / "outputs").mkdir(parents=True)
    (out / "outputs" / "part-w0000-x-00000.parquet").write_bytes(b"")
    return out


def test_check_workers_records_the_count_and_refuses_another(tmp_path):
    out = _folder_with_rows(tmp_path)
    check_workers(out, 2, 4)
    assert json.loads((out / WORKERS_FILE).read_text()) == {"num_shards": 4}
    check_workers(out, 3, 4)
    with pytest.raises(WorkersChanged) as err:
        check_workers(out, 0, 1)
    msg = str(err.value)
    assert "dealt among 4 worker(s)" in msg and "worker 0 of 1" in msg and "--num-shards 4" in msg
    assert str(out / WORKERS_FILE) in msg  # the way out, to re-split on purpose
    (out / WORKERS_FILE).unlink()  # as the message says: the next run records its own count
    check_workers(out, 0, 1)
    assert json.loads((out / WORKERS_FILE).read_text()) == {"num_shards": 1}


def test_check_workers_without_rows_or_record(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / WORKERS_FILE).write_text(json.dumps({"num_shards": 4}))
    check_workers(out, 0, 1)  # no rows yet: nothing was dealt, the new count is recorded
    assert json.loads((out / WORKERS_FILE).read_text()) == {"num_shards": 1}
    # a folder from before workers.json: its summaries tell the count
    legacy = _folder_with_rows(tmp_path / "legacy")
    (legacy / "summary-w0001.json").write_text(json.dumps({"num_shards": 2}))
    with pytest.raises(WorkersChanged, match="dealt among 2 worker"):
        check_workers(legacy, 0, 1)


def test_redoing_one_task_runs_as_that_worker_of_n(tmp_path, tiny_dir):
    _, ids = _three_shards(tmp_path)  # 12 rows in 3 files, dealt to 2 workers
    job, out = make_job(tmp_path, tiny_dir, [str(tmp_path / "in")], sampling={"max_tokens": 2})
    run_ok(job, env={"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"})
    first = {r["id"] for r in read_rows(out)}
    assert 0 < len(first) < 12
    redo_1 = {**REDO_TASK_2, "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "1"}
    # without the count, the one-task array cannot say which worker this is: refused, nothing written
    res = invoke("run", job, "--no-progress", env=redo_1)
    assert res.exit_code == 1 and "--num-shards N" in res.output, res.output
    # a count other than the folder's: refused before any row, the fix in the message
    res = invoke("run", job, "--no-progress", "--num-shards", "3", env=redo_1)
    assert res.exit_code == 1 and "dealt among 2 worker(s)" in res.output and "--num-shards 2" in res.output
    assert {r["id"] for r in read_rows(out)} == first
    # as the example script runs it: worker 1 of 2, its own rows only
    run_ok(job, "--num-shards", "2", env=redo_1)
    assert_each_id_once(out, ids[0] + ids[1] + ids[2])
    summary = json.loads((out / "summary-w0001.json").read_text())
    assert (summary["shard_index"], summary["num_shards"]) == (1, 2)
    assert summary["rows_ok"] == 12 - len(first)


# --------------------------------------------------------------------------
# the example script, with fake Slurm
# --------------------------------------------------------------------------


FAKE_SPIN_BATCH = """#!/bin/bash
printf '%s\\n' "$*" >> "$FAKE_LOG"
if [[ "${FAKE_MODE:-ok}" == wait ]]; then
    trap 'echo "spin-batch got TERM" >> "$FAKE_LOG"; exit 143' TERM
    touch "$FAKE_READY"
    for _ in $(seq 600); do sleep 0.1; done
    exit 9
fi
exit "${FAKE_RC:-0}"
"""

FAKE_SCONTROL = """#!/bin/bash
printf 'scontrol %s\\n' "$*" >> "$FAKE_LOG"
"""


@pytest.fixture
def fake_slurm(tmp_path):
    """A working directory with a fake venv whose activate puts a fake spin-batch and scontrol on PATH,
    and the environment of array task 2 of a job redone alone (`sbatch --array=2`)."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for name, text in (("spin-batch", FAKE_SPIN_BATCH), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SPIN_BATCH_"))}
    env.update(REDO_TASK_2, SLURM_JOB_ID="4242", SLURM_ARRAY_JOB_ID="4240", SPIN_BATCH_VENV=str(venv),
               FAKE_LOG=str(tmp_path / "calls.log"), FAKE_READY=str(tmp_path / "ready"))
    return work, env, tmp_path / "calls.log"


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.slow
def test_the_script_runs_a_redone_task_as_worker_2_of_4(fake_slurm):
    work, env, log = fake_slurm
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (call,) = _calls(log)
    assert call == "run jobs/demo.yaml --no-progress --set output.dir=out/demo-slurm --shard-index 2 --num-shards 4"
    # the arguments it passes mean worker 2 of 4 to spin-batch, whatever the one-task array's count says
    assert resolve_workers(2, 4, env) == (2, 4) and resolve_workers(None, 4, env) == (2, 4)
    assert (work / "logs").is_dir()
    # a failing run's code comes back, and nothing is requeued
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=work, env={**env, "FAKE_RC": "75"}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 75 and not any(c.startswith("scontrol") for c in _calls(log))


def test_the_script_header_requeues_signals_and_appends():
    header = [line.split(None, 1)[1] for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH ")]
    assert "--requeue" in header and "--open-mode=append" in header
    signal_opt = next(h for h in header if h.startswith("--signal="))
    assert re.fullmatch(r"--signal=B:USR1@\d+", signal_opt)  # to the batch shell, which passes it on
    first, last = map(int, next(h for h in header if h.startswith("--array=")).split("=")[1].split("-"))
    default_count = re.search(r'NUM_SHARDS="\$\{SPIN_BATCH_NUM_SHARDS:-(\d+)\}"', SCRIPT.read_text())
    assert (first, last - first + 1) == (0, int(default_count.group(1)))  # the count is the array's size


def _start_waiting(work: Path, env: dict, ready: Path) -> subprocess.Popen:
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=work, env={**env, "FAKE_MODE": "wait"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the fake spin-batch never started"
        time.sleep(0.05)
    return proc


@pytest.mark.slow
def test_the_time_limit_signal_stops_spin_batch_and_requeues_the_task(fake_slurm):
    work, env, log = fake_slurm
    proc = _start_waiting(work, env, log.parent / "ready")
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends before the time limit
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, (out, err)
    calls = _calls(log)
    assert "spin-batch got TERM" in calls and "scontrol requeue 4242" in calls, calls
    assert "requeuing task 2" in out
    # past SPIN_BATCH_MAX_REQUEUES restarts: not requeued again, and the log says how to go on
    log.unlink()
    (log.parent / "ready").unlink()
    proc = _start_waiting(work, {**env, "SLURM_RESTART_COUNT": "3", "SPIN_BATCH_MAX_REQUEUES": "3"},
                          log.parent / "ready")
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and not any(c.startswith("scontrol") for c in _calls(log))
    assert "sbatch --array=2" in err


@pytest.mark.slow
def test_preemption_or_scancel_stops_spin_batch_without_a_requeue_of_its_own(fake_slurm):
    work, env, log = fake_slurm
    proc = _start_waiting(work, env, log.parent / "ready")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, (out, err)
    calls = _calls(log)
    assert "spin-batch got TERM" in calls and not any(c.startswith("scontrol") for c in calls), calls
