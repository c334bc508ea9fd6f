"""``hyper_parallel.core.dtensor.device_mesh``: torch's ``DeviceMesh``, and meshes over some ranks.

``DeviceMesh`` is torch's class. :func:`init_device_mesh` takes HyperParallel's arguments:
without ``rank_list`` it is torch's ``init_device_mesh`` (every rank of the job calls it, and
the mesh covers them all); with ``rank_list`` it builds a torch ``DeviceMesh`` over those
ranks only, and only they call it.

HyperParallel's additions, kept additive so that ``DeviceMesh`` stays torch's own class:

- ``mesh.rank_list``: the global ranks of the mesh this rank sees, flat and row-major
  (``tuple(mesh.mesh.flatten().tolist())``). Installed on torch's ``DeviceMesh`` as a read-only
  property when this module is imported (torch defines no such attribute).
- ``mesh.mesh_shape``: the mesh's shape as a tuple of ints (HyperParallel's name for
  ``tuple(mesh.mesh.shape)``), installed the same way.
- ``_DEVICE_MESH_MAP``: the meshes :func:`_create_device_mesh` built, keyed by device type,
  shape, names and ranks, so that every HyperParallel ``Layout`` over the same ranks shares one
  mesh (and its process groups). Tests ``.clear()`` it.
- ``DeviceMesh(device_type, ranks, mesh_dim_names=..., _init_backend=False)`` is torch's
  constructor: it creates no process group, but torch still asks the default group for this
  process's rank unless ``_rank=`` is given. :func:`_create_device_mesh` passes ``_rank`` for
  you when no process group exists (``dist.get_rank()`` if that answers, else ``platform.get_rank()``,
  0 unless patched).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh

from ...platform import get_platform, member_group

__all__ = ["DeviceMesh", "init_device_mesh"]

_DEVICE_MESH_MAP: dict[tuple, DeviceMesh] = {}

platform = get_platform()
"""HyperParallel's platform object, as its ``device_mesh`` holds it: asked for this process's
rank when there is no process group (so ``patch.object(device_mesh.platform, "get_rank")``
places a mesh built without one)."""


def _rank_list(self: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of this mesh (this rank's view of it), flat in row-major order."""
    return tuple(int(r) for r in self.mesh.flatten().tolist())


def _mesh_shape(self: DeviceMesh) -> tuple[int, ...]:
    """The shape of this mesh, one size per mesh dimension."""
    return tuple(int(n) for n in self.mesh.shape)


if not hasattr(DeviceMesh, "rank_list"):
    DeviceMesh.rank_list = property(_rank_list)  # type: ignore[attr-defined]
if not hasattr(DeviceMesh, "mesh_shape"):
    DeviceMesh.mesh_shape = property(_mesh_shape)  # type: ignore[attr-defined]


def _own_rank() -> int:
    """This process's rank for a mesh without process groups: the default group's, else the
    platform's (0 without a process group)."""
    try:
        return int(dist.get_rank())
    except (RuntimeError, ValueError):
        return int(platform.get_rank())


def _create_device_mesh(device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Sequence[str] | None = None,
                        rank_list: Sequence[int] | None = None, init_backend: bool = True) -> DeviceMesh:
    """The (cached) torch ``DeviceMesh`` of ``rank_list`` arranged as ``mesh_shape``.

    With ``init_backend`` (and a process group), the mesh gets its process groups: over the
    whole job through torch's ``init_device_mesh``, over some ranks through
    :func:`init_device_mesh`'s ``rank_list`` path (only members may call it then). Without
    (or with no process group), the mesh is bookkeeping only: ranks and coordinates, no groups,
    usable for layouts and chunk geometry. Meshes are cached in ``_DEVICE_MESH_MAP``.
    """
    shape = tuple(int(s) for s in mesh_shape)
    ranks = tuple(range(math.prod(shape))) if rank_list is None else tuple(int(r) for r in rank_list)
    names = tuple(mesh_dim_names) if mesh_dim_names else None
    groups = bool(init_backend) and dist.is_initialized()
    key = (device_type, shape, names, ranks, groups)
    mesh = _DEVICE_MESH_MAP.get(key)
    if mesh is None:
        if groups:
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, rank_list=ranks)
        else:
            mesh = DeviceMesh(device_type, torch.tensor(ranks, dtype=torch.int).reshape(shape),
                              mesh_dim_names=names, _init_backend=False, _rank=_own_rank())
        _DEVICE_MESH_MAP[key] = mesh
    return mesh


def _check_args(mesh_shape: tuple[int, ...], mesh_dim_names: Sequence[str] | None) -> tuple[str, ...] | None:
    if not isinstance(mesh_shape, tuple):
        raise TypeError(f"mesh_shape must be a tuple or list, got {type(mesh_shape).__name__}")
    if not mesh_shape or any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in mesh_shape):
        raise ValueError(f"mesh_shape must hold positive integers, got {mesh_shape}")
    if mesh_dim_names is None:
        return None
    names = tuple(mesh_dim_names)
    if len(names) != len(mesh_shape):
        raise ValueError(f"mesh_dim_names {names} must name each of the {len(mesh_shape)} mesh dimensions")
    if len(set(names)) != len(names) or any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"mesh_dim_names {names} must be distinct non-empty strings")
    return names


