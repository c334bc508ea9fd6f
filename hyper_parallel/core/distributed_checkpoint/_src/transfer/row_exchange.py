"""Whole rows from boxes spread over ranks: a collective regrouping before a row-major write.

A format that stores each tensor whole and row-major (a consolidated Hugging Face checkpoint)
is written fastest in long contiguous runs. A box that splits a trailing dim (a ``Shard(1)``
box) has one run per row, and the ranks' runs share disk blocks, so they can only go through
the page cache: a 2-rank ``Shard(1)`` consolidated save of 1 GiB took 2.1x our own save.
Regrouped, rank ``q`` owns rows ``[q*R/W, (q+1)*R/W)`` of every such tensor (``R`` rows, ``W``
ranks); every rank sends each owner the part of its boxes in the owner's rows, and each
owner assembles its rows in aligned memory and writes them as one run.

Like :mod:`.shared_reads`, in three steps over the coordinator's group:

1. an exchange of every rank's boxes (any failure so far fails every rank here);
2. rounds of at most ``batch_bytes`` of owned rows per rank: post the receives, send the
   parts, wait, assemble, write. A rank that cannot produce a part sends zeros in its place,
   and one whose write fails stops writing, so no receiver waits;
3. an exchange that fails every rank if any rank failed in step 2.

A key is regrouped only when its boxes over all ranks tile the tensor exactly (each element
held once) and some box splits a trailing dim; the caller writes the others itself, and all
of them on more than :data:`MAX_WORLD` ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..backends import direct_io
from ..base.alignment import DIRECT_IO_ALIGN
from ..base.box import Box
from ..coordination.coordinator import Coordinator
from .host_mailboxes import HostMailboxes

DEFAULT_BATCH_BYTES = 64 << 20  # rows per rank per round (3 such buffers: receiving, assembling, writing)
MAX_WORLD = 64  # beyond, the W^2 messages per tensor cost more than they save: no regrouping

Value = Callable[[str, Box], torch.Tensor]  # (key, held box) -> its data (a tensor of box.sizes)
Write = Callable[[str, int, memoryview], None]  # (key, first row, row-major bytes of the rows)
Offset = Callable[[str, int], int]  # (key, row) -> the row's byte offset in the file (for alignment)


def owned_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` rank ``rank`` writes of a tensor of ``rows`` rows."""
    return rows * rank // world, rows * (rank + 1) // world


def _splits_rows(shape: tuple[int, ...], box: Box) -> bool:
    return any(box.sizes[d] != shape[d] for d in range(1, len(shape)))


def regroupable(shapes: dict[str, tuple[int, ...]], everyone: list[dict[str, list[Box]]]) -> list[str]:
    """The keys to regroup (sorted): 2-D or more, some box splitting a trailing dim, and the
    boxes of all ranks together tiling the tensor (each element held once)."""
    out = []
    for key in sorted(shapes):
        shape = shapes[key]
        boxes = [b for held in everyone for b in held.get(key, ())]
        if len(shape) < 2 or not boxes or not any(_splits_rows(shape, b) for b in boxes):
            continue
        if sum(b.numel for b in boxes) == math.prod(shape) and _tiles(shape, boxes):
            out.append(key)
    return out


MAX_CELLS = 1 << 22  # beyond this the tiling check is not made, and the key is not regrouped


