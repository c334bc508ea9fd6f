"""HyperParallel's ``get_platform()`` on torch: rank, world size, barrier and groups.

HyperParallel code asks a platform object for its process facts instead of calling
``torch.distributed`` (the same code runs on MindSpore there). Here there is one platform,
torch, and its methods are thin calls into ``torch.distributed``::

    from hyper_parallel.platform import get_platform
    platform = get_platform()
    if platform.get_rank() == 0:
        ...
    platform.barrier()

:meth:`TorchPlatform.create_group` and meshes over some ranks
(``init_device_mesh(..., rank_list=)``) create their groups with only the member ranks
taking part; see :func:`member_group`. The current platform object (resettable, chosen by
``HYPER_PARALLEL_PLATFORM``) and the group registry ``EXISTING_COMM_GROUPS`` live in
:mod:`hyper_parallel.platform.platform`.
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Sequence
from typing import Any

import safetensors.torch
import torch as _torch  # "torch" in this namespace is the subpackage hyper_parallel.platform.torch
import torch.distributed as dist

__all__ = ["get_platform", "set_platform", "TorchPlatform", "PlatformType", "member_group",
           "EXISTING_COMM_GROUPS"]


class PlatformType(enum.Enum):
    """The frameworks HyperParallel names; only ``PYTORCH`` exists here."""

    MINDSPORE = 0
    PYTORCH = 1


_LOCK = threading.Lock()
_GROUPS: dict[tuple, Any] = {}
_CALLS: dict[tuple, int] = {}


def _pg_count() -> int:
    return len(dist.distributed_c10d._world.pg_names)


def member_group(ranks: Sequence[int], backend: str | None = None, timeout: Any = None, *,
                 cached: bool = True) -> Any:
    """The process group of ``ranks``, created (once) by those ranks alone.

    Only the members call this; ranks outside ``ranks`` must not (and need not) take part.
    torch names a group created this way (``use_local_synchronization=True``) from its ranks
    and from how many groups the creating process already has, and the members rendezvous
    under that name; members whose histories differ would wait under different names. So
    the members first agree, through the default store, on the largest such count, and the
    ones below it make private one-rank groups until they reach it. The group is cached:
    asking again for the same ranks returns the same group, without any communication.

    ``backend``/``timeout`` go to ``new_group`` (a group per distinct pair is cached).
    ``cached=False`` makes a new group every call (for callers that cache, and destroy, their own).

    Raises:
        ValueError: this rank is not in ``ranks``, or ``ranks`` repeats a rank.
    """
    key = tuple(int(r) for r in ranks)
    if len(set(key)) != len(key):
        raise ValueError(f"group ranks {list(key)} repeat a rank")
    me = dist.get_rank()
    if me not in key:
        raise ValueError(f"rank {me} is not in the group {list(key)}; only its members create it")
    canon = tuple(sorted(key))
    cache_key = (canon, backend, timeout, id(dist.group.WORLD))
    with _LOCK:
        if cached and cache_key in _GROUPS:
            return _GROUPS[cache_key][1]
        if len(canon) == dist.get_world_size() and backend is None and timeout is None:
            _GROUPS[cache_key] = (dist.group.WORLD, dist.group.WORLD)
            return dist.group.WORLD
        n = _CALLS.get(cache_key, 0)
        _CALLS[cache_key] = n + 1
        store = dist.distributed_c10d._get_default_store()
        # the timeout too: n counts per (ranks, backend, timeout), so two timeouts must not share a tag
        tag = f"hyper_parallel/member_group/{'_'.join(map(str, canon))}/{backend}/{timeout}/{n}"
        store.set(f"{tag}/{me}", str(_pg_count()))
        target = max(int(store.get(f"{tag}/{r}")) for r in canon)
        while _pg_count() < target:
            dist.new_group([me], use_local_synchronization=True)
        kwargs = {k: v for k, v in (("backend", backend), ("timeout", timeout)) if v is not None}
        group = dist.new_group(list(canon), use_local_synchronization=True, **kwargs)
        if cached:
            _GROUPS[cache_key] = (dist.group.WORLD, group)  # holds the world: ids in the key stay unique
        return group


class TorchPlatform:
    """The platform object HyperParallel code gets from :func:`get_platform`, on torch."""

    platform_type = PlatformType.PYTORCH
    Tensor = _torch.Tensor
    dtype = _torch.dtype

    @staticmethod
    def get_rank(group: Any = None) -> int:
        """This process's rank (in ``group``; default: the world). 0 without a process group."""
        return dist.get_rank(group) if dist.is_initialized() else 0

    @staticmethod
    def get_world_size(group: Any = None) -> int:
        """Ranks in ``group`` (default: the world). 1 without a process group."""
        return dist.get_world_size(group) if dist.is_initialized() else 1

    @staticmethod
    def get_global_rank(group: Any, group_rank: int) -> int:
        return dist.get_global_rank(group, group_rank)

    @staticmethod
    def get_process_group_ranks(group: Any = None) -> list[int]:
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)

    @staticmethod
    def barrier(group: Any = None) -> None:
        """Wait for every rank of ``group`` (default: the world); no-op without a process group."""
        if dist.is_initialized():
            dist.barrier(group)

    @staticmethod
    def create_group(rank_list: Sequence[int], group_name: str | None = None) -> Any:
        """The process group of ``rank_list``; only its members call this (see :func:`member_group`).

        The group is recorded in ``EXISTING_COMM_GROUPS`` under ``tuple(rank_list)``.
        """
        del group_name  # torch names groups itself
        group = member_group(rank_list)
        EXISTING_COMM_GROUPS[tuple(int(r) for r in rank_list)] = group
        return group

    @staticmethod
    def get_group_rank(group: Any) -> int:
        """This process's rank inside ``group`` (-1 when it is not a member)."""
        return dist.get_rank(group) if dist.is_initialized() else 0

    @staticmethod
    def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
        dist.all_gather_object(object_list, obj, group=group)

    @staticmethod
    def is_tensor(obj: Any) -> bool:
        return isinstance(obj, _torch.Tensor)

    @staticmethod
    def detach(tensor: _torch.Tensor) -> _torch.Tensor:
        """The tensor's data without autograd history (a view, no copy)."""
        return tensor.detach()

    @staticmethod
    def new_tensor(size: Sequence[int], dtype: _torch.dtype | None = None, device: Any = None) -> _torch.Tensor:
        """An uninitialised tensor of ``size`` (a staging buffer)."""
        return _torch.empty(tuple(size), dtype=dtype, device=device)

    @staticmethod
    def copy_each(dests: list[_torch.Tensor], srcs: list[_torch.Tensor]) -> None:
        """Copy ``srcs[i]`` into ``dests[i]`` for every ``i``, in one fused call."""
        if dests:
            _torch._foreach_copy_(dests, srcs)

    @staticmethod
    def synchronize() -> None:
        """Wait for the work queued on the current accelerator stream (nothing to wait for on
        a host without an initialised accelerator)."""
        for name in ("cuda", "npu"):
            device = getattr(_torch, name, None)
            if device is not None and device.is_available() and device.is_initialized():
                device.current_stream().synchronize()

    @staticmethod
    def broadcast_async(tensor: _torch.Tensor, src_rank: int, group: Any = None) -> Any:
        """Start broadcasting ``tensor`` from global rank ``src_rank`` over ``group``, in place;
        returns the work handle to ``wait()`` on (``None`` when the backend already finished)."""
        return dist.broadcast(tensor, src_rank, group=group, async_op=True)

    @staticmethod
    def new_group(group_ranks: Sequence[int]) -> Any:
        """A new process group of exactly ``group_ranks``, neither cached nor recorded.
        Collective over the world: every rank calls it, in the same order."""
        return dist.new_group(ranks=[int(r) for r in group_ranks])

    @staticmethod
    def destroy_process_group(group: Any = None) -> None:
        """Release ``group`` (``None``: the default group and every other one)."""
        dist.destroy_process_group(group)

    @staticmethod
    def get_created_group(group_ranks: Sequence[int]) -> Any:
        """The group of ``group_ranks`` that ``EXISTING_COMM_GROUPS`` holds (under the sorted
        rank tuple, or its ``str``, HyperParallel's key), or ``None``."""
        ranks = tuple(sorted(int(r) for r in group_ranks))
        found = EXISTING_COMM_GROUPS.get(ranks)
        return found if found is not None else EXISTING_COMM_GROUPS.get(str(ranks))

    @staticmethod
    def get_world_group() -> Any:
        """The group of every rank (the default process group)."""
        return dist.group.WORLD

    @staticmethod
    def get_tensor_storage_size(tensor: _torch.Tensor) -> int:
        """Bytes the tensor's elements take when serialized (numel times element size)."""
        return tensor.numel() * tensor.element_size()

    @staticmethod
    def get_op_name(func: Any) -> str:
        """A stable name for an operator: ``aten::add.Tensor`` for aten ops, else ``__name__``."""
        name = getattr(func, "_name", None) or getattr(func, "__name__", None)
        return str(name) if name is not None else str(func)

    @staticmethod
    def parameters_dict(module: _torch.nn.Module) -> dict[str, _torch.nn.Parameter]:
        """``{fully qualified name: parameter}`` of ``module`` (HyperParallel's name for
        ``dict(module.named_parameters())``, which MindSpore spells ``parameters_dict()``)."""
        return dict(module.named_parameters())

    @staticmethod
    def get_cells_and_names(module: _torch.nn.Module) -> list[tuple[str, _torch.nn.Module]]:
        """``(name, submodule)`` pairs, the module itself first (MindSpore calls modules cells)."""
        return list(module.named_modules())

    @staticmethod
    def get_modules(module: _torch.nn.Module) -> list[_torch.nn.Module]:
        return list(module.modules())

    @staticmethod
    def search_parameter_by_name(module: _torch.nn.Module, param_name: str) -> tuple[str, Any] | None:
        """``(name, parameter)`` for ``param_name`` in ``module``, or None when it has none."""
        param = dict(module.named_parameters()).get(param_name)
        return None if param is None else (param_name, param)

    @staticmethod
    def get_param_local_shape(param: _torch.Tensor) -> tuple[int, ...]:
        """The shape this rank holds: a DTensor's local shard, else the tensor's shape."""
        local = param.to_local() if hasattr(param, "to_local") else param
        return tuple(local.shape)

    @staticmethod
    def get_param_local_data(param: _torch.Tensor) -> _torch.Tensor:
        """The tensor this rank holds: a DTensor's local shard, else the tensor itself."""
        return param.to_local() if hasattr(param, "to_local") else param

    @staticmethod
    def get_param_type_size(param: _torch.Tensor) -> int:
        return param.element_size()

    @staticmethod
    def save_checkpoint(obj: Any, file_path: str | os.PathLike) -> None:
        """Write one file: a dict of tensors to ``*.safetensors`` (safetensors), anything else
        with ``torch.save`` (a module is saved as its ``state_dict()``, so loading it needs no
        code). HyperParallel's single-file save; sharded checkpoints use DCP."""
        if isinstance(obj, _torch.nn.Module):
            obj = obj.state_dict()
        if os.fspath(file_path).endswith(".safetensors"):
            safetensors.torch.save_file({k: v.contiguous() for k, v in obj.items()}, os.fspath(file_path))
        else:
            _torch.save(obj, file_path)

    @staticmethod
    def load_checkpoint(file_path: str | os.PathLike) -> dict[str, Any]:
        """Read one file written by :meth:`save_checkpoint` (or by safetensors / ``torch.save``):
        ``*.safetensors`` through safetensors, anything else with ``torch.load(weights_only=True)``,
        so a file naming a class or function is refused (``UnpicklingError``), never run."""
        if os.fspath(file_path).endswith(".safetensors"):
            return safetensors.torch.load_file(os.fspath(file_path))
        return _torch.load(file_path, map_location="cpu", weights_only=True)


# The platform module (``hyper_parallel.platform.platform``) holds the resettable instance and
# the group registry; imported last because it builds on the classes above.
from .platform import EXISTING_COMM_GROUPS, get_platform, set_platform  # noqa: E402
