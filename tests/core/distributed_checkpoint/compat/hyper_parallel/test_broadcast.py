"""HyperParallel's read-and-broadcast pipeline (``distributed_checkpoint.broadcast``, real code in
``transfer/broadcasts.py``): shard order, in-flight limit, groups, batching, and a real load
walk on 2 gloo ranks where each shard is read by one rank and lands on both."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch
from multiprocess import run_ranks
from torch.distributed.checkpoint.metadata import MetadataIndex

from hyper_parallel.core.distributed_checkpoint import broadcast, planner, util
from hyper_parallel.core.distributed_checkpoint._src.transfer import broadcasts
from hyper_parallel.core.distributed_checkpoint._src.transfer.broadcasts import BroadcastOps


@dataclass(frozen=True)
class Read:
    """A read item with the two fields the pipeline uses (HyperParallel's ReadItem has more)."""

    dest_index: MetadataIndex
    source: planner.BroadcastSource | None = None


def _read(fqn: str, src: int | None = None, group: tuple[int, ...] = (0, 1), offset: tuple = (0,)) -> Read:
    source = None if src is None else planner.BroadcastSource(group_ranks=group, src_rank=src)
    return Read(MetadataIndex(fqn=fqn, offset=offset, index=0), source)


class _Work:
    def __init__(self, fake: _Dist) -> None:
        self.fake = fake
        fake.going += 1
        fake.peak = max(fake.peak, fake.going)

    def wait(self) -> None:
        self.fake.going -= 1


class _Dist:
    """Records broadcasts; a world of ``world`` ranks where this one is ``rank``."""

    def __init__(self, rank: int = 0, world: int = 2) -> None:
        self.rank, self.world, self.sent, self.going, self.peak = rank, world, [], 0, 0

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any, async_op: bool = False) -> _Work:
        assert async_op, "a load's broadcasts are started without waiting"
        self.sent.append((tensor, src, group))
        return _Work(self)


def test_broadcast_source_is_a_frozen_record_of_plain_ints():
    source = planner.BroadcastSource(group_ranks=[1, 0], src_rank=torch.tensor(1).item())
    assert source == planner.BroadcastSource((1, 0), 1) and source.group_ranks == (1, 0)
    with pytest.raises(AttributeError):
        source.src_rank = 0  # type: ignore[misc]


def test_every_rank_derives_the_same_shard_order_from_its_own_plan():
    items = [_read("b", 0), _read("a", 1, offset=(4,)), _read("a", 0, offset=(0,)), _read("plain"), _read("b", 0)]
    order = broadcasts.shard_order(items)
    assert [(s[0].dest_index.fqn, tuple(s[0].dest_index.offset), len(s)) for s in order] == [
        ("a", (0,), 1), ("a", (4,), 1), ("b", (0,), 2)]
    again = broadcasts.shard_order(list(reversed(items)))
    assert [(s[0].dest_index.fqn, tuple(s[0].dest_index.offset)) for s in again] == [
        (s[0].dest_index.fqn, tuple(s[0].dest_index.offset)) for s in order]


def test_a_shard_with_two_sources_is_refused_naming_it():
    with pytest.raises(ValueError, match="'w' at offset"):
        broadcasts.shard_order([_read("w", 0), _read("w", 1)])


def test_a_shard_whose_group_was_not_built_raises_before_any_broadcast():
    fake = _Dist()
    with pytest.raises(KeyError):
        broadcasts.broadcast_shard(deque(), {"w": torch.zeros(2)}, _read("w", 0), {}, BroadcastOps(dist=fake))
    assert fake.sent == []


def test_broadcasts_in_flight_never_pass_the_limit_and_land_in_the_state_dict_tensor():
    fake = _Dist()
    ops = BroadcastOps(dist=fake, max_in_flight=3)
    state = {f"w{i}": torch.zeros(2) for i in range(10)}
    in_flight: deque = deque()
    for name in state:
        broadcasts.broadcast_shard(in_flight, state, _read(name, 1), {(0, 1): "g"}, ops)
    assert fake.peak == 3 and len(in_flight) == 3
    broadcasts.wait_broadcasts(in_flight)
    assert not in_flight and fake.going == 0
    assert [t.data_ptr() for t, _, _ in fake.sent] == [t.data_ptr() for t in state.values()]


def test_the_face_reads_its_patched_names_at_call_time():
    fake = _Dist()
    with mock.patch.object(broadcast, "dist", fake), mock.patch.object(broadcast, "_MAX_BROADCASTS_IN_FLIGHT", 2):
        in_flight: deque = deque()
        for _ in range(5):
            broadcast.broadcast_shard(in_flight, {"w": torch.zeros(1)}, _read("w", 0), {(0, 1): "g"})
        broadcast.wait_broadcasts(in_flight)
    assert len(fake.sent) == 5 and fake.peak == 2
    assert util._MAX_BROADCASTS_IN_FLIGHT == broadcast._MAX_BROADCASTS_IN_FLIGHT == 8


