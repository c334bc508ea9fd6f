"""torch DCP's calls that are ours: the deprecated spellings, torch.save conversion, shard
lookup, chunk reads, the sharded optimizer load, and ``CheckpointException`` catching our errors.

Where torch's function can run on the same input, the two results are compared.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
import torch.distributed.checkpoint.format_utils as torch_format_utils
from helpers import assert_same, make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list as torch_create_read_items_for_chunk_list,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    FileSystemReader,
    FileSystemWriter,
    NotACheckpointError,
    RankFailedError,
    StandardPlanner,
    StateDictMismatchError,
    UnsupportedValueError,
    load,
    save,
)
from hyper_parallel.core.distributed_checkpoint.filesystem import SerializationFormat
from hyper_parallel.core.distributed_checkpoint.format_utils import (
    BroadcastingTorchSaveReader,
    DynamicMetaLoadPlanner,
    dcp_to_torch_save,
    torch_save_to_dcp,
)
from hyper_parallel.core.distributed_checkpoint.optimizer import load_sharded_optimizer_state_dict
from hyper_parallel.core.distributed_checkpoint.planner_helpers import create_read_items_for_chunk_list
from hyper_parallel.core.distributed_checkpoint.utils import find_state_dict_object, find_tensor_shard


def small_sd() -> dict:
    return {"model": {"w": make_tensor((6, 4)), "b": make_tensor((4,), seed=1)}, "step": 3}


# ---------------------------------------------------------------- CheckpointException


def test_our_errors_are_torchs_checkpoint_exception_and_still_exceptions(tmp_path):
    with pytest.raises(CheckpointException) as info:
        load({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "nothing"))
    assert isinstance(info.value, NotACheckpointError) and isinstance(info.value, Exception)
    assert "nothing" in str(info.value)
    assert "CheckpointException ranks" not in str(info.value)  # our message, not torch's failure report
    assert tdcp.CheckpointException is dcp.CheckpointException is CheckpointException
    failed = RankFailedError("save", {1: "OSError: disk full"})
    assert isinstance(failed, CheckpointException) and failed.failures == {1: "OSError: disk full"}
    assert CheckpointError("x").failures == {}


class _FailOnRank(StandardPlanner):
    def __init__(self, bad: int):
        super().__init__()
        self.bad = bad

    def resolve_data(self, item):
        if dist.get_rank() == self.bad:
            raise OSError(28, "No space left on device (injected)")
        return super().resolve_data(item)


def rank_checkpoint_exception(rank: int, ws: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    sd = {"w": make_dtensor(make_tensor((8, 3), seed=1), mesh, [Shard(0)])}
    try:
        save(sd, checkpoint_id=path, planner=_FailOnRank(bad=1))
    except tdcp.api.CheckpointException as exc:  # how torch DCP users catch a failed save
        caught = {"type": type(exc).__name__, "failures": sorted(exc.failures), "text": str(exc)}
    else:
        raise AssertionError("a save failing on rank 1 did not raise")
    # find_tensor_shard / find_state_dict_object on a DTensor: this rank's chunk by its offset
    mine = (4 * rank, 0)
    assert torch.equal(find_tensor_shard(sd["w"], MetadataIndex("w", torch.Size(mine))), sd["w"].to_local())
    assert find_state_dict_object(sd, MetadataIndex("w")) is not None
    other = (4 * (1 - rank), 0)
    try:
        find_state_dict_object(sd, MetadataIndex("w", torch.Size(other)))
    except StateDictMismatchError as exc:
        caught["lookup"] = str(exc)
    return caught


def test_a_failure_on_one_rank_is_a_checkpoint_exception_on_every_rank(tmp_path):
    out = run_ranks(rank_checkpoint_exception, 2, str(tmp_path / "ckpt"))
    for rank, caught in enumerate(out):
        assert caught["type"] == "RankFailedError" and caught["failures"] == [1], caught
        assert "No space left" in caught["text"], caught
        assert f"offsets ({4 * (1 - rank)}, 0)" in caught["lookup"], caught


# ---------------------------------------------------------------- deprecated spellings


def _future_warning(fn, *args, **kwargs) -> str:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn(*args, **kwargs)
    messages = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]
    assert len(messages) == 1, [str(w.message) for w in seen]
    return messages[0]


def test_save_state_dict_and_load_state_dict_warn_as_torch_and_round_trip(tmp_path):
    sd = small_sd()
    ours = _future_warning(dcp.save_state_dict, sd, FileSystemWriter(str(tmp_path / "ours")), None, 0, True)
    theirs = _future_warning(tdcp.save_state_dict, sd, tdcp.FileSystemWriter(str(tmp_path / "torch")), None, 0, True)
    assert ours == theirs

    target = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4)}, "step": 0}
    ours = _future_warning(dcp.load_state_dict, target, FileSystemReader(str(tmp_path / "ours")), no_dist=True)
    theirs = _future_warning(tdcp.load_state_dict, {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4)}, "step": 0},
                             tdcp.FileSystemReader(str(tmp_path / "torch")), no_dist=True)
    assert ours == theirs
    assert_same(sd, target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert dcp.load_state_dict(target, FileSystemReader(str(tmp_path / "ours")), no_dist=True) is None


def test_file_system_writer_takes_torchs_serialization_format(tmp_path):
    sd = small_sd()
    save(sd, storage_writer=FileSystemWriter(str(tmp_path / "a"), serialization_format=SerializationFormat.SAFETENSORS))
    save(sd, storage_writer=FileSystemWriter(str(tmp_path / "b"), serialization_format=SerializationFormat.TORCH_SAVE))
    for p in ("a", "b"):
        assert_same(sd, load(path=str(tmp_path / p)))
    with pytest.raises(ValueError, match="SerializationFormat"):
        FileSystemWriter(str(tmp_path / "c"), serialization_format="safetensors")


# ---------------------------------------------------------------- format_utils


class _Custom:
    def __init__(self):
        self.x = 1


def test_dcp_to_torch_save_and_back_are_bit_exact_and_safe(tmp_path):
    sd = small_sd()
    save(sd, str(tmp_path / "ckpt"))
    dcp_to_torch_save(str(tmp_path / "ckpt"), str(tmp_path / "full.pt"))
    assert_same(sd, torch.load(str(tmp_path / "full.pt"), weights_only=True))

    torch_save_to_dcp(str(tmp_path / "full.pt"), str(tmp_path / "again"))
    assert_same(sd, load(path=str(tmp_path / "again")))
    torch_save_to_dcp(str(tmp_path / "full.pt"), str(tmp_path / "again"))  # replaces, as torch's does

    torch.save({"w": torch.ones(2), "obj": _Custom()}, str(tmp_path / "code.pt"))
    with pytest.raises(UnsupportedValueError, match="allow_pickle=True"):
        torch_save_to_dcp(str(tmp_path / "code.pt"), str(tmp_path / "refused"))
    assert not os.path.exists(tmp_path / "refused" / ".metadata")


def test_torch_dcp_output_of_torch_save_to_dcp_matches_ours(tmp_path):
    sd = {"w": make_tensor((5, 3)), "nested": {"b": make_tensor((2,), torch.bfloat16, seed=4)}}
    torch.save(sd, str(tmp_path / "full.pt"))
    torch_save_to_dcp(str(tmp_path / "full.pt"), str(tmp_path / "ours"))
    torch_format_utils.torch_save_to_dcp(str(tmp_path / "full.pt"), str(tmp_path / "torch"))
    theirs = {"w": torch.zeros(5, 3), "nested": {"b": torch.zeros(2, dtype=torch.bfloat16)}}
    tdcp.load(theirs, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    assert_same(theirs, load(path=str(tmp_path / "ours")))


def test_loading_a_torch_save_file_directly_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(CheckpointException, match="torch_save_to_dcp"):
        BroadcastingTorchSaveReader(str(tmp_path / "model.pt"))
    with pytest.raises(CheckpointError, match="torch_save_to_dcp"):
        DynamicMetaLoadPlanner()


# ---------------------------------------------------------------- planner_helpers, utils


def _torch_items(items) -> list[tuple]:
    return sorted((tuple(i.dest_index.offset), i.dest_index.index, tuple(i.dest_offsets), tuple(i.storage_index.offset),
                   i.storage_index.index, tuple(i.storage_offsets), tuple(i.lengths), i.type) for i in items)


@pytest.mark.parametrize("saved,local", [
    ([((0, 0), (4, 6)), ((4, 0), (4, 6))], [((0, 0), (8, 3)), ((0, 3), (8, 3))]),      # rows -> columns
    ([((0, 0), (3, 6)), ((3, 0), (3, 6)), ((6, 0), (2, 6))], [((2, 1), (5, 4))]),       # uneven, a window
    ([((0,), (5,)), ((5,), (2,))], [((1,), (6,)), ((0,), (1,))]),                        # 1-d
    ([((), ())], [((), ())]),                                                              # 0-d
    ([((0, 0), (4, 6))], [((4, 0), (4, 6))]),                                              # no overlap
])
def test_create_read_items_for_chunk_list_reads_what_torchs_does(saved, local):
    def chunk(o, s):
        return ChunkStorageMetadata(torch.Size(o), torch.Size(s))

    shape = tuple(max(o[d] + s[d] for o, s in saved) for d in range(len(saved[0][0])))
    md = TensorStorageMetadata(tdcp.metadata.TensorProperties(dtype=torch.float32), torch.Size(shape),
                               [chunk(*c) for c in saved])
    wanted = [chunk(*c) for c in local]
    ours = create_read_items_for_chunk_list("w", md, wanted)
    assert _torch_items(ours) == _torch_items(torch_create_read_items_for_chunk_list("w", md, wanted))
    assert all(i.dest_index.fqn == "w" == i.storage_index.fqn for i in ours)


def test_find_state_dict_object_on_plain_values():
    sd = {"w": make_tensor((3, 2)), "step": 7}
    assert find_state_dict_object(sd, MetadataIndex("w")) is sd["w"]
    assert find_state_dict_object(sd, MetadataIndex("w", torch.Size([0, 0]))) is sd["w"]
    assert find_state_dict_object(sd, MetadataIndex("step")) == 7
    with pytest.raises(StateDictMismatchError, match="Could not find FQN 'nope'"):
        find_state_dict_object(sd, MetadataIndex("nope"))
    with pytest.raises(StateDictMismatchError, match=r"no chunk at offsets \(1, 0\)"):
        find_state_dict_object(sd, MetadataIndex("w", torch.Size([1, 0])))
    with pytest.raises(StateDictMismatchError, match="'step' is a int, not a tensor"):
        find_state_dict_object(sd, MetadataIndex("step", torch.Size([0])))


# ---------------------------------------------------------------- load_sharded_optimizer_state_dict


def rank_sharded_optimizer(rank: int, ws: int, path: str) -> str:
    mesh = init_device_mesh("cpu", (ws,))
    full_w, full_avg, full_sq = make_tensor((6, 4), seed=1), make_tensor((6, 4), seed=2), make_tensor((6, 4), seed=3)
    model = {"w": make_dtensor(full_w, mesh, [Shard(0)]), "b": make_tensor((4,), seed=5)}
    optim = {"state": {"w": {"exp_avg": make_dtensor(full_avg, mesh, [Shard(0)]),
                             "exp_avg_sq": make_dtensor(full_sq, mesh, [Shard(0)]), "step": torch.tensor(3.0)},
                       "b": {"exp_avg": make_tensor((4,), seed=6), "step": torch.tensor(3.0)}},
             "param_groups": [{"lr": 0.01, "betas": [0.9, 0.999], "params": ["w", "b"]}]}
    save({"model": model, "optim": optim, "extra": 1}, storage_writer=FileSystemWriter(path))

    # the loading job shards w by columns: the optimizer state follows the model's layout
    new_model = {"w": make_dtensor(torch.zeros(6, 4), mesh, [Shard(1)]), "b": torch.zeros(4)}
    out = load_sharded_optimizer_state_dict(new_model, "optim", FileSystemReader(path))
    assert list(out) == ["optim"]
    got = out["optim"]
    for name, full in (("exp_avg", full_avg), ("exp_avg_sq", full_sq)):
        t = got["state"]["w"][name]
        assert isinstance(t, DTensor) and list(t.placements) == [Shard(1)], (name, t)
        assert torch.equal(t.to_local(), full[:, 2 * rank:2 * rank + 2]), name
        assert torch.equal(t.full_tensor(), full), name
    assert torch.equal(got["state"]["w"]["step"], torch.tensor(3.0))
    assert torch.equal(got["state"]["b"]["exp_avg"], optim["state"]["b"]["exp_avg"])
    assert got["param_groups"] == optim["param_groups"]
    _fsdp2_adam_round_trip(mesh, path + "-fsdp")
    try:
        load_sharded_optimizer_state_dict(new_model, "optimizer", FileSystemReader(path))
    except StateDictMismatchError as exc:
        return str(exc)
    raise AssertionError("a missing optimizer_key did not raise")


def _fsdp2_adam_round_trip(mesh, path: str) -> None:
    """torch's documented flow, on FSDP2: the optimizer state loaded sharded, then set_optimizer_state_dict."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from hyper_parallel import fully_shard

    def build():
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)), mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    model, opt = build()
    for step in range(2):
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
    osd = get_optimizer_state_dict(model, opt)
    save({"model": get_model_state_dict(model), "optim": osd}, storage_writer=FileSystemWriter(path))

    fresh, fresh_opt = build()
    loaded = load_sharded_optimizer_state_dict(get_model_state_dict(fresh), "optim", FileSystemReader(path))
    set_optimizer_state_dict(fresh, fresh_opt, optim_state_dict=loaded["optim"])
    assert_same(osd, get_optimizer_state_dict(fresh, fresh_opt))


def test_load_sharded_optimizer_state_dict_shards_the_state_like_the_model(tmp_path):
    for text in run_ranks(rank_sharded_optimizer, 2, str(tmp_path / "ckpt")):
        assert "optimizer_key='optimizer'" in text and "'optim'" in text, text
