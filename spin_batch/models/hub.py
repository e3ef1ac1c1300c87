"""Hugging Face repo ids (``HuggingFaceTB/SmolLM2-135M-Instruct``) as model references, resolved through
the local Hugging Face cache only.

A model reference that is no local path but has the form ``org/name`` is looked up in the Hugging
Face hub cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``): the
snapshot that the cached ``refs/main`` names, the folder `huggingface-cli download` (or `hf
download`) fills. Nothing is ever downloaded: a repo that is not in the cache is a
ModelNotFoundError that names the cache folder and says how to fill it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .checkpoint import ModelNotFoundError

__all__ = ["cached_snapshot", "hub_cache", "is_repo_id"]

# org/name as the hub spells repo ids: letters, digits, '-', '_', '.'; neither part starts with '.'
_REPO_ID = re.compile(r"[A-Za-z0-9_][\w.-]*/[A-Za-z0-9_][\w.-]*")


def is_repo_id(ref: str) -> bool:
    """Whether ``ref`` names a hub repo rather than a local folder: of the form org/name, and no such
    path exists here (a local folder always wins)."""
    return bool(_REPO_ID.fullmatch(ref)) and ".." not in ref and not os.path.exists(os.path.expanduser(ref))


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, from the environment as huggingface_hub reads it."""
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def cached_snapshot(repo_id: str) -> Path:
    """The cached snapshot folder of a model repo (its ``refs/main``), offline.

    Raises:
        ModelNotFoundError: the repo is not in the cache (naming the cache folder and the fix).
    """
    from huggingface_hub import snapshot_download

    cache = hub_cache()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception as e:  # noqa: BLE001  LocalEntryNotFoundError, a malformed id, an unreadable cache
        folder = cache / f"models--{repo_id.replace('/', '--')}"
        why = "not there" if not folder.exists() else f"no snapshot of refs/main there ({type(e).__name__})"
        raise ModelNotFoundError(
            f"{repo_id}: no such local folder, and not in the Hugging Face cache at {cache} ({folder}: {why}). "
            f"spin-batch never downloads: fetch it first (`hf download {repo_id}` or `huggingface-cli download "
            f"{repo_id}`), or point HF_HUB_CACHE (or HF_HOME) at the cache that holds it") from None