def _tiles(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """Whether ``boxes`` cover ``shape`` exactly once: counted on the grid of their edges."""
    edges = [sorted({0, n, *(b.offsets[d] for b in boxes), *(b.offsets[d] + b.sizes[d] for b in boxes)})
             for d, n in enumerate(shape)]
    if math.prod(len(e) - 1 for e in edges) > MAX_CELLS:
        return False
    count = np.zeros([len(e) - 1 for e in edges], dtype=np.int32)
    for b in boxes:
        at = tuple(slice(e.index(o), e.index(o + n)) for e, o, n in zip(edges, b.offsets, b.sizes, strict=True))
        count[at] += 1
    return bool((count == 1).all())


@dataclass
class _Part:
    key: str
    src: int
    dst: int
    box: Box  # global coordinates
    tag: int
    message: torch.Tensor | None = None


def regroup_rows(coord: Coordinator, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype],
                 held: dict[str, list[Box]], value: Value, write: Write, offset: Offset,
                 batch_bytes: int = DEFAULT_BATCH_BYTES, phase: str = "save") -> list[str]:
    """Write the rows this rank owns of every regroupable key (see the module docstring);
    return those keys (the same on every rank). Every rank of ``coord``'s group calls it with
    the same ``shapes``/``dtypes`` (the keys it may regroup) and its own ``held`` boxes.
    ``write`` gets rows in aligned memory whose address matches ``offset``'s modulo 4 KiB, so
    an O_DIRECT writer takes their whole blocks as they are."""
    world = coord.world_size
    if world > MAX_WORLD:
        return []
    everyone = coord.exchange(f"{phase} (regrouping rows: boxes)",
                              lambda: {k: list(v) for k, v in held.items() if k in shapes})
    keys = regroupable(shapes, everyone)
    rounds: list[list[str]] = [[]]
    size = 0
    for key in keys:  # rounds of about batch_bytes of rows per rank (the same cut on every rank)
        nbytes = math.prod(shapes[key]) * dtypes[key].itemsize // world
        if rounds[-1] and size + nbytes > batch_bytes:
            rounds.append([])
            size = 0
        rounds[-1].append(key)
        size += nbytes
    failure: list[BaseException] = []

    def transfer() -> None:
        me = coord.rank
        tags: dict[tuple[int, int], int] = {}  # per (src, dst): the same count on both ends

        def part(key: str, src: int, dst: int, cut: Box | None) -> None:
            if cut is not None and cut.numel:
                tags[(src, dst)] = tags.get((src, dst), 0) + 1
                parts.append(_Part(key, src, dst, cut, tags[(src, dst)]))

        schedule = []
        for round_keys in rounds:  # only the parts this rank sends or receives, key by key, box by box
            parts: list[_Part] = []
            for key in round_keys:
                shape = shapes[key]
                mine = _rows_box(shape, *owned_rows(shape[0], world, me))
                for src, held_by in enumerate(everyone):
                    for box in held_by.get(key, ()):
                        part(key, src, me, box.intersect(mine))
                for _, dst, cut, _, _ in _outgoing(me, [key], shapes, dtypes, everyone, world):
                    part(key, me, dst, cut)
            schedule.append((round_keys, parts))
        # Ranks of one host hand their parts over in shared memory (one copy in, one out),
        # others over gloo into one receive arena; two row arenas (a round assembles into one
        # while the other is written by a thread), each as large as the largest round needs
        need_out = max((_bytes_out(parts, dtypes, coord.rank) for _, parts in schedule), default=0)
        mail = HostMailboxes.open(coord, need_out, f"{phase} (regrouping rows)") if world > 1 else None
        need_in = 0 if mail is not None else max((_bytes_in(parts, dtypes, coord.rank) for _, parts in schedule),
                                                 default=0)
        need_rows = max((_bytes_owned(keys_, shapes, dtypes, world, coord.rank, offset)
                         for keys_, _ in schedule), default=0)
        inbox = torch.empty(need_in, dtype=torch.uint8)
        arenas = [direct_io.aligned_array(need_rows) for _ in range(min(2, len(schedule)))]
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="dcp-row-write") as writer:
                pending = None
                for n, (round_keys, parts) in enumerate(schedule):
                    arena = arenas[n % len(arenas)]
                    if pending is not None and len(arenas) == 1:
                        _settle(pending, failure)
                        pending = None
                    if mail is not None:
                        _hand_over(coord, mail, n, parts, round_keys, shapes, dtypes, everyone, held, value,
                                   failure)
                    writes = _round(coord, parts, round_keys, shapes, dtypes, held, value, offset, failure, inbox,
                                    arena, mail is not None)
                    if pending is not None:
                        _settle(pending, failure)  # the arena of the round before is free again
                    pending = writer.submit(_write_all, writes, write, failure)
                if pending is not None:
                    _settle(pending, failure)
        finally:
            if mail is not None:
                mail.close()

    coord._collective(f"{phase} (regrouping rows: sending and writing)", transfer)

    def finish() -> None:
        if failure:
            raise failure[0]

    coord.exchange(f"{phase} (regrouping rows)", finish)
    return keys


