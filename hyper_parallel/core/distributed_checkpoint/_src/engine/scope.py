"""Where one save or load runs, and with which ranks.

The place (``path``/``checkpoint_id`` or a storage object pointed there:
:func:`resolve_path`), the storage's calls bounded by the exchange timeout
(:func:`bound_calls`), the group a mesh over some ranks chooses when none is given
(:func:`mesh_group`), and the guards of a collective save's scope: every rank names one
checkpoint (:func:`check_one_location`), and a save on a mesh's ranks only never replaces a
checkpoint holding tensors it does not have (:func:`part_guard`).

What it is not: the phases of the procedures (:mod:`.checkpoint`) nor the exchanges
themselves (:mod:`..coordination.coordinator`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .....platform import member_group
from ..backends.locations import location
from ..base.errors import CheckpointError
from ..coordination.coordinator import Coordinator
from ..format import metadata as md
from ..sharding.records import mesh_ranks
from ..state.flatten import FlatLeaves, FlatStateDict

__all__ = ["PathLike", "resolve_path", "bound_calls", "distributed", "mesh_group", "check_one_location",
           "part_guard"]

PathLike = str | os.PathLike


_STORAGE_METHODS = {"storage_writer": ("write_file", "write_data"),  # ours, torch's
                    "storage_reader": ("read_into", "read_data")}


def storage_in_path_slot(path: Any, storage: Any, kind: str) -> tuple[Any, Any]:
    """``(path, storage)`` with a storage object passed positionally moved to its keyword: torch
    DCP still accepts ``save(sd, FileSystemWriter(p))`` / ``load(sd, reader)`` (its second
    positional argument is the storage; ours is the path). ``kind``: ``"storage_writer"`` or
    ``"storage_reader"``. Raises TypeError when a storage object comes both ways."""
    if path is None or isinstance(path, (str, os.PathLike)) or not any(
            callable(getattr(path, m, None)) for m in _STORAGE_METHODS[kind]):
        return path, storage
    if storage is not None:
        raise TypeError(f"a {type(path).__name__} was passed positionally and {kind}= too; pass one")
    return None, path


def resolve_path(path: PathLike | None, checkpoint_id: PathLike | None, storage: Any) -> str | None:
    """Where the checkpoint is. With a storage object too, ``checkpoint_id`` wins, as in torch
    DCP: the storage is pointed there (its ``reset``); one that cannot be and is elsewhere is
    an error, never a silent save or load at the storage's own place."""
    if path is not None and checkpoint_id is not None and os.fspath(path) != os.fspath(checkpoint_id):
        raise ValueError(f"path={path!r} and checkpoint_id={checkpoint_id!r} disagree; pass one")
    chosen = path if path is not None else checkpoint_id
    if chosen is None and storage is None:
        raise ValueError("say where the checkpoint is: path=/checkpoint_id= or a storage writer/reader")
    own = getattr(storage, "path", None) or getattr(storage, "url", None) if storage is not None else None
    if chosen is not None and storage is not None and (
            own is None or location(os.fspath(own)) != location(os.fspath(chosen))):
        if callable(getattr(storage, "reset", None)):
            storage.reset(os.fspath(chosen))
        elif own is not None:
            raise ValueError(f"checkpoint_id={os.fspath(chosen)!r}, but the {type(storage).__name__} given "
                             f"points at {os.fspath(own)!r} and has no reset() to point it there; pass one")
    return None if chosen is None else os.fspath(chosen)


def bound_calls(storage: Any, coord: Coordinator) -> None:
    """Bound the storage's calls by the exchange timeout: a stuck store fails the save or load
    as a stuck peer does (storage not derived from our ABCs may lack the hook)."""
    hook = getattr(storage, "bound_calls", None)
    if hook is not None:
        hook(coord.timeout.total_seconds())


def distributed() -> bool:
    """Whether torch.distributed is up (else every call is a process alone)."""
    return dist.is_available() and dist.is_initialized()


MESH_DEPTH = 64  # DTensors nested deeper than this are not looked at


