"""Zero-redundant loading: chunks several ranks need are read from storage once and sent."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import FileSystemReader, RankFailedError, load, save
from hyper_parallel.core.distributed_checkpoint._src.transfer import shared_reads
from hyper_parallel.core.distributed_checkpoint._src.transfer.shared_reads import Needs, assign, worth_sharing


class CountingReader(FileSystemReader):
    """Counts the payload bytes read from storage (not .metadata, not file indexes)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.payload = 0

    def read_into(self, name, offset, buffer):
        n = memoryview(buffer).nbytes
        if n > 4096 or offset > 4096:  # indexes and headers are small; payloads here are not
            self.payload += n
        return super().read_into(name, offset, buffer)


class MemoryReader(CountingReader):
    """The same files, presented as kept in memory (as on tmpfs)."""

    memory_backed = True


def test_sharing_is_worth_it_only_when_two_ranks_need_one_slab(monkeypatch):
    def needs(*ids):
        return Needs(np.array(ids, dtype=np.int64), np.full(len(ids), 8, dtype=np.int64))

    assert worth_sharing([needs(5, 1), needs(9, 5)])
    assert not worth_sharing([needs(5, 1), needs(9, 2)])
    assert not worth_sharing([needs(), needs()])
    monkeypatch.setattr(shared_reads, "MAX_SHARED_IDS", 3)
    assert not worth_sharing([needs(5, 1), needs(9, 5)])  # too much bookkeeping: each reads alone


def test_assignment_gives_each_shared_chunk_one_reader_balanced_and_batched():
    # 4 ranks; chunk 10 and 11 needed by all, 20 only by rank 2, 30..37 by ranks 0 and 1
    needs = [Needs(np.array([10, 11, *range(30, 38)]), np.array([100, 100] + [10] * 8)),
             Needs(np.array([10, 11, *range(30, 38)]), np.array([100, 100] + [10] * 8)),
             Needs(np.array([10, 11, 20]), np.array([100, 100, 500])),
             Needs(np.array([11, 10]), np.array([100, 100]))]
    a = assign(needs, batch_bytes=150)
    chunks = [c for rnd in a.rounds for c in rnd]
    assert sorted(c[0] for c in chunks) == [10, 11, *range(30, 38)] and a.shared == {10, 11, *range(30, 38)}
    assert all(owner in holders for _, _, owner, holders in chunks)
    owners = {cid: owner for cid, _, owner, _ in chunks}
    assert owners[10] != owners[11] and 2 not in (owners[10], owners[11])  # rank 2 reads 500 B alone
    sizes = {10: 100, 11: 100, **{c: 10 for c in range(30, 38)}}
    loads = {r: sum(sizes[c] for c, o in owners.items() if o == r) for r in (0, 1, 3)}
    assert max(loads.values()) == 100  # the best balance: 100, 100 and 80 bytes
    for rnd in a.rounds:  # nobody holds more than the batch in a round (or a single chunk)
        for r in range(4):
            held = [size for _, size, _, holders in rnd if r in holders]
            assert sum(held) <= 150 or len(held) == 1
    assert assign(needs, batch_bytes=150).rounds == a.rounds  # the same on every rank


def rank_hsdp(rank: int, ws: int, path: str, share: bool | None, batch: int | None, memory: bool = False,
              share_min: int | None = 0) -> dict:
    if share_min is not None:  # share the small targets too (through buffers where they need them)
        shared_reads.SHARE_MIN_BYTES = share_min
    if batch:  # small rounds, and targets cut into several slabs (at checksum blocks)
        shared_reads.SLAB_BYTES = 1000
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    w = make_tensor((16384, 64), seed=1)  # 2 checksum blocks per saved shard
    b = make_tensor((512,), seed=2)
    m = make_tensor((64, 32), seed=3)
    sd = {"w": make_dtensor(w, mesh, [Replicate(), Shard(0)]), "b": b.clone(), "m": m.clone(), "h": b[:96].clone(),
          "step": 5}
    if not os.path.exists(os.path.join(path, ".metadata")):
        save(sd, checkpoint_id=path)
    # "m" lands in a transposed (non-contiguous) target, "h" in another dtype: both go through
    # buffers; "w" and "b" straight into the targets
    target = {"w": make_dtensor(torch.zeros(16384, 64), mesh, [Replicate(), Shard(0)]),
              "b": torch.zeros(512), "m": torch.zeros(32, 64).t(), "h": torch.zeros(96, dtype=torch.bfloat16),
              "step": 0}
    reader = (MemoryReader if memory else CountingReader)(path)
    load(target, storage_reader=reader, broadcast_replicated_tensors=share, broadcast_batch_bytes=batch)
    want = make_dtensor(w, mesh, [Replicate(), Shard(0)]).to_local()
    assert torch.equal(target["w"].to_local(), want) and torch.equal(target["b"], b) and target["step"] == 5
    assert torch.equal(target["m"], m) and torch.equal(target["h"], b[:96].to(torch.bfloat16))
    return {"payload": reader.payload}