def _rows_box(shape: tuple[int, ...], lo: int, hi: int) -> Box:
    return Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:]))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _bytes_in(parts: list[_Part], dtypes: dict[str, torch.dtype], me: int) -> int:
    return sum(p.box.numel * dtypes[p.key].itemsize for p in parts if p.dst == me and p.src != me)


def _bytes_out(parts: list[_Part], dtypes: dict[str, torch.dtype], me: int) -> int:
    return sum(p.box.numel * dtypes[p.key].itemsize for p in parts if p.src == me and p.dst != me)


def _outgoing(src: int, keys: list[str], shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype],
              everyone: list[dict[str, list[Box]]], world: int) -> list[tuple[str, int, Box, int, int]]:
    """The parts rank ``src`` sends in a round, in the order it lays them out in its slot:
    ``(key, dst, box, offset, bytes)``. Every rank computes the same list from the boxes all
    ranks exchanged, so a receiver finds its parts without being told where they are."""
    out = []
    at = 0
    for key in keys:
        shape = shapes[key]
        for box in everyone[src].get(key, ()):
            for dst in range(world):
                if dst == src:
                    continue
                cut = box.intersect(_rows_box(shape, *owned_rows(shape[0], world, dst)))
                if cut is not None and cut.numel:
                    n = cut.numel * dtypes[key].itemsize
                    out.append((key, dst, cut, at, n))
                    at += n
    return out


def _held_part(key: str, cut: Box, held: dict[str, list[Box]], value: Value,
               sources: dict[tuple[str, Box], torch.Tensor]) -> torch.Tensor:
    """Region ``cut`` of the box this rank holds of ``key`` that contains it (each box's data
    asked of ``value`` once, kept in ``sources``)."""
    for box in held[key]:
        if box.intersect(cut) == cut:
            if (key, box) not in sources:
                sources[(key, box)] = value(key, box)
            return sources[(key, box)][cut.relative_to(box)]
    raise RuntimeError(f"{key!r}: no box of this rank holds {cut}")


def _hand_over(coord: Coordinator, mail: HostMailboxes, round_no: int, parts: list[_Part], keys: list[str],
               shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype],
               everyone: list[dict[str, list[Box]]], held: dict[str, list[Box]], value: Value,
               failure: list[BaseException]) -> None:
    """A round through shared memory: this rank copies the parts it sends into its slot, every
    rank waits for every other (a barrier), then each part it receives is a view of its
    sender's slot (``message``). The slot is filled again two rounds later, after the next
    round's barrier, which every rank reaches only once it has assembled this round."""
    me, world = coord.rank, coord.world_size
    box_out = mail.outbox(round_no)
    if not failure:
        sources: dict[tuple[str, Box], torch.Tensor] = {}
        try:
            for key, _, cut, at, n in _outgoing(me, keys, shapes, dtypes, everyone, world):
                box_out[at:at + n] = _as_bytes(_held_part(key, cut, held, value, sources)).numpy()
        except BaseException as exc:  # reported to every rank in the last step
            failure.append(exc)
    dist.barrier(group=coord.group)
    where: dict[tuple[int, str, Box], tuple[int, int]] = {}
    for src in {p.src for p in parts if p.dst == me and p.src != me}:
        for key, dst, cut, at, n in _outgoing(src, keys, shapes, dtypes, everyone, world):
            if dst == me:
                where[(src, key, cut)] = (at, n)
    for p in parts:
        if p.dst == me and p.src != me:
            at, n = where[(p.src, p.key, p.box)]
            p.message = mail.inbox(p.src, round_no)[at:at + n]