def _mesh_over(device_type: str, mesh: torch.Tensor, names: tuple[str, ...] | None) -> DeviceMesh:
    """A torch DeviceMesh over ``mesh``'s ranks, its groups created by those ranks alone."""
    me = dist.get_rank()
    coord = (mesh == me).nonzero()
    groups = []
    for d in range(mesh.ndim):
        index = [int(c) for c in coord[0]]
        index[d] = slice(None)
        line = [int(r) for r in mesh[tuple(index)].tolist()]
        if line != sorted(line):
            raise ValueError(
                f"rank_list {mesh.flatten().tolist()} arranged as {list(mesh.shape)} puts ranks {line} "
                f"along mesh dimension {d} out of ascending order; torch orders a group's ranks "
                "ascending, so list the ranks of every mesh dimension in ascending order")
        groups.append(member_group(line))
    if mesh.ndim == 1:
        return DeviceMesh.from_group(groups[0], device_type, mesh=mesh, mesh_dim_names=names)
    if names is None:  # torch needs names to build a mesh from several groups
        names = tuple(f"dim{d}" for d in range(mesh.ndim))
    return DeviceMesh.from_group(groups, device_type, mesh=mesh, mesh_dim_names=names)


def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    rank_list: Sequence[int] | None = None,
    **kwargs: Any,
) -> DeviceMesh:
    """Create a torch ``DeviceMesh``: ranks arranged as an N-d grid.

    Args:
        device_type: "cpu", "cuda", "npu", ...; passed to torch unchanged.
        mesh_shape: ranks per mesh dimension, a tuple such as ``(dp, tp)``.
        mesh_dim_names: one distinct name per dimension, e.g. ``("dp", "tp")``.
        rank_list: the global ranks of the mesh in row-major order (length = the product of
            ``mesh_shape``). When given, the mesh covers these ranks only: **only these ranks
            call this function**, and each creates just the groups it belongs to. Ranks outside
            must not call it, hold no DTensor on the mesh, and take part in no collective over
            it. When omitted and ``mesh_shape`` covers the whole job, every rank calls this
            (torch's ``init_device_mesh``). When omitted and the mesh is smaller than the job,
            the ranks form consecutive blocks of that size and each block gets its own mesh
            (HyperParallel's rule: ``rank_list = range(r - r % n, r - r % n + n)``).
        **kwargs: further keyword arguments of torch's ``init_device_mesh`` (whole-job meshes only).

    Returns:
        The ``DeviceMesh`` (torch's class; ``mesh["tp"]`` gives a sub-mesh).

    Raises:
        TypeError: ``mesh_shape`` is not a tuple or list; ``kwargs`` with a partial mesh.
        ValueError: bad shape or names; ``rank_list`` of the wrong length, repeating a rank,
            naming a rank outside the job, or not listing this rank; a mesh dimension whose
            ranks are not ascending.

    Example::

        if rank < 2:  # a load on ranks 0-1 of a 4-rank job
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), rank_list=(0, 1))
    """
    if isinstance(mesh_shape, list):
        mesh_shape = tuple(mesh_shape)
    names = _check_args(mesh_shape, mesh_dim_names)
    n = math.prod(mesh_shape)
    if rank_list is None:
        world = dist.get_world_size() if dist.is_initialized() else n
        if world == n:
            return _torch_init_device_mesh(device_type, mesh_shape, mesh_dim_names=names, **kwargs)
        if world % n:
            raise ValueError(f"a mesh of {n} ranks does not divide the job's {world} ranks; pass rank_list")
        base = dist.get_rank() - dist.get_rank() % n
        rank_list = range(base, base + n)
    if kwargs:
        raise TypeError(f"init_device_mesh: {sorted(kwargs)} only apply to a mesh over the whole job")
    if not dist.is_initialized():
        raise RuntimeError("init_device_mesh(rank_list=...) needs a process group: call "
                           "torch.distributed.init_process_group first")
    ranks = [int(r) for r in rank_list]
    if len(ranks) != n:
        raise ValueError(f"rank_list has {len(ranks)} ranks, mesh_shape {mesh_shape} needs {n}")
    if len(set(ranks)) != n:
        raise ValueError(f"rank_list {ranks} repeats a rank")
    world = dist.get_world_size()
    if any(r < 0 or r >= world for r in ranks):
        raise ValueError(f"rank_list {ranks} names ranks outside the job's {world}")
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not in rank_list {ranks}: only the mesh's ranks call "
                         "init_device_mesh for it")
    mesh = torch.tensor(ranks, dtype=torch.int).reshape(mesh_shape)
    return _mesh_over(device_type, mesh, names)
