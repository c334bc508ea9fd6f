"""The global save plan: who writes each saved box, computed from every rank's structure.

From every rank's entries (keys, kinds, dtypes, shapes, layout records) every rank computes
the same plan, in O(tensors): a DTensor is stored as the grid of its layout
(:mod:`..sharding.grid`) and each box is written by one of its holders, the replicas taking
turns by box id; copies of a tensor on disjoint sub-meshes of one shape (TP+DP) are stacked
into one storage layout with a leading replica dim; a tensor held whole by several ranks
(plain tensors, numpy arrays, bytes, a replicated single box) goes to the least-loaded
holder, largest first. A RaggedShard tensor (:mod:`..sharding.ragged`) is stored as a table of
the boxes of every rank's flat run (its entry keeps no layout: the format has no name for the
placement), each run written by one of its replicas, taking turns by run. A ShardedTensor
(:mod:`..sharding.sharded_tensor`) is stored alike, as a table of its shards, each written by
the rank that holds it. A rank's own writes are worked out only when asked for.

What it is not: the planner protocol (:mod:`.planner`) nor a rank's local plan
(:mod:`.standard_planner`); the column bands per box are the planner's ``tiles``.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from ..base.errors import StateDictMismatchError, UnsupportedValueError
from ..format import metadata as md
from ..sharding.grid import Grid
from ..sharding.ragged import flat_range_boxes, ragged_from_name, ragged_mesh_dim, rank_flat_range
from ..sharding.records import record_position, record_ranks, storable_layout
from ..sharding.sharded_tensor import is_shard_table, table_shards
from .planner import EntrySpec, SavePlan, WriteItem

__all__ = ["GlobalPlan"]


class GlobalPlan(Sequence):
    """The global save plan: entries with their stores for everyone, writes per rank on demand."""

    def __init__(self, tiles_of: Callable[[str, EntrySpec], int], plans: list[SavePlan], lowest_rank: bool = False):
        """``tiles_of(key, spec)``: the column bands per saved box (the planner's ``tiles``);
        ``lowest_rank``: a tensor held whole by several ranks goes to the lowest of them (torch
        DCP's ``dedup_save_to_lowest_rank``) instead of the least-loaded."""
        self.size = len(plans)
        groups: dict[int, tuple[SavePlan, list[int]]] = {}
        for r, plan in enumerate(plans):
            groups.setdefault(id(plan), (plan, []))[1].append(r)
        merged: dict[str, EntrySpec] = {}
        first: dict[str, int] = {}
        holders: dict[str, list[int]] = {}  # for keys held whole: the group ids holding them
        submeshes: dict[str, dict[tuple[int, ...], None]] = {}  # keys on different sub-meshes of one shape
        group_members = [members for _, members in groups.values()]
        for g, (plan, members) in enumerate(groups.values()):
            for key, spec in plan.entries.items():
                seen = merged.get(key)
                if seen is None:
                    merged[key], first[key] = spec, members[0]
                    holders[key] = [g]
                    continue
                if _same_but_ranks(seen, spec):  # e.g. TP+DP: each DP replica has its own TP sub-mesh
                    found = submeshes.setdefault(key, {record_ranks(seen.layout): None})
                    found[record_ranks(spec.layout)] = None
                elif (seen.kind, seen.dtype, seen.shape, seen.layout) != (spec.kind, spec.dtype, spec.shape,
                                                                          spec.layout):
                    what = "layout" if seen.layout != spec.layout else "kind, dtype or shape"
                    raise StateDictMismatchError(
                        f"{key!r} differs between ranks ({what}): rank {first[key]} has {_spec_text(seen)}, rank "
                        f"{members[0]} has {_spec_text(spec)}")
                first[key] = min(first[key], members[0])
                holders[key].append(g)
        self.entries: dict[str, EntrySpec] = {}
        self.grids: dict[str, Grid] = {}
        self.owner: dict[str, int] = {}
        self.ragged: dict[str, _RaggedRuns] = {}
        self.shard_tables: dict[str, list[tuple[int, Any]]] = {}  # ShardedTensor: (writer, box) per row
        single: list[tuple[int, str, tuple]] = []  # (bytes, key, holder set): one box, many holders
        for key, spec in merged.items():
            if spec.kind == "object":
                self.owner[key] = first[key]
                self.entries[key] = spec
                continue
            tiles = tiles_of(key, spec)
            nbytes = math.prod(spec.shape or ()) * md.itemsize(spec.dtype)
            if is_shard_table(spec.layout):  # a ShardedTensor: a table of its shards, each by its holder
                self.shard_tables[key] = table_shards(spec.layout)
                self.entries[key] = EntrySpec(spec.kind, spec.path, spec.dtype, spec.shape, None, None)
                continue
            if spec.layout is None or self.size == 1:  # held whole (a process alone holds everything)
                if spec.layout is not None and storable_layout(spec.layout) is None:  # a RaggedShard's record
                    spec = EntrySpec(spec.kind, spec.path, spec.dtype, spec.shape, None)
                self.entries[key] = _with_store(spec, None)
                self.grids[key] = Grid(spec.shape or (), (1,), ["R"], None, tiles)
                hs = tuple(sorted(holders[key]))
                single.append((nbytes, key, ("groups", hs)))
                continue
            lay = spec.layout if key not in submeshes else _stacked(key, spec.layout, list(submeshes[key]))
            if storable_layout(lay) is None:  # RaggedShard: a table of its runs' boxes
                self.ragged[key] = _RaggedRuns(key, tuple(spec.shape or ()), lay)
                self.entries[key] = EntrySpec(spec.kind, spec.path, spec.dtype, spec.shape, None, None)
                continue
            try:
                grid = Grid(spec.shape or (), lay["mesh_shape"], lay["placements"], lay.get("rank_list"), tiles)
            except ValueError as exc:
                raise UnsupportedValueError(f"{key!r}: {exc}") from None
            self.grids[key] = grid
            own = None if lay is spec.layout else lay  # a storage layout of its own (stacked sub-meshes)
            if own is not None:  # the entry keeps the DTensor's layout, without one sub-mesh's ranks
                spec = EntrySpec(spec.kind, spec.path, spec.dtype, spec.shape,
                                 {k: v for k, v in spec.layout.items() if k != "rank_list"})
            if grid.num_boxes == 1 and grid.replicas > 1:
                single.append((nbytes, key, ("mesh", tuple(lay["rank_list"]) if "rank_list" in lay
                                             else grid.replicas)))
                self.entries[key] = _with_store(spec, md.GridStore(tiles=tiles, layout=own))
            else:
                offset = zlib.crc32(key.encode()) % grid.replicas
                self.entries[key] = _with_store(spec, md.GridStore(tiles=tiles, offset=offset, layout=own))
        # One-box tensors with several holders: largest first, to the least-loaded holder (or the lowest).
        load = [0] * self.size
        heaps: dict[tuple, list[tuple[int, int]]] = {}
        for nbytes, key, hs in sorted(single, key=lambda t: (-t[0], t[1])):
            heap = heaps.get(hs)
            if heap is None:
                ranks = (sorted(r for g in hs[1] for r in group_members[g]) if hs[0] == "groups"
                         else list(hs[1]) if isinstance(hs[1], tuple) else list(range(hs[1])))
                heap = heaps[hs] = [(load[r], r) for r in ranks]
                heapq.heapify(heap)
            if lowest_rank:
                rank = min(r for _, r in heap)
            else:
                while True:  # entries go stale when a rank of several holder sets gained load elsewhere
                    got, rank = heapq.heappop(heap)
                    if got == load[rank]:
                        break
                    heapq.heappush(heap, (load[rank], rank))
                heapq.heappush(heap, (load[rank] + nbytes, rank))
            load[rank] += nbytes
            spec, grid = self.entries[key], self.grids[key]
            if spec.layout is None or self.size == 1:
                self.entries[key] = _with_store(spec, md.GridStore(tiles=grid.tiles, writer=rank))
            else:  # a replicated DTensor: the holder with replica index q writes it
                own = spec.store.layout
                q = grid.locate(record_position(own or spec.layout, rank))[1]
                self.entries[key] = _with_store(spec, md.GridStore(tiles=grid.tiles, offset=q, layout=own))
        self._plans: dict[int, SavePlan] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, rank: int) -> SavePlan:  # type: ignore[override]
        if not 0 <= rank < self.size:  # also ends iteration (``for plan in global_plan``)
            raise IndexError(f"rank {rank} is outside the save's {self.size} ranks")
        plan = self._plans.get(rank)
        if plan is None:
            plan = self._plans[rank] = self._plan_of(rank)
        return plan

    def _plan_of(self, rank: int) -> SavePlan:
        items: list[WriteItem] = []
        objects: list[str] = []
        for key, spec in self.entries.items():
            if spec.kind == "object":
                if self.owner[key] == rank:
                    objects.append(key)
                continue
            runs = self.ragged.get(key)
            if runs is not None:
                items.extend(runs.writes(rank, md.itemsize(spec.dtype)))
                continue
            shards = self.shard_tables.get(key)
            if shards is not None:
                size = md.itemsize(spec.dtype)
                items.extend(WriteItem(key, box, box.numel * size, row)
                             for row, (writer, box) in enumerate(shards) if writer == rank)
                continue
            store, grid = spec.store, self.grids[key]
            if store.writer is not None:
                box = 0 if store.writer == rank else None
            else:
                pos = record_position(store.layout or spec.layout, rank)
                box = None
                if pos is not None:
                    b, q = grid.locate(pos)
                    box = b if q == (store.offset + b) % grid.replicas else None
            if box is None:
                continue
            size = md.itemsize(spec.dtype)
            items.extend(WriteItem(key, sub_box, sub_box.numel * size, sub) for sub, sub_box in grid.band_subs(box))
        return SavePlan(self.entries, items, objects)


class _RaggedRuns:
    """The boxes of every rank's run of a RaggedShard tensor, numbered 0..n-1 in run order
    (the table's rows), and which replica writes each run."""

    def __init__(self, key: str, shape: tuple[int, ...], layout: dict[str, Any]):
        names = layout["placements"]
        self.key = key
        self.mesh_dim = m = ragged_mesh_dim(names, key)
        placement = ragged_from_name(names[m])
        self.mesh_shape = tuple(layout["mesh_shape"])
        self.layout = layout
        if len(placement.local_units) != self.mesh_shape[m]:
            raise UnsupportedValueError(f"{key!r}: RaggedShard local_units {placement.local_units} needs one entry "
                                        f"per rank of mesh dim {m} ({self.mesh_shape[m]} ranks)")
        self.runs: list[tuple[int, list]] = []  # per index on the mesh dim: (first sub id, boxes)
        sub = 0
        for j in range(self.mesh_shape[m]):
            try:
                boxes = flat_range_boxes(shape, *rank_flat_range(shape, placement, j, key))
            except ValueError as exc:
                raise UnsupportedValueError(str(exc)) from None
            self.runs.append((sub, boxes))
            sub += len(boxes)
        self.replicas = math.prod(self.mesh_shape) // self.mesh_shape[m]
        self.offset = zlib.crc32(key.encode()) % self.replicas

    def writes(self, rank: int, itemsize: int) -> list[WriteItem]:
        """The write items of ``rank``: the boxes of its run if it is that run's writer."""
        pos = record_position(self.layout, rank)
        if pos is None:
            return []
        coord = []
        for n in reversed(self.mesh_shape):
            pos, c = divmod(pos, n)
            coord.append(c)
        coord.reverse()
        j = coord[self.mesh_dim]
        q = 0  # the replica index: the coordinates of the other mesh dims, row-major
        for d, (c, n) in enumerate(zip(coord, self.mesh_shape, strict=True)):
            if d != self.mesh_dim:
                q = q * n + c
        if q != (self.offset + j) % self.replicas:
            return []
        first, boxes = self.runs[j]
        return [WriteItem(self.key, b, b.numel * itemsize, first + i) for i, b in enumerate(boxes)]


def _same_but_ranks(a: EntrySpec, b: EntrySpec) -> bool:
    """Same tensor and layout pattern on two different sub-meshes (mesh shapes equal)."""
    if a.layout is None or b.layout is None or (a.kind, a.dtype, a.shape) != (b.kind, b.dtype, b.shape):
        return False
    if is_shard_table(a.layout) or is_shard_table(b.layout):  # one record for every rank: no sub-meshes
        return False
    strip = lambda lay: {k: v for k, v in lay.items() if k != "rank_list"}  # noqa: E731
    return strip(a.layout) == strip(b.layout) and record_ranks(a.layout) != record_ranks(b.layout)


def _stacked(key: str, layout: dict[str, Any], rank_lists: list[tuple[int, ...]]) -> dict[str, Any]:
    """One storage layout for copies of a tensor on disjoint sub-meshes: a leading replica dim."""
    rank_lists = sorted(rank_lists)
    flat = [r for ranks in rank_lists for r in ranks]
    if len(set(flat)) != len(flat):
        raise StateDictMismatchError(
            f"{key!r} is held on overlapping sub-meshes {[list(r) for r in rank_lists][:4]} with the same "
            "placements; a rank holds it once")
    names = layout.get("mesh_dim_names")
    extra = "replica"
    while names and extra in names:
        extra += "_"
    return {"mesh_shape": [len(rank_lists), *layout["mesh_shape"]],
            "mesh_dim_names": [extra, *names] if names else None,
            "placements": ["R", *layout["placements"]], "rank_list": flat}


def _with_store(spec: EntrySpec, store: md.GridStore | None) -> EntrySpec:
    return EntrySpec(spec.kind, spec.path, spec.dtype, spec.shape, spec.layout, store)


def _spec_text(spec: EntrySpec) -> str:
    text = f"{spec.kind} {spec.dtype} {list(spec.shape) if spec.shape is not None else ''}"
    if is_shard_table(spec.layout):
        text += f" as a ShardedTensor of shards {spec.layout['shards']}"
    elif spec.layout is not None:
        text += f" on mesh {spec.layout['mesh_shape']} {spec.layout['placements']}"
    return text
