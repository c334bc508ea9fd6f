"""torch DCP's ``load_sharded_optimizer_state_dict``: an optimizer's state from a checkpoint,
sharded like the model's parameters.

Every saved key under ``optimizer_key`` becomes a target: a tensor of a parameter's state
(key path ``(optimizer_key, "state", <param fqn>, <name>)``, as ``get_state_dict`` and FSDP
name them) takes that parameter's DTensor layout from ``model_state_dict`` (same mesh,
placements, global shape; its own dtype), any other tensor is loaded whole on the CPU, and plain
values (``param_groups``) whole. Then one :func:`~...engine.checkpoint.load` fills them, resharding
from whatever layout saved them. torch builds FSDP1 ``ShardedTensor`` targets; ours are the
DTensors FSDP2 and tensor parallelism use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ...backends.protocol import StorageReader
from ...base.dtypes import torch_dtype
from ...base.errors import StateDictMismatchError
from ...engine.checkpoint import load
from ...engine.metadata_reader import read_checkpoint_metadata
from ...planning.planner import LoadPlanner
from ...state.flatten import unflatten

__all__ = ["load_sharded_optimizer_state_dict"]


def _target(entry: Any, model_state_dict: dict[str, Any]) -> Any:
    """An empty destination for one saved key: the parameter's layout where one matches."""
    if entry.kind != "tensor":
        return None  # plain values, bytes, arrays: replaced whole by load
    shape, dtype = tuple(entry.shape or ()), torch_dtype(entry.dtype)
    param = model_state_dict.get(entry.path[2]) if len(entry.path) >= 4 else None
    if isinstance(param, DTensor) and tuple(param.shape) == shape and shape:
        return torch.empty_like(param, dtype=dtype)  # a DTensor on the param's mesh and placements
    return torch.empty(shape, dtype=dtype)


def load_sharded_optimizer_state_dict(
    model_state_dict: dict[str, Any],
    optimizer_key: str,
    storage_reader: StorageReader,
    planner: LoadPlanner | None = None,
) -> dict[str, Any]:
    """Load the optimizer state saved under ``optimizer_key``, each parameter's state sharded like it.

    Every rank of the job calls it (a collective, like :func:`load`). Returns
    ``{optimizer_key: {...}}``, nested as saved: states of parameters that are DTensors in
    ``model_state_dict`` (flat FQN keys, e.g. ``model.state_dict()`` of an FSDP2 model) come
    back as DTensors with their layout; the rest as whole CPU tensors and plain values.

    Raises:
        NotACheckpointError: the reader's directory holds no checkpoint.
        StateDictMismatchError: nothing is saved under ``optimizer_key``.

    Example::

        save({"model": model.state_dict(), "optim": osd}, storage_writer=FileSystemWriter(path))
        optim_sd = load_sharded_optimizer_state_dict(model.state_dict(), "optim", FileSystemReader(path))
        set_optimizer_state_dict(model, optim, optim_state_dict=optim_sd["optim"])
    """
    meta = read_checkpoint_metadata(storage_reader)
    targets = {tuple(e.path): _target(e, model_state_dict) for e in meta.entries.values()
               if e.path and e.path[0] == optimizer_key}
    if not targets:
        tops = sorted({str(e.path[0]) for e in meta.entries.values() if e.path})
        raise StateDictMismatchError(
            f"the checkpoint holds nothing under optimizer_key={optimizer_key!r}; its top-level keys are {tops}")
    state_dict = unflatten(targets)
    load(state_dict, storage_reader=storage_reader, planner=planner)
    return state_dict
