"""HuggingFaceStorageWriter and the CheckpointManager's async and incremental modes.

The manager takes no storage writer: its steps are checkpoints of this library, found and
described (step number, metrics, timeline) by their ``.metadata``, which a Hugging Face
directory does not have. Plugged in through the manager's storage hook anyway, the writer
used to "commit" every step while dropping that record: the steps loaded in the same run, but
a restarted manager saw none of them and the next save's retention deleted them all. The
writer now refuses ``user_metadata`` (which the manager always passes) at the commit, before
anything is put in place; the manager's earlier steps stay and load.

The machinery of those modes (one ``AsyncCheckpointer`` with one save in flight, the manager's
``IncrementalState``) does work with the writer where no ``.metadata`` is needed: every step,
saved while the state keeps changing (also behind torch's version counter), loads bit-exact to
the state at its call, in one process and on two ranks with DTensor shards.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import bits, make_dtensor, make_tensor
from multiprocess import run_ranks

from hyper_parallel.core.distributed_checkpoint import (
    AsyncCheckpointer,
    AsyncSaveError,
    CheckpointManager,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
    TorchShardedSafetensorsReader,
    UnsupportedValueError,
    load,
)
from hyper_parallel.core.distributed_checkpoint._src.engine.incremental import IncrementalState
from hyper_parallel.core.distributed_checkpoint._src.format.validation import step_dir_name

MODES = {"sync": {}, "async": {"async_save": True}, "incremental": {"incremental": True},
         "async+incremental": {"async_save": True, "incremental": True}}
REFUSAL = r"HuggingFaceStorageWriter\('.*step_00000003'\) cannot keep user_metadata \(keys \['checkpoint_manager'\]\)"


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": make_tensor((64, 48), seed=step), "b": make_tensor((48,), torch.bfloat16, seed=100 + step)}


class HFStepsManager(CheckpointManager):
    """A manager whose steps go through HuggingFaceStorageWriter: its storage hook is the only
    way to give it another writer."""

    def _storage_writer(self, name: str):
        return HuggingFaceStorageWriter(os.path.join(self.directory, name))


def test_the_manager_takes_no_storage_writer(tmp_path):
    with pytest.raises(TypeError, match="storage_writer"):
        CheckpointManager(str(tmp_path), storage_writer=HuggingFaceStorageWriter(str(tmp_path)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("mode", list(MODES))
def test_hf_steps_through_the_manager_are_refused_and_its_steps_survive(tmp_path, mode):
    d = str(tmp_path / "run")
    with CheckpointManager(d) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step), metrics={"loss": 1.0 / step})
    mgr = HFStepsManager(d, keep_latest=2, **MODES[mode])
    try:
        assert mgr.all_steps() == [1, 2]
        sd = _state(3)
        if MODES[mode].get("async_save"):
            assert mgr.save(3, sd)  # started; the refusal comes with the commit
            with pytest.raises(AsyncSaveError, match=REFUSAL):
                mgr.wait()
        else:
            with pytest.raises(UnsupportedValueError, match=REFUSAL):
                mgr.save(3, sd)
        assert mgr.all_steps() == [1, 2]
    finally:
        mgr._release()  # (close() would raise the async save's error again)
    step3 = os.path.join(d, step_dir_name(3))
    left = os.listdir(step3) if os.path.isdir(step3) else []
    assert not [n for n in left if n.endswith(".safetensors") or n.endswith(".json")], left
    with CheckpointManager(d, keep_latest=2) as mgr:  # a restart finds both steps, whole
        assert mgr.all_steps() == [1, 2] and mgr.metrics(2) == {"loss": 0.5}
        for step in (1, 2):
            got = {k: torch.empty_like(v) for k, v in _state(step).items()}
            assert mgr.load(got, step=step) == step
            assert all(torch.equal(bits(got[k]), bits(v)) for k, v in _state(step).items())


def _write(sd: dict[str, torch.Tensor], step: int) -> None:
    """Change the state between saves in the ways training does, version counter or not."""
    if step % 3 == 1:
        sd["w"].add_(1.0)  # seen by torch's version counter
    elif step % 3 == 2:
        sd["w"].data[step, :5] += 2.0  # .data: behind the version counter
    else:
        sd["w"].numpy()[-1, :] = float(step)  # a numpy view: behind it too
    sd["b"].data.mul_(2)


def _reader(sharded: bool, path: str):
    return TorchShardedSafetensorsReader(path) if sharded else HuggingFaceStorageReader(path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
@pytest.mark.parametrize("sharded", [False, True], ids=["consolidated", "torch-sharded"])
def test_async_hf_saves_as_the_manager_runs_them_load_bit_exact_at_every_step(tmp_path, incremental, sharded):
    ckpt = AsyncCheckpointer(max_in_flight=1)  # as the manager holds it
    inc = IncrementalState() if incremental else None
    sd = _state(0)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for step in range(1, 6):
            _write(sd, step)
            snapshots[step] = {k: v.clone() for k, v in sd.items()}
            if inc is not None:
                inc.begin(step_dir_name(step))
            writer = HuggingFaceStorageWriter(str(tmp_path / step_dir_name(step)), save_distributed=sharded)
            resp = ckpt.save(sd, storage_writer=writer, incremental=inc, no_dist=True)
            for v in sd.values():  # training goes on at once: the save holds a snapshot
                v.data.fill_(float("nan"))
            resp.result()
            for k, v in sd.items():
                v.data.copy_(snapshots[step][k])
    finally:
        ckpt.close()
    for step, want in snapshots.items():
        path = str(tmp_path / step_dir_name(step))
        got = load(storage_reader=_reader(sharded, path), no_dist=True)
        assert set(got) == set(want)
        assert all(torch.equal(bits(got[k]), bits(v)) for k, v in want.items()), step
    # every step is whole on its own: nothing refers to an earlier step's files
    for step in range(1, 5):
        shutil.rmtree(tmp_path / step_dir_name(step))
    got = load(storage_reader=_reader(sharded, str(tmp_path / step_dir_name(5))), no_dist=True)
    assert all(torch.equal(bits(got[k]), bits(v)) for k, v in snapshots[5].items())


def _async_incremental_on_ranks(rank: int, ws: int, d: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (ws,))
    full = {"rows": make_tensor((9, 40), seed=1), "cols": make_tensor((6, 300), torch.bfloat16, seed=2),
            "rep": make_tensor((5, 3), seed=3)}
    placements = {"rows": [Shard(0)], "cols": [Shard(1)], "rep": [Replicate()]}
    sd = {k: make_dtensor(v, mesh, placements[k]) for k, v in full.items()}
    ckpt = AsyncCheckpointer(max_in_flight=1)
    inc = IncrementalState()
    expected: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for step in range(1, 5):
            for key, t in sd.items():  # a change of every rank's shard, behind the version counter
                t.to_local().data.add_(step)
                full[key] = full[key] + step
            expected[step] = {k: v.clone() for k, v in full.items()}
            inc.begin(step_dir_name(step))
            resp = ckpt.save(sd, storage_writer=HuggingFaceStorageWriter(os.path.join(d, step_dir_name(step))),
                             incremental=inc)
            kept = {k: t.to_local().clone() for k, t in sd.items()}
            for t in sd.values():
                t.to_local().data.fill_(float("nan"))  # after the snapshot: must not reach the files
            resp.result()
            for k, t in sd.items():
                t.to_local().data.copy_(kept[k])
    finally:
        ckpt.close()
    wrong = []
    if rank == 0:
        for step, want in expected.items():
            got = load(storage_reader=HuggingFaceStorageReader(os.path.join(d, step_dir_name(step))), no_dist=True)
            wrong += [f"step {step} {k}" for k, v in want.items() if not torch.equal(bits(got[k]), bits(v))]
    return wrong


def test_async_incremental_hf_saves_of_dtensor_shards_on_two_ranks_load_bit_exact(tmp_path):
    results = run_ranks(_async_incremental_on_ranks, 2, str(tmp_path), timeout_s=240)
    assert results == [[], []], results
