"""An async save stages large 2-D tensors as the column bands the data file holds, so the
background write copies nothing: the same bytes as a synchronous save, no gathering."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer, StandardPlanner, load, save
from hyper_parallel.core.distributed_checkpoint._src.planning.staged_bands import BandedSnapshot, band_columns
from hyper_parallel.core.distributed_checkpoint._src.transfer import saver as saver_module


def _payloads(path: str) -> dict[str, bytes]:
    """Each data file's bytes after its safetensors header (which names the save id), by rank."""
    out = {}
    for name in os.listdir(path):
        if name.startswith("data-"):
            raw = open(os.path.join(path, name), "rb").read()
            out[name.split("-")[1]] = raw[8 + int.from_bytes(raw[:8], "little"):]
    return out


def _no_gathering(monkeypatch) -> None:
    """Fail the test if the saver gathers strided bands or the bands are put back together."""
    def gather(*args, **kwargs):
        raise AssertionError("the saver gathered bands an async save had staged contiguously")

    region = BandedSnapshot.region

    def band_only(self, index):
        out = region(self, index)
        assert any(out is band for band in self.bands), "the save asked for a region that is not one band"
        return out

    monkeypatch.setattr(saver_module, "_gather_bands", gather)
    monkeypatch.setattr(BandedSnapshot, "region", band_only)


def _state(seed: int) -> dict:
    return {"gaps": make_tensor((600, 784), seed=seed),  # bands 4 KiB-aligned with padding between
            "bf16": make_tensor((3000, 784), torch.bfloat16, seed=seed + 1),
            "three_d": make_tensor((300, 512, 2), seed=seed + 2),
            "transposed": make_tensor((512, 700), seed=seed + 3).t(),  # a strided source
            "uneven": make_tensor((1000, 1001), seed=seed + 4),  # bands of unequal widths
            "small": make_tensor((10, 10), seed=seed + 5),
            "vec": make_tensor((100_000,), seed=seed + 6)}


@pytest.mark.parametrize("staging", ["eager", "lazy"])
@pytest.mark.parametrize("stage_bands", [None, True])
def test_async_saves_write_staged_bands_as_they_are_with_a_sync_saves_bytes(tmp_path, monkeypatch, staging,
                                                                            stage_bands):
    ckpt = AsyncCheckpointer(stage_bands=stage_bands)  # None (the default) stages bands too
    sd = _state(0)
    save(sd, str(tmp_path / "sync"), no_dist=True)
    _no_gathering(monkeypatch)
    ckpt.save(sd, str(tmp_path / "async0"), no_dist=True, staging=staging).result(timeout=60)
    assert _payloads(str(tmp_path / "async0")) == _payloads(str(tmp_path / "sync"))
    for step in (1, 2):  # the buffer is reused: each save holds the values of its own call
        expected = {k: v.clone() for k, v in sd.items()}
        resp = ckpt.save(sd, str(tmp_path / f"async{step}"), no_dist=True, staging=staging)
        resp.wait_staged(timeout=60)
        for v in sd.values():
            v.add_(1)
        resp.result(timeout=60)
        out = load(path=str(tmp_path / f"async{step}"), no_dist=True)
        assert all(torch.equal(out[k], expected[k]) for k in sd)
    assert ckpt.stats.allocations == 1 and ckpt.stats.reuses == 2
    ckpt.close()


class _RenamingPlanner(StandardPlanner):
    def transform_key(self, key):
        return "renamed." + key


class _OwnData(StandardPlanner):
    """Resolves write data its own way: it must get row-major tensors, not staged bands."""

    def resolve_data(self, item):
        value = super().resolve_data(item)
        assert isinstance(value, torch.Tensor) and value.device.type == "cpu"
        return value


class _Casting(StandardPlanner):
    """Transforms the values themselves: it must get the tensors, not stand-ins."""

    def transform_state_dict(self, state_dict):
        return {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}


@pytest.mark.parametrize("planner", [_RenamingPlanner, _OwnData, _Casting])
def test_planner_subclasses_save_the_same_bytes(tmp_path, planner):
    sd = _state(3)
    save(sd, str(tmp_path / "sync"), planner=planner(), no_dist=True)
    ckpt = AsyncCheckpointer(stage_bands=True)
    ckpt.save(sd, str(tmp_path / "async"), planner=planner(), no_dist=True).result(timeout=60)
    ckpt.close()
    assert _payloads(str(tmp_path / "async")) == _payloads(str(tmp_path / "sync"))


