"""The cache folder ($SPIN_BATCH_CACHE, default ~/.cache/spin-batch) and files made in it once.

A leaf: it imports nothing of spin_batch, so the model code, the kernels' build and the planner can all
use it without importing each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("SPIN_BATCH_CACHE") or Path.home() / ".cache" / "spin-batch")


@contextlib.contextmanager
def file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_file(out: Path, make) -> Path:
    """out, made once by make(tmp_path) if it does not exist: under a file lock, into a temporary file in
    the same directory that is renamed into place, so concurrent jobs (a Slurm array) never see half of it."""
    if out.exists():
        return out
    with file_lock(out.parent / f".{out.name}.lock"):
        if not out.exists():
            fd, tmp = tempfile.mkstemp(prefix=f".{out.name}-", dir=out.parent)
            os.close(fd)
            try:
                make(Path(tmp))
                os.chmod(tmp, 0o644 | (os.stat(tmp).st_mode & 0o111))  # mkstemp's 0600 would hide it from others
                os.replace(tmp, out)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return out


def write_atomic(path: Path, text: str) -> None:
    """path replaced by text in one rename (readers see the old or the new file, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
