"""Save planning and load planning as two planners, and StandardPlanner as both.

BoxSavePlanner saves what BoxLoadPlanner loads, on real files (one process and 2 gloo ranks);
their files are the ones StandardPlanner writes; renaming keys is one rule on both sides;
StandardPlanner still saves and loads with one object, as HyperParallel's code uses it.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from helpers import Counter, local_expected, make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import StandardLoadPlanner, StandardSavePlanner, load, save
from hyper_parallel.core.distributed_checkpoint._src.planning.load_planner import BoxLoadPlanner
from hyper_parallel.core.distributed_checkpoint._src.planning.plan_cache import PLAN_CACHE
from hyper_parallel.core.distributed_checkpoint._src.planning.planner import LoadPlanner, SavePlanner
from hyper_parallel.core.distributed_checkpoint._src.planning.planner_base import BoxPlannerBase
from hyper_parallel.core.distributed_checkpoint._src.planning.save_planner import BoxSavePlanner
from hyper_parallel.core.distributed_checkpoint._src.planning.standard_planner import StandardPlanner


def every_kind(seed: int) -> dict:
    return {
        "w": make_tensor((4, 3), seed=seed),
        "half": make_tensor((2, 5), torch.bfloat16, seed=seed + 1),
        "nested": {"bias": make_tensor((3,), seed=seed + 2), "step": seed},
        "arr": np.arange(6, dtype=np.float32).reshape(2, 3) + seed,
        "blob": bytes([seed]) * 5,
        "name": f"run-{seed}", "none": None, "cfg": {"lr": 0.1 * seed, "betas": (0.9, 0.99)},
        "app": Counter(seed),  # a Stateful
    }


def zeros_target(seed: int) -> dict:
    target = every_kind(0)
    target["app"].hist = torch.zeros(seed)  # a saved Counter(seed) holds seed values
    return target


def assert_every_kind(target: dict, seed: int) -> None:
    want = every_kind(seed)
    assert torch.equal(target["w"], want["w"])
    assert target["half"].dtype == torch.bfloat16 and torch.equal(target["half"], want["half"])
    assert torch.equal(target["nested"]["bias"], want["nested"]["bias"]) and target["nested"]["step"] == seed
    assert np.array_equal(target["arr"], want["arr"])
    assert target["blob"] == want["blob"]
    assert (target["name"], target["none"], target["cfg"]) == (f"run-{seed}", None, want["cfg"])
    assert target["app"].n == seed and torch.equal(target["app"].hist, want["app"].hist)


def test_the_save_planner_saves_what_the_load_planner_loads(tmp_path):
    save(every_kind(3), str(tmp_path), planner=BoxSavePlanner())
    target = zeros_target(3)
    load(target, str(tmp_path), planner=BoxLoadPlanner())
    assert_every_kind(target, 3)
    whole = load(path=str(tmp_path), planner=BoxLoadPlanner())  # no target: the checkpoint as saved
    assert torch.equal(whole["nested"]["bias"], every_kind(3)["nested"]["bias"])


def _normalized(path: str) -> tuple[dict, dict[str, bytes]]:
    """A checkpoint's metadata and data files with its save id (in file names and in the
    metadata, with the checksum over it) taken out."""
    meta = json.loads(open(os.path.join(path, ".metadata"), "rb").read())
    save_id = meta.pop("save_id")
    meta.pop("crc32c")
    meta = json.loads(json.dumps(meta).replace(save_id, "ID"))
    files = {name.replace(save_id, "ID"): open(os.path.join(path, name), "rb").read().replace(save_id.encode(), b"ID")
             for name in os.listdir(path) if name != ".metadata"}
    return meta, files


def test_the_save_planner_writes_the_files_standard_planner_writes(tmp_path):
    """The split changes no byte on disk: same metadata, same data files (save ids aside)."""
    state = every_kind(5)
    state["big"] = make_tensor((512, 1024), seed=9)  # >= 1 MiB: stored in column bands (tiles)
    save(state, str(tmp_path / "split"), planner=BoxSavePlanner())
    save(state, str(tmp_path / "standard"), planner=StandardPlanner())
    split, standard = _normalized(str(tmp_path / "split")), _normalized(str(tmp_path / "standard"))
    assert split[0]["entries"]["big"]["store"]["grid"]["tiles"] > 1
    assert split == standard


class PrefixSave(BoxSavePlanner):
    def transform_key(self, key):
        return None if key.startswith("skip") else "v2." + key


class PrefixLoad(BoxLoadPlanner):
    def transform_key(self, key):
        return None if key.startswith("skip") else "v2." + key


def test_renaming_keys_is_one_rule_for_both_planners(tmp_path):
    state = every_kind(4)
    state["skip_me"] = torch.ones(2)
    save(state, str(tmp_path), planner=PrefixSave())
    stored = load(path=str(tmp_path))
    assert set(stored) == {"v2"} and "skip_me" not in stored["v2"]
    target = zeros_target(4)
    load(target, str(tmp_path), planner=PrefixLoad())
    assert_every_kind(target, 4)
    # the renaming of a save planner's mapper is undone by the same mapper on the load planner
    save({"layers": {"0": {"w": torch.ones(2)}}}, str(tmp_path / "pp"),
         planner=BoxSavePlanner(topology_mapper={"layers.0.w": "layers.2.w"}))
    into = {"layers": {"0": {"w": torch.zeros(2)}}}
    load(into, str(tmp_path / "pp"), planner=BoxLoadPlanner(topology_mapper={"layers.0.w": "layers.2.w"}))
    assert torch.equal(into["layers"]["0"]["w"], torch.ones(2))


def test_standard_planner_still_saves_and_loads_with_one_object(tmp_path):
    planner = StandardPlanner()
    save(every_kind(6), str(tmp_path / "a"), planner=planner)
    target = zeros_target(6)
    load(target, str(tmp_path / "a"), planner=planner)
    assert_every_kind(target, 6)
    # and with the split planners on the other side, both ways
    target = zeros_target(6)
    load(target, str(tmp_path / "a"), planner=BoxLoadPlanner())
    assert_every_kind(target, 6)
    save(every_kind(7), str(tmp_path / "b"), planner=BoxSavePlanner())
    target = zeros_target(7)
    load(target, str(tmp_path / "b"), planner=planner)
    assert_every_kind(target, 7)


def test_standard_planner_is_both_planners_and_adds_no_planning_of_its_own():
    planner = StandardPlanner()
    for cls in (SavePlanner, LoadPlanner, BoxSavePlanner, BoxLoadPlanner, BoxPlannerBase):
        assert isinstance(planner, cls)
    assert StandardSavePlanner is StandardPlanner and StandardLoadPlanner is StandardPlanner  # HyperParallel's names
    assert not isinstance(BoxSavePlanner(), LoadPlanner) and not isinstance(BoxLoadPlanner(), SavePlanner)
    assert not isinstance(BoxSavePlanner(), StandardPlanner)
    own = {n for n, v in vars(StandardPlanner).items() if callable(v) and not n.startswith("__")}
    assert own == set(), own  # every method is a split planner's (or HyperParallel's calls')
    assert StandardPlanner.resolve_data is BoxSavePlanner.resolve_data
    assert StandardPlanner.finish_load is BoxLoadPlanner.finish_load
    assert StandardPlanner.transform_key is BoxSavePlanner.transform_key is BoxLoadPlanner.transform_key
    # options land where each side reads them
    both = StandardPlanner(allow_pickle=True, convert_dtype=False, allow_partial_load=True,
                           save_to_minimum_rank=True, enable_plan_caching=False)
    assert (both.allow_pickle, both.convert_dtype, both.allow_partial_load) == (True, False, True)
    assert (both.dedup_save_to_lowest_rank, both.enable_plan_caching, both._enable_plan_caching) == (True, False, False)
    assert BoxSavePlanner(dedup_save_to_lowest_rank=True).dedup_save_to_lowest_rank is True
    assert BoxLoadPlanner(allow_partial_load=True, convert_dtype=False).convert_dtype is False
    for make in (StandardPlanner, BoxSavePlanner, BoxLoadPlanner):
        with pytest.raises(TypeError, match="flatten_state_dict must be True or False"):
            make(flatten_state_dict="yes")


def test_a_planner_of_one_side_passed_to_the_other_says_what_to_pass(tmp_path):
    with pytest.raises(AttributeError, match="BoxLoadPlanner has no set_up_save: it plans only loads.*BoxSavePlanner"):
        save({"w": torch.ones(2)}, str(tmp_path / "a"), planner=BoxLoadPlanner())
    save({"w": torch.ones(2)}, str(tmp_path / "b"))
    with pytest.raises(AttributeError, match="BoxSavePlanner has no set_up_load: it plans only saves.*BoxLoadPlanner"):
        load({"w": torch.zeros(2)}, str(tmp_path / "b"), planner=BoxSavePlanner())
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        BoxLoadPlanner().nothing  # noqa: B018 (any other missing name: the usual error)


class RecordingSave(BoxSavePlanner):
    """Counts plan-cache hits as a subclass that calls the base hooks does."""

    hits = 0

    def get_cached(self):
        found = super().get_cached()
        type(self).hits += found is not None
        return found


def test_the_save_planner_caches_plans_under_its_own_class(tmp_path):
    PLAN_CACHE.clear()
    state = {"w": make_tensor((8, 8), seed=1), "step": 1}
    save(state, str(tmp_path / "a"), planner=RecordingSave())
    save(state, str(tmp_path / "b"), planner=RecordingSave())
    assert RecordingSave.hits == 1
    assert RecordingSave().cache_key()[0] == "RecordingSave" and StandardPlanner().cache_key()[0] == "StandardPlanner"
    target = {"w": torch.zeros(8, 8), "step": 0}
    load(target, str(tmp_path / "b"), planner=BoxLoadPlanner())  # the save from the cached plan loads
    assert torch.equal(target["w"], state["w"]) and target["step"] == 1


def _two_ranks(rank: int, ws: int, path: str) -> list[str]:
    """Save a Shard(0), a Replicate DTensor and a plain tensor with the save planner, load them
    as Shard(1) with the load planner; then the same with one StandardPlanner for both."""
    mesh = init_device_mesh("cpu", (ws,))
    full = {"s": make_tensor((6, 4), seed=1), "r": make_tensor((3, 5), seed=2), "p": make_tensor((2, 2), seed=3)}
    state = {"s": make_dtensor(full["s"], mesh, [Shard(0)]), "r": make_dtensor(full["r"], mesh, [Replicate()]),
             "p": full["p"].clone(), "step": 9}
    problems: list[str] = []
    for name, saver, loader in (("split", BoxSavePlanner(), BoxLoadPlanner()),
                                ("standard", StandardPlanner(), None)):
        where = os.path.join(path, name)
        save(state, where, planner=saver)
        target = {"s": make_dtensor(torch.zeros(6, 4), mesh, [Shard(1)]),
                  "r": make_dtensor(torch.zeros(3, 5), mesh, [Shard(0)]), "p": torch.zeros(2, 2), "step": 0}
        load(target, where, planner=loader if loader is not None else saver)
        if not torch.equal(target["s"].to_local(), local_expected(full["s"], mesh, [Shard(1)])):
            problems.append(f"{name}: s")
        if not torch.equal(target["r"].to_local(), local_expected(full["r"], mesh, [Shard(0)])):
            problems.append(f"{name}: r")
        if not torch.equal(target["p"], full["p"]) or target["step"] != 9:
            problems.append(f"{name}: p/step")
    return problems


def test_two_ranks_save_with_the_save_planner_and_load_with_the_load_planner(tmp_path):
    results = run_ranks(_two_ranks, 2, str(tmp_path))
    assert results == [[], []]
    split, standard = _normalized(str(tmp_path / "split")), _normalized(str(tmp_path / "standard"))
    assert split == standard  # the same files, whichever planner wrote them
    assert sorted(re.sub(r"-r(\d+)-.*", r"-r\1", n) for n in split[1]) == ["data-r00000", "data-r00001"]
