"""Call forms and import paths that torch DCP code uses and that must keep working with the import
swapped: a storage object as the second positional argument of ``save``/``load`` (torch still
accepts it), and torch's private helpers imported from our public submodules (torch's own tests
and some user code do)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import hyper_parallel.core.distributed_checkpoint as dcp


def test_save_and_load_take_a_storage_object_positionally(tmp_path):
    sd = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}
    dcp.save(sd, dcp.FileSystemWriter(str(tmp_path / "a")), no_dist=True)
    out = {"w": torch.zeros(3, 4), "step": 0}
    dcp.load(out, dcp.FileSystemReader(str(tmp_path / "a")), no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 7


def test_torchs_own_storage_objects_positionally(tmp_path):
    sd = {"w": torch.arange(6.0)}
    dcp.save(sd, tdcp.FileSystemWriter(str(tmp_path / "b")), no_dist=True)
    out = {"w": torch.zeros(6)}
    dcp.load(out, tdcp.FileSystemReader(str(tmp_path / "b")), no_dist=True)
    assert torch.equal(out["w"], sd["w"])


def test_a_storage_object_both_positionally_and_by_keyword_is_refused(tmp_path):
    w = dcp.FileSystemWriter(str(tmp_path / "c"))
    with pytest.raises(TypeError, match="passed positionally and storage_writer= too"):
        dcp.save({"w": torch.ones(2)}, w, storage_writer=w, no_dist=True)
    dcp.save({"w": torch.ones(2)}, str(tmp_path / "c"), no_dist=True)  # a path stays a path
    r = dcp.FileSystemReader(str(tmp_path / "c"))
    with pytest.raises(TypeError, match="passed positionally and storage_reader= too"):
        dcp.load({"w": torch.zeros(2)}, r, storage_reader=r, no_dist=True)


def test_torchs_private_helpers_import_from_our_submodules_as_torchs_objects():
    import torch.distributed.checkpoint.default_planner as t_default_planner
    import torch.distributed.checkpoint.filesystem as t_filesystem
    import torch.distributed.checkpoint.logger as t_logger
    import torch.distributed.checkpoint.state_dict as t_state_dict
    import torch.distributed.checkpoint.utils as t_utils

    from hyper_parallel.core.distributed_checkpoint import default_planner, filesystem, logger, state_dict, utils

    pairs = [(utils.CheckpointException, t_utils.CheckpointException), (utils._DistWrapper, t_utils._DistWrapper),
             (utils._create_file_view, t_utils._create_file_view), (filesystem._StorageInfo, t_filesystem._StorageInfo),
             (logger._dcp_logger, t_logger._dcp_logger),
             (default_planner._create_default_local_metadata, t_default_planner._create_default_local_metadata),
             (state_dict._patch_model_state_dict, t_state_dict._patch_model_state_dict),
             (state_dict._patch_optimizer_state_dict, t_state_dict._patch_optimizer_state_dict)]
    assert all(ours is theirs for ours, theirs in pairs)
    assert utils.CheckpointException is dcp.CheckpointException
