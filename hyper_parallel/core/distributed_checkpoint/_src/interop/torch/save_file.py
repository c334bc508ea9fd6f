"""torch DCP's ``format_utils``: a checkpoint <-> one ``torch.save`` file, in one process.

:func:`dcp_to_torch_save` loads a whole checkpoint as full CPU tensors and plain values and
``torch.save``-s it (writing a pickle is safe). :func:`torch_save_to_dcp` reads the file with
``torch.load(weights_only=True)``, so no code in it runs; a file that needs full unpickling
takes the caller's ``allow_pickle=True``. Both reuse :mod:`.full_checkpoint`.

torch's ``BroadcastingTorchSaveReader``/``DynamicMetaLoadPlanner`` (load a ``torch.save`` file
straight into a sharded state dict, unpickling it on rank 0) are refused with what to use
instead: convert once, then ``load`` resharding as from any checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...base.errors import CheckpointError
from .full_checkpoint import convert_full_checkpoint_to_dcp, dcp_to_full_state_dict

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp", "BroadcastingTorchSaveReader", "DynamicMetaLoadPlanner"]

_CONVERT_FIRST = (
    "convert the file once with torch_save_to_dcp(torch_save_path, checkpoint_dir) (it reads it with "
    "torch.load(weights_only=True); pass allow_pickle=True only for a file you trust), then "
    "load(state_dict, checkpoint_id=checkpoint_dir), which reshards into any layout")


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike, torch_save_path: str | os.PathLike, *,
                      allow_pickle: bool = False) -> None:
    """Write a whole checkpoint, whatever layout saved it, as one ``torch.save`` file.

    The file holds the state dict nested as it was saved, full CPU tensors and plain values.
    ``allow_pickle`` is needed only for a checkpoint saved with pickled values. Runs in one
    process; it holds the whole model in memory (as torch's does).

    Example::

        dcp_to_torch_save("/ckpt/step100", "model.pt")
        sd = torch.load("model.pt", weights_only=True)
    """
    torch.save(dcp_to_full_state_dict(dcp_checkpoint_dir, allow_pickle=allow_pickle), torch_save_path)


def torch_save_to_dcp(torch_save_path: str | os.PathLike, dcp_checkpoint_dir: str | os.PathLike, *,
                      allow_pickle: bool = False) -> None:
    """Save the state dict of a ``torch.save`` file as a checkpoint (replacing one already there).

    The file is read with ``torch.load(weights_only=True)``: tensors, containers and plain
    values only, no code runs. A file holding other objects is refused
    (:class:`~...base.errors.UnsupportedValueError`) unless ``allow_pickle=True``, which you pass
    only for a file you trust.

    Example::

        torch_save_to_dcp("model.pt", "/ckpt/model")
        load(sharded_sd, checkpoint_id="/ckpt/model")
    """
    convert_full_checkpoint_to_dcp(os.fspath(torch_save_path), dcp_checkpoint_dir, src_platform="torch",
                                   overwrite=True, allow_pickle=allow_pickle)


class BroadcastingTorchSaveReader:
    """Refused: torch's reader unpickles a ``torch.save`` file (``weights_only=False``) on the
    coordinator and broadcasts every tensor. Convert the file once instead (see the error)."""

    def __init__(self, checkpoint_id: str | os.PathLike | None = None, coordinator_rank: int = 0) -> None:
        raise CheckpointError(f"BroadcastingTorchSaveReader({checkpoint_id!r}) is not supported: it would unpickle "
                              f"the file on load; {_CONVERT_FIRST}")


class DynamicMetaLoadPlanner:
    """Refused, with :class:`BroadcastingTorchSaveReader` (its only use): convert the file once
    with :func:`torch_save_to_dcp`, then ``load``."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False, **_: Any) -> None:
        raise CheckpointError(f"DynamicMetaLoadPlanner is not supported (it serves loading a torch.save file "
                              f"directly); {_CONVERT_FIRST}")
