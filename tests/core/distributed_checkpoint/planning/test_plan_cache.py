"""The save-plan cache and HyperParallel's hooks on it (``get_cached``, ``cache_result``,
``_cached_plans_key``, ``_cached_save_result``), as its ``dcp_plan_cache_minimal_api.py``
system test uses them: ported to 2 real gloo ranks with torch's DTensor on a CPU mesh.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import StandardPlanner, async_save, load, save
from hyper_parallel.core.distributed_checkpoint._src.planning.plan_cache import PLAN_CACHE, CachedSaveResult, PlanCache
from hyper_parallel.core.distributed_checkpoint._src.planning.planner import SavePlanner
from hyper_parallel.core.distributed_checkpoint._src.planning.standard_planner import StandardSavePlanner


class _Recording(StandardSavePlanner):
    """Records every plan-cache hook call with the entry key it was made for, calling the base
    hooks as a HyperParallel subclass does (its system tests count hits and misses this way)."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)
        self.calls: list[tuple[str, str]] = []  # ("hit" | "miss" | "write", entry key)

    def get_cached(self):
        found = super().get_cached()
        self.calls.append(("miss" if found is None else "hit", self._cached_plans_key))
        return found

    def cache_result(self, final_plan, metadata) -> None:
        self.calls.append(("write", self._cached_plans_key))
        super().cache_result(final_plan, metadata)

    def keys(self, kind: str) -> list[str]:
        return [key for what, key in self.calls if what == kind]

    @classmethod
    def clear_cache(cls) -> None:
        cls._cached_save_result.clear()  # HyperParallel's name for the cache


def model_state(step: int, mesh) -> dict:
    """A plain tensor, a Shard(0) and a Replicate DTensor, and a dict of plain values."""
    return {
        "dense": torch.full((64, 32), float(step)),
        "dt_sharded": DTensor.from_local(torch.arange(32 * 32, dtype=torch.float32).reshape(32, 32)
                                         + step + 1000 * mesh.get_local_rank(), mesh, [Shard(0)]),
        "dt_replicated": DTensor.from_local(torch.full((16, 24), float(step)), mesh, [Replicate()]),
        "io_payload": {"step": step, "tag": f"model-{step}"},
    }


def model_target(mesh) -> dict:
    return {
        "dense": torch.zeros(64, 32),
        "dt_sharded": DTensor.from_local(torch.zeros(32, 32), mesh, [Shard(0)]),
        "dt_replicated": DTensor.from_local(torch.zeros(16, 24), mesh, [Replicate()]),
        "io_payload": {"step": 0, "tag": ""},
    }


def optimizer_state(step: int) -> dict:
    return {
        "exp_avg": torch.full((64, 32), float(step)),
        "exp_avg_sq": torch.full((64, 32), float(step + 1)),
        "optim_state": {"step": step, "tag": f"optim-{step}"},
    }


def assert_loaded(target: dict, saved: dict) -> None:
    for key, want in saved.items():
        got = target[key]
        if isinstance(want, DTensor):
            assert torch.equal(got.to_local(), want.to_local()), key
        elif isinstance(want, torch.Tensor):
            assert torch.equal(got, want), key
        else:
            assert got == want, key


def counts(planner: _Recording) -> tuple[int, int, int]:
    return len(planner.keys("miss")), len(planner.keys("hit")), len(planner.keys("write"))


# ---------------------------------------------------------------- on 2 gloo ranks

def _repeated_save_hits(rank: int, ws: int, base: str) -> list[str]:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    _Recording.clear_cache()
    planner = _Recording()
    sd = model_state(1, mesh)
    save(sd, checkpoint_id=os.path.join(base, "ckpt1"), planner=planner, use_collectives=True)
    assert counts(planner) == (1, 0, 1)
    sd.clear()
    sd.update(model_state(2, mesh))  # same structure, new values
    save(sd, checkpoint_id=os.path.join(base, "ckpt2"), planner=planner, use_collectives=True)
    assert counts(planner) == (1, 1, 1)
    assert planner.keys("hit") == planner.keys("write")
    target = model_target(mesh)
    load(target, checkpoint_id=os.path.join(base, "ckpt2"))
    assert_loaded(target, sd)
    assert target["io_payload"]["step"] == 2
    return planner.keys("write")


def test_a_second_save_of_the_same_structure_hits_the_cache_and_saves_the_new_values(tmp_path):
    keys = run_ranks(_repeated_save_hits, 2, str(tmp_path))
    assert keys[0] != keys[1]  # an entry per rank: each rank caches its own part of the plan


