"""HyperParallel's single-file saver and loader: one safetensors file, no process group.

``saver.save_checkpoint(obj, path)`` and ``loader.load_checkpoint(path)`` are HyperParallel's
"base API": a whole (unsharded) state dict in one file, written and read by one process.
They are not distributed checkpoints (use ``save``/``load`` for those).

``save_checkpoint_file(state_dict, path)`` and ``load_checkpoint_file(path)`` are HyperParallel's
lower end of the same idea (its ``checkpoint_io``): a *flat* dict of tensors to one file and
back, in safetensors or, when asked, ``torch.save`` format; never an unrestricted unpickle.

The file is plain safetensors. A nested dict of tensors (``{"model_state_dict": sd}``) is
stored under dotted keys, and the nesting is recorded in the file's metadata so that
:func:`load_checkpoint` returns it nested again. Files an older HyperParallel wrote with
``torch.save`` under the same name still load (through ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ...base.errors import CorruptCheckpointError
from ...format.safetensors import check_safetensors_file

__all__ = ["save_checkpoint", "load_checkpoint", "save_checkpoint_file", "load_checkpoint_file"]

_NESTING_KEY = "hyper_parallel.nesting"


def _valid_file_path(file_path: str | os.PathLike, what: str) -> Path:
    path = Path(file_path)
    if not path.name or not path.suffix:
        raise ValueError(f"{what}: {os.fspath(file_path)!r} must name a file with an extension, "
                         "e.g. 'model.safetensors'")
    return path


def _flatten(obj: Mapping[str, Any], prefix: tuple[str, ...], out: dict[str, torch.Tensor],
             nesting: list[list[str]]) -> None:
    for k, v in obj.items():
        if not isinstance(k, str):
            raise TypeError(f"save_checkpoint: key {k!r} under {'.'.join(prefix) or 'the top'} is not a string")
        path = (*prefix, k)
        if isinstance(v, torch.nn.Module):
            v = v.state_dict()
        if isinstance(v, Mapping):
            _flatten(v, path, out, nesting)
        elif isinstance(v, torch.Tensor):
            name = ".".join(path)
            if name in out:
                raise ValueError(f"save_checkpoint: two entries flatten to the same key {name!r}")
            out[name] = v
            nesting.append(list(path))
        else:
            raise TypeError(f"save_checkpoint: {'.'.join(path)!r} is a {type(v).__name__}; a single-file "
                            "checkpoint holds tensors only (use save() for other values)")


def _safetensors_ready(flat: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """The tensors as safetensors takes them: detached, on the CPU, contiguous, none sharing memory."""
    from torch.distributed.tensor import DTensor

    storages: set[int] = set()
    tensors = {}
    for name, t in flat.items():
        if isinstance(t, DTensor):
            raise TypeError(f"{what}: {name!r} is a DTensor; call full_tensor() first, or use save()")
        t = t.detach().cpu().contiguous()
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages:
                t = t.clone()  # safetensors refuses tensors that share memory (tied weights)
            else:
                storages.add(ptr)
        tensors[name] = t
    return tensors


def save_checkpoint(save_obj: Any, file_path: str | os.PathLike) -> None:
    """Write a whole state dict (or a module's) to one safetensors file.

    Args:
        save_obj: a dict of tensors, possibly nested (``{"model_state_dict": sd}``), or an
            ``nn.Module`` (its ``state_dict()`` is saved). DTensors are not accepted: gather
            them first (``full_tensor()``) or use ``save``.
        file_path: the file to write; it must have a name with an extension. Missing parent
            directories are created.

    Raises:
        ValueError: the path names no file with an extension.
        TypeError: a value is not a tensor (or a nested dict of them), or a key is not a string.

    Example::

        save_checkpoint({"model_state_dict": model.state_dict()}, "out/model.safetensors")
    """
    from safetensors.torch import save_file

    path = _valid_file_path(file_path, "save_checkpoint")
    if isinstance(save_obj, torch.nn.Module):
        save_obj = save_obj.state_dict()
    if not isinstance(save_obj, Mapping):
        raise TypeError(f"save_checkpoint expects a dict of tensors or an nn.Module, got {type(save_obj).__name__}")
    flat: dict[str, torch.Tensor] = {}
    nesting: list[list[str]] = []
    _flatten(save_obj, (), flat, nesting)
    tensors = _safetensors_ready(flat, "save_checkpoint")
    meta = {"format": "pt"}
    if any(len(p) > 1 for p in nesting):
        meta[_NESTING_KEY] = json.dumps(nesting)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def is_torch_zip(path: str | os.PathLike) -> bool:
    """True when ``path`` is a ``torch.save`` zip archive (whatever its name says)."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def load_checkpoint(file_path: str | os.PathLike) -> dict[str, Any]:
    """Read a file :func:`save_checkpoint` wrote; return its (nested) dict of CPU tensors.

    A file HyperParallel wrote with ``torch.save`` is read with ``torch.load(weights_only=True)``,
    which refuses anything but tensors and plain containers.

    Raises:
        ValueError: the path names no file with an extension.
        FileNotFoundError: no such file.
        CorruptCheckpointError: the safetensors header is damaged (e.g. a negative dim) or
            describes more bytes than the file has (the message names the file and the tensor),
            or its nesting record does not match its tensors.

    Example::

        sd = load_checkpoint("out/model.safetensors")["model_state_dict"]
    """
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = _valid_file_path(file_path, "load_checkpoint")
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint: no file {os.fspath(path)!r}")
    if is_torch_zip(path):
        # a file object: torch would read a path ending in .safetensors as safetensors
        with open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    # header length, shapes and data offsets checked against the file's size, with errors
    # naming the file and the tensor (safetensors' own name neither)
    check_safetensors_file(os.fspath(path))
    try:  # anything else the safetensors library refuses: its errors name no file
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        flat = load_file(str(path))
    except SafetensorError as exc:
        raise CorruptCheckpointError(f"{os.fspath(path)}: not a readable safetensors file ({exc})") from None
    nesting = meta.get(_NESTING_KEY)
    if not nesting:
        return flat
    out: dict[str, Any] = {}
    try:
        for parts in json.loads(nesting):
            node = out
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = flat[".".join(parts)]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{os.fspath(path)}: its {_NESTING_KEY!r} metadata does not describe its "
                                     f"tensors ({type(exc).__name__}: {exc!s:.100}); the file is damaged") from None
    return out


