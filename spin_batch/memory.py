"""Selection memory: what the policy learnt in a run, kept for the next run of the same kind on the same machine.

The bandit learns on the job's own steps what each drafter costs here, how often its tokens are accepted and,
per batch size, whether speculating steps measure ahead of plain ones. A short job (a Slurm shard of a few
rows, a job with fewer rows than slots) spends most of its steps on that learning: first trials, probes, the
step gate's warm-up. So at the end of a run (and of each stream of a Ray Data actor) the policy's snapshot
(Policy.snapshot) goes to one JSON file per kind of run, and the next run starts from it at a quarter of its
weight (BanditState.restore): its first steps already price the drafters and back off where speculation
did not pay, and its own steps soon outweigh what it was given.

A kind of run is the machine (the CPU's model name and the C build's flags, or the GPU's name; the thread
count), the target (its folder, dtype and CPU path), the drafters as the job gives them, the spin settings,
the slots and whether rows sample: what the learnt costs and rates depend on. The slots too, because the
verify cost is fitted as a line over the step sizes a run meets, and a line fitted at many slots misprices
the short steps of a run at few. The file is <digest>.json in
$SPIN_BATCH_SELECTION_MEMORY (default $SPIN_BATCH_CACHE/selection). It never changes a row's text (selection decides speed only).
`spin.warm_start: false` turns it off; deleting the folder forgets everything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from .cachedir import cache_root, write_atomic
from .config import JobConfig
from .models import cpu_decoder

VERSION = 1  # of the state's layout: a file of another version is not read


def memory_key(job: JobConfig, target, model_dir: Path) -> dict:
    """What the learnt state depends on, as JSON data (the file's name is its digest)."""
    device = target.device
    if device.type == "cuda":
        machine = {"gpu": torch.cuda.get_device_name(device)}
    else:
        machine = {"cpu": cpu_decoder.cpu_model_name(), "build": cpu_decoder.machine_key()}
    plan = target.plan
    return {
        "version": VERSION,
        "machine": {**machine, "threads": torch.get_num_threads()},
        "target": {"model": str(model_dir), "dtype": job.target.dtype,
                   "quantize": job.target.quantize, "backend": plan.backend,
                   "layers": plan.cpu.layers, "lm_head": plan.cpu.lm_head},
        "drafters": [json.loads(json.dumps(dataclasses.asdict(d), default=str)) for d in job.drafters],
        "spin": {"selector": job.spin.selector, "num_speculative_tokens": job.spin.num_speculative_tokens,
                 "confidence_gate": job.spin.confidence_gate, "backoff": job.spin.backoff,
                 "tree_nodes": job.spin.tree_nodes},
        "slots": job.batch.slots,
        "sampled": not job.sampling.greedy,
        "structured": job.sampling.structured is not None,
    }


def memory_folder() -> Path:
    """$SPIN_BATCH_SELECTION_MEMORY, else the cache's `selection` folder."""
    return Path(os.environ.get("SPIN_BATCH_SELECTION_MEMORY") or cache_root() / "selection")


class SelectionMemory:
    """One kind of run's file: load() what the last run left, save() what this one learnt."""

    def __init__(self, key: dict, folder: Path | None = None):
        self.key = key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = (folder or memory_folder()) / f"{digest}.json"
        self.runs = 0  # runs that have saved into the file, as far as this object has read or written it

    def fits(self, gamma: int, confidence_gate: bool, backoff: bool, tree_nodes: int) -> bool:
        """Whether a policy with these settings is the kind this memory holds (a bench runs variants of the job's
        spin settings: spin-nobackoff must neither start from nor overwrite the gate verdicts of spin)."""
        spin = self.key["spin"]
        return (spin["num_speculative_tokens"], spin["confidence_gate"], spin["backoff"], spin["tree_nodes"]) == \
            (gamma, confidence_gate, backoff, tree_nodes)

    def load(self) -> dict | None:
        """The state the last run saved, or None: no file yet, another layout or kind, or a file that does not
        read (then a warning: the job goes on and learns from scratch)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            _warn(f"cannot read the selection memory {self.path} ({e}); learning from scratch")
            return None
        if not isinstance(data, dict) or data.get("key") != self.key or not isinstance(data.get("state"), dict):
            return None
        self.runs = int(data.get("runs", 0))
        return data["state"]

    def save(self, state: dict | None) -> None:
        """Replace the file by this run's state, in one rename (concurrent runs: the last one's stays)."""
        if state is None:
            return
        data = {"key": self.key, "runs": self.runs + 1, "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "state": state}
        try:
            write_atomic(self.path, json.dumps(data, sort_keys=True))
            self.runs += 1
        except OSError as e:
            _warn(f"cannot write the selection memory {self.path} ({e}); the next run learns from scratch")


def recall(memory: SelectionMemory, policy) -> bool:
    """Start `policy` from the memory's state; False where there is none or it does not fit (a warning)."""
    state = memory.load()
    if state is None:
        return False
    try:
        policy.restore(state)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        _warn(f"the selection memory {memory.path} does not fit this policy ({e!r}); learning from scratch")
        return False
    return True


def _warn(message: str) -> None:
    print(f"spin-batch: warning: {message}", file=sys.stderr, flush=True)
