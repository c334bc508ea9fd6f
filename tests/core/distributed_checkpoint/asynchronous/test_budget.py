"""AsyncCheckpointer(max_host_bytes=N): a state larger than N is staged and written in bounded
pieces through one reused ring; the checkpoint is the one a sync save writes, byte for byte.

Budgets here are 16 MiB (the minimum) against states of 64 MiB or more (a quarter or less).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from helpers import assert_same, make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    FileSystemWriter,
    StandardPlanner,
    UnsupportedValueError,
    load,
    register_optimizer_hook,
    save,
)
from hyper_parallel.core.distributed_checkpoint._src.asynchronous.buffers import StagingRing
from hyper_parallel.core.distributed_checkpoint._src.asynchronous.streamed_staging import MIN_HOST_BYTES, slabs

MiB = 1 << 20
BUDGET = 16 * MiB


def _payloads(path: str) -> dict[str, bytes]:
    """Each data file's bytes after its safetensors header (which names the save id), by rank."""
    out = {}
    for name in os.listdir(path):
        if name.startswith("data-"):
            with open(os.path.join(path, name), "rb") as f:
                raw = f.read()
            out[name.split("-")[1]] = raw[8 + int.from_bytes(raw[:8], "little"):]
    return out


def _tensor_bytes(sd: dict) -> int:
    total = 0
    for v in sd.values():
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def _clone(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(v.to_local().clone(), v.device_mesh, v.placements, shape=v.shape,
                                        stride=v.stride(), run_check=False)
        elif isinstance(v, torch.Tensor):
            out[k] = v.clone()
        elif isinstance(v, np.ndarray):
            out[k] = v.copy()
        else:
            out[k] = v
    return out


def _mutate(sd: dict) -> None:
    """What training does right after the call: every tensor changes in place."""
    with torch.no_grad():
        for v in sd.values():
            local = v.to_local() if isinstance(v, DTensor) else v
            if isinstance(local, torch.Tensor):
                local.logical_not_() if local.dtype == torch.bool else local.add_(7)
            elif isinstance(local, np.ndarray):
                local += 7


def _state(seed: int = 0) -> dict:
    """64 MiB: tensors larger than the ring, rows larger than a piece, strided sources, odd dtypes."""
    return {
        "big": make_tensor((2048, 4096), seed=seed),  # 32 MiB: cut into column bands, then row slabs
        "wide": make_tensor((2, 3 << 20), seed=seed + 1),  # 24 MiB: a band's row (3 MiB) is cut too
        "strided": make_tensor((1024, 2048), seed=seed + 2)[:, ::2],  # 4 MiB, not contiguous
        "bf16": make_tensor((2048, 1024), torch.bfloat16, seed=seed + 3),
        "transposed": make_tensor((512, 700), seed=seed + 4).t(),
        "ints": make_tensor((1000,), torch.int64, seed=seed + 5),
        "flags": make_tensor((333,), torch.bool, seed=seed + 6),
        "step": torch.tensor(3.0),
        "array": np.arange(1000, dtype=np.float32),  # copied whole at the call
        "lr": 0.5,
    }


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("staging", ["eager", "lazy"])
def test_a_save_four_times_the_budget_holds_the_call_time_values_bytes_of_a_sync_save(tmp_path, staging):
    sd = _state()
    assert _tensor_bytes(sd) >= 4 * BUDGET
    save(sd, str(tmp_path / "sync"), no_dist=True)
    expected = _clone(sd)
    ckpt = AsyncCheckpointer(max_host_bytes=BUDGET)
    for step in range(2):  # the second save reuses the ring
        resp = ckpt.save(sd, str(tmp_path / f"budget{step}"), no_dist=True, staging=staging)
        if staging == "lazy":
            assert resp.blocking_s < resp_staging_s(resp)  # returned before the snapshot was complete
        assert resp.staged()  # (after wait_staged for lazy)
        _mutate(sd)  # must not reach the checkpoint
        resp.result(timeout=120)
        assert resp.peak_staged_bytes is not None and 0 < resp.peak_staged_bytes <= BUDGET
        assert_same(load(path=str(tmp_path / f"budget{step}"), no_dist=True), expected)
        assert _payloads(str(tmp_path / f"budget{step}")) == _payloads(str(tmp_path / "sync"))
        for k, v in expected.items():  # back to the saved values for the next save
            if isinstance(v, torch.Tensor):
                sd[k].copy_(v)
            elif isinstance(v, np.ndarray):
                sd[k][...] = v
    assert ckpt.stats.allocations == 1 and ckpt.stats.allocated_bytes == BUDGET
    assert ckpt.stats.peak_staged_bytes <= BUDGET
    ckpt.close()
    assert ckpt.stats.held_bytes == 0


def resp_staging_s(resp) -> float:
    """Wait for a lazy snapshot; return the seconds from the call until it was complete."""
    resp.wait_staged(timeout=120)
    return resp.staging_s


def test_the_optimizer_hook_holds_the_step_until_a_lazy_budgeted_snapshot_is_complete(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096)  # 64 MiB of weights: four times the budget
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ckpt = AsyncCheckpointer(max_host_bytes=BUDGET)
    handle = register_optimizer_hook(opt, ckpt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(8, 4096)).sum().backward()
    resp = ckpt.save(model.state_dict(), str(tmp_path / "ck"), no_dist=True, staging="lazy")
    opt.step()  # waits for the snapshot, then changes every weight
    assert resp.staged()
    resp.result(timeout=120)
    handle.remove()
    assert not torch.equal(model.weight, before["weight"])
    assert_same(load(path=str(tmp_path / "ck"), no_dist=True), before)
    assert resp.peak_staged_bytes <= BUDGET
    ckpt.close()


def test_a_state_within_the_budget_is_saved_as_at_the_call(tmp_path):
    sd = {"w": make_tensor((1024, 1024)), "b": make_tensor((1024,))}  # 4 MiB
    expected = _clone(sd)
    ckpt = AsyncCheckpointer(max_host_bytes=BUDGET)
    resp = ckpt.save(sd, str(tmp_path / "ck"), no_dist=True)
    _mutate(sd)
    resp.result(timeout=60)
    assert 0 < resp.peak_staged_bytes <= _tensor_bytes(expected)  # the writer may take pieces meanwhile
    assert_same(load(path=str(tmp_path / "ck"), no_dist=True), expected)
    ckpt.close()


class _FailingWriter(FileSystemWriter):
    """Fails after ``parts`` parts of its data file: a crash in the middle of the write."""

    def __init__(self, path: str, parts: int):
        super().__init__(path)
        self.parts = parts

    def write_file(self, name, parts):
        def failing():
            for i, part in enumerate(parts):
                if i == self.parts:
                    raise OSError(28, "No space left on device (injected)")
                yield part
        return super().write_file(name, failing())


def test_a_failure_mid_save_keeps_the_previous_checkpoint_and_the_ring_works_again(tmp_path):
    path = str(tmp_path / "ck")
    sd = _state(1)
    old = _clone(sd)
    ckpt = AsyncCheckpointer(max_host_bytes=BUDGET)
    ckpt.save(sd, path, no_dist=True).result(timeout=120)
    _mutate(sd)
    resp = ckpt.save(sd, storage_writer=_FailingWriter(path, parts=5), no_dist=True)
    with pytest.raises(OSError, match="injected"):
        resp.result(timeout=120)
    assert resp.staged()  # the caller is never left waiting for a snapshot that will not complete
    assert_same(load(path=path, no_dist=True), old)  # the committed checkpoint is intact
    new = _clone(sd)
    with pytest.raises(CheckpointError):  # the failure is reported once more, then saves go on
        ckpt.save(sd, path, no_dist=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = ckpt.save(sd, path, no_dist=True)
        again.result(timeout=120)
    # pieces the failed save's writer held may still be referred to: then a new ring, said so
    assert all("uses a new staging ring" in str(w.message) for w in seen), [str(w.message) for w in seen]
    assert ckpt.stats.allocations == 1 + len(seen) and again.peak_staged_bytes <= BUDGET
    assert_same(load(path=path, no_dist=True), new)
    ckpt.close()


class _Renaming(StandardPlanner):
    def transform_key(self, key):
        return "renamed." + key


class _OwnData(StandardPlanner):
    def resolve_data(self, item):
        return super().resolve_data(item)


def test_a_planner_that_renames_keys_streams_and_one_that_resolves_data_is_refused(tmp_path):
    sd = {"w": make_tensor((4096, 1024))}
    ckpt = AsyncCheckpointer(max_host_bytes=BUDGET)
    ckpt.save(sd, str(tmp_path / "renamed"), no_dist=True, planner=_Renaming()).result(timeout=60)
    assert torch.equal(load(path=str(tmp_path / "renamed"), no_dist=True)["renamed"]["w"], sd["w"])
    with pytest.raises(UnsupportedValueError, match="_OwnData .*resolves write data its own way"):
        ckpt.save(sd, str(tmp_path / "own"), no_dist=True, planner=_OwnData())
    ckpt.close()


def test_bad_budgets_are_refused_with_the_minimum_named():
    for bad in (0, -1, 1000, MIN_HOST_BYTES - 1):
        with pytest.raises(ValueError, match="max_host_bytes must be at least 16777216"):
            AsyncCheckpointer(max_host_bytes=bad)
    for bad in (1.5e9, "1G", True):
        with pytest.raises(TypeError, match="max_host_bytes must be an int"):
            AsyncCheckpointer(max_host_bytes=bad)
    ckpt = AsyncCheckpointer(max_host_bytes=BUDGET)
    with pytest.raises(ValueError, match="too small for thread_count=2.*pass thread_count=1"):
        ckpt.save({"w": torch.ones(4)}, "/nonexistent/never-written", no_dist=True, thread_count=2)
    ckpt.close()


def test_numpy_arrays_that_leave_too_little_of_the_budget_fail_the_save_clearly(tmp_path):
    ckpt = AsyncCheckpointer(max_host_bytes=BUDGET)
    resp = ckpt.save({"a": np.zeros(MiB, dtype=np.float32)}, str(tmp_path / "ck"), no_dist=True)
    with pytest.raises(Exception, match="numpy arrays .*'a'.* take 4194304 bytes"):
        resp.result(timeout=60)
    assert not os.path.exists(tmp_path / "ck" / ".metadata")
    with pytest.raises(CheckpointError):
        ckpt.close()


# ----------------------------------------------------------------------------- the ring


def test_ring_memory_is_reused_only_once_nothing_refers_to_a_piece():
    ring = StagingRing(1 * MiB, pinned=False)
    ring.start(1 * MiB)
    target, piece = ring.take(MiB, 64)
    target.fill_(1)
    del target
    held = memoryview(piece)[100:200]  # e.g. a part a storage writer still has queued
    del piece
    with pytest.raises(CheckpointError, match="no staged piece was written for 0s.*holds 1048576 bytes"):
        ring.take(4096, 64, stall_s=0.2)
    assert bytes(held) == b"\x01" * 100
    del held
    target, piece = ring.take(MiB, 64)  # now free
    assert ring.in_use == MiB and ring.peak == MiB
    del target, piece
    assert ring.in_use == 0


def test_ring_hands_out_pieces_in_order_and_wraps_around():
    ring = StagingRing(64 << 10, pinned=False)
    ring.start(64 << 10)
    pieces = [ring.take(20 << 10, 4096) for _ in range(3)]  # [0, 20K) [20K, 40K) [40K, 60K)
    starts = [t.data_ptr() - ring.flat.data_ptr() for t, _ in pieces]
    assert starts == [0, 20 << 10, 40 << 10]
    del pieces[0]  # the oldest comes back: the next piece wraps to the start
    t, p = ring.take(16 << 10, 4096)
    assert t.data_ptr() == ring.flat.data_ptr()
    ring.stop(CheckpointError("stopped"))
    with pytest.raises(CheckpointError, match="stopped"):
        ring.take(4096, 64)


def test_slabs_cover_a_tensor_in_row_major_order_within_the_limit():
    cases = [make_tensor((300, 70)), make_tensor((300, 140))[:, ::2], make_tensor((3, 5000)).t(),
             make_tensor((4, 6, 5000))[:, ::2], make_tensor((5,), torch.int64), torch.tensor(2.5),
             make_tensor((2, 40000))[:, 1:]]
    for t in cases:
        for limit in (64, 4096, 10_000, 1 << 20):
            parts = list(slabs(t, limit))
            assert all(p.numel() * p.element_size() <= max(limit, t.element_size()) for p in parts)
            joined = torch.cat([p.contiguous().reshape(-1) for p in parts])
            assert torch.equal(joined, t.contiguous().reshape(-1)), (tuple(t.shape), limit)


# ----------------------------------------------------------------------------- 2 ranks


def _rank_state(ws: int, seed: int) -> dict:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    return {
        "s0": make_dtensor(make_tensor((4096, 4096), seed=seed), mesh, [Shard(0)]),  # 32 MiB a rank
        "s1": make_dtensor(make_tensor((2048, 4096), seed=seed + 1), mesh, [Shard(1)]),  # 16 MiB a rank
        "rep": make_dtensor(make_tensor((2048, 2048), seed=seed + 2), mesh, [Replicate()]),  # 16 MiB, half written
        "half": make_dtensor(make_tensor((1000, 300), torch.bfloat16, seed=seed + 3), mesh, [Shard(0)]),
        "plain": make_tensor((300, 7), seed=seed + 4),
        "step": 5,
    }


def rank_budgeted_saves(rank: int, ws: int, root: str) -> list[int]:
    sd = _rank_state(ws, 0)
    assert _tensor_bytes(sd) >= 4 * BUDGET
    save(sd, os.path.join(root, "sync"))
    ckpt = AsyncCheckpointer(max_host_bytes=BUDGET)
    peaks = []
    for staging in ("eager", "lazy"):
        expected = _clone(sd)
        resp = ckpt.save(sd, os.path.join(root, staging), staging=staging)
        resp.wait_staged(timeout=120)
        _mutate(sd)
        resp.result(timeout=120)
        peaks.append(resp.peak_staged_bytes)
        target = {k: (DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                         shape=v.shape, stride=v.stride(), run_check=False)
                      if isinstance(v, DTensor) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
                  for k, v in expected.items()}
        load(target, os.path.join(root, staging))
        assert_same(target, expected, staging)
        assert _payloads(os.path.join(root, staging))[f"r{rank:05d}"] == \
            _payloads(os.path.join(root, "sync"))[f"r{rank:05d}"], f"{staging}: rank {rank}'s file differs"
        for k, v in expected.items():
            if isinstance(v, DTensor):
                sd[k].to_local().copy_(v.to_local())
            elif isinstance(v, torch.Tensor):
                sd[k].copy_(v)
    ckpt.close()
    return peaks


def test_two_ranks_with_dtensor_shards_save_under_a_quarter_budget_bit_exact(tmp_path):
    peaks = run_ranks(rank_budgeted_saves, 2, str(tmp_path), timeout_s=300)
    assert all(0 < p <= BUDGET for rank in peaks for p in rank), peaks


def test_the_checkpoint_manager_saves_incrementally_through_a_budgeted_checkpointer(tmp_path):
    """CheckpointManager(async_save=AsyncCheckpointer(max_host_bytes=...)): every save bounded,
    each step loads as it was at its save (an incremental save of a streamed snapshot writes
    every chunk: its hashes are taken as it is written)."""
    from hyper_parallel.core.distributed_checkpoint import CheckpointManager

    ckpt = AsyncCheckpointer(max_host_bytes=BUDGET)
    sd = {"frozen": make_tensor((4096, 2048)), "w": make_tensor((2048, 2048), seed=1), "step": 0}
    with CheckpointManager(str(tmp_path / "run"), async_save=ckpt, incremental=True, keep_latest=2) as mgr:
        saved = {}
        for step in (1, 2):
            sd["step"] = step
            saved[step] = _clone(sd)
            mgr.save(step, sd)
            sd["w"].add_(1)  # right after the call
        mgr.wait()
        assert ckpt.stats.peak_staged_bytes <= BUDGET
        for step in (1, 2):
            target = {"frozen": torch.zeros(4096, 2048), "w": torch.zeros(2048, 2048), "step": 0}
            assert mgr.load(target, step=step) == step
            assert_same(target, saved[step])