def test_a_planner_without_bands_stages_row_major(tmp_path, monkeypatch):
    planner = StandardPlanner()
    planner.max_tiles = 1
    sd = _state(4)
    assert all(planner.staging_bands(k, v) == 1 for k, v in sd.items())
    assert StandardPlanner().staging_bands("gaps", sd["gaps"]) == 4
    assert _OwnData().staging_bands("gaps", sd["gaps"]) == 1
    _no_gathering(monkeypatch)
    ckpt = AsyncCheckpointer(stage_bands=True)
    ckpt.save(sd, str(tmp_path / "c"), planner=planner, no_dist=True).result(timeout=60)
    ckpt.close()
    out = load(path=str(tmp_path / "c"), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_a_region_that_is_not_one_band_comes_from_the_bands_it_covers():
    full = make_tensor((6, 10, 3))
    cols = band_columns(10, 4)
    assert cols == [(0, 3), (3, 3), (6, 3), (9, 1)]
    bands = [full[:, lo:lo + n].clone() for lo, n in cols]
    snap = BandedSnapshot(torch.empty(full.shape, device="meta"), bands, cols)
    assert snap.region((slice(0, 6), slice(3, 6), slice(0, 3))) is bands[1]
    for index in [(slice(0, 6), slice(2, 7), slice(0, 3)), (slice(1, 3), slice(3, 6), slice(0, 3)),
                  (slice(0, 6), slice(0, 10), slice(0, 3)), (slice(2, 4), slice(4, 5), slice(1, 2)),
                  (slice(0, 6), slice(5, 5), slice(0, 3))]:
        assert torch.equal(snap.region(index), full[index]), index
    bands[0].add_(1)  # a later save's snapshot into the same buffer: nothing stale is kept
    assert torch.equal(snap.region((slice(0, 6), slice(0, 10), slice(0, 3)))[:, :3], full[:, :3] + 1)


class _OwnTiles(StandardPlanner):
    """Decides bands by the checkpoint key, which renaming changes: staging must not guess."""

    def transform_key(self, key):
        return "v2." + key

    def tiles(self, key, spec):
        return {"v2.gaps": 2, "v2.uneven": 8, "v2.small": 1}[key]  # any other key is a bug


def test_rank_local_saves_and_planners_deciding_bands_by_key_stage_row_major(tmp_path, monkeypatch):
    sd = {k: v for k, v in _state(6).items() if k in ("gaps", "uneven", "small")}
    regions = []
    region = BandedSnapshot.region
    monkeypatch.setattr(BandedSnapshot, "region", lambda self, index: regions.append(index) or region(self, index))
    ckpt = AsyncCheckpointer(stage_bands=True)
    save(sd, str(tmp_path / "sync"), planner=_OwnTiles(), no_dist=True)
    ckpt.save(sd, str(tmp_path / "async"), planner=_OwnTiles(), no_dist=True, staging="lazy").result(timeout=60)
    assert _payloads(str(tmp_path / "async")) == _payloads(str(tmp_path / "sync"))
    ckpt.save(sd, str(tmp_path / "local"), use_collectives=False).result(timeout=60)  # chunks whole
    ckpt.close()
    out = load(path=str(tmp_path / "local"), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    assert regions == []  # nothing was staged as bands


def rank_dtensors(rank: int, ws: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    sd = {"s0": make_dtensor(make_tensor((1024, 600), seed=1), mesh, [Shard(0)]),
          "s1": make_dtensor(make_tensor((640, 2048), seed=2), mesh, [Shard(1)]),
          "uneven_s1": make_dtensor(make_tensor((500, 2049), seed=3), mesh, [Shard(1)]),
          "rep": make_dtensor(make_tensor((512, 512), seed=4), mesh, [Replicate()]),
          "plain": make_tensor((256, 1024), seed=5)}
    save(sd, os.path.join(root, "sync"))
    mp = pytest.MonkeyPatch()
    try:
        _no_gathering(mp)
        ckpt = AsyncCheckpointer(stage_bands=True)
        ckpt.save(sd, os.path.join(root, "async")).result(timeout=60)
        ckpt.close()
    finally:
        mp.undo()
    # loaded under another layout, and whole by one process
    other = init_device_mesh("cpu", (ws,))
    target = {k: make_dtensor(torch.zeros(v.shape), other, [Shard(1) if k == "s0" else Shard(0)])
              for k, v in sd.items() if k != "plain"}
    load(target, os.path.join(root, "async"))
    for k, t in target.items():
        full = sd[k].test_full
        want = make_dtensor(full, other, [Shard(1) if k == "s0" else Shard(0)]).to_local()
        assert torch.equal(t.to_local(), want), k
    return _payloads(os.path.join(root, "sync")) == _payloads(os.path.join(root, "async"))


def test_sharded_dtensors_staged_as_bands_save_a_sync_saves_bytes_on_two_ranks(tmp_path):
    assert run_ranks(rank_dtensors, 2, str(tmp_path)) == [True, True]


def test_stage_bands_false_stages_row_major_and_stage_bands_is_checked(tmp_path, monkeypatch):
    sd = _state(5)
    gathered = []
    gather = saver_module._gather_bands
    monkeypatch.setattr(saver_module, "_gather_bands", lambda *a: gathered.append(1) or gather(*a))
    save(sd, str(tmp_path / "sync"), no_dist=True)
    ckpt = AsyncCheckpointer(stage_bands=False)  # the fastest snapshot (a flat copy); the saver gathers bands
    ckpt.save(sd, str(tmp_path / "c"), no_dist=True).result(timeout=60)
    ckpt.close()
    assert gathered and _payloads(str(tmp_path / "c")) == _payloads(str(tmp_path / "sync"))
    with pytest.raises(ValueError, match="stage_bands"):
        AsyncCheckpointer(stage_bands="yes")
