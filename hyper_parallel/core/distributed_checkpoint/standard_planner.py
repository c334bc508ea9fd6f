"""StandardPlanner: flatten values into chunk boxes, dedup replicas, intersect on load.

Save: every DTensor contributes the box its rank holds (torch's own chunk computation, so
uneven splits and FSDP+TP's ``_StridedShard`` are right); plain tensors, numpy arrays and
bytes are assumed equal on every rank that has them. The global plan writes each distinct
box once: boxes held by one rank go to it; replicated boxes go, largest first, to the
holder with the fewest bytes so far, so every rank's share differs from the even share by
at most the largest single box.

Load: every target box (a DTensor's local shard, or a whole tensor) is intersected with the
saved chunks; the loader copies each overlap straight into the target's memory.
"""

from __future__ import annotations

import hashlib
import pickle
import re
import threading
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from . import metadata as md
from .box import Box, uncovered
from .errors import CorruptCheckpointError, StateDictMismatchError, UnsupportedValueError
from .layout import TensorLayout, placement_to_name
from .planner import (
    EntrySpec,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)

__all__ = ["StandardPlanner", "StandardSavePlanner", "StandardLoadPlanner", "dtensor_box", "layout_record"]


def layout_record(t: DTensor) -> dict[str, Any]:
    mesh = t.device_mesh
    return {
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "placements": [placement_to_name(p) for p in t.placements],
    }


def dtensor_box(t: DTensor, key: str) -> Box | None:
    """The global box of this rank's local shard, or None if the rank holds nothing."""
    if any(p.is_partial() for p in t.placements):
        raise UnsupportedValueError(
            f"{key!r}: DTensor has Partial placement {list(t.placements)}; its local values are "
            "not the tensor's values. Reduce it first, e.g. "
            "t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])"
        )
    if t.device_mesh.get_coordinate() is None:
        return None
    if any(type(p).__name__ == "_StridedShard" for p in t.placements):
        try:  # uneven strided shards are not contiguous boxes: refuse rather than save wrong data
            TensorLayout.from_dtensor(t)._check_strided_tiles(tuple(t.shape))
        except ValueError as exc:
            raise UnsupportedValueError(f"{key!r}: {exc}") from None
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1:
        raise UnsupportedValueError(f"{key!r}: expected one local chunk per rank, found {len(chunks)}")
    box = Box(tuple(chunks[0].offsets), tuple(chunks[0].sizes))
    local = t._local_tensor
    if tuple(local.shape) != box.sizes:
        raise UnsupportedValueError(
            f"{key!r}: local tensor shape {tuple(local.shape)} differs from its chunk {box}"
        )
    return box if box.numel else None


def _bytes_tensor(value: bytes | bytearray) -> torch.Tensor:
    buf = bytearray(value)
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


def _numpy_tensor(arr: np.ndarray, key: str) -> torch.Tensor:
    try:
        return torch.from_numpy(np.ascontiguousarray(arr))
    except TypeError:
        raise UnsupportedValueError(
            f"{key!r}: numpy dtype {arr.dtype} cannot be stored as a tensor"
        ) from None


