"""Zero-redundant loading: saved bytes that several ranks need are read from storage once.

With data-parallel replicas (HSDP, DDP, ``Replicate`` placements, plain tensors every rank
loads) many ranks read the same region of the same saved chunk; each reading it itself
multiplies the load on shared storage by the replica count. Here every rank tells the others
which reads its plan makes (ids of (key, chunk, region), not bytes), every rank computes the
same assignment — each read that several ranks make goes to one of them, the least loaded
so far, so the reads stay balanced — and then, in rounds bounded by ``batch_bytes`` per rank:

1. each owner reads its regions of the round, checksums verified (an exchange, so a corrupt
   chunk fails every rank at once instead of leaving receivers waiting);
2. owners send the bytes to the other ranks that make the same read, one message per
   (owner, receiver) pair per round, over the load's gloo group;
3. every rank copies what it read or received into its targets.

Reads only one rank makes — including different parts of one chunk that different ranks
need, as in a resharded load — are done by that rank directly into its targets, as without
sharing. Storage then serves each replicated byte once; the process group carries the copies.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import metadata as md
from .box import Box
from .coordination import Coordinator
from .loader import ReadStats, read_plan
from .planner import LoadPlan, ReadItem
from .storage import StorageReader

DEFAULT_BATCH_BYTES = 256 << 20
MAX_SHARED_IDS = 1 << 22  # beyond this many needs over all ranks, the exchange costs more than it saves


@dataclass
class Needs:
    """What one rank's plan reads: ``ids`` (see :func:`read_id`) and bytes of each read."""

    ids: np.ndarray
    nbytes: np.ndarray


@dataclass
class Assignment:
    """The same on every rank: which rank reads each shared chunk, and in which round."""

    rounds: list[list[tuple[int, int, int, tuple[int, ...]]]] = field(default_factory=list)
    # each round: (read id, bytes, owner, ranks that need it)
    shared: set[int] = field(default_factory=set)


def _key_index(meta: md.Metadata) -> dict[str, int]:
    found = meta.__dict__.get("_shared_read_keys")
    if found is None:
        found = meta.__dict__["_shared_read_keys"] = {k: i for i, k in enumerate(sorted(meta.entries))}
    return found


def read_id(index: dict[str, int], item: ReadItem) -> int:
    """A 63-bit id of a read, the same on every rank that makes it: the key, the saved
    chunk's offsets (distinct boxes of a key never overlap; replicas share a box) and the
    region read."""
    parts = (*item.chunk.box.offsets, *item.region.offsets, *item.region.sizes)
    raw = index[item.key].to_bytes(4, "little") + b"".join(o.to_bytes(8, "little") for o in parts)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


