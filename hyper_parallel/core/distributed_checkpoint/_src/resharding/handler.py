"""HyperParallel's ``ReshardHandler``: assemble one rank's slice of a tensor from another layout's slices.

HyperParallel's ``reshard.ReshardHandler`` answers, for one parameter, "which parts of which source
ranks' slices make up the slice this target rank holds?" and then pastes those parts
together. It works on array slices in memory (numpy, as in HyperParallel's DCP; torch tensors too), with
layouts given as MindSpore-style ``(mesh_shape, tensor_map, rank_list)``. Use it in two steps:

1. :meth:`ReshardHandler.infer_all_tensor_offset` -> ``{source rank: area within that rank's
   slice}``: fetch those regions (only from non-redundant source ranks: of the replicas of a
   slice, only the one at coordinate 0 on every mesh dim that splits nothing);
2. :meth:`ReshardHandler.get_real_tensor` ``({source rank: region})`` -> the target slice.

Not here: reading checkpoints (our online load and :func:`.reshard.reshard` do that with
boxes, uneven splits included). The geometry is :mod:`..sharding.tensor_map_areas`: splits
must be even, as in HyperParallel's DCP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..base.areas import Area, infer_intersection
from ..sharding.layout import TensorLayout
from ..sharding.tensor_map_areas import infer_slice_area_by_rank, rank_id_to_dev_id_list

__all__ = ["ReshardHandler", "check_layout"]

# (attribute names accepted, HyperParallel's name used in messages)
_REQUIRED = ((("mesh_shape",), "mesh_shape"), (("_tensor_map", "tensor_map"), "_tensor_map"),
             (("_rank_list", "rank_list"), "_rank_list"))


def _layout_values(layout: Any, name: str) -> tuple[tuple[int, ...], tuple[Any, ...], list[int]]:
    """``(mesh_shape, tensor_map, rank_list)`` of a layout, checked as :func:`check_layout` says."""
    if isinstance(layout, TensorLayout):
        d = layout.to_dict()
        if "tensor_map" not in d:
            raise ValueError(f"Layout {name} has no tensor dims count: build it with ndim (layout(..., ndim=N))")
    else:
        for spellings, seed_name in _REQUIRED:
            if not any(hasattr(layout, a) for a in spellings):
                raise ValueError(f"Layout {name} must contain attribute {seed_name} "
                                 f"(one of {', '.join(spellings)}); found {type(layout).__name__}")
        d = layout.to_dict()
        if "tensor_map" not in d:
            raise ValueError(f"Layout {name} has no tensor_map yet: derive it first "
                             "(e.g. layout.placement_to_tensor_map(dim=ndim))")
    for key in ("mesh_shape", "tensor_map", "rank_list"):
        value = d.get(key)
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"Layout {name} {key} must be tuple or list, but got {type(value).__name__}")
    mesh_shape = tuple(d["mesh_shape"])
    rank_list = list(d["rank_list"])
    if len(rank_list) != math.prod(mesh_shape):
        raise ValueError(f"Layout {name} rank_list size ({len(rank_list)}) must match device count "
                         f"({math.prod(mesh_shape)} for mesh {mesh_shape})")
    return mesh_shape, tuple(d["tensor_map"]), rank_list


def check_layout(layout: Any, name: str) -> None:
    """Check that ``layout`` describes a tensor on a mesh; a falsy layout (None) passes.

    A layout has ``mesh_shape``, a tensor map (``_tensor_map``/``tensor_map``) and a rank list
    (``_rank_list``/``rank_list``) and a ``to_dict()`` giving them as tuples or lists, with one
    rank per mesh position: HyperParallel's DTensor layout, our
    :class:`hyper_parallel.core.dtensor.layout.Layout` once its tensor map is derived, or our
    :class:`..sharding.layout.TensorLayout`.

    Raises:
        ValueError: an attribute is missing (named in the message), no tensor map is derived,
            or the rank list's length is not the mesh's size.
        TypeError: ``mesh_shape``, ``tensor_map`` or ``rank_list`` is not a tuple or list.
    """
    if not layout:
        return
    _layout_values(layout, name)


def _sliced(area: Area) -> tuple[slice, ...]:
    return tuple(slice(s, e) for s, e in area)


class ReshardHandler:
    """One target rank's slice of ``param_name``, from the slices of a source layout.

    Args:
        param_name: the parameter's name (kept for messages and callers).
        full_shape: the global shape.
        from_layout: the source layout (see :func:`check_layout`); None: one rank (0) holds the whole tensor.
        to_layout: the target layout; None: one rank (0) holds the whole tensor.
        to_rank_id: the global rank whose slice is assembled (ignored when ``to_layout`` is None).

    Raises:
        ValueError: both layouts are None, a layout is malformed, or ``to_rank_id`` is not in
            the target's rank list.

    Example::

        h = ReshardHandler("w", (4, 2), None, to_layout, to_rank_id=1)   # target: rows split over 2 ranks
        need = h.infer_all_tensor_offset()        # {0: ((2, 4), (0, 2))}: rows 2..4 of rank 0's whole tensor
        part = h.get_real_tensor({0: full[2:4]})
    """

    def __init__(self, param_name: str, full_shape: Sequence[int], from_layout: Any, to_layout: Any,
                 to_rank_id: int):
        check_layout(from_layout, "from_layout")
        check_layout(to_layout, "to_layout")
        if from_layout is None and to_layout is None:
            raise ValueError(f"{param_name!r}: `from_layout` and `to_layout` cannot both be None "
                             "(nothing to reshard between)")
        self.param_name = param_name
        self.full_shape = tuple(full_shape)
        whole = ((1,), tuple(0 for _ in self.full_shape), [0])
        self.from_mesh_shape, self.from_tensor_map, self.from_rank_list = (
            whole if from_layout is None else _layout_values(from_layout, "from_layout"))
        self.to_mesh_shape, self.to_tensor_map, self.to_rank_list = (
            whole if to_layout is None else _layout_values(to_layout, "to_layout"))
        self.to_rank_id = 0 if to_layout is None else to_rank_id
        if self.to_rank_id not in self.to_rank_list:
            raise ValueError(f"{param_name!r}: to_rank_id {self.to_rank_id} is not in the target rank_list "
                             f"{self.to_rank_list}")
        self.from_dev_num = len(self.from_rank_list)
        self.inner_from_rank_list = range(self.from_dev_num)
        self.inner_to_rank_id = self.to_rank_list.index(self.to_rank_id)
        self.inner_deredundancy_from_rank_list = (
            self._distinct_source_positions() if from_layout is not None else [0])
        self.global_union_area_map: dict[int, Area] = {}
        self.to_area: Area = ()

    def _distinct_source_positions(self) -> list[int]:
        """Source mesh positions holding distinct slices: coordinate 0 on every mesh dim that splits nothing."""
        last = len(self.from_mesh_shape) - 1
        used = {last - d for entry in self.from_tensor_map
                for d in ((entry,) if isinstance(entry, int) else tuple(entry)) if d != -1}
        idle = [m for m in range(len(self.from_mesh_shape)) if m not in used]
        if not idle:
            return list(self.inner_from_rank_list)
        return [p for p in self.inner_from_rank_list
                if not any(rank_id_to_dev_id_list(self.from_mesh_shape, p)[m] for m in idle)]

    def infer_all_tensor_offset(self) -> dict[int, Area]:
        """``{source global rank: area to take, relative to that rank's slice}`` for every
        distinct source slice that overlaps the target rank's slice (also kept, in global
        coordinates, in :attr:`global_union_area_map`; the target's area in :attr:`to_area`)."""
        self.to_area = infer_slice_area_by_rank(self.to_mesh_shape, self.to_tensor_map, self.inner_to_rank_id,
                                                self.full_shape)
        self.global_union_area_map.clear()
        local: dict[int, Area] = {}
        for position in self.inner_deredundancy_from_rank_list:
            from_area = infer_slice_area_by_rank(self.from_mesh_shape, self.from_tensor_map, position,
                                                 self.full_shape)
            overlap = infer_intersection(from_area, self.to_area)
            if overlap is None:
                continue
            rank = self.from_rank_list[position]
            self.global_union_area_map[rank] = overlap
            local[rank] = tuple((s - f, e - f) for (s, e), (f, _) in zip(overlap, from_area, strict=True))
        return local

    def get_real_tensor(self, from_tensor_map: Mapping[int, Any]) -> Any:
        """The target rank's slice, pasted from ``{source rank: region}`` as
        :meth:`infer_all_tensor_offset` asked for (numpy arrays give a numpy array, torch
        tensors a torch tensor; the first region's dtype). Extra ranks are ignored.

        Raises:
            ValueError: ``from_tensor_map`` is empty, a needed rank is missing ("Missing slice
                data from rank N"), or a region's shape is not the one asked for.
        """
        if not from_tensor_map:
            raise ValueError(f"{self.param_name!r}: from_tensor_map is empty; pass the regions "
                             "infer_all_tensor_offset() asked for")
        for rank, area in self.global_union_area_map.items():
            if rank not in from_tensor_map:
                raise ValueError(f"Missing slice data from rank {rank} for {self.param_name!r} (got ranks "
                                 f"{sorted(from_tensor_map)}). Please provide all required slices from "
                                 "infer_all_tensor_offset.")
            want = tuple(e - s for s, e in area)
            got = tuple(from_tensor_map[rank].shape)
            if want != got:
                raise ValueError(f"Slice from rank {rank} for {self.param_name!r} has incorrect shape. "
                                 f"Expected {want}, got {got}.")
        shape = tuple(e - s for s, e in self.to_area)
        first = next(iter(from_tensor_map.values()))
        if isinstance(first, torch.Tensor):
            out: Any = torch.zeros(shape, dtype=first.dtype, device=first.device)
        else:
            out = np.zeros(shape, dtype=first.dtype)
        for rank, area in self.global_union_area_map.items():
            rel = tuple((s - t, e - t) for (s, e), (t, _) in zip(area, self.to_area, strict=True))
            out[_sliced(rel)] = from_tensor_map[rank]
        return out
