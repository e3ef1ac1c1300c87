"""How long a context a model folder takes, and what its KV cache costs, from its config.json alone (no
weights read): validate and every run check batch.max_model_len against both before any weights load.

The position limit is vLLM's (``_get_and_verify_max_len``): the smallest of the config's length keys,
times the rope scaling factor where the scaling stretches the trained context (linear, dynamic, yarn:
from ``original_max_position_embeddings`` where the scaling names it); llama3 and longrope scaling
already count in max_position_embeddings. The cache is the one KVCache.allocate makes: K and V of
``layers x slots x kv_heads x max_len x head_dim``, all of it allocated (and zeroed) at start.
"""

from __future__ import annotations

from pathlib import Path

import torch

# config.json keys that bound the positions a model was trained for (vLLM reads these)
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
               "max_seq_length", "seq_len")
_UNSTRETCHED_ROPE = frozenset({"default", "llama3", "longrope", "su", "mrope"})


def _text_config(cfg: dict) -> dict:
    """The language model's part of a config (a multimodal config nests it as text_config)."""
    inner = cfg.get("text_config")
    return inner if isinstance(inner, dict) and "num_hidden_layers" not in cfg else cfg


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def position_limit(cfg: dict) -> tuple[int, str] | None:
    """``(positions, where)``: the most positions the model takes and the config key(s) that say so, or
    None where the config gives no length."""
    cfg = _text_config(cfg)
    found = [(n, key) for key in LENGTH_KEYS if (n := _positive_int(cfg.get(key))) is not None]
    if not found:
        return None
    limit, key = min(found)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if kind not in _UNSTRETCHED_ROPE and isinstance(factor, (int, float)) and not isinstance(factor, bool) \
            and factor > 1:
        base = _positive_int(rope.get("original_max_position_embeddings"))
        if base is not None:
            limit, key = base, "rope_scaling.original_max_position_embeddings"
        limit, key = int(limit * factor), f"{key} x rope_scaling.factor {factor:g}"
    return limit, key


def kv_bytes_per_position(cfg: dict, dtype: torch.dtype) -> int | None:
    """Bytes the KV cache holds per position of one slot (K and V, every layer), or None where the config
    does not say its layers and heads in the usual keys."""
    cfg = _text_config(cfg)
    layers = _positive_int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("num_layers"))
    heads = _positive_int(cfg.get("num_attention_heads") or cfg.get("n_head"))
    kv_heads = _positive_int(cfg.get("num_key_value_heads")) or heads
    hidden = _positive_int(cfg.get("hidden_size") or cfg.get("n_embd"))
    head_dim = _positive_int(cfg.get("head_dim")) or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


def weights_bytes(model_dir: Path) -> int:
    """The bytes of the folder's safetensors files (what its weights take once loaded, near enough)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory(device: torch.device) -> int | None:
    """Bytes this process may still allocate on ``device``, or None where that cannot be read: CUDA's free
    memory; on CPU, /proc/meminfo's MemAvailable, or less where a cgroup (a Slurm job's, a container's)
    caps memory."""
    if device.type == "cuda":
        try:
            return torch.cuda.mem_get_info(device)[0]
        except RuntimeError:
            return None
    if device.type != "cpu":
        return None
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return None
    cap, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if free is not None and cap is not None and used is not None:
        free = min(free, max(cap - used, 0))
    return free


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def context_problem(cfg: dict, model_dir: Path, max_len: int, slots: int, dtype: torch.dtype,
                    free: int | None) -> str | None:
    """Why a cache of ``slots`` x ``max_len`` positions does not suit this model: more positions than it
    takes, or a cache (with the weights) larger than ``free`` bytes. None where it suits, or where the
    config does not say."""
    limit = position_limit(cfg)
    if limit is not None and max_len > limit[0]:
        return (f"{max_len} positions is more than the model takes: {limit[0]} ({limit[1]} in "
                f"{Path(model_dir) / 'config.json'}); set batch.max_model_len to {limit[0]} or less")
    per_position = kv_bytes_per_position(cfg, dtype)
    if per_position is None or free is None:
        return None
    cache, weights = per_position * slots * max_len, weights_bytes(model_dir)
    if cache + weights <= free:
        return None
    fit = max(free - weights, 0) // (per_position * slots)
    dtype_name = str(dtype).removeprefix("torch.")
    return (f"{max_len} positions x {slots} slots need a KV cache of {gib(cache)} ({dtype_name}) besides"
            f" {gib(weights)} of weights, and {gib(free)} is free here: at most {fit} positions per slot "
            f"fit at {slots} slots; lower batch.max_model_len (or batch.slots)")

