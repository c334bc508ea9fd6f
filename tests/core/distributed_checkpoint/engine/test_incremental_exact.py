"""Incremental steps are exact by default: every committed step loads bit-exact to the state at
its call, whatever wrote the memory — including the writes torch's version counter never sees
(``.data``, numpy views, DLPack, ``untyped_storage()`` aliases, ctypes, ``set_``). The opt-in
``incremental_check="version_counter"`` misses the sparse ones, as documented."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
from helpers import bits, make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from hyper_parallel.core.distributed_checkpoint import CheckpointManager, load
from hyper_parallel.core.distributed_checkpoint._src.format.metadata import step_dir_name

SHAPE = (512, 1024)  # 2 MiB of fp32: stored as column bands, larger than a spot check reads whole

KINDS = ("data", "numpy", "dlpack", "untyped_storage", "ctypes", "set_")
# one element and a few rows that no spot check reads (pieces sit at evenly spread places), the whole tensor
EXTENTS = {"one element": (7, 300), "a few rows": slice(200, 203), "whole tensor": slice(None)}


def write_behind(t: torch.Tensor, kind: str, region, delta: float = 1.5) -> None:
    """Add ``delta`` to ``t[region]`` in a way that does not move ``t``'s version counter
    (``set_`` swaps in other memory instead)."""
    before = t._version
    if kind == "data":
        t.data[region] += delta
    elif kind == "numpy":
        t.detach().numpy()[region] += delta
    elif kind == "dlpack":
        torch.from_dlpack(t.detach())[region] += delta
    elif kind == "untyped_storage":  # another tensor over the same storage: its own counter
        alias = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
        alias[region] += delta
    elif kind == "ctypes":  # a raw-pointer kernel
        new = t.detach().clone()
        new[region] += delta
        ctypes.memmove(t.data_ptr(), new.data_ptr(), t.numel() * t.element_size())
    elif kind == "set_":
        new = t.detach().clone()
        new[region] += delta
        with torch.no_grad():
            t.set_(new)
    else:
        raise ValueError(kind)
    assert kind == "set_" or t._version == before, f"{kind}: the write moved the version counter"


def snapshot(sd: dict) -> dict:
    return {k: v.detach().clone() for k, v in sd.items()}


def stale_steps(root: str, saved: list[dict]) -> dict[int, list[str]]:
    """Steps whose loaded bytes differ from the state at their call: {step: [keys]}."""
    bad = {}
    for step, want in enumerate(saved, 1):
        out = load(path=os.path.join(root, step_dir_name(step)))
        keys = [k for k, v in want.items() if not torch.equal(bits(out[k]), bits(v))]
        if keys:
            bad[step] = keys
    return bad


def run_steps(root: str, kind: str, region, steps: int = 5, **manager) -> dict[int, list[str]]:
    """Save ``steps`` steps of a state, writing behind the counter into one key before steps 2
    and 4 and changing a trainable key in place every step; return the stale steps."""
    sd = {"w": make_tensor(SHAPE, seed=1), "v": make_tensor((1 << 18,), seed=2), "lora": make_tensor((64, 16), seed=3)}
    saved = []
    with CheckpointManager(root, incremental=True, **manager) as mgr:
        for step in range(1, steps + 1):
            if step == 2:
                write_behind(sd["w"], kind, region)
            if step == 4:
                write_behind(sd["v"], kind, region if not isinstance(region, tuple) else 1000)
            saved.append(snapshot(sd))
            mgr.save(step, sd)
            sd["lora"].add_(1.0)  # through torch: the counter moves
        mgr.wait()
    return stale_steps(root, saved)


@pytest.mark.parametrize("extent", list(EXTENTS))
@pytest.mark.parametrize("kind", KINDS)
def test_every_step_is_exact_by_default_whatever_wrote_the_memory(tmp_path, kind, extent):
    assert run_steps(str(tmp_path / "run"), kind, EXTENTS[extent]) == {}


@pytest.mark.parametrize("kind", KINDS)
def test_every_async_step_is_exact_by_default(tmp_path, kind):
    for extent, region in EXTENTS.items():
        got = run_steps(str(tmp_path / extent.replace(" ", "_")), kind, region, async_save=True)
        assert got == {}, (extent, got)


def test_the_version_counter_opt_in_commits_a_sparse_write_stale_as_documented(tmp_path):
    # the reason the default is "content": one element changed through .data stays unseen by the
    # counter and the spot check until the rotating re-hash reaches it
    got = run_steps(str(tmp_path / "run"), "data", EXTENTS["one element"],
                    incremental_check="version_counter", incremental_rehash_every=8)
    assert 2 in got and got[2] == ["w"], got


def test_an_exact_step_reuses_what_did_not_change_and_hashes_every_chunk(tmp_path):
    sd = {"w": make_tensor(SHAPE, seed=1), "lora": make_tensor((64, 16), seed=3)}
    nbytes = SHAPE[0] * SHAPE[1] * 4
    with CheckpointManager(str(tmp_path / "run"), incremental=True) as mgr:
        mgr.save(1, sd)
        sd["lora"].add_(1.0)
        mgr.save(2, sd)
        st = mgr.incremental_stats
    assert st.unread_bytes == 0 and st.hashed_bytes >= nbytes, st  # nothing reused unread
    assert st.written_bytes == 64 * 16 * 4, st  # only the changed key written


def test_incremental_check_is_validated_and_rehash_every_needs_the_opt_in(tmp_path):
    with pytest.raises(ValueError, match="incremental_check must be one of"):
        CheckpointManager(str(tmp_path / "a"), incremental=True, incremental_check="stamps")
    with pytest.raises(ValueError, match="configures incremental_check='version_counter'"):
        CheckpointManager(str(tmp_path / "b"), incremental=True, incremental_rehash_every=4)
    with pytest.raises(ValueError, match="incremental saves, which are off"):
        CheckpointManager(str(tmp_path / "c"), incremental_check="version_counter")
    with CheckpointManager(str(tmp_path / "d"), incremental=True, incremental_rehash_every=1) as mgr:
        assert mgr.incremental_check == "content"  # 1 is what the default does anyway


def rank_exact_dtensor_steps(rank: int, ws: int, root: str, async_save: bool) -> dict[int, list[str]]:
    """Every kind of write behind the counter, one per step, into this rank's local shards."""
    mesh = init_device_mesh("cpu", (ws,))
    sd = {"w": make_dtensor(make_tensor((1024, 1024), seed=1), mesh, [Shard(0)]),
          "v": make_dtensor(make_tensor((1024, 1024), seed=2), mesh, [Shard(1)])}
    regions = list(EXTENTS.values())
    saved = []
    with CheckpointManager(root, incremental=True, async_save=async_save) as mgr:
        for step in range(1, len(KINDS) + 2):
            if step > 1:
                kind = KINDS[step - 2]
                key = "w" if step % 2 else "v"
                write_behind(sd[key].to_local(), kind, regions[(step + rank) % len(regions)])
            saved.append({k: v.to_local().clone() for k, v in sd.items()})
            mgr.save(step, sd)
        mgr.wait()
        bad: dict[int, list[str]] = {}
        for step, want in enumerate(saved, 1):
            target = {k: DTensor.from_local(torch.zeros_like(v.to_local()), mesh, v.placements,
                                            shape=v.shape, stride=v.stride()) for k, v in sd.items()}
            assert mgr.load(target, step=step) == step
            keys = [k for k in want if not torch.equal(bits(target[k].to_local()), bits(want[k]))]
            if keys:
                bad[step] = keys
    return bad


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_dtensor_shards_on_two_ranks_are_exact_by_default(tmp_path, async_save):
    results = run_ranks(rank_exact_dtensor_steps, 2, str(tmp_path / "run"), async_save, timeout_s=180)
    assert results == [{}, {}], results
