"""The planner and storage ABCs at torch's import paths: torch's classes, open to HyperParallel's
method names (planning/protocols.py, backends/torch_abcs.py, base/either_protocol.py)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from hyper_parallel.core.distributed_checkpoint import load, planner, save, storage


def test_the_faces_are_torchs_abcs():
    assert issubclass(planner.SavePlanner, tdcp.SavePlanner) and issubclass(planner.LoadPlanner, tdcp.LoadPlanner)
    assert issubclass(storage.StorageReader, tdcp.StorageReader) and storage.StorageWriter is tdcp.StorageWriter
    assert planner.SavePlanner._cached_save_plan is tdcp.SavePlanner._cached_save_plan  # torch's class state

    class Incomplete(planner.SavePlanner):  # torch's abstract methods still hold for torch's form
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


class TorchForm(planner.LoadPlanner):
    """torch's hook names, delegating to torch's default planner and doubling what it loads."""

    def __init__(self):
        self.inner = DefaultLoadPlanner()

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.inner.set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self):
        return self.inner.create_local_plan()

    def create_global_plan(self, global_plan):
        return self.inner.create_global_plan(global_plan)

    def finish_plan(self, central_plan):
        return self.inner.finish_plan(central_plan)

    def load_bytes(self, read_item, value):
        self.inner.load_bytes(read_item, value)

    def resolve_tensor(self, read_item):
        return self.inner.resolve_tensor(read_item)

    def commit_tensor(self, read_item, tensor):
        tensor.mul_(2)


class SeedForm(planner.LoadPlanner):
    """HyperParallel's hook names only (its build_global_plan returns this rank's own plan)."""

    def __init__(self):
        self.inner, self.calls = DefaultLoadPlanner(), []

    def configure_planner(self, state_dict, metadata=None, **kwargs):
        self.calls.append("configure_planner")
        self.inner.set_up_planner(state_dict, metadata, True)

    def build_local_plan(self):
        return self.inner.create_local_plan()

    def build_global_plan(self, all_plans):
        self.calls.append("build_global_plan")
        return all_plans[0]

    def finalize_plan(self, plan):
        return self.inner.finish_plan(plan)

    def acquire_tensor(self, read_item):
        return self.inner.resolve_tensor(read_item)

    def apply_tensor(self, read_item, tensor):
        self.calls.append("apply_tensor")
        tensor.add_(1)

    def apply_bytes(self, read_item, value):
        self.inner.load_bytes(read_item, io.BytesIO(value) if isinstance(value, bytes) else value)


@pytest.mark.parametrize("form", [TorchForm, SeedForm])
def test_a_subclass_of_either_form_runs_under_our_load(tmp_path, form):
    save({"w": torch.arange(6.0), "step": 3}, str(tmp_path / "ck"), no_dist=True)
    p = form()
    target = {"w": torch.zeros(6), "step": 0}
    load(target, checkpoint_id=str(tmp_path / "ck"), planner=p, no_dist=True)
    want = torch.arange(6.0) * 2 if form is TorchForm else torch.arange(6.0) + 1
    assert torch.equal(target["w"], want) and target["step"] == 3
    if form is SeedForm:
        assert {"configure_planner", "build_global_plan", "apply_tensor"} <= set(p.calls)
