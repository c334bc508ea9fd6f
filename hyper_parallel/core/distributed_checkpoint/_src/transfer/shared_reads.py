"""Zero-redundant loading: saved bytes that several ranks need are read from storage once.

With data-parallel replicas (HSDP, DDP, ``Replicate`` placements, plain tensors every rank
loads) many ranks load the same part of a tensor; each reading it itself multiplies the load
on shared storage by the replica count. The unit of sharing is a *slab*: a run of whole rows
(dim 0) of one key's target, at most ``SLAB_BYTES``, so it is contiguous in a row-major target
and a message can land straight in it. Ranks whose targets of a key are the same box need the
same slabs. Every rank tells the others which slabs its plan fills (ids, not bytes), every
rank computes the same assignment — each slab that several ranks need goes to one of them, the
least loaded so far, so the reads stay balanced — and then, in rounds bounded by
``batch_bytes`` of buffers per rank (targets that cannot take a message directly):

1. every rank posts the receives of the round, straight into its targets where it can;
2. each owner reads its slabs of the round (checksums verified, into its own target) in
   batches and sends each batch as soon as it is read, so storage and network overlap;
3. receivers copy what landed in buffers into their targets.

Targets that only one rank has are read by that rank directly, as without sharing. Storage
then serves each replicated byte once; the process group carries the copies. Targets under
``SHARE_MIN_BYTES`` (norms, biases, an optimizer's 0-d steps) are read by every rank that
wants them: each shared slab costs a message per holder and bookkeeping on every rank, and
an FSDP2 + AdamW load spent ~30 ms (5%) sharing 148 steps of 8 bytes; the bytes they add
stay far below 1% of a model even at 64 replicas.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..backends.protocol import StorageReader
from ..base.box import Box
from ..base.dtypes import torch_dtype
from ..coordination.coordinator import Coordinator
from ..format import metadata as md
from ..format.data_file import block_rows
from ..planning.planner import LoadPlan, ReadItem
from .loader import ReadStats, read_plan

DEFAULT_BATCH_BYTES = 256 << 20
SHARE_MIN_BYTES = 64 << 10  # smaller targets are read by each rank that wants them
MAX_SHARED_IDS = 1 << 22  # beyond this many needs over all ranks, the exchange costs more than it saves


@dataclass
class Needs:
    """What one rank's plan fills: slab ``ids`` (see :func:`slab_id`) and bytes of each."""

    ids: np.ndarray
    nbytes: np.ndarray


@dataclass
class Assignment:
    """The same on every rank: which rank reads each shared slab, and in which round."""

    rounds: list[list[tuple[int, int, int, tuple[int, ...]]]] = field(default_factory=list)
    # each round: (slab id, bytes, owner, ranks that need it)
    shared: set[int] = field(default_factory=set)


def _key_index(meta: md.Metadata) -> dict[str, int]:
    found = meta.__dict__.get("_shared_read_keys")
    if found is None:
        found = meta.__dict__["_shared_read_keys"] = {k: i for i, k in enumerate(sorted(meta.entries))}
    return found


SLAB_BYTES = 32 << 20  # the unit of sharing: small enough to balance, big enough per message


@dataclass(frozen=True)
class Slab:
    """Rows of one key's target box (contiguous in a row-major target)."""

    key: str
    target: Box
    box: Box