def mesh_group(state_dict: Any, flat: FlatLeaves | None = None) -> Any:
    """The group of the one mesh every DTensor of ``state_dict`` lives on, when that mesh is
    a root mesh over some ranks only (``init_device_mesh(..., rank_list=)``); else None.

    Slices of a bigger mesh (``mesh["tp"]``) do not count: their ranks save with the rest.
    DTensors inside Stateful objects do not either (their ``state_dict()`` is not called for
    this). ``flat``: ``state_dict`` flattened already; its leaves are read instead of walking
    the state dict again.
    """
    if not distributed() or isinstance(state_dict, FlatStateDict):
        return None
    meshes: dict[int, Any] = {}
    if flat is not None:
        for leaf in flat.leaves.values():
            value = leaf.value
            if isinstance(value, DTensor) and not leaf.via_stateful and len(leaf.path) <= MESH_DEPTH:
                meshes[id(value.device_mesh)] = value.device_mesh
        return _group_of(meshes)

    def walk(v: Any, depth: int = 0) -> None:
        if isinstance(v, DTensor):
            meshes[id(v.device_mesh)] = v.device_mesh
        elif isinstance(v, dict) and depth < MESH_DEPTH:
            for x in v.values():
                walk(x, depth + 1)
        elif isinstance(v, (list, tuple)) and depth < MESH_DEPTH:
            for x in v:
                walk(x, depth + 1)

    walk(state_dict)
    return _group_of(meshes)


def _group_of(meshes: dict[int, Any]) -> Any:
    """The group of the one mesh in ``meshes`` when it is a root mesh over some ranks only."""
    if len(meshes) != 1:
        return None
    mesh = next(iter(meshes.values()))
    ranks = sorted(mesh_ranks(mesh))
    if mesh._get_root_mesh() is not mesh or len(ranks) == dist.get_world_size():
        return None
    return member_group(ranks)


def check_one_location(places: list[str | None], coord: Coordinator) -> None:
    """Every rank of a collective save must write the same checkpoint: ranks naming different
    directories would commit metadata naming files that lie elsewhere, or leave a rank's
    directory without the checkpoint it believes it saved (checked on every rank from the
    same exchange, so every rank raises alike). Symlinked names of one directory agree;
    names of one shared directory under different mount points do not: name it alike."""
    if None in places or len(set(places)) <= 1:
        return
    shown = ", ".join(f"rank {coord._name(r)} {p!r}" for r, p in enumerate(places[:8]))
    raise ValueError(
        f"save: the ranks saving together name different checkpoints ({shown}"
        f"{' ...' if len(places) > 8 else ''}). One collective save writes one checkpoint, which every "
        "rank must name alike; to save parts apart, save each with a process_group of its own ranks, "
        "or use_collectives=False for rank-local checkpoints")


def part_guard(coord: Coordinator, keys: set[str], where: str | None) -> Callable[[bytes | None], None]:
    """For a save whose group a mesh over some ranks chose (no ``process_group`` given):
    refuse to replace a checkpoint holding tensors this save does not. That is another part
    of the model (a pipeline stage on a mesh of its own, saving into the same directory
    through its own group) or a whole model this part belongs to; replacing it would lose the
    rest while every rank reports success. A caller's explicit subgroup is trusted."""
    def guard(previous: bytes | None) -> None:
        if previous is None:
            return
        try:
            old = md.Metadata.from_json(previous).entries
        except Exception:  # unreadable: the commit replaces it, as any save does
            return
        lost = sorted(k for k, e in old.items() if e.kind != "object" and k not in keys)
        if lost:
            raise CheckpointError(
                f"{where or 'storage'} holds a checkpoint with tensors this save does not have ({len(lost)}, e.g. "
                f"{lost[0]!r}), and this save runs on ranks {coord.group_ranks[:8]} of {dist.get_world_size()} "
                "only: replacing that checkpoint would lose them. Parts of one model (pipeline stages on "
                "meshes of their own) save into one checkpoint through one group: pass "
                "process_group=dist.group.WORLD (or a group of every part's ranks); or save each part to a "
                "directory of its own")
    return guard