def _bytes_owned(keys: list[str], shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype],
                 world: int, me: int, offset: Offset) -> int:
    total = 0
    for key in keys:
        lo, hi = owned_rows(shapes[key][0], world, me)
        total += _padded(_rows_box(shapes[key], lo, hi).numel * dtypes[key].itemsize)
    return total + DIRECT_IO_ALIGN * len(keys)


def _in_bytes(sizes: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """A shape with its last dim counted in bytes."""
    return (*sizes[:-1], sizes[-1] * itemsize)


def _padded(n: int) -> int:
    return -(-n // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN


def _settle(pending: Any, failure: list[BaseException]) -> None:
    try:
        pending.result()
    except BaseException as exc:  # reported to every rank in the last step
        failure.append(exc)


def _write_all(writes: list[tuple[str, int, memoryview]], write: Write, failure: list[BaseException]) -> None:
    for key, row, data in writes:
        if failure:
            return
        write(key, row, data)


def _round(coord: Coordinator, parts: list[_Part], keys: list[str], shapes: dict[str, tuple[int, ...]],
           dtypes: dict[str, torch.dtype], held: dict[str, list[Box]], value: Value, offset: Offset,
           failure: list[BaseException], inbox: torch.Tensor,
           arena: np.ndarray, handed: bool = False) -> list[tuple[str, int, memoryview]]:
    """One round: post the receives, send, wait (unless ``handed``: the parts came through
    shared memory, :func:`_hand_over`), assemble the owned rows in ``arena``; the writes to
    make (rows in ``arena``)."""
    me, world, group = coord.rank, coord.world_size, coord.group
    works = []
    at = 0
    for p in parts:  # receives first, into the arena
        if p.dst == me and p.src != me and not handed:
            n = p.box.numel * dtypes[p.key].itemsize
            p.message = inbox[at:at + n]
            at += n
            works.append(dist.irecv(p.message, src=coord._global(p.src), group=group, tag=p.tag))
    sources: dict[tuple[str, Box], torch.Tensor] = {}

    def part_of(p: _Part) -> torch.Tensor:
        return _held_part(p.key, p.box, held, value, sources)

    for p in parts:  # then the sends (zeros after a failure: no receiver waits)
        if p.src == me and p.dst != me and not handed:
            if not failure:
                try:
                    p.message = _as_bytes(part_of(p))
                except BaseException as exc:  # reported to every rank in the last step
                    failure.append(exc)
            if failure:
                p.message = torch.zeros(p.box.numel * dtypes[p.key].itemsize, dtype=torch.uint8)
            works.append(dist.isend(p.message, dst=coord._global(p.dst), group=group, tag=p.tag))
    for w in works:
        w.wait()
    writes = []
    at = 0
    for key in keys:  # assemble the rows this rank owns
        lo, hi = owned_rows(shapes[key][0], world, me)
        if failure or hi <= lo:
            continue
        own, size = _rows_box(shapes[key], lo, hi), dtypes[key].itemsize
        nbytes = own.numel * size
        at += (offset(key, lo) - at) % DIRECT_IO_ALIGN  # the rows' address mirrors their file offset in a block
        rows = arena[at:at + nbytes].reshape(_in_bytes(own.sizes, size))  # bytes: any dtype, any alignment
        try:
            for p in parts:
                if p.key == key and p.dst == me:
                    src = np.asarray(_as_bytes(part_of(p)) if p.src == me else p.message)  # gloo: tensor; shm: array
                    where = p.box.relative_to(own)
                    last = where[-1]
                    np.copyto(rows[(*where[:-1], slice(last.start * size, last.stop * size))],
                              src.reshape(_in_bytes(p.box.sizes, size)))
        except BaseException as exc:
            failure.append(exc)
            continue
        writes.append((key, lo, memoryview(arena)[at:at + nbytes]))
        at = _padded(at + nbytes)
    for p in parts:
        p.message = None
    sources.clear()
    return writes


