"""BoxLoadPlanner: what every rank reads, and where each read lands.

Every target box (a DTensor's local shard, or a whole tensor) is intersected with the saved
chunks by arithmetic (:mod:`..format.chunks`); the loader copies each overlap straight into
the target's memory. A target of another dtype is filled through a temporary of the saved
dtype and converted (``convert_dtype=False`` refuses instead). Plain values, bytes and
pickled values (with ``allow_pickle``) go back to the key they were renamed from.

What it is not: the save side (:mod:`.save_planner`), the options and key renaming both
sides share (:mod:`.planner_base`), nor the planner that does both
(:class:`~.standard_planner.StandardPlanner`, what ``load`` uses when given none).
"""

from __future__ import annotations

import pickle
import threading
import warnings
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ..base.box import Box, uncovered
from ..base.dtypes import torch_dtype
from ..base.errors import CorruptCheckpointError, StateDictMismatchError, UnsupportedValueError
from ..format import metadata as md
from ..format.chunk_info import check_chunk_info
from ..format.chunks import overlapping
from ..sharding.ragged import RaggedPiece
from ..sharding.records import dtensor_box, is_ragged_dtensor, ragged_piece
from ..sharding.sharded_tensor import ShardPieces, is_sharded_tensor, local_pieces
from ..state.topology_mapper import MapperLike
from .leaves import (
    check_writable,
    describe,
    fill_plain,
    kind_of,
    number_kind,
    numpy_tensor_view,
    part_name,
    shaped_like,
)
from .planner import LoadPlan, LoadPlanner, ReadItem
from .planner_base import BoxPlannerBase, check_flags

__all__ = ["BoxLoadPlanner"]


