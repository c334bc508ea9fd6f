"""MindSpore distributed checkpoints: ``rank_<id>/`` directories of sliced files plus the
strategy file, imported as one checkpoint whose chunks keep the layout the strategy gives
them (each distinct slice written once; replicated values checked to agree).

Not here: strategy files (:mod:`.strategy`), single files (:mod:`.checkpoints`).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable
from typing import Any

from ...base.box import Box
from ...base.errors import CheckpointError
from ...engine.streaming_writer import write_streaming
from ...format import metadata as md
from ...planning.planner import EntrySpec, WriteItem
from ...state.flatten import prefixed_path
from .file_model import STR, MindSporeFile
from .reader import open_mindspore_file
from .strategy import MindSporeLayout, read_strategy

log = logging.getLogger(__name__)

_RANK_DIR = re.compile(r"^rank_(\d+)$")


def rank_files(src: str) -> dict[int, str]:
    """``{rank: file}`` of a MindSpore distributed checkpoint directory (``rank_<id>/*.ckpt``)."""
    out: dict[int, str] = {}
    for d in os.listdir(src):
        m = _RANK_DIR.match(d)
        full = os.path.join(src, d)
        if not m or not os.path.isdir(full):
            continue
        names = sorted(os.listdir(full))
        ckpts = [n for n in names if n.endswith(".ckpt")]
        sts = [n for n in names if n.endswith(".safetensors")]
        if ckpts and sts:
            raise CheckpointError(f"{full} holds both .ckpt and .safetensors files; keep one kind")
        chosen = (ckpts or sts)[-1:]  # as MindSpore's tools: the last in name order
        if chosen:
            if len(ckpts or sts) > 1:
                log.warning("%s holds %d checkpoint files; using %s (the last in name order, as MindSpore does)",
                            full, len(ckpts or sts), chosen[0])
            out[int(m.group(1))] = os.path.join(full, chosen[0])
    return dict(sorted(out.items()))


def import_distributed(src: str, ranks: dict[int, str], strategy_file: str, dst_path: str | os.PathLike,
                        prefix: str, verify: bool, overwrite: bool,
                        progress: Callable[[int], None] | None) -> md.Metadata:
    layouts = read_strategy(strategy_file)
    files: dict[int, MindSporeFile] = {}
    try:
        for r, p in ranks.items():
            files[r] = open_mindspore_file(p, verify=verify)
        order: dict[str, None] = {}
        for f in files.values():
            order.update(dict.fromkeys(f.tensors))
        entries: dict[str, EntrySpec] = {}
        by_rank: dict[int, list[WriteItem]] = {}
        source: dict[tuple[str, Box], tuple[int, str]] = {}
        for name in order:
            key = prefix + name
            have = [r for r in files if name in files[r].tensors]
            first = files[have[0]].tensors[name]
            for r in have[1:]:
                other = files[r].tensors[name]
                if other.dtype != first.dtype:
                    raise CheckpointError(f"{name!r} is {first.dtype} in {files[have[0]].path} but {other.dtype} in "
                                          f"{files[r].path}")
            path = prefixed_path(prefix, name)
            if first.dtype == STR:
                entries[key] = EntrySpec("object", path)
                source[(key, Box((), ()))] = (have[0], name)
                continue
            if name in layouts:
                spec, placed = _sliced(name, layouts[name], files, have, strategy_file)
                entries[key] = EntrySpec("tensor", path, first.dtype, spec[0], spec[1])
            else:
                _check_replicated(name, files, have, verify)
                entries[key] = EntrySpec("tensor", path, first.dtype, first.shape)
                placed = [(Box.full(first.shape), have[0])]
            for box, r in placed:
                nbytes = box.numel * md.itemsize(first.dtype)
                if nbytes:
                    by_rank.setdefault(r, []).append(WriteItem(key, box, nbytes))
                    source[(key, box)] = (r, name)
        _check_unsaved(src, layouts, order, files, strategy_file)  # after the saved ones' own errors

        def produce(item: WriteItem) -> Any:
            r, name = source[(item.key, item.box)]
            value = files[r].read(name)
            if progress is not None and item.nbytes:
                progress(item.nbytes)
            return value

        return write_streaming(
            dst_path, entries, [by_rank[r] for r in sorted(by_rank)], produce, overwrite=overwrite,
            user_metadata={"imported_from": {"platform": "mindspore", "format": "distributed",
                                             "ranks": len(files), "strategy": os.path.basename(strategy_file)}})
    finally:
        for f in files.values():
            f.close()


def _check_unsaved(src: str, layouts: dict[str, MindSporeLayout], saved: dict[str, None],
                   files: dict[int, MindSporeFile], strategy_file: str) -> None:
    """Refuse strategy parameters that no rank file holds because their ranks' files are missing.

    A parameter the strategy names may legitimately be in no file: the strategy of a training
    job names every parameter of the compiled graph, optimizer states included, while a
    checkpoint of the network alone does not hold those (MindSpore's ``transform_checkpoints``
    then ignores them). So it is skipped, with a warning, when each of its slices has a rank
    with a file (that rank would hold it had it been saved). When some slice lies only on ranks
    without a file (a whole pipeline stage's ``rank_<id>/`` missing), the parameter is lost with
    them: an error, as MindSpore's ``transform_checkpoints`` refuses missing rank files.
    """
    lost: dict[tuple[int, ...], list[str]] = {}
    unsaved: list[str] = []
    for name, ms_layout in layouts.items():
        if name in saved:
            continue
        missing = tuple(r for ranks in _slice_holders(ms_layout) if not any(r in files for r in ranks)
                        for r in ranks)
        if missing:
            lost.setdefault(missing, []).append(name)
        else:
            unsaved.append(name)
    if lost:
        detail = "; ".join(f"{names} on rank(s) {list(missing)}" for missing, names in lost.items())
        raise CheckpointError(
            f"{src}: {strategy_file} names parameter(s) that no rank file holds, and the ranks it gives them "
            f"have no rank_<id>/ file: {detail}. Rank files found: {sorted(files)}. Is a pipeline stage's "
            "rank_<id>/ directory missing?")
    if unsaved:
        log.warning("%s names %d parameter(s) that no rank file of %s holds although ranks holding their slices "
                    "have files (e.g. optimizer states of a network-only checkpoint); they are not imported: %s",
                    strategy_file, len(unsaved), src, ", ".join(unsaved[:20]))


def _slice_holders(ms_layout: MindSporeLayout) -> list[list[int]]:
    """The global ranks of each distinct slice of a parameter (replicas share one), shape unknown.

    Ranks hold the same slice when their device-matrix coordinates agree on every dim the
    tensor_map splits by (dims counted from the right), which needs no tensor shape.
    """
    dev = ms_layout.dev_matrix
    used = sorted({x for t in ms_layout.tensor_map for x in t if 0 <= x < len(dev)})
    world = math.prod(dev)
    groups: dict[tuple[int, ...], list[int]] = {}
    for pos in range(world):
        coord, rest = [], pos  # coord[i]: the coordinate on dev dim i counted from the right
        for size in reversed(dev):
            coord.append(rest % size)
            rest //= size
        groups.setdefault(tuple(coord[d] for d in used), []).append(ms_layout.stage * world + pos)
    return list(groups.values())


def _local_shape(name: str, ms_layout: MindSporeLayout, files: dict[int, MindSporeFile], have: list[int],
                 strategy_file: str) -> tuple[tuple[int, ...], int]:
    """The slice shape of ``name`` most of its rank files agree on, and a rank holding it.

    MindSpore slices evenly, so every rank's slice has one shape. Taking the shape most files
    hold (rather than the first file's) lets the error name the file that disagrees; when no
    shape has a majority, the error lists every file with its shape.
    """
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for r in have:
        by_shape.setdefault(files[r].tensors[name].shape, []).append(r)
    if len(by_shape) == 1:
        return next(iter(by_shape)), have[0]
    groups = sorted(by_shape.items(), key=lambda kv: -len(kv[1]))
    where = (f"{strategy_file} (dev_matrix {list(ms_layout.dev_matrix)}, tensor_map {ms_layout.resolved_map()}) "
             "slices it evenly, so every rank's slice has one shape")
    if len(groups[0][1]) > len(groups[1][1]):
        shape, ranks = groups[0]
        odd = "; ".join(f"{files[r].path} holds {list(s)}" for s, rs in groups[1:] for r in rs)
        raise CheckpointError(
            f"{name!r}: {odd}, but the other {len(ranks)} rank file(s) (ranks {ranks}) hold {list(shape)} and "
            f"{where}; is it from another checkpoint?")
    listed = "; ".join(f"{list(s)} in {', '.join(files[r].path for r in rs)}" for s, rs in groups)
    raise CheckpointError(f"{name!r}: its rank files hold slices of different shapes and no shape is held by most "
                          f"of them: {listed}. {where}; one of these files is from another checkpoint")


def _sliced(name: str, ms_layout: MindSporeLayout, files: dict[int, MindSporeFile], have: list[int],
            strategy_file: str) -> tuple[tuple[tuple[int, ...], dict[str, Any]], list[tuple[Box, int]]]:
    """Global shape and layout record of a sliced parameter, and which rank's file gives each distinct box."""
    local, holder = _local_shape(name, ms_layout, files, have, strategy_file)
    try:
        tl = ms_layout.tensor_layout(ndim=len(local))
    except ValueError as exc:
        raise CheckpointError(f"{strategy_file}: parameter {name!r} (shape {list(local)} in "
                              f"{files[holder].path}): {exc}") from None
    global_shape = tuple(s * math.prod(tl.layout.mesh_shape[m] for m in tl.splits.get(d, ()))
                         for d, s in enumerate(local))
    placed: list[tuple[Box, int]] = []
    for box, holders in tl.holders(global_shape).items():
        present = [r for r in holders if r in files and name in files[r].tensors]
        if not present:
            raise CheckpointError(
                f"{name!r}: no rank file holds its slice at offsets {list(box.offsets)} (sizes {list(box.sizes)}), "
                f"which the strategy gives to rank(s) {holders}; rank files found: {sorted(files)}. The slice "
                "set does not cover the tensor")
        r = present[0]
        got = files[r].tensors[name].shape
        if got != box.sizes:
            raise CheckpointError(
                f"{files[r].path}: {name!r} has shape {list(got)}, but {strategy_file} (dev_matrix "
                f"{list(ms_layout.dev_matrix)}, tensor_map {ms_layout.resolved_map(len(local))}) gives rank {r} "
                f"a slice of {list(box.sizes)} of the global {list(global_shape)}")
        placed.append((box, r))
    return (global_shape, tl.to_record()), placed


def _check_replicated(name: str, files: dict[int, MindSporeFile], have: list[int], verify: bool) -> None:
    first = files[have[0]]
    for r in have[1:]:
        f = files[r]
        if f.tensors[name].shape != first.tensors[name].shape or (verify and f.digest(name) != first.digest(name)):
            raise CheckpointError(
                f"{name!r} is not in the strategy file, so it should be the same on every rank, but "
                f"{first.path} and {f.path} hold different values (shapes {list(first.tensors[name].shape)} "
                f"and {list(f.tensors[name].shape)}); is it the strategy file of this checkpoint?")
