"""find_state_dict_object / find_tensor_shard (sharding/shard_lookup.py): torch DCP's lookup of
a state dict's value, or this rank's chunk of it, by ``MetadataIndex``.

No offset means the whole value, in torch's form (``offset=None``) and in HyperParallel's
(``MetadataIndex("a")``, offset ``()``); a ShardedTensor answers with its local shard at the
offset (trying the index hint first), a DTensor with its local tensor when its chunk starts
there. A miss is a StateDictLookupError, which is also the ValueError torch raises. The sharded
cases run on two real gloo ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from multiprocess import run_ranks
from torch.distributed.checkpoint.metadata import MetadataIndex as TorchMetadataIndex

from hyper_parallel.core.distributed_checkpoint._src.base.errors import StateDictLookupError, StateDictMismatchError
from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex
from hyper_parallel.core.distributed_checkpoint.utils import find_state_dict_object, find_tensor_shard

# ---------------------------------------------------------------- one process: plain values


def test_no_offset_finds_a_whole_plain_tensor_in_either_form():
    sd = {"a": torch.rand(10), "m": torch.rand(3, 2)}
    assert MetadataIndex("a").offset == ()  # HyperParallel's form of "no offset"
    assert find_state_dict_object(sd, MetadataIndex("a")) is sd["a"]
    assert find_state_dict_object(sd, TorchMetadataIndex("a")) is sd["a"]
    assert find_state_dict_object(sd, MetadataIndex("a", index=99)) is sd["a"]  # a hint changes nothing
    assert find_state_dict_object(sd, MetadataIndex("m", [0, 0])) is sd["m"]  # the origin


def test_a_zero_dim_tensor_is_found_at_its_origin():
    sd = {"s": torch.tensor(3.0)}
    assert find_state_dict_object(sd, MetadataIndex("s")) is sd["s"]
    assert find_state_dict_object(sd, TorchMetadataIndex("s", torch.Size([]))) is sd["s"]


def test_a_plain_tensor_has_no_chunk_away_from_the_origin():
    with pytest.raises(StateDictLookupError, match=r"'a' is a plain tensor of shape \(10,\).*at offsets \(4,\)"):
        find_tensor_shard(torch.rand(10), MetadataIndex("a", [4]))


def test_a_non_tensor_value_is_found_without_an_offset_and_refused_with_one():
    sd = {"b": [1, 2, 3]}
    assert find_state_dict_object(sd, MetadataIndex("b")) is sd["b"]
    assert find_state_dict_object(sd, TorchMetadataIndex("b", index=1)) is sd["b"]
    with pytest.raises(StateDictLookupError, match=r"'b' is a list, not a tensor.*offsets \(1,\)"):
        find_state_dict_object(sd, MetadataIndex("b", [1]))


def test_a_missing_key_is_named_and_is_the_value_error_torch_raises():
    with pytest.raises(StateDictLookupError, match="Could not find FQN 'c'") as caught:
        find_state_dict_object({"a": 1, "b": 2}, MetadataIndex("c"))
    assert isinstance(caught.value, ValueError)  # torch's utils raise ValueError
    assert isinstance(caught.value, StateDictMismatchError)  # and ours a mismatch, as before


# ---------------------------------------------------------------- two ranks: ShardedTensor, DTensor


def _sharded(rank: int, ws: int) -> Any:
    """A (16,) ShardedTensor of two 4-element shards per rank: rank r holds offsets 8r and 8r+4,
    filled with their global positions."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    metas = [ShardMetadata([4 * i], [4], f"rank:{i // 2}/cpu") for i in range(2 * ws)]
    local = [Shard(torch.arange(4 * i, 4 * i + 4, dtype=torch.float32), metas[i]) for i in (2 * rank, 2 * rank + 1)]
    meta = ShardedTensorMetadata(metas, torch.Size([8 * ws]), TensorProperties(dtype=torch.float32))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def _outcome(fn: Any) -> Any:
    """What a lookup gave: the values found, or the error's kinds and text."""
    try:
        return fn().tolist()
    except Exception as exc:  # the tests read the kind and the message
        return {"error": type(exc).__name__, "value_error": isinstance(exc, ValueError), "text": str(exc)}


def _lookups(rank: int, ws: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    st = _sharded(rank, ws)
    mesh = init_device_mesh("cpu", (ws,))
    dt = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    sd = {"st": st, "dt": dt}
    second = 8 * rank + 4
    return {
        "st second": _outcome(lambda: find_state_dict_object(sd, MetadataIndex("st", [second]))),
        "st torch index": _outcome(lambda: find_state_dict_object(sd, TorchMetadataIndex("st", [second]))),
        "st good hint": _outcome(lambda: find_state_dict_object(sd, MetadataIndex("st", [second], index=1))),
        "st wrong hint": _outcome(lambda: find_state_dict_object(sd, MetadataIndex("st", [second], index=0))),
        "st hint out of range": _outcome(lambda: find_state_dict_object(sd, MetadataIndex("st", [second], index=9))),
        "st other rank": _outcome(lambda: find_state_dict_object(sd, MetadataIndex("st", [8 * (1 - rank)]))),
        "st no offset": _outcome(lambda: find_state_dict_object(sd, MetadataIndex("st"))),
        "st torch no offset": _outcome(lambda: find_state_dict_object(sd, TorchMetadataIndex("st"))),
        "dt mine": _outcome(lambda: find_state_dict_object(sd, MetadataIndex("dt", [2 * rank, 0]))),
        "dt no offset": _outcome(lambda: find_state_dict_object(sd, MetadataIndex("dt"))),
        "dt other rank": _outcome(lambda: find_state_dict_object(sd, MetadataIndex("dt", [2 * (1 - rank), 0]))),
    }


@pytest.fixture(scope="module")
def lookups() -> list[dict[str, Any]]:
    return run_ranks(_lookups, 2, timeout_s=180)


@pytest.mark.parametrize("name", ["st second", "st torch index", "st good hint", "st wrong hint",
                                  "st hint out of range"])
def test_a_sharded_tensor_gives_its_local_shard_at_the_offset_whatever_the_hint(lookups, name):
    for rank, got in enumerate(lookups):
        start = 8 * rank + 4
        assert got[name] == list(range(start, start + 4)), (rank, got[name])


def test_a_sharded_tensor_shard_held_by_another_rank_is_a_clear_miss(lookups):
    for rank, got in enumerate(lookups):
        miss = got["st other rank"]
        assert miss["error"] == "StateDictLookupError" and miss["value_error"], miss
        assert f"Could not find shard at offsets ({8 * (1 - rank)},) for FQN 'st'" in miss["text"]
        assert f"start at [({8 * rank},), ({8 * rank + 4},)]" in miss["text"]


@pytest.mark.parametrize("name", ["st no offset", "st torch no offset"])
def test_a_sharded_tensor_needs_an_offset(lookups, name):
    for got in lookups:
        assert got[name]["value_error"] and "'st' is a ShardedTensor and no offset was provided" in got[name]["text"]


def test_a_dtensor_gives_its_local_tensor_at_its_chunk_or_with_no_offset(lookups):
    for rank, got in enumerate(lookups):
        mine = [[4.0 * rank, 4.0 * rank + 1], [4.0 * rank + 2, 4.0 * rank + 3]]
        assert got["dt mine"] == mine and got["dt no offset"] == mine, got


def test_a_dtensor_chunk_of_another_rank_is_a_clear_miss(lookups):
    for rank, got in enumerate(lookups):
        miss = got["dt other rank"]
        assert miss["value_error"] and f"'dt': no shard at offsets ({2 * (1 - rank)}, 0)" in miss["text"], miss
