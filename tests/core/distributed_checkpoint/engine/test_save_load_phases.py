"""save and load as phases (engine/save_run.py, engine/load_run.py): a phase's own part stays
on its rank, the state dict is flattened once per call (a failure flattening it on one rank
still fails every rank, as inside an exchange), the group a mesh over some ranks chooses is
read from the flattened leaves, and an async save's staging data rides on a snapshot record
of its own (asynchronous/staged_snapshot.py), not on every flat state dict."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks

from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer, StandardPlanner, load, save
from hyper_parallel.core.distributed_checkpoint._src.asynchronous.staged_snapshot import StagedSnapshot
from hyper_parallel.core.distributed_checkpoint._src.coordination.coordinator import Coordinator
from hyper_parallel.core.distributed_checkpoint._src.engine.phase_result import PhaseResult
from hyper_parallel.core.distributed_checkpoint._src.engine.scope import mesh_group
from hyper_parallel.core.distributed_checkpoint._src.state.flatten import FlatStateDict, flatten


class _Counting:
    """A Stateful that counts its state_dict() calls and, on ``fail_rank``, raises from it."""

    def __init__(self, fail_rank: int | None = None):
        self.w = torch.arange(6.0)
        self.calls = 0
        self.fail_rank = fail_rank

    def state_dict(self) -> dict:
        self.calls += 1
        if self.fail_rank is not None and dist.is_initialized() and dist.get_rank() == self.fail_rank:
            raise ValueError(f"state_dict() refused on rank {self.fail_rank}")
        return {"w": self.w}

    def load_state_dict(self, sd: dict) -> None:
        self.w = sd["w"]


class _CountingDict(dict):
    """A root state dict that counts how often it is iterated."""

    walks = 0

    def items(self):
        type(self).walks += 1
        return super().items()

    def values(self):
        type(self).walks += 1
        return super().values()


def test_a_phase_keeps_its_own_part_and_the_exchange_carries_the_rest():
    coord = Coordinator(no_dist=True)
    reader = object()
    phase = PhaseResult(lambda: (reader, "summary"))
    with pytest.raises(RuntimeError, match="has not run"):
        _ = phase.kept
    assert phase.kept_or_none is None
    assert coord.exchange("phase", phase.shared) == ["summary"]
    assert phase.kept is reader

    def failing() -> tuple:
        raise KeyError("planning failed")

    broken = PhaseResult(failing)
    with pytest.raises(KeyError, match="planning failed"):
        coord.exchange("phase", broken.shared)
    assert broken.kept_or_none is None


def _count_walks(rank: int, ws: int, path: str) -> dict:
    app = _Counting()
    out = {}
    _CountingDict.walks = 0
    save(_CountingDict(app=app, step=3), path)  # the world's group: a mesh over some ranks could choose another
    out["save"] = (app.calls, _CountingDict.walks)
    app.w = torch.zeros(6)
    _CountingDict.walks = 0
    target = _CountingDict(app=app, step=0)
    load(target, path)
    out["load"] = (app.calls - 1, _CountingDict.walks)
    out["loaded"] = torch.equal(app.w, torch.arange(6.0)) and target["step"] == 3
    return out


def test_a_save_and_a_load_walk_the_state_dict_once(tmp_path):
    for out in run_ranks(_count_walks, 2, str(tmp_path / "c"), timeout_s=120):
        assert out["save"] == (1, 1)  # one state_dict() call, one walk: flattening (the group is read from it)
        assert out["load"] == (1, 2)  # flattening, and assigning the top-level values back as torch does
        assert out["loaded"]


def _fail_flattening_on_rank_1(rank: int, ws: int, path: str) -> dict:
    from hyper_parallel.core.distributed_checkpoint._src.base.errors import RankFailedError

    save({"app": _Counting(), "x": torch.full((2,), 5.0)}, path)
    out = {}
    app = _Counting(fail_rank=1)
    try:
        save({"app": app, "x": torch.zeros(2)}, path)
    except RankFailedError as exc:
        out["save"] = str(exc)
    out["save_calls"] = app.calls
    target = {"app": _Counting(fail_rank=1), "x": torch.zeros(2)}
    try:
        load(target, path)
    except RankFailedError as exc:
        out["load"] = str(exc)
    target = {"app": _Counting(), "x": torch.zeros(2)}
    load(target, path)  # the failed save left the previous checkpoint whole
    out["kept"] = target["x"].tolist()
    return out


def test_a_state_dict_that_fails_to_flatten_on_one_rank_fails_every_rank(tmp_path):
    outs = run_ranks(_fail_flattening_on_rank_1, 2, str(tmp_path / "c"), timeout_s=120)
    for rank, out in enumerate(outs):
        for call in ("save", "load"):
            assert "rank 1" in out[call] and "state_dict() refused on rank 1" in out[call], (rank, call, out)
        assert out["save_calls"] == 1
        assert out["kept"] == [5.0, 5.0]  # the first save's


class _Holder:
    """A Stateful holding a DTensor: its state is not looked into to choose the group."""

    def __init__(self, value):
        self.value = value

    def state_dict(self) -> dict:
        return {"v": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["v"]


def _mesh_from_leaves(rank: int, ws: int) -> dict:
    from torch.distributed.tensor import DTensor, Replicate

    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh

    if rank != 0:
        return {}
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",), rank_list=(0,))  # a mesh over rank 0 only
    t = DTensor.from_local(torch.ones(2), mesh, [Replicate()])
    out = {}
    for name, sd in {"nested": {"model": {"layers": [{"w": t}]}, "step": 1},
                     "in a stateful": {"app": _Holder(t), "step": 1},
                     "deeper than 64": _nest(t, 70),
                     "at 64": _nest(t, 63)}.items():
        walked, read = mesh_group(sd), mesh_group(sd, flatten(sd))
        out[name] = (None if walked is None else dist.get_process_group_ranks(walked),
                     None if read is None else dist.get_process_group_ranks(read))
    return out


def _nest(value, depth: int) -> dict:
    sd: dict = {"w": value}
    for _ in range(depth):
        sd = {"x": sd}
    return sd


def test_the_group_a_mesh_chooses_is_read_from_the_flattened_leaves_as_from_a_walk():
    out = run_ranks(_mesh_from_leaves, 2, timeout_s=120)[0]
    assert out["nested"] == ([0], [0])
    assert out["at 64"] == ([0], [0])
    assert out["in a stateful"] == (None, None)
    assert out["deeper than 64"] == (None, None)


_SEEN: list = []


class _Recording(StandardPlanner):
    def set_up_save(self, state_dict, is_coordinator):
        _SEEN.append((type(state_dict), getattr(state_dict, "stamps", None), getattr(state_dict, "bands", None)))
        super().set_up_save(state_dict, is_coordinator)


def test_an_async_save_hands_save_a_staged_snapshot_and_a_plain_flat_state_dict_has_no_staging_data(tmp_path):
    assert not hasattr(FlatStateDict(), "bands") and not hasattr(FlatStateDict(), "stamps")
    assert not hasattr(FlatStateDict(), "stream")
    _SEEN.clear()
    sd = {"w": torch.arange(12.0).reshape(3, 4), "step": 2}
    ckpt = AsyncCheckpointer()
    try:
        ckpt.save(sd, tmp_path / "a", planner=_Recording(), no_dist=True).result()
    finally:
        ckpt.close()
    save(sd, tmp_path / "b", planner=_Recording(), no_dist=True)
    (kind, stamps, bands), (plain_kind, plain_stamps, plain_bands) = _SEEN
    assert kind is StagedSnapshot and isinstance(stamps, dict) and isinstance(bands, dict)
    assert plain_kind is FlatStateDict and plain_stamps is None and plain_bands is None
    target = {"w": torch.zeros(3, 4), "step": 0}
    load(target, tmp_path / "a", no_dist=True)
    assert torch.equal(target["w"], sd["w"]) and target["step"] == 2


def test_a_staged_snapshot_keeps_the_paths_and_its_staging_data():
    snap = StagedSnapshot.staged({"a.b": (("a", "b"), 1)}, bands={}, stamps={"a.b": 7}, stream=None)
    assert dict(snap) == {"a.b": 1} and snap.paths == {"a.b": ("a", "b")}
    assert snap.stamps == {"a.b": 7} and snap.bands == {} and snap.stream is None
    assert isinstance(snap, FlatStateDict)