def _structures_have_entries_of_their_own(rank: int, ws: int, base: str) -> None:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    _Recording.clear_cache()
    planner = _Recording()
    model = model_state(10, mesh)
    save(model, checkpoint_id=os.path.join(base, "model"), planner=planner)
    model.clear()
    model.update(model_state(11, mesh))
    save(model, checkpoint_id=os.path.join(base, "model_2"), planner=planner)
    assert counts(planner) == (1, 1, 1)
    assert planner.keys("hit")[0] == planner.keys("write")[0]

    optim = optimizer_state(20)
    save(optim, checkpoint_id=os.path.join(base, "optim"), planner=planner)
    assert counts(planner) == (2, 1, 2)
    assert planner.keys("write")[1] != planner.keys("write")[0]
    optim.clear()
    optim.update(optimizer_state(21))
    save(optim, checkpoint_id=os.path.join(base, "optim_2"), planner=planner)
    assert counts(planner) == (2, 2, 2)
    assert planner.keys("hit")[1] == planner.keys("write")[1] != planner.keys("write")[0]

    target = model_target(mesh)
    load(target, checkpoint_id=os.path.join(base, "model_2"))
    assert_loaded(target, model)
    assert target["io_payload"]["step"] == 11
    target = {"exp_avg": torch.zeros(64, 32), "exp_avg_sq": torch.zeros(64, 32), "optim_state": {"step": 0, "tag": ""}}
    load(target, checkpoint_id=os.path.join(base, "optim_2"))
    assert_loaded(target, optim)
    assert target["optim_state"]["step"] == 21


def test_differently_structured_state_dicts_use_cache_entries_of_their_own(tmp_path):
    run_ranks(_structures_have_entries_of_their_own, 2, str(tmp_path))


def _clear_cache_empties_it(rank: int, ws: int, base: str) -> None:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    planner = _Recording()
    sd = model_state(1, mesh)
    save(sd, os.path.join(base, "a"), planner=planner)
    save(sd, os.path.join(base, "b"), planner=planner)
    assert counts(planner) == (1, 1, 1)
    assert len(_Recording._cached_save_result) >= 1
    _Recording.clear_cache()
    assert len(StandardPlanner._cached_save_result) == 0
    sd["dense"] += 1
    save(sd, os.path.join(base, "c"), planner=planner)
    assert counts(planner) == (2, 1, 2)  # missed, made the plan again, cached it
    assert planner.keys("write")[1] == planner.keys("write")[0]  # under the same key
    save(sd, os.path.join(base, "d"), planner=planner)
    assert counts(planner) == (2, 2, 2)
    StandardSavePlanner.cached_save_result.clear()  # HyperParallel's older name: the same cache
    save(sd, os.path.join(base, "e"), planner=planner)
    assert counts(planner) == (3, 2, 3)
    target = model_target(mesh)
    load(target, os.path.join(base, "e"))
    assert_loaded(target, sd)


def test_clear_cache_empties_the_plan_cache_so_the_next_save_misses(tmp_path):
    run_ranks(_clear_cache_empties_it, 2, str(tmp_path))


def _one_rank_without_the_entry(rank: int, ws: int, base: str) -> None:
    planner = _Recording()
    sd = optimizer_state(1)
    save(sd, os.path.join(base, "a"), planner=planner)
    if rank == 1:
        planner.clear_cache()  # rank 0 still holds the plan; rank 1 does not
    dist.barrier()
    save(sd, os.path.join(base, "b"), planner=planner)
    assert counts(planner) == (2, 0, 2)  # a miss anywhere is a miss everywhere
    save(sd, os.path.join(base, "c"), planner=planner)
    assert counts(planner) == (2, 1, 2)


def test_a_plan_is_used_only_when_every_rank_has_it_cached(tmp_path):
    run_ranks(_one_rank_without_the_entry, 2, str(tmp_path))


# ---------------------------------------------------------------- one process

@pytest.fixture(autouse=True)
def _empty_cache():
    PLAN_CACHE.clear()
    yield
    PLAN_CACHE.clear()


def test_both_hyper_parallel_names_are_the_one_process_wide_cache():
    assert StandardSavePlanner._cached_save_result is StandardSavePlanner.cached_save_result is PLAN_CACHE
    assert _Recording._cached_save_result is PLAN_CACHE


def test_get_cached_returns_what_the_ranks_agreed_and_its_key_names_the_entry(tmp_path):
    planner = _Recording()
    sd = optimizer_state(1)
    save(sd, str(tmp_path / "a"), planner=planner, no_dist=True)
    key = planner.keys("write")[0]
    assert isinstance(key, str) and list(PLAN_CACHE) == [key]
    entry = PLAN_CACHE[key]
    assert isinstance(entry, CachedSaveResult)
    assert set(entry.final_plan.entries) == {"exp_avg", "exp_avg_sq", "optim_state"}
    assert entry.metadata is None  # the plan only: the metadata would keep the caller's values alive
    assert planner.get_cached() is entry  # outside a save: the entry under _cached_plans_key


def test_a_subclass_whose_cache_result_skips_super_caches_nothing(tmp_path):
    class NoCache(_Recording):
        def cache_result(self, final_plan, metadata):
            self.calls.append(("write", self._cached_plans_key))  # and no super(): nothing stored

    planner = NoCache()
    for i in range(3):
        save(optimizer_state(i), str(tmp_path), planner=planner, no_dist=True)
    assert counts(planner) == (3, 0, 3)
    assert len(PLAN_CACHE) == 0