@pytest.mark.parametrize("batch", [None, 64 << 10])
def test_hsdp_replicas_read_each_byte_once(tmp_path, batch):
    path = str(tmp_path / "ckpt")
    checkpoint = 16384 * 64 * 4 + 512 * 4 + 64 * 32 * 4 + 96 * 4
    shared = run_ranks(rank_hsdp, 4, path, True, batch)
    alone = run_ranks(rank_hsdp, 4, path, False, None)
    total_shared = sum(r["payload"] for r in shared)
    total_alone = sum(r["payload"] for r in alone)
    assert total_shared <= 1.05 * checkpoint, (total_shared, checkpoint)
    assert total_alone >= 1.9 * checkpoint  # each replica read its shard: twice the bytes, "b" four times
    assert max(r["payload"] for r in shared) <= 0.5 * checkpoint  # the reads are spread over the ranks


def test_small_targets_are_read_by_each_replica_and_large_ones_once(tmp_path):
    """SHARE_MIN_BYTES (64 KiB): "b", "m" and "h" (under 10 KiB each) are read by all 4 ranks,
    the 4 MiB "w" still once."""
    path = str(tmp_path / "ckpt")
    checkpoint = 16384 * 64 * 4 + 512 * 4 + 64 * 32 * 4 + 96 * 4
    every = [r["payload"] for r in run_ranks(rank_hsdp, 4, path, True, None, False, 0)]
    small = [r["payload"] for r in run_ranks(rank_hsdp, 4, path, True, None, False, None)]
    assert sum(every) <= 1.05 * checkpoint and sum(small) <= 1.05 * checkpoint, (every, small)
    assert sum(small) > sum(every)  # the small ones, read more than once
    # "w" is still read once, spread over the ranks: a rank reads at most one of its 2 MiB shards
    assert max(small) <= 16384 * 64 * 4 // 2 + (checkpoint - 16384 * 64 * 4), small


def test_by_default_replicas_read_once_unless_the_files_are_in_memory(tmp_path):
    """broadcast_replicated_tensors=None: share reads, except where the files live in memory
    (the reader's memory_backed: reading again costs no more than receiving)."""
    path = str(tmp_path / "ckpt")
    checkpoint = 16384 * 64 * 4 + 512 * 4 + 64 * 32 * 4 + 96 * 4
    default = sum(r["payload"] for r in run_ranks(rank_hsdp, 4, path, None, None, False))
    assert default <= 1.05 * checkpoint, (default, checkpoint)
    memory = sum(r["payload"] for r in run_ranks(rank_hsdp, 4, path, None, None, True))
    assert memory >= 1.9 * checkpoint, (memory, checkpoint)


def rank_corrupt(rank: int, ws: int, path: str) -> str:
    shared_reads.SHARE_MIN_BYTES = 0  # share "b" (2 KiB)
    target = {"b": torch.zeros(512)}
    try:
        load(target, checkpoint_id=path, broadcast_replicated_tensors=True)
    except RankFailedError as exc:
        return str(exc)
    return "loaded"


