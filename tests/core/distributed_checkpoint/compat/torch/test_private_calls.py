"""torch's private call forms real clients import, at torch's paths in ours: ``format_utils`` and
``state_dict_loader``'s ``_load_state_dict``, ``state_dict_saver``'s ``_save_state_dict``,
``format_utils._EmptyStateDictLoadPlanner``; torch's signatures, in-place fills, and the
accelerate/Lightning form (an empty dict receives a whole checkpoint). One process, real files."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint import format_utils as torch_format_utils
from torch.distributed.checkpoint import state_dict_loader as torch_loader
from torch.distributed.checkpoint import state_dict_saver as torch_saver
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

from hyper_parallel.core.distributed_checkpoint import (
    FileSystemReader,
    FileSystemWriter,
    format_utils,
    save,
    state_dict_loader,
    state_dict_saver,
)

CALLS = [(format_utils, torch_format_utils, "_load_state_dict"), (state_dict_loader, torch_loader, "_load_state_dict"),
         (state_dict_saver, torch_saver, "_save_state_dict")]


def _state() -> dict:
    return {"model": {"w": torch.arange(6.0).reshape(3, 2), "b": torch.ones(2, dtype=torch.bfloat16)}, "step": 7}


@pytest.mark.parametrize(("ours", "theirs", "name"), CALLS, ids=lambda x: getattr(x, "__name__", x))
def test_the_private_call_has_torchs_parameters_in_torchs_order(ours, theirs, name):
    assert list(inspect.signature(getattr(ours, name)).parameters) == list(
        inspect.signature(getattr(theirs, name)).parameters)


def test_the_empty_state_dict_planner_is_torchs_own():
    assert format_utils._EmptyStateDictLoadPlanner is _EmptyStateDictLoadPlanner


def test_private_save_and_load_round_trip_in_place(tmp_path):
    sd = _state()
    state_dict_saver._save_state_dict(sd, FileSystemWriter(str(tmp_path)), no_dist=True)
    target = {"model": {"w": torch.zeros(3, 2), "b": torch.zeros(2, dtype=torch.bfloat16)}, "step": 0}
    w = target["model"]["w"]
    for module in (format_utils, state_dict_loader):
        assert module._load_state_dict(target, FileSystemReader(str(tmp_path)), no_dist=True) is None
        assert target["model"]["w"] is w and torch.equal(w, sd["model"]["w"])
        assert torch.equal(target["model"]["b"], sd["model"]["b"]) and target["step"] == 7


def _whole(sd: dict, reader) -> None:
    got: dict = {}
    format_utils._load_state_dict(got, storage_reader=reader, planner=format_utils._EmptyStateDictLoadPlanner(),
                                  no_dist=True)  # accelerate's merge_fsdp_weights, Lightning's consolidation
    assert set(got) == set(sd) and got["step"] == sd["step"]
    assert all(torch.equal(got["model"][k], v) for k, v in sd["model"].items())


def test_an_empty_dict_receives_a_whole_checkpoint_torch_wrote(tmp_path):
    sd = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    _whole(sd, FileSystemReader(str(tmp_path)))
    _whole(sd, tdcp.FileSystemReader(str(tmp_path)))


def test_an_empty_dict_receives_a_whole_checkpoint_we_wrote(tmp_path):
    sd = _state()
    save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    _whole(sd, FileSystemReader(str(tmp_path)))