def slabs_of(plan: LoadPlan, meta: md.Metadata) -> dict[str, list[Slab]]:
    """Each key's target (keys with reads only) cut into slabs of about ``SLAB_BYTES``, at
    rows where every saved chunk it reads from starts a checksum block (so no block is read
    by two owners). The cut depends only on the target box and the checkpoint, so it is the
    same on every rank with the same target."""
    out: dict[str, list[Slab]] = {}
    for key, items in _by_key(plan.items).items():
        target = plan.targets[key]
        if not target.numel:
            continue
        row_bytes = math.prod(target.sizes[1:]) * torch_dtype(meta.entries[key].dtype).itemsize
        cuts = _cuts(target, items, max(1, SLAB_BYTES // max(1, row_bytes))) if target.ndim else []
        rows = [target.offsets[0], *cuts, target.offsets[0] + target.sizes[0]] if target.ndim else []
        out[key] = ([Slab(key, target, Box((a, *target.offsets[1:]), (b - a, *target.sizes[1:])))
                     for a, b in zip(rows, rows[1:], strict=False)] if rows else [Slab(key, target, target)])
    return out


def _by_key(items: list[ReadItem]) -> dict[str, list[ReadItem]]:
    out: dict[str, list[ReadItem]] = {}
    for item in items:
        out.setdefault(item.key, []).append(item)
    return out


def _cuts(target: Box, items: list[ReadItem], step: int) -> list[int]:
    """Rows inside ``target`` to cut at, about ``step`` rows apart, where no saved chunk is
    cut inside a checksum block."""
    t0, t1 = target.offsets[0], target.offsets[0] + target.sizes[0]
    if t1 - t0 <= step:
        return []
    spans = []  # (first row, end row, rows per block) of each saved chunk
    for item in items:
        chunk = item.chunk
        if isinstance(chunk, md.ChunkRecord):
            c0, rows, per = chunk.offsets[0], chunk.rows, chunk.block_rows
        else:
            c0, rows, per = chunk.box.offsets[0], chunk.box.sizes[0], block_rows(chunk.box.sizes, chunk.nbytes)
        spans.append((c0, c0 + rows, max(1, per)))
    candidates = sorted({r for c0, c1, per in spans for r in (*range(c0, c1, per), c1) if t0 < r < t1})
    if len(candidates) * len(spans) > 1 << 20:  # too many tiles to check: one slab
        return []
    valid = [r for r in candidates if all(r <= c0 or r >= c1 or (r - c0) % per == 0 for c0, c1, per in spans)]
    cuts, last = [], t0
    for i, r in enumerate(valid):
        after = valid[i + 1] if i + 1 < len(valid) else t1
        if after - last > step and r > last:  # the next cut would make this slab too long
            cuts.append(r)
            last = r
    return cuts


def slab_id(index: dict[str, int], slab: Slab) -> int:
    """A 63-bit id of a slab, the same on every rank whose target of the key is the same box."""
    parts = (*slab.target.offsets, *slab.target.sizes, *slab.box.offsets, *slab.box.sizes)
    raw = index[slab.key].to_bytes(4, "little") + b"".join(o.to_bytes(8, "little") for o in parts)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


def _nbytes(slab: Slab, meta: md.Metadata) -> int:
    return slab.box.numel * torch_dtype(meta.entries[slab.key].dtype).itemsize


def needs_of(plan: LoadPlan, meta: md.Metadata) -> Needs:
    """The slabs ``plan`` fills, of targets of at least ``SHARE_MIN_BYTES`` (the decision is
    the same on every rank with the same target, so a key is shared whole or not at all)."""
    index = _key_index(meta)
    slabs, sizes = [], []
    for per_key in slabs_of(plan, meta).values():
        nbytes = [_nbytes(s, meta) for s in per_key]
        if sum(nbytes) >= SHARE_MIN_BYTES:  # a key's slabs tile its target
            slabs += per_key
            sizes += nbytes
    return Needs(np.fromiter((slab_id(index, s) for s in slabs), np.int64, len(slabs)),
                 np.array(sizes, dtype=np.int64))


def assign(needs: list[Needs], batch_bytes: int = DEFAULT_BATCH_BYTES) -> Assignment:
    """Give every slab that several ranks need to one of them, balancing bytes read; cut
    the transfers into rounds in which no rank holds more than ``batch_bytes`` (or one slab)."""
    ranks = np.concatenate([np.full(len(n.ids), r, np.int64) for r, n in enumerate(needs)])
    ids = np.concatenate([n.ids for n in needs])
    sizes = np.concatenate([n.nbytes for n in needs])
    out = Assignment()
    if not len(ids):
        return out
    order = np.lexsort((ranks, ids))
    ids, ranks, sizes = ids[order], ranks[order], sizes[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    counts = np.diff(np.r_[starts, len(ids)])
    load = np.zeros(len(needs), np.int64)
    np.add.at(load, ranks[starts[counts == 1]], sizes[starts[counts == 1]])  # what each reads alone
    multi = starts[counts > 1]
    # biggest chunks first, so the greedy balance ends even
    chunks = sorted(((int(sizes[s]), int(ids[s]), tuple(int(r) for r in ranks[s:s + c]))
                     for s, c in zip(multi, counts[counts > 1], strict=True)), key=lambda t: (-t[0], t[1]))
    owned = []
    for size, cid, holders in chunks:
        owner = min(holders, key=lambda r: (load[r], (cid + r) % len(needs)))
        load[owner] += size
        owned.append((cid, size, owner, holders))
        out.shared.add(cid)
    owned.sort(key=lambda t: t[0])  # rounds in chunk order
    held = np.zeros(len(needs), np.int64)
    current: list[tuple[int, int, int, tuple[int, ...]]] = []
    for cid, size, owner, holders in owned:
        if current and any(held[r] + size > batch_bytes for r in holders):
            out.rounds.append(current)
            current, held[:] = [], 0
        current.append((cid, size, owner, holders))
        held[list(holders)] += size
    if current:
        out.rounds.append(current)
    return out


@dataclass
class _Shared:
    """One shared slab as this rank sees it: ``direct`` is the target's bytes (uint8) when the
    slab lies there contiguously in the saved dtype, so the read fills it and the message
    lands in it; otherwise a buffer in the saved dtype carries it, for its round only."""

    tag: int
    size: int
    owner: int
    holders: tuple[int, ...]
    slab: Slab
    items: list[ReadItem]  # the plan's reads, cut to the slab
    dtype: torch.dtype  # saved
    direct: torch.Tensor | None
    message: torch.Tensor | None = None  # the bytes sent or received, in its round


def read_shared(
    coord: Coordinator,
    plan: LoadPlan,
    planner: Any,
    reader: StorageReader,
    meta: md.Metadata,
    everyone: list[Needs],
    *,
    thread_count: int,
    verify: bool,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    phase: str = "load",
) -> ReadStats:
    """Fill this rank's targets of ``plan``, reading each shared slab once over the group.

    Every rank of ``coord``'s group must call it with its own plan and the same ``everyone``
    (each rank's :func:`needs_of`). Returns this rank's bytes read from storage.

    A failed read does not leave receivers waiting: its owner sends zeros in its place and
    the failure is reported to every rank at the end, so the load fails everywhere (a target
    may then hold those zeros, as it may hold partial data after any failed load).
    """
    assignment = assign(everyone, batch_bytes)
    index = _key_index(meta)
    me = coord.rank
    slabs = {slab_id(index, s): s for per_key in slabs_of(plan, meta).values() for s in per_key}
    shared_keys = {s.key for cid, s in slabs.items() if cid in assignment.shared}
    by_key = _by_key(plan.items)
    solo = [item for item in plan.items if item.key not in shared_keys]
    stats = ReadStats()
    rounds: list[list[_Shared]] = []

    def prepare() -> None:
        tag = 0
        for chunks in assignment.rounds:
            rounds.append([])
            for cid, size, owner, holders in chunks:
                tag += 1
                if me in holders:
                    rounds[-1].append(_prepare(slabs[cid], tag, size, owner, holders, by_key, planner, meta))

    coord.exchange(f"{phase} (preparing shared reads)", prepare)
    failure: list[BaseException] = []

    def transfer() -> None:
        for shared in rounds:
            _round(coord, shared, me, planner, plan.targets, reader, stats, thread_count, verify, failure)

    coord._collective(f"{phase} (reading and sending shared slabs)", transfer)

    def finish() -> None:
        if failure:
            raise failure[0]
        got = read_plan(LoadPlan(solo, plan.targets), planner, reader, thread_count, verify=verify)
        stats.bytes_read += got.bytes_read
        stats.bytes_needed += got.bytes_needed

    coord.exchange(f"{phase} (reading)", finish)
    return stats


def _prepare(slab: Slab, tag: int, size: int, owner: int, holders: tuple[int, ...],
             by_key: dict[str, list[ReadItem]], planner: Any, meta: md.Metadata) -> _Shared:
    dtype = torch_dtype(meta.entries[slab.key].dtype)
    if _nbytes(slab, meta) != size:  # a 64-bit id collision: never copy wrong bytes
        raise RuntimeError(f"{slab.key!r}: shared slab {slab.box} is {_nbytes(slab, meta)} bytes here "
                           f"and {size} on rank {owner}; load with broadcast_replicated_tensors=False")
    items = []
    for item in by_key[slab.key]:
        cut = item.region.intersect(slab.box)
        if cut is not None and cut.numel:
            items.append(ReadItem(item.key, item.chunk, cut))
    view = _view(slab, planner)
    direct = view.device.type == "cpu" and view.dtype == dtype and view.is_contiguous()
    return _Shared(tag, size, owner, holders, slab, items, dtype, _as_bytes(view) if direct else None)


def _view(slab: Slab, planner: Any) -> torch.Tensor:
    dest = planner.resolve_target(slab.key).detach()
    return dest[slab.box.relative_to(slab.target)] if dest.dim() else dest


SEND_BATCH_BYTES = 32 << 20  # slabs read together before sending: threads get several files, sends start early


def _round(coord: Coordinator, shared: list[_Shared], me: int, planner: Any, targets: dict[str, Box],
           reader: StorageReader, stats: ReadStats, thread_count: int, verify: bool,
           failure: list[BaseException]) -> None:
    """One round: post the receives, read and send what this rank owns in batches, wait,
    then copy what landed in buffers into the targets."""
    for s in shared:
        if s.direct is not None:
            s.message = s.direct
        elif s.owner != me:
            s.message = torch.empty(s.size, dtype=torch.uint8)
    works = [dist.irecv(s.message, src=coord._global(s.owner), group=coord.group, tag=s.tag)
             for s in shared if s.owner != me and s.size]
    owned = [s for s in shared if s.owner == me]
    batch: list[_Shared] = []
    for i, s in enumerate(owned):
        batch.append(s)
        if i + 1 < len(owned) and sum(b.size for b in batch) < SEND_BATCH_BYTES:
            continue
        if not failure:
            try:
                items = [item for b in batch for item in b.items]
                stats.bytes_read += read_plan(LoadPlan(items, targets), planner, reader, thread_count,
                                              verify=verify).bytes_read
            except BaseException as exc:  # reported to every rank once the transfers are done
                failure.append(exc)
        for b in batch:
            if failure:
                b.message = torch.zeros(b.size, dtype=torch.uint8)
            elif b.direct is None:  # the slab as the receivers expect it: host memory, contiguous, saved dtype
                b.message = _as_bytes(_view(b.slab, planner).to(device="cpu", dtype=b.dtype).contiguous())
            works.extend(dist.isend(b.message, dst=coord._global(r), group=coord.group, tag=b.tag)
                         for r in b.holders if r != me and b.size)
        batch = []
    for w in works:
        w.wait()
    with torch.no_grad():
        for s in shared:
            if not failure and s.direct is None and s.owner != me:
                _view(s.slab, planner).copy_(s.message.view(s.dtype).reshape(s.slab.box.sizes))
            s.message = None


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def sharing_wanted(coord: Coordinator, enabled: bool, rank_local: bool) -> bool:
    """Whether a load should exchange its needs (the switch, and a group to share over)."""
    return enabled and coord.distributed and coord.world_size > 1 and not rank_local


def worth_sharing(everyone: list[Needs]) -> bool:
    """True when some slab is needed by two ranks and the bookkeeping stays small."""
    total = sum(len(n.ids) for n in everyone)
    if not total or total > MAX_SHARED_IDS:
        return False
    ids = np.sort(np.concatenate([n.ids for n in everyone]))  # np.unique would import numpy.ma: ~20 ms
    return bool((ids[1:] == ids[:-1]).any())


