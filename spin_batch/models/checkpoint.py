"""A model folder's checkpoint, read without building a model: its config (ModelSpec), its safetensors
files as transformers picks them, their tensor names from the headers alone (with the checks that name
a corrupt or truncated file), and the tensors themselves. A leaf under loader.py and distilled.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .spec import CheckpointError, ModelSpec


class ModelNotFoundError(FileNotFoundError):
    pass


def read_spec(model_dir: Path) -> ModelSpec:
    return ModelSpec.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))


SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files that hold a folder's weights, as transformers picks them: the shards
    model.safetensors.index.json names where there is one, else model.safetensors where there is one
    (a consolidated.safetensors beside them, as Mistral's folders ship, is another format of the same
    weights), else every *.safetensors. Raises CheckpointError for a shard the index names that is
    not there."""
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (no readable weight_map: {e})") from None
        missing = [f for f in shards if not (model_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} names {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'}"
                                  " not in the folder")
        return [model_dir / f for f in shards]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    return sorted(model_dir.glob("*.safetensors"))


def read_tensor_names(path: Path) -> list[str]:
    """The tensor names of one safetensors file, from its header alone (8-byte little-endian length, JSON).
    Raises CheckpointError naming the file where it is not a whole safetensors file: a garbage or
    oversized header, or a data section shorter than the header's offsets (a truncated copy)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, no header)")
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: not a safetensors file, or a truncated one: its header length says "
                                      f"{n} bytes, the file has {size - 8} after it")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except ValueError as e:  # not UTF-8, or not JSON
        raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise CheckpointError(f"{path}: not a safetensors file (a header entry has no data_offsets)") from None
    if end > size - 8 - n:
        raise CheckpointError(f"{path}: truncated: its header says {end} bytes of tensor data, the file has "
                              f"{size - 8 - n}")
    try:  # the library's own checks too (dtypes, shapes against offsets, bytes past the last tensor)
        with safe_open(str(path), framework="pt") as fh:
            return list(fh.keys())
    except Exception as e:  # safetensors' SafetensorError derives from Exception only
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None


def checkpoint_names(model_dir: Path) -> list[str]:
    """Every tensor name of a folder's weight files (weight_files), headers only. Raises
    ModelNotFoundError where there are none, CheckpointError for an unreadable file or a tensor
    in two files."""
    files = weight_files(model_dir)
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {model_dir}")
    where: dict[str, Path] = {}
    for f in files:
        for name in read_tensor_names(f):
            if name in where:
                raise CheckpointError(f"tensor {name} is in both {where[name]} and {f}")
            where[name] = f
    return list(where)


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files, after checkpoint_names has checked their headers."""
    from safetensors.torch import load_file

    checkpoint_names(model_dir)
    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        try:
            sd.update(load_file(str(f)))
        except Exception as e:  # a file changed since, or a read error the header did not show
            raise CheckpointError(f"{f}: cannot load it ({e})") from None
    return sd
