"""``hyper_parallel.core.dtensor.layout``: HyperParallel's DTensor ``Layout`` at its seed path.

It is our checkpoint layout (:class:`hyper_parallel.core.distributed_checkpoint._src.sharding.layout.Layout`:
mesh shape, dim names, rank list, ``layout("dp", "None")`` tensor layouts, chunk boxes) plus
the state the seed's DTensor layout carries for one tensor:

- ``mesh``: a torch ``DeviceMesh`` over ``rank_list``, built on first use and shared through
  ``device_mesh._DEVICE_MESH_MAP``; with ``init_backend=False`` (or no process group) it has no
  process groups, only ranks and coordinates.
- ``set_placements(placements)`` / ``placements``; ``placement_to_tensor_map(dim)`` derives
  and stores the seed's ``tensor_map`` for a ``dim``-dimensional tensor (``-1``: not split;
  otherwise the splitting mesh dim counted from the last).
- ``set_tensor_meta(shape, stride, dtype)``: the global tensor the layout describes, which
  ``DTensor.from_local_with_layout`` uses as the DTensor's global shape.

Not here: the seed's partial-status bookkeeping and ``interleaved_parallel`` (torch's DTensor
has neither), and the seed's ``Shard(dim, uneven_shard=...)`` flag (torch's ``Shard`` always
splits unevenly like ``torch.chunk``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..distributed_checkpoint._src.sharding.layout import Layout as _CheckpointLayout
from ..distributed_checkpoint._src.sharding.layout import TensorLayout
from .device_mesh import DeviceMesh, _create_device_mesh

__all__ = ["Layout", "DeviceMesh", "TensorLayout"]


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Layout(_CheckpointLayout):
    """A device mesh layout with the seed's per-tensor state (placements, tensor map, meta).

    Args:
        mesh_shape: ranks per mesh dim.
        alias_name: one name per mesh dim.
        rank_list: the global rank at each mesh position (default ``range(prod(mesh_shape))``).
        init_backend: whether :attr:`mesh` creates process groups (needs a process group;
            only the listed ranks may then touch :attr:`mesh`).

    Example::

        layout = Layout((2,), ("dp",), init_backend=False)
        layout.set_placements((Shard(0),))
        layout.placement_to_tensor_map(dim=2)      # [0, -1]
        layout.set_tensor_meta((6, 3), (3, 1), torch.float32)
    """

    def __init__(self, mesh_shape: Sequence[int], alias_name: Sequence[str] | str,
                 rank_list: Sequence[int] | None = None, init_backend: bool = True):
        super().__init__(mesh_shape, alias_name, list(rank_list) if rank_list else None)
        self._init_backend = bool(init_backend)
        self._mesh: DeviceMesh | None = None
        self._placements: tuple[Any, ...] | None = None
        self._tensor_map: tuple[Any, ...] | None = None
        self._tensor_meta: tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None = None

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> Layout:
        """The layout of a torch ``DeviceMesh``; :attr:`mesh` is that mesh itself."""
        obj = super().from_device_mesh(mesh)
        obj._mesh = mesh
        return obj

    @property
    def mesh(self) -> DeviceMesh:
        """The torch ``DeviceMesh`` of this layout (built and cached on first use)."""
        if self._mesh is None:
            self._mesh = _create_device_mesh(_default_device_type(), self.mesh_shape,
                                             mesh_dim_names=self.alias_name, rank_list=tuple(self.rank_list),
                                             init_backend=self._init_backend)
        return self._mesh

    @property
    def placements(self) -> tuple[Any, ...] | None:
        return self._placements

    def set_placements(self, placements: Sequence[Any]) -> None:
        """Record one torch placement per mesh dim (``Shard(d)``, ``Replicate()``, ...)."""
        placements = tuple(placements)
        if len(placements) != self.ndim:
            raise ValueError(f"{len(placements)} placements given for a mesh of {self.ndim} dims "
                             f"{self.alias_name}; give one per mesh dim")
        self._placements = placements

    def placement_to_tensor_map(self, dim: int) -> list[Any]:
        """The seed's tensor map of a ``dim``-dimensional tensor under :attr:`placements`; stored too.

        Raises:
            ValueError: ``dim`` is negative, no placements are set, or a ``Shard`` dim is out of range.
        """
        if dim < 0:
            raise ValueError(f"tensor dimension must be non-negative, got {dim}")
        if self._placements is None:
            raise ValueError("placement_to_tensor_map needs placements: call set_placements first")
        tensor_map = TensorLayout.from_placements(self, list(self._placements), ndim=dim).tensor_map
        self._tensor_map = tuple(tensor_map)
        return list(tensor_map)

    @property
    def tensor_map(self) -> tuple[Any, ...] | None:
        return self._tensor_map

    def set_tensor_meta(self, shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> None:
        """Record the global tensor this layout describes (shape, stride, dtype)."""
        self._tensor_meta = (tuple(int(s) for s in shape), tuple(int(s) for s in stride), dtype)

    @property
    def tensor_meta(self) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None:
        return self._tensor_meta

    def to_dict(self) -> dict[str, Any]:
        """The mesh's dict, plus ``tensor_map`` once one is derived (the seed's ``to_dict`` keys)."""
        d = super().to_dict()
        if self._tensor_map is not None:
            d["tensor_map"] = list(self._tensor_map)
        return d