def test_no_hook_is_called_when_plan_caching_is_off(tmp_path):
    class Off(_Recording):
        def __init__(self):
            super().__init__()
            self.enable_plan_caching = False

    planner = Off()
    for i in range(2):
        save(optimizer_state(i), str(tmp_path), planner=planner, no_dist=True)
    assert counts(planner) == (0, 0, 0)
    assert len(PLAN_CACHE) == 0


def test_get_cached_raising_fails_the_save_before_anything_is_committed(tmp_path):
    class Broken(StandardPlanner):
        def get_cached(self):
            raise RuntimeError("hook broke")

    with pytest.raises(RuntimeError, match="hook broke"):
        save(optimizer_state(1), str(tmp_path), planner=Broken(), no_dist=True)
    assert not os.path.exists(tmp_path / ".metadata")


def test_cache_result_raising_is_a_warning_after_the_commit(tmp_path):
    class Broken(StandardPlanner):
        def cache_result(self, final_plan, metadata):
            raise RuntimeError("hook broke")

    with pytest.warns(UserWarning, match=r"is committed, but .*Broken\.cache_result raised RuntimeError: hook broke"):
        save(optimizer_state(3), str(tmp_path), planner=Broken(), no_dist=True)
    assert load(path=str(tmp_path))["optim_state"]["step"] == 3
    assert len(PLAN_CACHE) == 0


class _Delegating(SavePlanner):
    """A SavePlanner that is not a StandardPlanner and has no cache hooks, only a cache_key."""

    def __init__(self):
        self.inner = StandardPlanner()
        self.global_plans = 0

    def cache_key(self):
        return "delegating"

    def set_up_save(self, state_dict, is_coordinator):
        self.inner.set_up_save(state_dict, is_coordinator)

    def create_local_save_plan(self):
        return self.inner.create_local_save_plan()

    def create_global_save_plan(self, plans):
        self.global_plans += 1
        return self.inner.create_global_save_plan(plans)

    def resolve_data(self, item):
        return self.inner.resolve_data(item)


def test_a_planner_without_the_hooks_is_still_cached(tmp_path):
    planner = _Delegating()
    for i in range(3):
        save(optimizer_state(i), str(tmp_path), planner=planner, no_dist=True)
    assert planner.global_plans == 1
    assert len(PLAN_CACHE) == 1
    assert load(path=str(tmp_path))["optim_state"]["step"] == 2


def test_async_saves_call_the_hooks_of_the_callers_planner(tmp_path):
    planner = _Recording()
    for step in range(2):
        async_save(optimizer_state(step), checkpoint_id=str(tmp_path / str(step)), planner=planner,
                   no_dist=True).result()
    assert [what for what, _ in planner.calls] == ["miss", "write", "hit"]
    # async_save plans with a copy of the planner, but the hooks run on the caller's object
    assert len(planner.keys("write")) == 1
    assert (len(planner.keys("miss")), len(planner.keys("hit"))) == (1, 1)
    assert planner.keys("hit") == planner.keys("write")
    assert load(path=str(tmp_path / "1"))["optim_state"]["step"] == 1


def test_the_cache_is_bounded_and_drops_the_least_recently_used_entry():
    cache = PlanCache(size=2)
    a, b, c = (CachedSaveResult(None, None) for _ in range(3))  # type: ignore[arg-type]
    cache["s:a"], cache["s:b"] = a, b
    cache.touch("s:a")
    cache["s:c"] = c
    assert list(cache) == ["s:a", "s:c"]
    assert cache.under("s:") == {"a": a, "c": c}
    cache.clear()
    assert len(cache) == 0 and cache.under("s:") == {}


class _SlowCacheResult(StandardPlanner):
    """A cache_result that works a while (logging, metrics) on the async writer's thread."""

    def cache_result(self, final_plan, metadata):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.5)
        super().cache_result(final_plan, metadata)


def test_a_planner_shared_by_an_async_and_a_sync_save_caches_each_plan_under_its_own_key(tmp_path):
    planner = _SlowCacheResult()
    small = {"x": torch.ones(4)}
    big = {"x": torch.ones(4), "y": torch.full((4,), 7.0)}
    resp = async_save(small, checkpoint_id=str(tmp_path / "a"), planner=planner, no_dist=True)
    time.sleep(0.2)  # the async save is in its cache_result
    save(big, str(tmp_path / "b"), planner=planner, no_dist=True)
    resp.result(timeout=60)
    assert sorted(sorted(e.final_plan.entries) for e in PLAN_CACHE.values()) == [["x"], ["x", "y"]]
    assert all(e.metadata is None for e in PLAN_CACHE.values())  # the caller's values are not kept
    save(big, str(tmp_path / "b2"), planner=_SlowCacheResult(), no_dist=True)  # a hit
    out = load(path=str(tmp_path / "b2"))
    assert sorted(out) == ["x", "y"] and torch.equal(out["y"], big["y"])