class BoxLoadPlanner(BoxPlannerBase, LoadPlanner):
    """Plans a load: which saved chunks fill which target, and the values it gives back.

    :class:`~.standard_planner.StandardPlanner` is this and :class:`~.save_planner.BoxSavePlanner`
    in one; subclass this one for a planner that only loads.

    Hooks for subclasses: :meth:`transform_key` / :meth:`transform_state_dict` (each target
    key to the checkpoint key it is read from, :mod:`.planner_base`) and every method of
    :class:`~.planner.LoadPlanner`. Every value kind (tensors, plain values, bytes, Stateful
    objects) goes back to the target key it was renamed from.

    Args:
        allow_pickle: load values that need pickle.
        convert_dtype: fill a target of another dtype through the saved dtype (False: refuse).
        allow_partial_load: HyperParallel's name for ``load(strict=False)``.
        topology_mapper: renames each target key to the checkpoint key it is read from (see
            :class:`~.standard_planner.StandardPlanner`).
        flatten_state_dict, flatten_sharded_tensors: torch DCP's options, as
            :class:`~.standard_planner.StandardPlanner` takes them.

    Example — load a checkpoint whose keys lack the model's ``"module."`` prefix::

        class Unwrapped(BoxLoadPlanner):
            def transform_key(self, key):
                return key.removeprefix("module.")

        load(wrapped.state_dict(), path, planner=Unwrapped())
    """

    def __init__(self, allow_pickle: bool = False, *, convert_dtype: bool = True, allow_partial_load: bool = False,
                 topology_mapper: MapperLike | None = None, flatten_state_dict: bool = True,
                 flatten_sharded_tensors: bool = True) -> None:
        check_flags(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors)
        self._set_options(allow_pickle, topology_mapper, flatten_state_dict, flatten_sharded_tensors)
        self._set_load_options(convert_dtype, allow_partial_load)

    def _set_load_options(self, convert_dtype: bool, allow_partial_load: bool) -> None:
        """Store the load options."""
        self.convert_dtype = convert_dtype
        self.allow_partial_load = allow_partial_load

    def set_up_load(
        self, state_dict: dict[str, Any] | None, metadata: md.Metadata, is_coordinator: bool, rank: int = 0
    ) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self.rank = rank
        self._paths = dict(getattr(state_dict, "paths", {})) if state_dict is not None else {}
        if state_dict is not None:
            self._check_flat(state_dict, "load")
        self._targets = self._transform(state_dict) if state_dict is not None else None
        self.missing_keys: list[str] = []
        self.unexpected_keys: list[str] = []
        # A destination is a target's tensor, or (shape, dtype) to allocate on first use: the
        # loader checks every file's size before it asks, so a forged shape in .metadata never
        # makes us allocate more than the files can hold.
        self._dest: dict[str, torch.Tensor | tuple[tuple[int, ...], torch.dtype]] = {}
        self._alloc_lock = threading.Lock()
        self._results: dict[str, Any] = {}
        self._convert: dict[str, torch.Tensor] = {}  # key -> target tensor filled from a temporary
        # targets of several boxes (a RaggedShard's run, a ShardedTensor's local shards) read via their bounding box
        self._pieces: dict[str, tuple[RaggedPiece | ShardPieces, Box]] = {}
        self._lossy: list[str] = []  # conversions to a lesser kind of number (complex -> real, float -> int)

    def create_local_load_plan(self) -> LoadPlan:
        entries = self.metadata.entries
        if self._targets is None:
            wanted = {key: None for key in entries}
        else:
            wanted = self._targets
            gathered = self._gather_split_plain(wanted, entries)  # may add sub-keys to missing_keys
            self.missing_keys[:0] = [k for k in wanted if k not in entries and k not in gathered]
            taken = {k for keys in gathered.values() for k in keys}
            self.unexpected_keys = [k for k in entries if k not in wanted and k not in taken]
        items: list[ReadItem] = []
        targets: dict[str, Box] = {}
        for key, target in wanted.items():
            entry = entries.get(key)
            if entry is None:
                continue
            if entry.kind == "object":
                if kind_of(target) in ("tensor", "ndarray", "bytes"):
                    raise self._mismatch(key, entry, target)
                self._results[key] = fill_plain(key, entry.value, target, self.missing_keys)
                continue
            if entry.kind == "pickle" and not self.allow_pickle:
                raise UnsupportedValueError(
                    f"{key!r} holds a pickled Python object; loading it would run code from the "
                    "checkpoint. Pass allow_pickle=True only if you trust where it came from"
                )
            if isinstance(target, torch.Tensor) and not isinstance(target, DTensor):
                check_chunk_info(key, target)
            box, dest = self._destination(key, entry, target)
            if box is None:
                continue
            targets[key] = box
            self._dest[key] = dest
            items.extend(self._reads(key, entry, box))
        if self._lossy:
            warnings.warn(f"load: {len(self._lossy)} target(s) have a lesser kind of dtype than the checkpoint "
                          f"and lose part of each value in the conversion: {', '.join(self._lossy[:8])}"
                          f"{' ...' if len(self._lossy) > 8 else ''}; StandardPlanner(convert_dtype=False) refuses "
                          "instead", stacklevel=4)
        return LoadPlan(items, targets)

    def _gather_split_plain(self, wanted: dict[str, Any], entries: dict[str, md.Entry]) -> dict[str, list[str]]:
        """Plain values the checkpoint holds split into keys of their own (torch DCP, and so
        an imported torch checkpoint, stores ``{"extra": {"step": 1}}`` as ``extra.step`` and
        ``param_groups`` item by item), asked for by a target that holds them whole: each is
        put together from its parts into ``_results``. Returns {target key: the parts used}."""
        asked = [k for k, t in wanted.items() if k not in entries and kind_of(t) == "object"]
        if not asked:
            return {}
        under: dict[tuple[str, ...], list[tuple[str, md.Entry]]] = {}  # path prefix -> entries below it
        for k, e in entries.items():
            names = tuple(part_name(p) for p in e.path)
            for n in range(1, len(names)):
                under.setdefault(names[:n], []).append((k, e))
        out: dict[str, list[str]] = {}
        for key in asked:
            base = tuple(part_name(p) for p in self._paths.get(key, (key,)))
            parts = under.get(base, [])
            # only a value that is plain all through: tensors below it mean the target is not the checkpoint's
            if not parts or any(e.kind != "object" or k in wanted for k, e in parts):
                continue
            tree: dict[str, Any] = {}
            for _, e in parts:
                node = tree
                rest = [part_name(p) for p in e.path[len(base):]]
                for name in rest[:-1]:
                    node = node.setdefault(name, {})
                    if not isinstance(node, dict):
                        break
                else:
                    node[rest[-1]] = e.value
            value = shaped_like(tree, wanted[key])
            self._results[key] = fill_plain(key, value, wanted[key], self.missing_keys)
            out[key] = [k for k, _ in parts]
        return out

    def _destination(self, key: str, entry: md.Entry, target: Any) -> tuple[Box | None, Any]:
        shape, dtype = entry.shape, torch_dtype(entry.dtype)
        if target is None or entry.kind in ("bytes", "pickle"):
            if target is not None and entry.kind != kind_of(target):
                raise self._mismatch(key, entry, target)
            return Box.full(shape), (shape, dtype)
        if entry.kind not in ("tensor", "ndarray") or kind_of(target) not in ("tensor", "ndarray"):
            raise self._mismatch(key, entry, target)
        if is_sharded_tensor(target):
            if tuple(target.size()) != shape or (target.dtype != dtype and not self.convert_dtype):
                raise self._mismatch(key, entry, target)
            return self._shards_destination(key, entry, target, dtype)
        if isinstance(target, np.ndarray):
            if not target.flags.writeable:
                raise StateDictMismatchError(f"{key!r}: target numpy array is read-only")
            target = numpy_tensor_view(target, key)
        if tuple(target.shape) != shape or (target.dtype != dtype and not self.convert_dtype):
            raise self._mismatch(key, entry, target)
        local = target._local_tensor if isinstance(target, DTensor) else target
        check_writable(key, local)
        if is_ragged_dtensor(target):
            return self._ragged_destination(key, target, dtype)
        box = dtensor_box(target, key) if isinstance(target, DTensor) else Box.full(shape)
        if target.dtype != dtype and number_kind(target.dtype) < number_kind(dtype):
            self._lossy.append(f"{key!r} ({entry.dtype} -> {str(target.dtype).removeprefix('torch.')})")
        if target.dtype != dtype and box is not None:
            # read into a temporary of the saved dtype; finish_load converts into the target
            self._convert[key] = local
            return box, (box.sizes, dtype)
        return box, local

    def _ragged_destination(self, key: str, target: DTensor, dtype: torch.dtype) -> tuple[Box | None, Any]:
        """A RaggedShard target: its run is one box (filled in place) or several, read into
        a temporary of their bounding box (only the runs' regions are read, see
        :meth:`_reads`) and copied into the flat local tensor by :meth:`finish_load`."""
        piece = ragged_piece(target, key)
        if piece is None:
            return None, None
        local = piece.flat
        if not local.is_contiguous():
            raise StateDictMismatchError(f"{key!r}: the RaggedShard target's local tensor is not contiguous and cannot "
                                         "be filled in place; load into a contiguous local tensor")
        return self._pieces_destination(key, piece, target.dtype, dtype)

    def _shards_destination(self, key: str, entry: md.Entry, target: Any,
                            dtype: torch.dtype) -> tuple[Box | None, Any]:
        """A ShardedTensor target: each local shard's tensor is filled in place, from
        whatever boxes the checkpoint holds (one shard: read straight into it)."""
        try:
            pieces = local_pieces(target, key)
        except UnsupportedValueError as exc:
            raise StateDictMismatchError(str(exc)) from None
        if pieces is None:
            return None, None
        for tensor in pieces.tensors:
            check_writable(key, tensor)
        if target.dtype != dtype and number_kind(target.dtype) < number_kind(dtype):
            self._lossy.append(f"{key!r} ({entry.dtype} -> {str(target.dtype).removeprefix('torch.')})")
        return self._pieces_destination(key, pieces, target.dtype, dtype)

    def _pieces_destination(self, key: str, piece: RaggedPiece | ShardPieces, target_dtype: torch.dtype,
                            dtype: torch.dtype) -> tuple[Box, Any]:
        """A target of several boxes: one box of the saved dtype is filled in place; several
        (or another dtype) are read into a temporary of their bounding box (only the boxes'
        regions are read, see :meth:`_reads`) and copied into place by :meth:`finish_load`."""
        if len(piece.boxes) == 1 and target_dtype == dtype:
            return piece.boxes[0], piece.view(piece.boxes[0])
        ndim = len(piece.boxes[0].sizes)
        lo = tuple(min(b.offsets[d] for b in piece.boxes) for d in range(ndim))
        hi = tuple(max(b.offsets[d] + b.sizes[d] for b in piece.boxes) for d in range(ndim))
        bbox = Box(lo, tuple(h - o for o, h in zip(lo, hi, strict=True)))
        self._pieces[key] = (piece, bbox)
        return bbox, (bbox.sizes, dtype)

    def _mismatch(self, key: str, entry: md.Entry, target: Any) -> StateDictMismatchError:
        found = describe(target)
        saved = (f"a plain {type(entry.value).__name__}" if entry.kind == "object"
                 else f"{entry.kind} {entry.dtype} shape {list(entry.shape or ())}")
        return StateDictMismatchError(
            f"{key!r}: the checkpoint holds {saved}, but the target is {found} (Size mismatch, in torch DCP's "
            "words); make the target match (or convert after loading into a matching tensor)"
        )

    def _reads(self, key: str, entry: md.Entry, box: Box) -> list[ReadItem]:
        pieces = self._pieces.get(key)
        if pieces is not None:  # only the target's boxes inside the bounding box
            return [r for b in pieces[0].boxes for r in self._box_reads(key, entry, b)]
        return self._box_reads(key, entry, box)

    def _box_reads(self, key: str, entry: md.Entry, box: Box) -> list[ReadItem]:
        reads = []
        covered = 0
        for ref in overlapping(self.metadata, entry, box, self.rank):
            region = ref.box.intersect(box)
            if region is None:  # a column band of an overlapping box that misses the target
                continue
            reads.append(ReadItem(key, ref, region))
            covered += region.numel
        if covered != box.numel:  # saved chunks are disjoint (metadata validation checks it)
            missing = uncovered(box, [r.region for r in reads])
            shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            if self.metadata.fragment is not None:  # a rank-local load reads its own fragment alone
                raise StateDictMismatchError(
                    f"{key!r}: this rank's fragment of the rank-local checkpoint holds no data for region(s) "
                    f"{shown} of the target region {box}: load(..., use_collectives=False) reads only the "
                    "rank's own shards (the layout it saved). Load with use_collectives=True to read every "
                    "rank's fragment under another layout")
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
            if key in self._pieces:  # each box of the bounding box into the target's own memory
                piece, bbox = self._pieces[key]
                with torch.no_grad():
                    for b in piece.boxes:
                        piece.view(b).copy_(tensor[b.relative_to(bbox)])
            elif key in self._convert:
                with torch.no_grad():
                    self._convert[key].copy_(tensor)  # the saved dtype into the target's
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

