"""Loads through HyperParallel's ``filesystem_storage.safe_open`` while a caller has replaced it
(backends/opener_reads.py): the bytes really come through the opener, the loader's checksums
still hold, and the library's own opener leaves the fast path alone."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from helpers import local_expected, make_dtensor, make_tensor
from multiprocess import run_ranks
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import CorruptCheckpointError, filesystem_storage, load, save
from hyper_parallel.core.distributed_checkpoint._src.backends.filesystem import FileSystemReader
from hyper_parallel.core.distributed_checkpoint._src.backends.opener_reads import OpenerReads, installed_opener


def _state() -> dict:
    return {
        "w": make_tensor((300, 70)),  # rows span several checksum blocks' worth of reads
        "half": make_tensor((33, 5)).to(torch.bfloat16),
        "ids": torch.arange(17, dtype=torch.int64),
        "mask": torch.arange(10) % 3 == 0,
        "scale": torch.tensor(2.5),
        "e": torch.zeros(0, 4),
    }


def _zeros_like(sd: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _data_files(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))


def test_the_library_opener_is_not_an_installed_one():
    assert filesystem_storage.safe_open is safe_open
    assert installed_opener() is None


def test_a_replaced_safe_open_serves_every_data_read_and_the_values_are_exact(tmp_path):
    root = str(tmp_path / "ck")
    sd = _state()
    save(sd, checkpoint_id=root)
    out = _zeros_like(sd)
    with mock.patch.object(filesystem_storage, "safe_open", wraps=filesystem_storage.safe_open) as opener:
        assert installed_opener() is opener
        load(out, checkpoint_id=root)
    opened = sorted(os.path.basename(c.args[0]) for c in opener.call_args_list)
    assert opened and set(opened) == set(_data_files(root))
    for k, v in sd.items():
        assert torch.equal(out[k], v), k
    assert installed_opener() is None  # restored: the next load reads with preadv again


def test_any_byte_range_through_the_opener_equals_the_file(tmp_path):
    root = str(tmp_path / "ck")
    save(_state(), checkpoint_id=root)
    name = _data_files(root)[0]
    with open(os.path.join(root, name), "rb") as f:
        whole = f.read()
    reader = FileSystemReader(root)
    reads = OpenerReads(reader, lambda n: os.path.join(root, n))
    try:
        for lo, hi in [(0, len(whole)), (3, 11), (len(whole) - 100, len(whole)), (4095, 4099 + 1000)]:
            buf = bytearray(hi - lo)
            reads.read_into(name, lo, buf, safe_open)
            assert bytes(buf) == whole[lo:hi], (lo, hi)
        with pytest.raises(CorruptCheckpointError, match="past its last entry"):
            reads.read_into(name, len(whole) - 4, bytearray(8), safe_open)
    finally:
        reads.close()
        reader.close()


class _Skewed:
    """An opened file whose slices come back changed: what a wrong custom opener would return."""

    def __init__(self, inner):
        self._inner = inner

    def get_slice(self, name):
        inner = self._inner.get_slice(name)

        class _Slice:
            def __getitem__(self, index):
                t = inner[index].clone()
                if t.dtype.is_floating_point and t.numel():
                    t.view(-1)[0] += 1
                return t
        return _Slice()

    def get_tensor(self, name):
        return self._inner.get_tensor(name)

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


def test_bytes_an_opener_changed_fail_the_checksums(tmp_path):
    root = str(tmp_path / "ck")
    sd = {"w": make_tensor((64, 8))}
    save(sd, checkpoint_id=root)

    def skewed_open(path, framework, device="cpu"):
        return _Skewed(safe_open(path, framework=framework, device=device))

    with mock.patch.object(filesystem_storage, "safe_open", skewed_open), \
            pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        load(_zeros_like(sd), checkpoint_id=root)


def _rank_reshard(rank: int, ws: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    full = make_tensor((12, 6))
    save({"w": make_dtensor(full, mesh, [Shard(0)])}, checkpoint_id=root)
    out = {"w": make_dtensor(torch.zeros(12, 6), mesh, [Shard(1)])}
    with mock.patch.object(filesystem_storage, "safe_open", wraps=filesystem_storage.safe_open) as opener:
        load(out, checkpoint_id=root)
    return {"called": opener.called, "exact": torch.equal(out["w"].to_local(), local_expected(full, mesh, [Shard(1)]))}


def test_a_resharding_load_on_two_ranks_goes_through_the_opener(tmp_path):
    for out in run_ranks(_rank_reshard, 2, str(tmp_path / "ck")):
        assert out == {"called": True, "exact": True}
