"""Where a Hugging Face checkpoint's tensors are: its path resolved, its files indexed, a tensor read whole.

A checkpoint is a ``.safetensors`` file, or a directory as ``save_pretrained`` writes it:
``model.safetensors.index.json`` (its ``weight_map`` names the file of every tensor) or a single
``model.safetensors``. Other files in the directory are never read. A path that is neither is
taken as a Hub repository id and fetched with ``huggingface_hub`` (weights and index only).

:class:`CheckpointIndex` is what the whole-tensor (legacy) loader reads through; the region
reads of :class:`HFLoadPlanner` go through a storage reader instead.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .weight_conversion import dot_natural_key

__all__ = ["SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME", "CheckpointIndex", "resolve_checkpoint_location",
           "resolve_checkpoint_index"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


@dataclass
class CheckpointIndex:
    """The file of every checkpoint tensor; reads a tensor whole (file handles kept open, one per file)."""

    files_by_key: dict[str, Path]
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def keys(self) -> tuple[str, ...]:
        """The tensor names, experts 2 before 10 (the order loads collect them in)."""
        return tuple(sorted(self.files_by_key, key=dot_natural_key))

    def load_tensor(self, key: str) -> torch.Tensor:
        """Tensor ``key``, whole, on the CPU, in its stored dtype."""
        path = self.files_by_key.get(key)
        if path is None:
            raise KeyError(f"the checkpoint has no tensor {key!r}")
        with self._lock:
            handle = self._handles.get(path)
            if handle is None:
                handle = self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
        return handle.get_tensor(key)

    def close(self) -> None:
        """Let go of the open files."""
        with self._lock:
            self._handles.clear()


def resolve_checkpoint_location(pretrained_path: str | Path) -> Path:
    """The local ``.safetensors`` file or checkpoint directory ``pretrained_path`` names.

    Raises:
        ValueError: a file that is not ``.safetensors`` (pickled checkpoints are never read).
        FileNotFoundError: neither a local path nor a Hub repository that can be fetched.
    """
    path = Path(pretrained_path).expanduser()
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{str(path)!r} is not a .safetensors file; only safetensors checkpoints are read")
        return path
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(f"{str(pretrained_path)!r} is neither a file nor a directory (and huggingface_hub, "
                                "which would fetch it as a Hub repository, is not installed)") from None
    try:
        return Path(snapshot_download(repo_id=str(pretrained_path),
                                      allow_patterns=["*.safetensors", "*.safetensors.index.json"]))
    except Exception as exc:
        raise FileNotFoundError(f"{str(pretrained_path)!r} is neither a local file or directory nor a Hub "
                                f"repository that could be fetched: {exc}") from exc


def _single(path: Path) -> CheckpointIndex:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return CheckpointIndex(dict.fromkeys(f.keys(), path))


def read_weight_map(index_path: Path) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index: tensor name -> file name in its directory.

    Raises:
        ValueError: not JSON with a non-empty ``weight_map``, or a value that is not a plain
            file name (a path would lead outside the directory).
    """
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{str(index_path)!r} is not a safetensors index (JSON with a weight_map): {exc}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{str(index_path)!r} has no weight_map naming the file of each tensor")
    for key, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name:
            raise ValueError(f"{str(index_path)!r} maps {key!r} to {name!r}, which is not a file name in the directory")
    return weight_map


def _indexed(directory: Path, index_path: Path) -> CheckpointIndex:
    files: dict[str, Path] = {}
    for key, name in read_weight_map(index_path).items():
        file = directory / name
        if not file.is_file():
            raise FileNotFoundError(f"{str(index_path)!r} puts {key!r} in {name!r}, which does not exist")
        files[key] = file
    return CheckpointIndex(files)


def resolve_checkpoint_index(pretrained_path: str | Path) -> CheckpointIndex:
    """Index the checkpoint ``pretrained_path`` names (see the module docstring)."""
    location = resolve_checkpoint_location(pretrained_path)
    if location.is_file():
        return _single(location)
    if (location / SAFE_WEIGHTS_INDEX_NAME).is_file():
        return _indexed(location, location / SAFE_WEIGHTS_INDEX_NAME)
    if (location / SAFE_WEIGHTS_NAME).is_file():
        return _single(location / SAFE_WEIGHTS_NAME)
    raise FileNotFoundError(f"{str(location)!r} has neither {SAFE_WEIGHTS_INDEX_NAME} nor {SAFE_WEIGHTS_NAME}")
