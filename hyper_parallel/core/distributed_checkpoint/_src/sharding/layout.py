"""Layouts: how a tensor is split over a device mesh, in HyperParallel's and torch's words.

A :class:`Layout` is a device mesh without devices: its shape, a name (alias) per mesh dim
and the global rank at each mesh position (``rank_list``). Calling it with one entry per
tensor dim gives a :class:`TensorLayout`::

    mesh = Layout((2, 4), ("dp", "tp"))
    mesh("tp", "None")            # dim 0 split 4 ways over "tp", dim 1 whole
    mesh(("dp", "tp"), "None")    # dim 0 split over dp, then each piece over tp (8 pieces)
    mesh([Replicate(), Shard(0)]) # the same as mesh("tp", "None"), in torch placements

HyperParallel's ``tensor_map`` has one entry per tensor dim: ``-1`` when the dim is not
split, else the mesh dim that splits it counted from the LAST mesh dim (on ``("dp", "tp")``,
``"tp"`` is 0 and ``"dp"`` is 1), or a tuple of those when several mesh dims split it, the
outermost split first. Torch writes the same thing as one placement per mesh dim;
:attr:`TensorLayout.placements` and :meth:`TensorLayout.from_placements` convert. A tuple in
mesh order (``("dp", "tp")``) is ``[Shard(0), Shard(0)]``; the reverse order
(``("tp", "dp")``, what FSDP applied on top of TP produces) is
``[_StridedShard(0, split_factor=4), Shard(0)]``.

:meth:`TensorLayout.chunk_box` gives the box (global offsets and sizes) a rank holds: the
same box torch's DTensor gives its local shard — uneven sizes split like ``torch.chunk``,
an empty shard has size 0 and offset equal to the dim's size.

The two types live together: a mesh called with entries makes a tensor layout, and a tensor
layout is a mesh plus splits. Not here: strategies (``strategy.py``), layout files
(``layout_files.py``), placement names (``placements.py``).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..base.box import Box
from ..base.limits import MAX_WORLD
from .grid import chunk_piece
from .placements import StridedShard as _StridedShard
from .placements import is_placement, is_strided, placement_from_name, placement_to_name

__all__ = ["Layout", "TensorLayout"]

NONE = "None"

Entry = str | tuple[str, ...]

# ---------------------------------------------------------------------------- device layout


class Layout:
    """A device mesh by shape and dim names, with the global rank at each mesh position.

    Args:
        mesh_shape: ranks per mesh dim, e.g. ``(2, 4)``.
        alias_name: a unique name per mesh dim, e.g. ``("dp", "tp")`` (``"None"`` is reserved).
        rank_list: the global rank at each mesh position, row-major; default
            ``range(prod(mesh_shape))``.

    Raises:
        ValueError: shapes and names disagree in length, a name repeats or is empty, a size
            is not a positive int, the mesh has more than ``MAX_WORLD`` (2**20) positions, or
            ``rank_list`` is not ``prod(mesh_shape)`` distinct ranks.

    Example::

        mesh = Layout((2, 4), ("dp", "tp"))
        w = mesh("tp", "None")          # column-parallel weight
        w.tensor_map                    # (0, -1)
        w.chunk_box(5, (10, 3))         # Box(offsets=(3, 0), sizes=(3, 3))
    """

    def __init__(self, mesh_shape: Sequence[int], alias_name: Sequence[str] | str,
                 rank_list: Sequence[int] | None = None):
        if isinstance(alias_name, str):
            alias_name = (alias_name,)
        if isinstance(mesh_shape, int):
            mesh_shape = (mesh_shape,)
        shape = tuple(mesh_shape)
        names = tuple(alias_name)
        if not shape or any(type(s) is not int or s < 1 for s in shape):
            raise ValueError(f"mesh_shape must be a non-empty tuple of positive ints, found {mesh_shape!r}")
        if len(names) != len(shape):
            raise ValueError(f"alias_name {names!r} needs one name per mesh dim of {shape}")
        for n in names:
            if not isinstance(n, str) or not n or n == NONE:
                raise ValueError(f"alias_name {names!r}: each name must be a non-empty str other than 'None'")
        if len(set(names)) != len(names):
            raise ValueError(f"alias_name {names!r} repeats a name")
        world = math.prod(shape)
        if world > MAX_WORLD:  # what .metadata accepts: a mesh that can be walked, ranks that can be listed
            raise ValueError(f"mesh_shape {shape} has {world} positions, more than any job ({MAX_WORLD})")
        # The default ranks stay a range: a layout read from metadata costs O(mesh dims),
        # not O(mesh positions), until someone walks it.
        ranks: Sequence[int] = range(world) if rank_list is None else tuple(rank_list)
        if rank_list is not None and (len(ranks) != world or len(set(ranks)) != world
                                      or any(type(r) is not int or r < 0 for r in ranks)):
            raise ValueError(f"rank_list must hold {world} distinct non-negative ints (one per mesh "
                             f"position of {shape}), found {list(rank_list or [])!r:.200}")
        if rank_list is not None and ranks == tuple(range(world)):
            ranks = range(world)
        self.mesh_shape = shape
        self.alias_name = names
        self.rank_list = ranks
        self._pos: dict[int, int] | None = None

    # ---------------------------------------------------------------- basics

    @property
    def ndim(self) -> int:
        """Number of mesh dims."""
        return len(self.mesh_shape)

    @property
    def world_size(self) -> int:
        return len(self.rank_list)

    def size(self, name: str) -> int:
        """Ranks along the mesh dim called ``name``."""
        return self.mesh_shape[self.dim(name)]

    def dim(self, name: str) -> int:
        """Index (from the first mesh dim) of the mesh dim called ``name``."""
        try:
            return self.alias_name.index(name)
        except ValueError:
            raise ValueError(f"mesh dim {name!r} is not one of {self.alias_name}") from None

    def position(self, rank: int) -> int | None:
        """The row-major mesh position of global ``rank``, or None if it is not in the mesh."""
        if isinstance(self.rank_list, range):
            return rank if type(rank) is int and 0 <= rank < len(self.rank_list) else None
        if self._pos is None:
            self._pos = {r: i for i, r in enumerate(self.rank_list)}
        return self._pos.get(rank)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of global ``rank``; raises ValueError if it is not in the mesh."""
        pos = self.position(rank)
        if pos is None:
            raise ValueError(f"rank {rank} is not in this mesh (rank_list {list(self.rank_list)!r:.120})")
        coord = []
        for s in reversed(self.mesh_shape):
            coord.append(pos % s)
            pos //= s
        return tuple(reversed(coord))

    def __call__(self, *entries: Any, ndim: int | None = None) -> TensorLayout:
        """A tensor layout on this mesh.

        Args:
            entries: one per tensor dim — a mesh dim name, ``"None"`` (not split), or a tuple
                of names (split over several mesh dims, outermost first); or, instead, torch
                placements, one per mesh dim, as a list or as separate arguments.
            ndim: tensor dims, when giving placements (they do not say it); needed for
                :attr:`TensorLayout.tensor_map` and negative ``Shard`` dims.

        Raises:
            ValueError: an unknown name, a mesh dim used twice, or placements of the wrong count.
        """
        if len(entries) == 1 and isinstance(entries[0], list) and entries[0] and all(
                is_placement(p) for p in entries[0]):
            return TensorLayout.from_placements(self, entries[0], ndim=ndim)
        if entries and all(is_placement(p) for p in entries):
            return TensorLayout.from_placements(self, list(entries), ndim=ndim)
        if ndim is not None and ndim != len(entries):
            raise ValueError(f"{len(entries)} alias entries given for ndim={ndim}")
        dims: dict[int, tuple[int, ...]] = {}
        for d, e in enumerate(entries):
            names = (e,) if isinstance(e, str) else tuple(e) if isinstance(e, (tuple, list)) else None
            if names is None or not all(isinstance(n, str) for n in names):
                raise ValueError(f"tensor dim {d}: expected a mesh dim name, 'None' or a tuple of names, "
                                 f"found {e!r}")
            if names == (NONE,) or not names:
                continue
            dims[d] = tuple(self.dim(n) for n in names)
        return TensorLayout(self, dims, len(entries))

    # ---------------------------------------------------------------- conversions

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> Layout:
        """The layout of a torch ``DeviceMesh`` (unnamed dims are called ``dim0``, ``dim1``, ...)."""
        shape = tuple(int(s) for s in mesh.shape)
        names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else tuple(f"dim{i}" for i in range(len(shape)))
        return cls(shape, names, [int(r) for r in mesh.mesh.flatten().tolist()])

    @classmethod
    def from_mapping(cls, sizes: Mapping[str, int]) -> Layout:
        """``{"dp": 2, "tp": 4}`` -> ``Layout((2, 4), ("dp", "tp"))`` (dict order is mesh order)."""
        return cls(tuple(sizes.values()), tuple(sizes.keys()))

    @classmethod
    def of(cls, mesh: Any) -> Layout:
        """Accept a :class:`Layout`, a torch ``DeviceMesh`` or a ``{name: size}`` mapping."""
        if isinstance(mesh, Layout):
            return mesh
        if isinstance(mesh, TensorLayout):
            return mesh.layout
        if isinstance(mesh, Mapping):
            return cls.from_mapping(mesh)
        if hasattr(mesh, "mesh") and hasattr(mesh, "shape"):
            return cls.from_device_mesh(mesh)
        raise TypeError(f"expected a Layout, a DeviceMesh or a {{dim name: size}} mapping, found "
                        f"{type(mesh).__name__}")

    def to_device_mesh(self, device_type: str = "cpu") -> Any:
        """A torch ``DeviceMesh`` with this shape, names and ranks.

        Every rank of the default process group must call it (torch creates sub-groups).

        Raises:
            RuntimeError: no process group is initialised.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Layout.to_device_mesh() needs an initialised process group; "
                               "use the layout's placements/boxes directly without one")
        if self.rank_list == range(dist.get_world_size()):
            return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.alias_name)
        ranks = torch.tensor(self.rank_list, dtype=torch.int64).reshape(self.mesh_shape)
        return DeviceMesh(device_type, ranks, mesh_dim_names=self.alias_name)

    def to_dict(self) -> dict[str, Any]:
        return {"mesh_shape": list(self.mesh_shape), "alias_name": list(self.alias_name),
                "rank_list": list(self.rank_list)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Layout:
        """Inverse of :meth:`to_dict`; raises ValueError on a malformed dict."""
        if not isinstance(d, Mapping) or "mesh_shape" not in d or "alias_name" not in d:
            raise ValueError(f"a layout dict needs 'mesh_shape' and 'alias_name', found {d!r:.200}")
        return cls(tuple(d["mesh_shape"]), tuple(d["alias_name"]), d.get("rank_list"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        return cls.from_dict(json.loads(text))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and (self.mesh_shape, self.alias_name, self.rank_list) == (
            other.mesh_shape, other.alias_name, other.rank_list)

    def __hash__(self) -> int:
        return hash((self.mesh_shape, self.alias_name, self.rank_list))

    def __repr__(self) -> str:
        ranks = "" if isinstance(self.rank_list, range) else f", rank_list={list(self.rank_list)}"
        return f"Layout({self.mesh_shape}, {self.alias_name}{ranks})"



# ---------------------------------------------------------------------------- tensor layout


class TensorLayout:
    """How one tensor is split over a :class:`Layout`: per tensor dim, the mesh dims that split it.

    Build one by calling a :class:`Layout`, or with :meth:`from_placements`,
    :meth:`from_dtensor`, :meth:`from_tensor_map`, :meth:`from_record`, :meth:`from_dict`.

    ``splits`` maps a tensor dim to the mesh dims (indices from the first) that split it,
    outermost first; dims not in it are whole. ``ndim`` is None when built from placements
    without it; then :attr:`tensor_map` is unavailable until :meth:`with_ndim`.
    """

    def __init__(self, layout: Layout, splits: Mapping[int, Sequence[int]], ndim: int | None = None):
        used: list[int] = []
        clean: dict[int, tuple[int, ...]] = {}
        for d, ms in splits.items():
            ms = tuple(ms)
            if not ms:
                continue
            if ndim is not None and not -ndim <= d < ndim:
                raise ValueError(f"tensor dim {d} is out of range for a {ndim}-d tensor")
            if ndim is not None and d < 0:
                d += ndim
            for m in ms:
                if type(m) is not int or not 0 <= m < layout.ndim:
                    raise ValueError(f"mesh dim {m!r} is out of range for {layout}")
            used.extend(ms)
            if d in clean:
                raise ValueError(f"tensor dim {d} is given twice")
            clean[d] = ms
        if len(set(used)) != len(used):
            dup = sorted({layout.alias_name[m] for m in used if used.count(m) > 1})
            raise ValueError(f"mesh dim(s) {dup} split more than one tensor dim (or one twice); "
                             "each mesh dim may split at most one tensor dim")
        self.layout = layout
        self.ndim = ndim
        self.splits: dict[int, tuple[int, ...]] = dict(sorted(clean.items()))
        self._tiled: set[tuple[int, ...]] = set()  # shapes whose strided shards are boxes

    # ---------------------------------------------------------------- HyperParallel view

    def _need_ndim(self, what: str) -> int:
        if self.ndim is None:
            raise ValueError(f"{what} needs the tensor's ndim; this layout was built from placements "
                             "without it: use layout(placements, ndim=N) or .with_ndim(N)")
        return self.ndim

    def with_ndim(self, ndim: int) -> TensorLayout:
        """The same layout for a tensor of ``ndim`` dims (negative shard dims resolved)."""
        if self.ndim is not None and self.ndim != ndim:
            raise ValueError(f"layout is for a {self.ndim}-d tensor, not {ndim}-d")
        return TensorLayout(self.layout, self.splits, ndim)

    @property
    def tensor_map(self) -> tuple[int | tuple[int, ...], ...]:
        """Per tensor dim: -1 (whole), the splitting mesh dim counted from the last, or a tuple."""
        n = self._need_ndim("tensor_map")
        last = self.layout.ndim - 1
        out: list[int | tuple[int, ...]] = []
        for d in range(n):
            ms = self.splits.get(d, ())
            out.append(-1 if not ms else last - ms[0] if len(ms) == 1 else tuple(last - m for m in ms))
        return tuple(out)

    @property
    def alias_map(self) -> tuple[Entry, ...]:
        """Per tensor dim: ``"None"``, a mesh dim name, or a tuple of names (outermost first)."""
        n = self._need_ndim("alias_map")
        names = self.layout.alias_name
        out: list[Entry] = []
        for d in range(n):
            ms = self.splits.get(d, ())
            out.append(NONE if not ms else names[ms[0]] if len(ms) == 1 else tuple(names[m] for m in ms))
        return tuple(out)

    @classmethod
    def from_tensor_map(cls, layout: Layout, tensor_map: Sequence[int | Sequence[int]]) -> TensorLayout:
        """Inverse of :attr:`tensor_map`; raises ValueError for entries outside the mesh."""
        last = layout.ndim - 1
        splits: dict[int, tuple[int, ...]] = {}
        for d, v in enumerate(tensor_map):
            vals = (v,) if isinstance(v, int) else tuple(v)
            if any(type(x) is not int or x < -1 or x > last for x in vals) or (-1 in vals and len(vals) > 1):
                raise ValueError(f"tensor_map entry {v!r} (dim {d}) must be -1 or in [0, {last}] "
                                 f"(mesh dims counted from the last), or a tuple of those")
            if vals != (-1,):
                splits[d] = tuple(last - x for x in vals)
        return cls(layout, splits, len(tensor_map))

    # ---------------------------------------------------------------- torch view

    @property
    def placements(self) -> tuple[Any, ...]:
        """One torch placement per mesh dim (``Shard``, ``Replicate`` or ``_StridedShard``)."""
        out: list[Any] = [Replicate()] * self.layout.ndim
        for d, ms in self.splits.items():
            for i, m in enumerate(ms):
                sf = math.prod(self.layout.mesh_shape[x] for x in ms[:i] if x > m)
                if sf == 1:
                    out[m] = Shard(d)
                elif _StridedShard is None:  # pragma: no cover
                    raise ValueError("this layout needs torch's _StridedShard")
                else:
                    out[m] = _StridedShard(d, split_factor=sf)
        return tuple(out)

    def to_placements(self) -> list[Any]:
        """:attr:`placements` as a list (what DTensor APIs take)."""
        return list(self.placements)

    @classmethod
    def from_placements(cls, layout: Layout, placements: Sequence[Any], ndim: int | None = None) -> TensorLayout:
        """The layout torch describes as ``placements`` (one per mesh dim) on ``layout``.

        Raises:
            ValueError: wrong number of placements, a Partial, or strided shards that no
                order of mesh dims explains.
        """
        placements = list(placements)
        if len(placements) != layout.ndim:
            raise ValueError(f"{len(placements)} placements given for a {layout.ndim}-d mesh {layout}")
        per_dim: dict[int, list[tuple[int, int]]] = {}
        for m, p in enumerate(placements):
            if isinstance(p, str):
                p = placement_from_name(p)
            if isinstance(p, Partial):
                raise ValueError(f"placement {p} on mesh dim {m} is Partial; a layout holds tensor values, "
                                 "reduce it to Replicate first")
            if isinstance(p, Replicate):
                continue
            strided = is_strided(p)
            if not (strided or isinstance(p, Shard)):
                raise ValueError(f"unknown placement {p!r} on mesh dim {m}")
            d = p.dim
            if d < 0:
                if ndim is None:
                    raise ValueError(f"placement {p} has a negative dim: pass ndim= to resolve it")
                d += ndim
            per_dim.setdefault(d, []).append((m, p.split_factor if strided else 1))
        splits: dict[int, tuple[int, ...]] = {}
        for d, ms in per_dim.items():
            splits[d] = _order_from_split_factors(layout, d, ms)
        return cls(layout, splits, ndim)

    @classmethod
    def from_dtensor(cls, t: DTensor) -> TensorLayout:
        """The layout of a DTensor (its mesh and placements)."""
        return cls.from_placements(Layout.from_device_mesh(t.device_mesh), t.placements, ndim=t.ndim)

    def to_device_mesh(self, device_type: str = "cpu") -> Any:
        """``self.layout.to_device_mesh()``; needs a process group (see :meth:`Layout.to_device_mesh`)."""
        return self.layout.to_device_mesh(device_type)

    @property
    def strided(self) -> bool:
        """True when torch needs ``_StridedShard`` for this layout (a split out of mesh order)."""
        return any(not isinstance(p, (Shard, Replicate)) for p in self.placements)

    # ---------------------------------------------------------------- boxes

    def chunk_box(self, rank: int, global_shape: Sequence[int]) -> Box:
        """The box of the global tensor that global ``rank`` holds — the same as DTensor's.

        An empty shard has size 0 and offset equal to the dim size (as torch reports it).

        Raises:
            ValueError: ``rank`` is not in the mesh, or the shape has too few dims.
        """
        return self._box(self.layout.coordinate(rank), tuple(global_shape))

    def boxes(self, global_shape: Sequence[int]) -> list[Box]:
        """Every mesh position's box, in ``rank_list`` order."""
        shape = tuple(global_shape)
        return [self._box(self.layout.coordinate(r), shape) for r in self.layout.rank_list]

    def holders(self, global_shape: Sequence[int]) -> dict[Box, list[int]]:
        """Each distinct non-empty box and the global ranks that hold it (replicas share one)."""
        out: dict[Box, list[int]] = {}
        shape = tuple(global_shape)
        for r in self.layout.rank_list:
            box = self._box(self.layout.coordinate(r), shape)
            if box.numel:
                out.setdefault(box, []).append(r)
        return out

    def _box(self, coord: tuple[int, ...], shape: tuple[int, ...]) -> Box:
        n = len(shape)
        if self.ndim is not None and self.ndim != n:
            raise ValueError(f"layout is for a {self.ndim}-d tensor, the shape {list(shape)} has {n} dims")
        if any(d >= n or d < -n for d in self.splits):
            raise ValueError(f"layout splits dim(s) {sorted(self.splits)}, shape {list(shape)} has {n} dims")
        if self.strided:
            self._check_strided_tiles(shape)
            return _torch_box(shape, self.layout.mesh_shape, coord, self.with_ndim(n).placements)
        offsets, sizes = [0] * n, list(shape)
        for d, ms in self.splits.items():
            d %= n
            start, size = 0, shape[d]
            for m in ms:  # torch.chunk, applied outermost first (mesh order for Shard)
                lo, size = chunk_piece(size, self.layout.mesh_shape[m], coord[m])
                start += lo
            offsets[d], sizes[d] = (start, size) if size else (shape[d], 0)
        return Box(tuple(offsets), tuple(sizes))

    def _check_strided_tiles(self, shape: tuple[int, ...]) -> None:
        # torch's _StridedShard splits uneven sizes so that a rank's rows need not be
        # contiguous; then (first offset, size) is no box. Shards are boxes exactly when
        # those pseudo-boxes tile the tensor, which is checked once per shape.
        if shape in self._tiled:
            return
        placements = self.with_ndim(len(shape)).placements
        mesh_shape = self.layout.mesh_shape
        boxes = {_torch_box(shape, mesh_shape, c, placements) for c in itertools.product(*map(range, mesh_shape))}
        boxes = [b for b in boxes if b.numel]
        full = Box.full(shape)
        if sum(b.numel for b in boxes) != full.numel or any(
                a.intersect(b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1:]):
            raise ValueError(
                f"layout {self!r} on shape {list(shape)}: torch's strided shards {list(placements)} split "
                "these uneven sizes so that a rank's part is not contiguous, so no box describes it. "
                "Use sizes the mesh divides evenly, or split the dim in mesh order")
        self._tiled.add(shape)

    # ---------------------------------------------------------------- on another mesh

    def on_mesh(self, layout: Layout) -> tuple[TensorLayout, list[str]]:
        """The same pattern (split dims per mesh dim NAME) on another mesh.

        Mesh dims the new mesh lacks are dropped (the tensor is less split there); mesh dims
        only the new mesh has replicate. Returns the new layout and the dropped names.
        """
        names = self.layout.alias_name
        dropped: list[str] = []
        splits: dict[int, tuple[int, ...]] = {}
        for d, ms in self.splits.items():
            kept = []
            for m in ms:
                if names[m] in layout.alias_name:
                    kept.append(layout.alias_name.index(names[m]))
                else:
                    dropped.append(names[m])
            if kept:
                splits[d] = tuple(kept)
        return TensorLayout(layout, splits, self.ndim), dropped

    # ---------------------------------------------------------------- dict / JSON / record

    def to_dict(self) -> dict[str, Any]:
        """``{"mesh_shape", "alias_name", "rank_list", "tensor_map"}`` (``"placements"`` when ndim is unknown)."""
        d = self.layout.to_dict()
        if self.ndim is None:
            d["placements"] = [placement_to_name(p) for p in self.placements]
        else:
            d["tensor_map"] = [list(v) if isinstance(v, tuple) else v for v in self.tensor_map]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorLayout:
        """Inverse of :meth:`to_dict`; raises ValueError on a malformed dict."""
        layout = Layout.from_dict(d)
        if "tensor_map" in d:
            return cls.from_tensor_map(layout, d["tensor_map"])
        if "placements" in d:
            return cls.from_placements(layout, d["placements"], ndim=d.get("ndim"))
        raise ValueError(f"a tensor layout dict needs 'tensor_map' or 'placements', found keys {sorted(d)}")

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> TensorLayout:
        return cls.from_dict(json.loads(text))

    def to_record(self) -> dict[str, Any]:
        """The layout as checkpoint metadata records it: mesh shape, dim names, placement names."""
        return {"mesh_shape": list(self.layout.mesh_shape), "mesh_dim_names": list(self.layout.alias_name),
                "placements": [placement_to_name(p) for p in self.placements]}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], ndim: int | None = None,
                    names: Sequence[str] | None = None) -> TensorLayout:
        """A layout from a checkpoint metadata record (``Entry.layout``).

        Args:
            record: ``{"mesh_shape": [...], "mesh_dim_names": [...] | None, "placements": [...]}``.
            ndim: the tensor's ndim (the entry's shape length).
            names: mesh dim names to use when the record has none (default ``dim0``, ``dim1``...).

        Raises:
            ValueError: the record is malformed.
        """
        if not isinstance(record, Mapping) or "mesh_shape" not in record or "placements" not in record:
            raise ValueError(f"a layout record needs 'mesh_shape' and 'placements', found {record!r:.200}")
        shape = tuple(record["mesh_shape"])
        rec_names = record.get("mesh_dim_names")
        if rec_names is None:
            rec_names = tuple(names) if names is not None else tuple(f"dim{i}" for i in range(len(shape)))
        return cls.from_placements(Layout(shape, tuple(rec_names)), list(record["placements"]), ndim=ndim)

    # ---------------------------------------------------------------- misc

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TensorLayout) and self.layout == other.layout
                and self.splits == other.splits and self.ndim == other.ndim)

    def __hash__(self) -> int:
        return hash((self.layout, tuple(self.splits.items()), self.ndim))

    def __repr__(self) -> str:
        if self.ndim is None:
            return f"{self.layout!r}({[placement_to_name(p) for p in self.placements]})"
        return f"{self.layout!r}{self.alias_map!r}"


def _order_from_split_factors(layout: Layout, d: int, ms: list[tuple[int, int]]) -> tuple[int, ...]:
    """The outermost-first order of mesh dims splitting dim ``d`` that torch's split factors imply."""
    want = dict(ms)
    if all(sf == 1 for sf in want.values()):
        return tuple(sorted(want))
    for order in itertools.permutations(sorted(want)):
        if all(math.prod(layout.mesh_shape[x] for x in order[:i] if x > m) == want[m]
               for i, m in enumerate(order)):
            return order
    raise ValueError(f"strided shards of tensor dim {d} with split factors "
                     f"{ {layout.alias_name[m]: sf for m, sf in ms} } match no order of mesh dims {layout}")


def _torch_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
               placements: Sequence[Any]) -> Box:
    # Strided shards: torch's own arithmetic (its uneven-split rules are not nested chunks).
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
    return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))
