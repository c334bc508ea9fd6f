"""hyper_parallel.platform.platform: the resettable platform object and the group registry."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks

import hyper_parallel
import hyper_parallel.platform as platform_pkg
import hyper_parallel.platform.platform as platform_mod
from hyper_parallel.core.utils import communication


@pytest.fixture(autouse=True)
def _fresh_platform(monkeypatch):
    monkeypatch.delenv("HYPER_PARALLEL_PLATFORM", raising=False)
    platform_mod.platform = None
    yield
    platform_mod.platform = None


def test_get_platform_builds_the_torch_platform_once_and_keeps_it():
    first = platform_mod.get_platform()
    assert isinstance(first, platform_pkg.TorchPlatform)
    assert platform_mod.platform is first
    assert platform_mod.get_platform() is first
    assert platform_pkg.get_platform is platform_mod.get_platform is hyper_parallel.get_platform


def test_setting_platform_to_none_rebuilds_it():
    first = platform_mod.get_platform()
    platform_mod.platform = None
    second = platform_mod.get_platform()
    assert second is not first and isinstance(second, platform_pkg.TorchPlatform)


def test_environment_variable_selects_torch_in_any_case(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", " Torch ")
    assert platform_mod.get_platform().platform_type is platform_pkg.PlatformType.PYTORCH


def test_mindspore_platform_is_refused_with_a_clear_error(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "mindspore")
    with pytest.raises(ImportError, match="torch only"):
        platform_mod.get_platform()


def test_unknown_platform_name_is_refused(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "jax")
    with pytest.raises(ValueError, match="jax"):
        platform_mod.get_platform()


def test_set_platform_installs_an_object():
    custom = platform_pkg.TorchPlatform()
    platform_mod.set_platform(custom)
    assert platform_mod.get_platform() is custom


def test_existing_comm_groups_is_one_dict_under_both_paths():
    assert communication.EXISTING_COMM_GROUPS is platform_mod.EXISTING_COMM_GROUPS
    assert platform_pkg.EXISTING_COMM_GROUPS is platform_mod.EXISTING_COMM_GROUPS
    platform_mod.EXISTING_COMM_GROUPS["probe"] = 1
    try:
        assert communication.EXISTING_COMM_GROUPS["probe"] == 1
    finally:
        platform_mod.EXISTING_COMM_GROUPS.clear()


def test_platform_answers_without_a_process_group():
    p = platform_mod.get_platform()
    assert (p.get_rank(), p.get_world_size()) == (0, 1)


def test_parameters_dict_and_module_helpers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1, bias=False))
    p = platform_mod.get_platform()
    params = p.parameters_dict(model)
    assert list(params) == ["0.weight", "0.bias", "2.weight"]
    assert params["0.weight"] is model[0].weight
    assert p.search_parameter_by_name(model, "2.weight") == ("2.weight", model[2].weight)
    assert p.search_parameter_by_name(model, "nope") is None
    assert [n for n, _ in p.get_cells_and_names(model)] == ["", "0", "1", "2"]
    assert p.get_tensor_storage_size(torch.zeros(3, 4, dtype=torch.bfloat16)) == 24
    assert p.get_op_name(torch.ops.aten.add.Tensor) == "aten::add.Tensor"
    assert p.get_param_local_shape(model[0].weight) == (2, 3)


def _groups_are_registered(rank: int, world: int) -> dict:
    p = platform_mod.get_platform()
    platform_mod.EXISTING_COMM_GROUPS.clear()
    group = p.create_group([0, 1])
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=group)
    own = p.create_group([rank])  # a one-rank group: only this rank takes part
    return {"sum": t.item(), "keys": sorted(platform_mod.EXISTING_COMM_GROUPS),
            "same": communication.EXISTING_COMM_GROUPS[(0, 1)] is group,
            "own_size": dist.get_world_size(own), "rank": p.get_rank(), "world": p.get_world_size()}


def test_create_group_registers_groups_on_real_ranks():
    out = run_ranks(_groups_are_registered, 2)
    for rank, r in enumerate(out):
        assert r["sum"] == 3.0 and r["same"] and r["own_size"] == 1
        assert r["keys"] == sorted([(0, 1), (rank,)])
        assert (r["rank"], r["world"]) == (rank, 2)


def test_hyper_parallels_torch_platform_path_is_the_same_class(tmp_path):
    """HyperParallel code patches hyper_parallel.platform.torch.platform.TorchPlatform.<method>."""
    import hyper_parallel.platform.torch.platform as seed_path

    assert seed_path.TorchPlatform is platform_pkg.TorchPlatform
    assert isinstance(platform_mod.get_platform(), seed_path.TorchPlatform)


def test_single_file_checkpoints_round_trip_and_never_run_code(tmp_path):
    import pickle

    plat = platform_pkg.TorchPlatform
    tensors = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    plat.save_checkpoint(tensors, tmp_path / "m.safetensors")
    back = plat.load_checkpoint(tmp_path / "m.safetensors")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    module = torch.nn.Linear(3, 2)
    plat.save_checkpoint(module, tmp_path / "m.pt")  # a module is saved as its state_dict
    loaded = plat.load_checkpoint(tmp_path / "m.pt")
    assert torch.equal(loaded["weight"], module.weight.detach())

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"x": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError):
        plat.load_checkpoint(tmp_path / "evil.pt")