class StandardPlanner(SavePlanner, LoadPlanner):
    """The default planner for save and load.

    Hooks for subclasses: :meth:`transform_key` (rename or drop one key) or, for changes
    that need the whole map, :meth:`transform_state_dict` (called on save and on load with
    the flattened ``{key: value}`` map); and every protocol method of
    :class:`~.planner.SavePlanner` / :class:`~.planner.LoadPlanner`. On load, every value
    kind (tensors, plain values, bytes, Stateful objects) goes back to the target key it
    was renamed from.

    Example — save and load every key under a new prefix::

        class Prefixed(StandardPlanner):
            def transform_key(self, key):
                return "v2." + key
    """

    def __init__(self, allow_pickle: bool = False):
        self.allow_pickle = allow_pickle
        self._values: dict[str, Any] = {}
        self._paths: dict[str, tuple] = {}
        self._data: dict[tuple[str, Box], Any] = {}
        self._origin: dict[str, str] = {}
        self._origin_identity = True

    # ------------------------------------------------------------------ hooks

    def transform_key(self, key: str) -> str | None:
        """The checkpoint key of one flattened key, or None to leave it out; the identity."""
        return key

    def transform_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Rename or filter flattened keys (default: :meth:`transform_key` on each key).

        Overriding this instead of :meth:`transform_key` works too; on load, renamed keys
        are traced back to the target's keys by value identity, or by calling this on the
        one key alone.
        """
        if type(self).transform_key is StandardPlanner.transform_key:
            return state_dict
        out = {}
        for key, value in state_dict.items():
            new = self.transform_key(key)
            if new is not None:
                out[new] = value
        return out

    def original_key(self, key: str) -> str | None:
        """On load: the target's key that checkpoint key ``key`` was renamed from (None if unknown)."""
        return self._origin.get(key, key if self._origin_identity else None)

    def _transform(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """:meth:`transform_state_dict`, remembering where each new key came from."""
        out = self.transform_state_dict(state_dict)
        self._origin_identity = out is state_dict
        self._origin = {} if out is state_dict else _trace_origins(self, state_dict, out)
        return out

    def cache_key(self) -> Any:
        """Global save plans are reused while this and every rank's local plan are unchanged."""
        return (type(self).__qualname__, self.allow_pickle)

    def _path(self, key: str) -> tuple:
        return self._paths.get(key) or tuple(key.split("."))

    # ------------------------------------------------------------------ save

    def set_up_save(self, state_dict: dict[str, Any], is_coordinator: bool) -> None:
        self._paths = dict(getattr(state_dict, "paths", {}))
        self._values = self._transform(state_dict)
        self.is_coordinator = is_coordinator

    def create_local_save_plan(self) -> SavePlan:
        entries: dict[str, EntrySpec] = {}
        items: list[WriteItem] = []
        objects: list[str] = []
        self._data = {}
        for key, value in self._values.items():
            path = self._path(key)
            if isinstance(value, DTensor):
                box = dtensor_box(value, key)
                dtype = md.dtype_name(value.dtype)
                entries[key] = EntrySpec("tensor", path, dtype, tuple(value.shape), layout_record(value))
                if box is not None:
                    self._add(items, key, box, value._local_tensor)
                continue
            if isinstance(value, torch.Tensor):
                kind, tensor = "tensor", value
            elif isinstance(value, np.ndarray):
                kind, tensor = "ndarray", _numpy_tensor(value, key)
            elif isinstance(value, (bytes, bytearray)):
                kind, tensor = "bytes", _bytes_tensor(value)
            elif md.is_json_value(value):
                entries[key] = EntrySpec("object", path)
                objects.append(key)
                self._data[(key, Box((), ()))] = value
                continue
            elif self.allow_pickle:
                kind, tensor = "pickle", _bytes_tensor(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
            else:
                raise UnsupportedValueError(
                    f"{key!r}: a {type(value).__module__}.{type(value).__qualname__} can only be "
                    "saved with pickle; convert it to tensors/plain values, or pass "
                    "allow_pickle=True to save (and again to load) if you trust the checkpoint"
                )
            shape = tuple(tensor.shape)
            entries[key] = EntrySpec(kind, path, md.dtype_name(tensor.dtype), shape)
            if tensor.numel():
                self._add(items, key, Box.full(shape), tensor)
        return SavePlan(entries, items, objects)

    def _add(self, items: list[WriteItem], key: str, box: Box, tensor: torch.Tensor) -> None:
        items.append(WriteItem(key, box, box.numel * tensor.element_size()))
        self._data[(key, box)] = tensor

    def create_global_save_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        with md.paused_gc():
            return self._global_save_plan(plans)

    def _global_save_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        merged: dict[str, EntrySpec] = {}
        first_rank: dict[str, int] = {}
        for rank, plan in enumerate(plans):
            for key, spec in plan.entries.items():
                seen = merged.get(key)
                if seen is None:
                    merged[key], first_rank[key] = spec, rank
                elif (seen.kind, seen.dtype, seen.shape) != (spec.kind, spec.dtype, spec.shape):
                    raise StateDictMismatchError(
                        f"{key!r} differs between ranks: rank {first_rank[key]} has "
                        f"{seen.kind} {seen.dtype} {seen.shape}, rank {rank} has "
                        f"{spec.kind} {spec.dtype} {spec.shape}"
                    )
        # (key, offsets, sizes) -> [first item, holder ranks...]; plain tuples hash in C.
        holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[Any]] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                k = (item.key, item.box.offsets, item.box.sizes)
                h = holders.get(k)
                if h is None:
                    holders[k] = [item, rank]
                else:
                    h.append(rank)
        load = [0] * len(plans)
        assigned: list[list[WriteItem]] = [[] for _ in plans]
        replicated = []
        # Boxes only one rank holds are forced; replicas then fill up the lightest holders,
        # largest first (ties by key and offsets, so every rank decides the same).
        for h in holders.values():
            if len(h) == 2:
                item, rank = h
                load[rank] += item.nbytes
                assigned[rank].append(item)
            else:
                replicated.append(h)
        replicated.sort(key=lambda h: (-h[0].nbytes, h[0].key, h[0].box.offsets))
        for item, *ranks in replicated:
            rank = min(ranks, key=lambda r: (load[r], r))
            load[rank] += item.nbytes
            assigned[rank].append(item)
        objects: list[list[str]] = [[] for _ in plans]
        for key, spec in merged.items():
            if spec.kind == "object":
                objects[first_rank[key]].append(key)
        return [SavePlan(merged, assigned[r], objects[r]) for r in range(len(plans))]

    def resolve_data(self, item: WriteItem) -> torch.Tensor | Any:
        return self._data[(item.key, item.box)]

    # ------------------------------------------------------------------ load

    def set_up_load(
        self, state_dict: dict[str, Any] | None, metadata: md.Metadata, is_coordinator: bool, rank: int = 0
    ) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self.rank = rank
        self._paths = dict(getattr(state_dict, "paths", {})) if state_dict is not None else {}
        self._targets = self._transform(state_dict) if state_dict is not None else None
        self.missing_keys: list[str] = []
        self.unexpected_keys: list[str] = []
        # A destination is a target's tensor, or (shape, dtype) to allocate on first use: the
        # loader checks every file's size before it asks, so a forged shape in .metadata never
        # makes us allocate more than the files can hold.
        self._dest: dict[str, torch.Tensor | tuple[tuple[int, ...], torch.dtype]] = {}
        self._alloc_lock = threading.Lock()
        self._results: dict[str, Any] = {}

    def create_local_load_plan(self) -> LoadPlan:
        entries = self.metadata.entries
        if self._targets is None:
            wanted = {key: None for key in entries}
        else:
            wanted = self._targets
            self.missing_keys = [k for k in wanted if k not in entries]
            self.unexpected_keys = [k for k in entries if k not in wanted]
        items: list[ReadItem] = []
        targets: dict[str, Box] = {}
        for key, target in wanted.items():
            entry = entries.get(key)
            if entry is None:
                continue
            if entry.kind == "object":
                if _kind_of(target) in ("tensor", "ndarray", "bytes"):
                    raise self._mismatch(key, entry, target)
                self._results[key] = entry.value
                continue
            if entry.kind == "pickle" and not self.allow_pickle:
                raise UnsupportedValueError(
                    f"{key!r} holds a pickled Python object; loading it would run code from the "
                    "checkpoint. Pass allow_pickle=True only if you trust where it came from"
                )
            box, dest = self._destination(key, entry, target)
            if box is None:
                continue
            targets[key] = box
            self._dest[key] = dest
            items.extend(self._reads(key, entry, box))
        return LoadPlan(items, targets)

    def _destination(self, key: str, entry: md.Entry, target: Any) -> tuple[Box | None, Any]:
        shape, dtype = entry.shape, md.torch_dtype(entry.dtype)
        if target is None or entry.kind in ("bytes", "pickle"):
            if target is not None and entry.kind != _kind_of(target):
                raise self._mismatch(key, entry, target)
            return Box.full(shape), (shape, dtype)
        if entry.kind not in ("tensor", "ndarray") or _kind_of(target) not in ("tensor", "ndarray"):
            raise self._mismatch(key, entry, target)
        if isinstance(target, np.ndarray):
            if not target.flags.writeable:
                raise StateDictMismatchError(f"{key!r}: target numpy array is read-only")
            target = _numpy_tensor_view(target, key)
        if tuple(target.shape) != shape or target.dtype != dtype:
            raise self._mismatch(key, entry, target)
        if isinstance(target, DTensor):
            return dtensor_box(target, key), target._local_tensor
        return Box.full(shape), target

    def _mismatch(self, key: str, entry: md.Entry, target: Any) -> StateDictMismatchError:
        found = _describe(target)
        saved = (f"a plain {type(entry.value).__name__}" if entry.kind == "object"
                 else f"{entry.kind} {entry.dtype} shape {list(entry.shape or ())}")
        return StateDictMismatchError(
            f"{key!r}: the checkpoint holds {saved}, but the target is {found}; "
            "make the target match (or convert after loading into a matching tensor)"
        )

    def _reads(self, key: str, entry: md.Entry, box: Box) -> list[ReadItem]:
        reads = []
        covered = 0
        for group in md.replicas(entry.chunks):
            region = Box(group[0].offsets, group[0].sizes).intersect(box)
            if region is not None:
                reads.append(ReadItem(key, pick_replica(group, self.rank), region))
                covered += region.numel
        if covered != box.numel:  # saved chunks are disjoint (metadata validation checks it)
            missing = uncovered(box, [r.region for r in reads])
            shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise CorruptCheckpointError(
                f"{key!r}: the checkpoint holds no data for region(s) {shown} of the target region {box} "
                f"({box.numel - covered} of {box.numel} elements missing); a rank's chunk is missing from "
                "the checkpoint"
            )
        return reads

    def resolve_target(self, key: str) -> torch.Tensor:
        dest = self._dest[key]
        if isinstance(dest, tuple):
            with self._alloc_lock:
                dest = self._dest[key]
                if isinstance(dest, tuple):
                    dest = self._dest[key] = torch.empty(dest[0], dtype=dest[1])
        return dest

    def finish_load(self) -> dict[str, Any]:
        out = dict(self._results)
        for key in list(self._dest):
            tensor = self.resolve_target(key)
            kind = self.metadata.entries[key].kind
            target = None if self._targets is None else self._targets.get(key)
            if kind == "ndarray":
                # filled in place: a numpy or torch target stays what it is
                out[key] = target if target is not None else tensor.numpy()
            elif kind == "bytes":
                out[key] = bytes(tensor.numpy().tobytes())
            elif kind == "pickle":
                out[key] = pickle.loads(tensor.numpy().tobytes())  # allow_pickle checked in plan
            else:
                out[key] = target if target is not None else tensor
        return out


def _trace_origins(planner: StandardPlanner, before: dict[str, Any], after: dict[str, Any]) -> dict[str, str]:
    """For a custom ``transform_state_dict``: new key -> original key, where it can be told.

    A value object found under exactly one original key names it; otherwise (equal small
    ints, None...) each candidate is transformed alone and the one that yields the new key
    wins. Keys that stay ambiguous are left out (loading a new value into them then raises).
    """
    by_id: dict[int, list[str]] = {}
    for key, value in before.items():
        by_id.setdefault(id(value), []).append(key)
    origin: dict[str, str] = {}
    for new, value in after.items():
        if new in before and before[new] is value:
            origin[new] = new
            continue
        candidates = by_id.get(id(value), [])
        if len(candidates) > 1:
            candidates = [k for k in candidates if new in planner.transform_state_dict({k: before[k]})]
        if len(candidates) == 1:
            origin[new] = candidates[0]
    return origin


def _numpy_tensor_view(arr: np.ndarray, key: str) -> torch.Tensor:
    try:
        return torch.from_numpy(arr)
    except TypeError:
        raise UnsupportedValueError(f"{key!r}: numpy dtype {arr.dtype} is not supported") from None


def _kind_of(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return "tensor"
    if isinstance(v, np.ndarray):
        return "ndarray"
    if isinstance(v, (bytes, bytearray)):
        return "bytes"
    return "object" if md.is_json_value(v) else "pickle"


def _describe(v: Any) -> str:
    if isinstance(v, (torch.Tensor, np.ndarray)):
        kind = "DTensor" if isinstance(v, DTensor) else type(v).__name__
        return f"{kind} {str(v.dtype).replace('torch.', '')} shape {list(v.shape)}"
    return type(v).__name__


_FILE_RANK = re.compile(r"^data-r(\d+)-")


def pick_replica(group: list[md.ChunkRecord], rank: int) -> md.ChunkRecord:
    """The replica in ``rank``'s own data file if there is one, else one spread by rank."""
    if len(group) == 1:
        return group[0]
    for c in group:
        m = _FILE_RANK.match(c.file)
        if m and int(m.group(1)) == rank:
            return c
    return group[rank % len(group)]


def plan_digest(plan: SavePlan) -> str:
    """A fingerprint of a local plan's structure (keys, kinds, dtypes, shapes, boxes)."""
    h = hashlib.sha256()
    h.update(repr(sorted(plan.entries.items())).encode())
    h.update(repr([(i.key, i.box) for i in plan.items]).encode())
    h.update(repr(plan.objects).encode())
    return h.hexdigest()


StandardSavePlanner = StandardPlanner
StandardLoadPlanner = StandardPlanner