SAFETENSORS_FORMAT = "safetensors"


def _uses_safetensors(path: Path, ckpt_format: str | None) -> bool:
    """HyperParallel's rule: ``"safetensors"`` means safetensors, any other name ``torch.save``;
    None decides by the file's suffix."""
    if ckpt_format is None:
        return path.suffix == ".safetensors"
    return ckpt_format == SAFETENSORS_FORMAT


def save_checkpoint_file(state_dict: Mapping[str, Any], file_path: str | os.PathLike,
                         ckpt_format: str | None = SAFETENSORS_FORMAT) -> None:
    """Write a flat dict of tensors to one file (HyperParallel's ``checkpoint_io.save_checkpoint_file``).

    Args:
        state_dict: ``{name: tensor}``, keys as they go in the file (no nesting; see
            :func:`save_checkpoint` for nested dicts).
        file_path: the file to write; its directory must exist.
        ckpt_format: ``"safetensors"`` (the default) writes safetensors; any other name writes
            a ``torch.save`` pickle; None picks safetensors for a ``..safetensors`` file and
            ``torch.save`` otherwise.

    Raises:
        TypeError: ``state_dict`` is not a dict with string keys, or (safetensors) a value is
            not a tensor, or is a DTensor.

    Example::

        save_checkpoint_file({"w": torch.ones(2)}, "shard0.safetensors")
    """
    from safetensors.torch import save_file

    path = Path(file_path)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"save_checkpoint_file({os.fspath(path)!r}) expects a dict of tensors, "
                        f"got {type(state_dict).__name__}")
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"save_checkpoint_file({os.fspath(path)!r}): key {name!r} is not a string")
        if _uses_safetensors(path, ckpt_format) and not isinstance(value, torch.Tensor):
            raise TypeError(f"save_checkpoint_file({os.fspath(path)!r}): {name!r} is a {type(value).__name__}; "
                            "a safetensors file holds tensors only (pass ckpt_format='pt' for torch.save)")
    if _uses_safetensors(path, ckpt_format):
        save_file(_safetensors_ready(state_dict, "save_checkpoint_file"), str(path), metadata={"format": "pt"})
    else:
        torch.save(dict(state_dict), path)


def load_checkpoint_file(file_path: str | os.PathLike, ckpt_format: str | None = SAFETENSORS_FORMAT) -> dict[str, Any]:
    """Read one file back into a flat dict (HyperParallel's ``checkpoint_io.load_checkpoint_file``).

    Args:
        file_path: the file to read.
        ckpt_format: as for :func:`save_checkpoint_file`. A ``torch.save`` file is read with
            ``torch.load(weights_only=True)``: tensors and plain containers only, never
            arbitrary objects.

    Returns:
        What the file holds, keyed by the names it was saved under.

    Raises:
        FileNotFoundError: no such file.
        CorruptCheckpointError: a safetensors file whose header is damaged or describes more
            bytes than the file has, or a ``torch.save`` file read as safetensors (the message
            says to pass another ``ckpt_format``).
        pickle.UnpicklingError: a ``torch.save`` file holding more than tensors and containers.

    Example::

        tensors = load_checkpoint_file("shard0.safetensors")
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(file_path)
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint_file: no file {os.fspath(path)!r}")
    if not _uses_safetensors(path, ckpt_format):
        with open(path, "rb") as f:  # a file object: torch would read a .safetensors path as safetensors
            return torch.load(f, weights_only=True)
    if is_torch_zip(path):
        raise CorruptCheckpointError(f"{os.fspath(path)} is a torch.save file, not safetensors; read it with "
                                     "load_checkpoint_file(path, ckpt_format='pt')")
    check_safetensors_file(os.fspath(path))
    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise CorruptCheckpointError(f"{os.fspath(path)}: not a readable safetensors file ({exc})") from None
