"""StandardPlanner hooks: renaming and filtering planners round-trip every value kind."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import Counter, make_tensor

from hyper_parallel.core.distributed_checkpoint import (
    StandardPlanner,
    StateDictMismatchError,
    UnsupportedValueError,
    load,
    save,
)


class PrefixKeys(StandardPlanner):
    """Renames one key at a time (the recommended hook)."""

    def transform_key(self, key):
        return None if key.startswith("skip") else "v2." + key


class PrefixDict(StandardPlanner):
    """Renames through the whole map (the older hook), which load must trace back."""

    def transform_state_dict(self, state_dict):
        return {"v2." + k: v for k, v in state_dict.items() if not k.startswith("skip")}


def every_kind(seed: int) -> dict:
    return {
        "w": make_tensor((4, 3), seed=seed),
        "arr": np.arange(6, dtype=np.float32).reshape(2, 3) + seed,
        "blob": bytes([seed]) * 5,
        "step": seed, "epoch": seed,  # equal small ints: the same object, so identity cannot tell them apart
        "name": f"run-{seed}", "none": None, "cfg": {"lr": 0.1 * seed, "betas": (0.9, 0.99)},
        "app": Counter(seed),  # a Stateful
        "skip_me": torch.ones(2),
    }


@pytest.mark.parametrize("planner_cls", [PrefixKeys, PrefixDict])
def test_a_renaming_planner_round_trips_every_value_kind(tmp_path, planner_cls):
    save(every_kind(3), str(tmp_path), planner=planner_cls())
    saved = load(path=str(tmp_path))
    assert set(saved) == {"v2"} and "skip_me" not in saved["v2"]
    target = every_kind(0)
    target["app"].hist = torch.zeros(3)  # the saved Counter(3) holds 3 values
    load(target, str(tmp_path), planner=planner_cls(), strict=False)
    want = every_kind(3)
    assert torch.equal(target["w"], want["w"])
    assert np.array_equal(target["arr"], want["arr"])
    assert target["blob"] == want["blob"]
    assert (target["step"], target["epoch"], target["name"], target["none"]) == (3, 3, "run-3", None)
    assert target["cfg"] == {"lr": 0.1 * 3, "betas": (0.9, 0.99)}
    assert target["app"].n == 3 and torch.equal(target["app"].hist, want["app"].hist)


class Ambiguous(StandardPlanner):
    """A whole-map rename that cannot be undone key by key (it swaps two equal values)."""

    def transform_state_dict(self, state_dict):
        if len(state_dict) == 1:
            return {}
        return {"x." + k: v for k, v in state_dict.items()}


def test_an_untraceable_rename_of_a_plain_value_is_an_error_not_a_silent_skip(tmp_path):
    save({"a": 5, "b": 5}, str(tmp_path), planner=Ambiguous())
    target = {"a": 0, "b": 0}
    with pytest.raises(StateDictMismatchError, match="transform_key"):
        load(target, str(tmp_path), planner=Ambiguous())


def test_allow_pickle_applies_to_one_call_not_to_the_planner(tmp_path):
    planner = StandardPlanner()
    save({"s": {1, 2}}, str(tmp_path / "a"), planner=planner, allow_pickle=True)
    assert planner.allow_pickle is False
    with pytest.raises(UnsupportedValueError, match="pickle"):
        save({"s": {1, 2}}, str(tmp_path / "b"), planner=planner)
    with pytest.raises(UnsupportedValueError, match="pickle"):
        load(path=str(tmp_path / "a"), planner=planner)
    assert load(path=str(tmp_path / "a"), planner=planner, allow_pickle=True) == {"s": {1, 2}}
    assert planner.allow_pickle is False


def test_a_numpy_entry_loaded_into_a_torch_target_stays_a_torch_tensor(tmp_path):
    save({"arr": np.arange(4, dtype=np.int64)}, str(tmp_path))
    target = {"arr": torch.zeros(4, dtype=torch.int64)}
    load(target, str(tmp_path))
    assert isinstance(target["arr"], torch.Tensor) and target["arr"].tolist() == [0, 1, 2, 3]


def test_empty_targets_with_zero_strides_load_and_one_element_views_save(tmp_path):
    """An empty tensor has no elements to share memory: torch ops (and numpy, always) give
    empty results zero strides; a one-element view of a wider row is saved as its value."""
    src = torch.randn(3, 2, 0, 1) * 3
    arr = np.zeros((6, 1, 0, 2), np.int32)
    assert 0 in src.stride() and arr.strides == (0, 0, 0, 0)
    row = torch.arange(6.0).reshape(1, 6)
    save({"t": src, "a": arr, "x": row[:, 3], "b": torch.ones(3, 2)}, str(tmp_path), no_dist=True)
    target = {"t": torch.zeros_like(src), "a": np.zeros_like(arr), "x": torch.zeros(1)}
    load(target, str(tmp_path), no_dist=True)
    assert target["t"].shape == src.shape and target["a"].shape == arr.shape
    assert torch.equal(target["x"], torch.tensor([3.0]))
    with pytest.raises(StateDictMismatchError, match="share memory"):  # a non-empty broadcast view still is
        load({"b": torch.zeros(3, 1).expand(3, 2)}, str(tmp_path), no_dist=True, strict=False)
