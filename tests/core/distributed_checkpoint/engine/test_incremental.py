"""Incremental checkpoints: a step writes only the chunks that changed and names the earlier
steps' files for the rest; retention keeps exactly the files a kept step names."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.cli import main as cli
from hyper_parallel.core.distributed_checkpoint import (
    CheckpointManager,
    CorruptCheckpointError,
    load,
    verify_checkpoint,
)


def data_bytes(step_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir) if f.endswith(".safetensors"))


def model(frozen_rows: int = 2048) -> dict:
    """A frozen base (4 MiB here) and a small trainable part with its optimizer state."""
    return {"base": make_tensor((frozen_rows, 512), seed=1), "emb": make_tensor((512, 64), seed=2),
            "lora": make_tensor((64, 16), seed=3), "exp_avg": make_tensor((64, 16), seed=4), "step": 0}


def test_a_second_step_writes_only_what_changed_and_loads_exactly_after_retention(tmp_path, capsys):
    d = str(tmp_path / "run")
    sd = model()
    with CheckpointManager(d, incremental=True, keep_latest=1) as mgr:
        mgr.save(1, sd)
        first = data_bytes(mgr.step_path(1))
        sd["lora"] += 1
        sd["exp_avg"] *= 0.5
        sd["step"] = 2
        mgr.save(2, sd)
        second = data_bytes(mgr.step_path(2))
        mgr.wait()
        assert second <= 0.1 * first, (second, first)
        assert mgr.all_steps() == [2]  # step 1 is gone as a step...
        left = os.listdir(mgr.step_path(1))  # ...but the file step 2 names stays
        assert ".metadata" not in left and len(left) == 1
    out = load(path=os.path.join(d, "step_00000002"))
    assert all(torch.equal(out[k], sd[k]) for k in ("base", "emb", "lora", "exp_avg")) and out["step"] == 2
    report = verify_checkpoint(os.path.join(d, "step_00000002"))
    assert report.ok, report.problems
    assert cli(["ls", d]) == 0 and "1" in capsys.readouterr().out.split("step_00000002")[-1]
    # a restarted manager finds step 2 and leaves step 1's named file alone
    with CheckpointManager(d, incremental=True, keep_latest=1) as mgr:
        assert mgr.all_steps() == [2]
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
        assert mgr.load(target) == 2 and torch.equal(target["base"], sd["base"])
        mgr.save(3, sd)  # the first save after a restart writes everything (no memory of hashes)
    assert not os.path.exists(os.path.join(d, "step_00000001"))  # nothing names its file any more


def test_one_changed_element_of_a_frozen_tensor_is_written_again(tmp_path):
    d = str(tmp_path / "run")
    sd = model()
    with CheckpointManager(d, incremental=True) as mgr:
        mgr.save(1, sd)
        sd["base"][1000, 7] += 1e-3  # a single element: the hash changes
        mgr.save(2, sd)
        assert data_bytes(mgr.step_path(2)) > 2048 * 512 * 4  # the base is in step 2's files again
    assert torch.equal(load(path=os.path.join(d, "step_00000002"))["base"], sd["base"])


def test_a_referenced_file_that_vanished_is_a_clear_error_naming_it(tmp_path):
    d = str(tmp_path / "run")
    sd = model(256)
    with CheckpointManager(d, incremental=True) as mgr:
        mgr.save(1, sd)
        sd["lora"] += 1
        mgr.save(2, sd)
    shutil.rmtree(os.path.join(d, "step_00000001"))
    with pytest.raises(CorruptCheckpointError, match=r"step_00000001/data-r00000-.*missing"):
        load(path=os.path.join(d, "step_00000002"))
    assert not verify_checkpoint(os.path.join(d, "step_00000002")).ok


def rank_incremental(rank: int, ws: int, d: str) -> list[int]:
    mesh = init_device_mesh("cpu", (ws,))
    frozen = make_dtensor(make_tensor((1024, 256), seed=1), mesh, [Shard(0)])
    train = make_dtensor(make_tensor((64, 32), seed=2), mesh, [Shard(0)])
    sd = {"model": {"frozen": frozen, "train": train}, "optim": {"exp_avg": make_tensor((64, 32), seed=3)}}
    written = []
    with CheckpointManager(d, incremental=True, keep_latest=2, async_save=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, sd)
            mgr.wait()
            written.append(data_bytes(mgr.step_path(step)))
            train.to_local().add_(1.0)
            sd["optim"]["exp_avg"] += 1
        target = {"model": {"frozen": make_dtensor(torch.zeros(1024, 256), mesh, [Shard(0)]),
                            "train": make_dtensor(torch.zeros(64, 32), mesh, [Shard(0)])},
                  "optim": {"exp_avg": torch.zeros(64, 32)}}
        assert mgr.load(target) == 3
        assert torch.equal(target["model"]["frozen"].to_local(), frozen.to_local())
        want = make_dtensor(make_tensor((64, 32), seed=2) + 1 + 1, mesh, [Shard(0)]).to_local()  # as trained
        assert torch.equal(target["model"]["train"].to_local(), want)
        assert torch.equal(target["optim"]["exp_avg"], make_tensor((64, 32), seed=3) + 1 + 1)
    return written


def test_incremental_async_saves_on_two_ranks(tmp_path):
    d = str(tmp_path / "run")
    written = run_ranks(rank_incremental, 2, d, timeout_s=120)[0]
    assert written[1] < 0.1 * written[0] and written[2] < 0.1 * written[0], written
    assert verify_checkpoint(os.path.join(d, "step_00000003")).ok


def test_incremental_steps_on_an_s3_server(s3_bucket):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    sd = model(256)
    with CheckpointManager(url, incremental=True, keep_latest=1, storage_options=opts) as mgr:
        mgr.save(1, sd)
        sd["lora"] += 1
        mgr.save(2, sd)
        mgr.wait()
        assert mgr.all_steps() == [2]
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
        assert mgr.load(target) == 2
    assert all(torch.equal(target[k], sd[k]) for k in ("base", "emb", "lora", "exp_avg"))
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    step1 = fs.ls(f"{bucket}/run/step_00000001")  # only the file step 2 names is left of step 1
    assert len(step1) == 1 and step1[0].rsplit("/", 1)[-1].startswith("data-r00000-")
    assert sum(fs.size(p) for p in fs.ls(f"{bucket}/run/step_00000002") if p.endswith(".safetensors")) \
        < 0.1 * fs.size(step1[0])


def test_table_stored_keys_reuse_earlier_files_and_load(tmp_path):
    """A planner that leaves stores unset (table-stored keys): unchanged chunks are named in
    the earlier step's file, not dropped."""
    import dataclasses

    from hyper_parallel.core.distributed_checkpoint import StandardPlanner, save
    from hyper_parallel.core.distributed_checkpoint._src.engine.incremental import IncrementalState
    from hyper_parallel.core.distributed_checkpoint._src.format.metadata import step_dir_name
    from hyper_parallel.core.distributed_checkpoint._src.planning.planner import SavePlan

    class Tables(StandardPlanner):
        def create_global_save_plan(self, plans):
            out = []
            for plan in super().create_global_save_plan(plans):  # a sequence of per-rank plans
                entries = {k: spec if spec.kind == "object" else dataclasses.replace(spec, store=None)
                           for k, spec in plan.entries.items()}
                out.append(SavePlan(entries, list(plan.items), list(plan.objects)))
            return out

    sd = model(256)
    inc = IncrementalState()
    with pytest.raises(ValueError, match="step directories named like 'step_00000001'"):
        inc.begin("step_1")  # the next step's 'dirs' could not name it
    for step in (1, 2):
        if step == 2:
            sd["lora"] = sd["lora"] + 1
        inc.begin(step_dir_name(step))
        save(sd, str(tmp_path / step_dir_name(step)), planner=Tables(), incremental=inc, no_dist=True)
    second = str(tmp_path / step_dir_name(2))
    assert data_bytes(second) < data_bytes(str(tmp_path / step_dir_name(1))) / 4
    out = load(path=second)
    assert [k for k in ("base", "emb", "lora", "exp_avg") if not torch.equal(out[k], sd[k])] == []
    assert verify_checkpoint(second).ok
