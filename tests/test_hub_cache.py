"""Hub repo ids (`org/name`) as target and drafter models, from a local Hugging Face cache that the test
builds (blobs, snapshots of symlinks, refs/main, as `hf download` lays them out); never a download."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from spin_batch.models import hub, loader

from conftest import write_jsonl
from conftest import make_job
from test_cli_e2e import _describe, _isolate_process_state, invoke, prompt_rows, read_rows, run_ok  # noqa: F401

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo_id: str, model_dir: Path) -> Path:
    """``model_dir``'s files as the cached snapshot of ``repo_id`` at refs/main; returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file():
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            blob.write_bytes(f.read_bytes())
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, tiny_dir, tiny_draft_dir, monkeypatch):
    cache = tmp_path / "hf-cache"
    cache_repo(cache, "TinyOrg/tiny-llama", tiny_dir)
    cache_repo(cache, "TinyOrg/tiny-draft", tiny_draft_dir)
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: any download attempt would fail
    return cache


def _job(tmp_path, model: str, drafter: str | None = None, name: str = "job"):
    src = write_jsonl(tmp_path / "in.jsonl", prompt_rows(3))
    drafters = [{"name": "d", "kind": "model", "model": drafter}] if drafter else []
    return make_job(tmp_path, Path(model), [src], name=name, drafters=drafters, sampling={"max_tokens": 4})


def test_repo_ids_resolve_to_the_cached_snapshot(hub_cache, tmp_path, tiny_dir):
    snapshot = loader.resolve_model_dir("TinyOrg/tiny-llama")
    assert snapshot == hub_cache / "models--TinyOrg--tiny-llama" / "snapshots" / COMMIT
    assert loader.check_model_ref("TinyOrg/tiny-llama") == []
    job, out = _job(tmp_path, "TinyOrg/tiny-llama", drafter="TinyOrg/tiny-draft")
    res = invoke("validate", job)
    assert res.exit_code == 0, _describe(res)
    run_ok(job)
    rows = read_rows(out)
    assert len(rows) == 3 and all(r["status"] == "ok" for r in rows)
    # the same model from its folder writes the same greedy text
    local, local_out = _job(tmp_path, str(tiny_dir), name="local")
    run_ok(local)
    assert {r["id"]: r["text"] for r in read_rows(local_out)} == {r["id"]: r["text"] for r in rows}


def test_a_repo_missing_from_the_cache_is_a_job_error_naming_the_cache(hub_cache, tmp_path):
    job, out = _job(tmp_path, "TinyOrg/not-cached")
    for command in ("validate", "run"):
        res = invoke(command, job)
        assert res.exit_code == 1, _describe(res)
        assert f"TinyOrg/not-cached: no such local folder, and not in the Hugging Face cache at {hub_cache}" \
            in res.output and "hf download TinyOrg/not-cached" in res.output, res.output
        assert "Traceback" not in res.output
    assert not (out / "outputs").exists()  # refused before any model or row
    job, _ = _job(tmp_path, "TinyOrg/tiny-llama", drafter="TinyOrg/no-draft", name="drafter")
    res = invoke("validate", job)
    assert res.exit_code == 1 and "drafters.d: TinyOrg/no-draft: no such local folder" in res.output, res.output
    # a cached repo whose refs/main names no snapshot
    (hub_cache / "models--TinyOrg--tiny-llama" / "refs" / "main").write_text("f" * 40)
    assert "no snapshot of refs/main there" in loader.check_model_ref("TinyOrg/tiny-llama")[0]


def test_what_counts_as_a_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not any(hub.is_repo_id(r) for r in ("builtin:smollm2-135m", "a/b/c", "./a", "/abs/m", "../x", "x", "a/.."))
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert not hub.is_repo_id("org/local")  # a local folder of that name wins


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub.hub_cache() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub.hub_cache() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub.hub_cache() == tmp_path / "c"