def _nbytes(item: ReadItem) -> int:
    ref = item.chunk
    return item.region.numel * (ref.nbytes // max(1, ref.box.numel))


def needs_of(plan: LoadPlan, meta: md.Metadata) -> Needs:
    """The reads ``plan`` makes (each once)."""
    index = _key_index(meta)
    seen: dict[int, int] = {}
    for item in plan.items:
        seen.setdefault(read_id(index, item), _nbytes(item))
    return Needs(np.fromiter(seen.keys(), np.int64, len(seen)), np.fromiter(seen.values(), np.int64, len(seen)))


def assign(needs: list[Needs], batch_bytes: int = DEFAULT_BATCH_BYTES) -> Assignment:
    """Give every read that several ranks make to one of them, balancing bytes read; cut
    the transfers into rounds in which no rank holds more than ``batch_bytes`` (or one read)."""
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


class _Buffers:
    """Resolver for shared reads into fresh buffers (see :func:`_buffer_name`)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def resolve_target(self, key: str) -> torch.Tensor:
        return self.tensors[key]


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
    """Fill this rank's targets of ``plan``, reading each shared chunk once over the group.

    Every rank of ``coord``'s group must call it with its own plan and the same ``everyone``
    (each rank's :func:`needs_of`). Returns this rank's bytes read from storage.
    """
    plan_assignment = assign(everyone, batch_bytes)
    index = _key_index(meta)
    me = coord.rank
    mine: dict[int, list[ReadItem]] = {}
    solo: list[ReadItem] = []
    for item in plan.items:
        cid = read_id(index, item)
        if cid in plan_assignment.shared:
            mine.setdefault(cid, []).append(item)
        else:
            solo.append(item)
    stats = ReadStats()

    def read_solo() -> None:
        got = read_plan(LoadPlan(solo, plan.targets), planner, reader, thread_count, verify=verify)
        stats.bytes_read += got.bytes_read
        stats.bytes_needed += got.bytes_needed

    coord.exchange(f"{phase} (reading)", read_solo)
    refs: dict[int, ReadItem] = {cid: items[0] for cid, items in mine.items()}
    for number, chunks in enumerate(plan_assignment.rounds):
        _round(coord, number, chunks, me, mine, refs, plan, planner, reader, meta, stats, thread_count, verify,
               phase)
    return stats


def _round(coord: Coordinator, number: int, chunks: list, me: int, mine: dict[int, list[ReadItem]],
           refs: dict[int, ReadItem], plan: LoadPlan, planner: Any, reader: StorageReader, meta: md.Metadata,
           stats: ReadStats, thread_count: int, verify: bool, phase: str) -> None:
    owned = [(cid, size, holders) for cid, size, owner, holders in chunks if owner == me]
    buffers = _Buffers()
    data: dict[int, torch.Tensor] = {}  # read id -> its bytes (uint8), read or received

    def read_owned() -> None:
        items = []
        for cid, _, _ in owned:
            ref = refs[cid]
            name = _buffer_name(ref)
            if name in buffers.tensors:
                raise AssertionError(f"two shared reads named {name!r}")  # would alias buffers
            buffers.tensors[name] = torch.empty(ref.region.sizes, dtype=md.torch_dtype(meta.entries[ref.key].dtype))
            items.append(ReadItem(name, ref.chunk, ref.region))
        if items:
            got = read_plan(LoadPlan(items, {i.key: i.region for i in items}), buffers, reader, thread_count,
                            verify=verify)
            stats.bytes_read += got.bytes_read
        for cid, _, _ in owned:
            ref = refs[cid]
            data[cid] = _as_bytes(buffers.tensors[_buffer_name(ref)])

    coord.exchange(f"{phase} (reading shared chunks, round {number})", read_owned)

    # one message per (owner, receiver) pair: the owner's chunks that receiver needs, in chunk order
    sends: dict[int, list[int]] = {}
    recvs: dict[int, list[tuple[int, int]]] = {}
    for cid, size, owner, holders in chunks:
        for r in holders:
            if r == owner:
                continue
            if owner == me:
                sends.setdefault(r, []).append(cid)
            elif r == me:
                recvs.setdefault(owner, []).append((cid, size))

    def transfer() -> None:
        works, inbox = [], {}
        for owner, wanted in sorted(recvs.items()):
            inbox[owner] = torch.empty(_packed_size(size for _, size in wanted), dtype=torch.uint8)
            works.append(dist.irecv(inbox[owner], src=coord._global(owner), group=coord.group, tag=number))
        for r, cids in sorted(sends.items()):
            out = data[cids[0]] if len(cids) == 1 else _pack([data[c] for c in cids])
            works.append(dist.isend(out, dst=coord._global(r), group=coord.group, tag=number))
        for w in works:
            w.wait()
        for owner, wanted in recvs.items():
            pos = 0
            for cid, size in wanted:
                data[cid] = inbox[owner][pos:pos + size]
                pos += _aligned(size)

    if sends or recvs:
        coord._collective(f"{phase} (sending shared chunks, round {number})", transfer)

    def apply() -> None:
        with torch.no_grad():
            for cid, _, _, holders in chunks:
                if me not in holders:
                    continue
                ref = refs[cid]
                if data[cid].numel() != _nbytes(ref):  # a 64-bit id collision: never copy wrong bytes
                    raise RuntimeError(f"{ref.key!r}: shared read {ref.region} arrived with {data[cid].numel()} "
                                       f"bytes, expected {_nbytes(ref)}; load with broadcast_replicated_tensors=False")
                region = data[cid].view(md.torch_dtype(meta.entries[ref.key].dtype)).reshape(ref.region.sizes)
                for item in mine[cid]:
                    _copy_region(item, region, planner.resolve_target(item.key), plan.targets[item.key])

    coord.exchange(f"{phase} (applying shared chunks, round {number})", apply)


def _buffer_name(ref: Any) -> str:
    """The name a shared read goes by (in errors too): the key, the chunk and the region."""
    return f"{ref.key} [chunk at {list(ref.chunk.box.offsets)}, region {ref.region}]"


_ALIGN = 16  # chunks in a message start at multiples of this, so any dtype can view them


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _packed_size(sizes: Any) -> int:
    sizes = list(sizes)
    return sum(_aligned(s) for s in sizes[:-1]) + sizes[-1]


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """The chunks of one message, each starting on an ``_ALIGN`` boundary."""
    out = torch.empty(_packed_size(p.numel() for p in parts), dtype=torch.uint8)
    pos = 0
    for p in parts:
        out[pos:pos + p.numel()].copy_(p)
        pos += _aligned(p.numel())
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _copy_region(item: ReadItem, region: torch.Tensor, dest: torch.Tensor, target: Box) -> None:
    dst = dest.detach()
    dst = dst[item.region.relative_to(target)] if dst.dim() else dst
    dst.copy_(region)


def sharing_wanted(coord: Coordinator, enabled: bool, rank_local: bool) -> bool:
    """Whether a load should exchange its needs (the switch, and a group to share over)."""
    return enabled and coord.distributed and coord.world_size > 1 and not rank_local


def worth_sharing(everyone: list[Needs]) -> bool:
    """True when some chunk is needed by two ranks and the bookkeeping stays small."""
    total = sum(len(n.ids) for n in everyone)
    if not total or total > MAX_SHARED_IDS:
        return False
    ids = np.concatenate([n.ids for n in everyone])
    return len(np.unique(ids)) < len(ids)