def test_a_corrupt_shared_chunk_fails_every_rank_naming_it(tmp_path):
    path = str(tmp_path / "ckpt")
    save({"b": make_tensor((512,), seed=2)}, checkpoint_id=path, no_dist=True)
    name = next(f for f in os.listdir(path) if f.endswith(".safetensors"))
    reader = FileSystemReader(path)
    from hyper_parallel.core.distributed_checkpoint._src.engine.metadata_reader import read_checkpoint_metadata

    meta = read_checkpoint_metadata(reader)
    f = meta.files[0]
    with open(os.path.join(path, name), "r+b") as fh:  # flip a byte of the payload (before the index)
        fh.seek(f.index_offset - 100)
        byte = fh.read(1)
        fh.seek(f.index_offset - 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    out = run_ranks(rank_corrupt, 2, path, timeout_s=60)
    assert all("checksum" in msg and "'b" in msg for msg in out), out


def test_readers_say_whether_their_files_are_in_memory(tmp_path, s3_bucket):
    from hyper_parallel.core.distributed_checkpoint import FsspecReader, HuggingFaceStorageReader
    from hyper_parallel.core.distributed_checkpoint._src.backends import direct_io

    assert FsspecReader("memory://x").memory_backed is True
    assert FsspecReader(f"s3://{s3_bucket[0]}/c", **s3_bucket[1]).memory_backed is False
    in_memory = direct_io.filesystem_name(str(tmp_path)) in ("tmpfs", "ramfs")
    assert FileSystemReader(str(tmp_path)).memory_backed is in_memory
    assert HuggingFaceStorageReader(str(tmp_path)).memory_backed is in_memory
    if os.path.isdir("/dev/shm") and direct_io.filesystem_name("/dev/shm") == "tmpfs":
        assert FileSystemReader("/dev/shm").memory_backed is True


def rank_hsdp_corrupt(rank: int, ws: int, path: str) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    target = {"w": make_dtensor(torch.zeros(16384, 64), mesh, [Replicate(), Shard(0)]), "b": torch.zeros(512)}
    try:
        load(target, checkpoint_id=path, broadcast_replicated_tensors=True, broadcast_batch_bytes=64 << 10)
    except RankFailedError as exc:
        return str(exc)
    return "loaded"


def test_a_corrupt_slab_in_an_early_round_fails_every_rank_without_waiting(tmp_path):
    """Its owner still sends (zeros) so receivers of that and later rounds finish; every rank
    then raises, naming the key."""
    path = str(tmp_path / "ckpt")
    run_ranks(rank_hsdp, 4, path, True, None)
    from hyper_parallel.core.distributed_checkpoint._src.engine.metadata_reader import read_checkpoint_metadata

    meta = read_checkpoint_metadata(FileSystemReader(path))
    f = max(meta.files, key=lambda f: f.index_offset)  # a file holding part of "w"
    with open(os.path.join(path, f.path), "r+b") as fh:
        fh.seek(f.index_offset // 3)
        byte = fh.read(1)
        fh.seek(f.index_offset // 3)
        fh.write(bytes([byte[0] ^ 0xFF]))
    out = run_ranks(rank_hsdp_corrupt, 4, path, timeout_s=60)
    assert all("checksum" in msg and "'w" in msg for msg in out), out


@pytest.mark.parametrize("slab_bytes,rows", [(1000, [4096] * 4), (3 << 20, [12288, 4096]), (64 << 20, [16384])])
def test_slabs_are_cut_at_checksum_blocks(tmp_path, monkeypatch, slab_bytes, rows):
    """Targets are shared in slabs of whole rows, cut only where every saved chunk starts a
    checksum block (4 blocks of 4096 rows here), so no block is read by two owners."""
    from hyper_parallel.core.distributed_checkpoint._src.engine.metadata_reader import read_checkpoint_metadata
    from hyper_parallel.core.distributed_checkpoint._src.planning.standard_planner import StandardPlanner

    save({"w": make_tensor((16384, 64), seed=1)}, checkpoint_id=str(tmp_path), no_dist=True)
    meta = read_checkpoint_metadata(FileSystemReader(str(tmp_path)))
    planner = StandardPlanner()
    planner.set_up_load({"w": torch.zeros(16384, 64)}, meta, True)
    monkeypatch.setattr(shared_reads, "SLAB_BYTES", slab_bytes)
    slabs = shared_reads.slabs_of(planner.create_local_load_plan(), meta)["w"]
    assert [s.box.sizes[0] for s in slabs] == rows and all(s.box.sizes[1:] == (64,) for s in slabs)