def test_small_shards_travel_in_one_batch_and_are_dealt_back_out_on_a_receiver():
    fake = _Dist(rank=1)
    ops = BroadcastOps(dist=fake)
    state = {f"w{i}": torch.zeros(4) for i in range(3)}
    batcher = broadcasts.BroadcastBatcher(1024, {(0, 1): "g"}, ops)
    in_flight: deque = deque()
    for name in state:
        batcher.add(in_flight, state, _read(name, 0))
    batcher.flush(in_flight)
    (staging, src, group), = fake.sent
    assert (staging.numel(), src, group) == (12, 0, "g")
    staging.copy_(torch.arange(12.0))  # what the sender's broadcast would bring
    broadcasts.wait_broadcasts(in_flight)
    assert torch.equal(torch.cat(list(state.values())), torch.arange(12.0))
    assert (batcher.sent, batcher.batched) == (1, 3)


def test_groups_for_a_load_are_created_where_missing_and_destroyed_after():
    class Gathering(_Dist):
        def __init__(self) -> None:
            super().__init__(world=4)
            self.made, self.gone = [], []

        def all_gather_object(self, out: list, obj: Any, group: Any = None) -> None:
            out[:] = [obj] + [(((2, 3),), ((2, 3),))] * 3  # each peer needs (2, 3) and has none

        def new_group(self, ranks: list[int]) -> str:
            self.made.append(tuple(ranks))
            return f"g{tuple(ranks)}"

        def destroy_process_group(self, group: Any = None) -> None:
            self.gone.append(group)

    fake = Gathering()
    ops = BroadcastOps(dist=fake, get_created_group=lambda ranks: None, world_group=lambda: "world",
                       synchronize=lambda: None)
    items = [_read("w", 0), _read("all", 0, group=(0, 1, 2, 3))]
    with broadcasts.broadcast_groups_for_load(items, None, ops) as groups:
        assert groups == {(0, 1): "g(0, 1)", (0, 1, 2, 3): "world"}
    assert fake.made == [(0, 1), (2, 3)]  # this rank takes part in making its peers' group too
    assert fake.gone == ["g(0, 1)"]  # the world group and the peers' group are not this load's to destroy


# --- 2 real gloo ranks -------------------------------------------------------------------

_STORAGE = {"a": torch.arange(6.0), "b": torch.arange(4.0) * 10, "c": torch.tensor([7.0, 8.0]),
            "d": torch.tensor([1.5]), "own": None}


def _load_on_rank(rank: int, world: int, batch_bytes: int) -> dict[str, Any]:
    state = {k: torch.zeros_like(v) for k, v in _STORAGE.items() if v is not None}
    state["own"] = torch.zeros(2)
    # rank 0 reads a and c for both, rank 1 reads b and d; "own" is read by each rank itself
    plan = [_read("a", 0), _read("b", 1), _read("c", 0), _read("d", 1), _read("own")]
    if rank == 1:
        plan.reverse()  # each rank's plan lists its items in its own order
    reads: list[str] = []
    threads: set[str] = set()

    def read(items: list[Read]) -> None:
        threads.add(threading.current_thread().name)
        for item in items:
            name = item.dest_index.fqn
            reads.append(name)
            state[name].copy_(torch.full((2,), float(rank)) if name == "own" else _STORAGE[name])

    with broadcast.broadcast_groups_for_load(plan) as groups:
        broadcast.read_and_broadcast(plan, state, read, groups, batch_bytes=batch_bytes)
    # plain lists: tensors sent back through the result queue would share memory of an exiting process
    return {"state": {k: v.tolist() for k, v in state.items()}, "reads": reads, "groups": sorted(groups),
            "threads": sorted(threads)}


@pytest.mark.parametrize("batch_bytes", [0, 1 << 20])
def test_two_ranks_each_shard_is_read_once_and_lands_on_both(batch_bytes):
    out = run_ranks(_load_on_rank, 2, batch_bytes)
    for rank, got in enumerate(out):
        for name in "abcd":
            assert got["state"][name] == _STORAGE[name].tolist(), (rank, name)
        assert got["state"]["own"] == [float(rank)] * 2
        assert got["groups"] == [(0, 1)]
        assert threading.main_thread().name not in got["threads"]  # reads run on the read-ahead thread
    assert sorted(out[0]["reads"]) == ["a", "c", "own"] and sorted(out[1]["reads"]) == ["b", "d", "own"]


def rank_broadcast_from_minimum_rank(rank: int, ws: int, root: str) -> bool:
    import torch.distributed as dist

    from hyper_parallel.core.distributed_checkpoint import load, save

    sd = {"shared": torch.arange(12.0).reshape(3, 4)}
    save(sd, root)
    target = {"shared": torch.full((3, 4), float(-1 - rank))}  # poisoned per rank
    groups = {(0, 1): dist.group.WORLD}
    load(target, checkpoint_id=root, broadcast_from_minimum_rank=True, broadcast_groups=groups)
    return torch.equal(target["shared"], sd["shared"])


def test_load_takes_hyper_parallels_broadcast_from_minimum_rank(tmp_path):
    from multiprocess import run_ranks

    from hyper_parallel.core.distributed_checkpoint import load

    assert run_ranks(rank_broadcast_from_minimum_rank, 2, str(tmp_path / "ck")) == [True, True]
    with pytest.raises(ValueError, match="disagree"):
        load({"w": torch.zeros(1)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True,
             broadcast_from_minimum_rank=True, broadcast_replicated_tensors=False)
    with pytest.raises(ValueError, match="broadcast_groups needs"):
        load({"w": torch.zeros(1)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True,
             broadcast_from_minimum_rank=False, broadcast_groups={(0,): None})
