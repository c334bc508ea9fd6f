"""The load hot path: checksums verified and bytes copied out in one pass, bit-exact, and
corruption still caught (naming key and file) before a corrupt block reaches a target."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import bits, local_expected, make_dtensor, make_tensor, rows_over_ranks
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    FileSystemReader,
    StandardPlanner,
    load,
    save,
)
from hyper_parallel.core.distributed_checkpoint._src.base.box import Box
from hyper_parallel.core.distributed_checkpoint._src.transfer import loader

ROWS, COLS = 8192, 256  # float32: 1 KiB rows, 1 MiB checksum blocks, 8 blocks


class _Columns(StandardPlanner):
    """Load columns ``lo:hi`` of every saved tensor into a target holding only them."""

    def __init__(self, lo: int, hi: int):
        super().__init__()
        self.lo, self.hi = lo, hi

    def _destination(self, key, entry, target):
        return Box((0, self.lo), (entry.shape[0], self.hi - self.lo)), target

    def _mismatch(self, *a):
        raise AssertionError


def _save_untiled(sd: dict, path: str) -> None:
    planner = StandardPlanner()
    planner.max_tiles = 1  # whole rows per chunk: a column reader reads (and checks) whole rows
    save(sd, path, planner=planner, no_dist=True)


@pytest.mark.parametrize("direct_io", [None, False])
@pytest.mark.parametrize("fused", [loader.FUSED_BYTES, 1 << 40])  # 1 << 40: the whole segment checked first
def test_column_loads_verified_in_fused_pieces_are_bit_exact(tmp_path, monkeypatch, direct_io, fused):
    full = make_tensor((ROWS, COLS))
    path = str(tmp_path / "ckpt")
    _save_untiled({"w": full}, path)
    monkeypatch.setattr(loader, "FUSED_BYTES", fused)
    target = {"w": torch.zeros(ROWS, 128)}
    load(target, path, storage_reader=FileSystemReader(path, direct_io=direct_io), planner=_Columns(64, 192))
    assert torch.equal(target["w"].view(torch.int32), full[:, 64:192].contiguous().view(torch.int32))


def _flip_byte_of_row(path: str, full: torch.Tensor, row: int) -> str:
    """Flip one byte of ``full[row]``'s payload in its data file; return the file's name."""
    pattern = full[row, :8].numpy().tobytes()  # 32 bytes of random floats: found once
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        raw = bytearray(open(os.path.join(path, name), "rb").read())
        at = raw.find(pattern)
        if at >= 0:
            assert raw.find(pattern, at + 1) < 0
            raw[at + 5] ^= 0x10
            with open(os.path.join(path, name), "wb") as f:
                f.write(raw)
            return name
    raise AssertionError("row payload not found")


@pytest.mark.parametrize("direct_io", [None, False])
def test_a_flipped_byte_in_a_middle_block_is_reported_naming_key_and_file_and_never_copied(tmp_path, direct_io):
    full = make_tensor((ROWS, COLS))
    path = str(tmp_path / "ckpt")
    _save_untiled({"w": full}, path)
    bad_row = 5000  # block 4 of 8 (1024 rows a block)
    name = _flip_byte_of_row(path, full, bad_row)
    target = {"w": torch.full((ROWS, 128), -7.0)}
    with pytest.raises(CorruptCheckpointError) as err:
        load(target, path, storage_reader=FileSystemReader(path, direct_io=direct_io), planner=_Columns(64, 192))
    msg = str(err.value)
    assert "'w'" in msg and name in msg and "block 4" in msg, msg
    # the corrupt block's rows never reached the target: each block is checked before it is copied
    block = slice(4096, 5120)
    assert bool((target["w"][block] == -7.0).all())


def test_verify_false_still_loads_only_the_needed_bytes(tmp_path):
    full = make_tensor((ROWS, COLS))
    path = str(tmp_path / "ckpt")
    _save_untiled({"w": full}, path)
    target = {"w": torch.zeros(ROWS, 128)}
    reader = FileSystemReader(path)
    load(target, path, storage_reader=reader, planner=_Columns(128, 256), verify=False)
    assert torch.equal(target["w"], full[:, 128:])
    index = reader.bytes_read - ROWS * 128 * 4
    assert 0 <= index < 64 << 10, reader.bytes_read  # the needed bytes, plus the file's index


# ---------------------------------------------------------------- 2 gloo ranks, many small tensors

# 16 float32 tensors of 2-4 MiB (each rank's chunk of 1-2 MiB is cut into column bands: a
# Shard(1) reader reads exactly its bands, in small runs), then bfloat16 vectors (whole rows read)
SHAPES = [(256 + 16 * i, 2048) for i in range(16)] + [(8, 96), (8, 40)]


def _dtype(i: int) -> torch.dtype:
    return torch.float32 if SHAPES[i][0] > 8 else torch.bfloat16


def _state(mesh, dim: int, fill: bool) -> dict:
    out = {}
    for i, shape in enumerate(SHAPES):
        full = make_tensor(shape, _dtype(i), seed=i)
        out[f"t{i}"] = make_dtensor(full if fill else torch.zeros_like(full), mesh, [Shard(dim)])
        out[f"t{i}"].test_full = full
    return out


def rank_shard0_to_shard1(rank: int, ws: int, path: str, corrupt_row: int | None) -> str:
    mesh = init_device_mesh("cpu", (ws,))
    if corrupt_row is None:
        save(_state(mesh, 0, True), path)
        tiles = json.load(open(os.path.join(path, ".metadata")))["entries"]["t0"]["store"]["grid"]["tiles"]
        assert tiles > 1, tiles
    target = _state(mesh, 1, False)
    reader = FileSystemReader(path)
    try:
        load(target, storage_reader=reader)
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    for k, v in target.items():
        assert torch.equal(bits(v.to_local()), bits(local_expected(v.test_full, mesh, [Shard(1)]).contiguous())), k
    return "ok"


def test_shard0_to_shard1_of_many_small_tensors_on_two_ranks_is_bit_exact_and_corruption_is_caught(tmp_path):
    path = str(tmp_path / "ckpt")
    assert run_ranks(rank_shard0_to_shard1, 2, path, None) == ["ok", "ok"]
    full = make_tensor(SHAPES[7], torch.float32, seed=7)
    name = _flip_byte_of_row(path, full, 3)
    # Every rank reads rows of every file (it wants a column band of each row): both see it.
    msgs = run_ranks(rank_shard0_to_shard1, 2, path, 3)
    for msg in msgs:
        assert "'t7'" in msg and name in msg and "checksum mismatch" in msg, msg
    # rank 0 reads t7's band 0 (the flipped byte is in row 3's first columns); whichever ranks
    # saw it, every rank fails naming the rank, the key and the file
    assert "[rank 0] CorruptCheckpointError" in msgs[0] and msgs[0] == msgs[1], msgs


def test_a_load_reuses_its_scratch_memory_instead_of_faulting_in_fresh_buffers(tmp_path, monkeypatch):
    # 64 MiB in 8 tensors, read through scratch runs (torch's tensors are not page-aligned):
    # the load holds its working set in the pool, so runs after the first few land in memory
    # already faulted in. Before, idle small buffers kept every run buffer out of the pool
    # and each run got fresh memory (the whole state's size in page faults).
    from hyper_parallel.core.distributed_checkpoint._src.backends import direct_io

    sd = {f"w{i}": make_tensor((2048, 1024), seed=i) for i in range(8)}
    path = str(tmp_path / "ckpt")
    save(sd, path, no_dist=True)
    pool = direct_io.AlignedPool(size=32 << 20)
    monkeypatch.setattr(direct_io, "POOL", pool)
    clog = [pool.get(1 << 20) for _ in range(64)]  # idle small buffers fill the pool's keep
    del clog
    fresh = []
    real = direct_io.aligned_array
    monkeypatch.setattr(direct_io, "aligned_array", lambda n, *a: fresh.append(n) or real(n, *a))
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    load(target, path, storage_reader=FileSystemReader(path, direct_io=None), no_dist=True, thread_count=1)
    assert all(torch.equal(bits(target[k]), bits(v)) for k, v in sd.items())
    total = sum(v.nbytes for v in sd.values())
    assert sum(fresh) <= total // 2, (sum(fresh), total)  # was: the whole state


def test_a_load_over_many_files_keeps_only_a_bounded_cache_of_their_indexes(tmp_path):
    sd = {f"w{i}": make_tensor((64, 4), seed=i) for i in range(3)}
    dst = rows_over_ranks(sd, tmp_path)
    reader = FileSystemReader(dst)
    cache = loader.index_cache(reader)
    cache.max_bytes = 1  # keeps one index at a time: each file's chunks are found right after its index is read
    target = {k: torch.zeros(64, 4) for k in sd}
    load(target, storage_reader=reader)
    assert all(torch.equal(target[k], v) for k, v in sd.items())
    assert len(cache._indexes) == 1
