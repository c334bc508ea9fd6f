"""ReshardOptions: the keywords of reshard() as one frozen record, checked once at the call,
before any storage is opened."""

from __future__ import annotations

import dataclasses
import os

import pytest
from helpers import make_tensor

from hyper_parallel.core.distributed_checkpoint import Layout, save
from hyper_parallel.core.distributed_checkpoint._src.resharding.reshard import (
    DEFAULT_MAX_MEMORY,
    ReshardOptions,
    reshard,
)


def test_options_resolve_the_destination_mesh_and_keep_the_defaults_reshard_documents():
    options = ReshardOptions({"dp": 2, "tp": 4})
    assert options.dst == Layout((2, 4), ("dp", "tp"))
    assert options.mapper is None
    assert (options.max_memory, options.verify, options.sync_files, options.copy_replicas) == (
        DEFAULT_MAX_MEMORY, True, True, True)


def test_options_cannot_change_after_the_call_built_them():
    options = ReshardOptions({"tp": 4})
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_memory = 1  # type: ignore[misc]


def test_a_mapper_given_as_a_mapping_is_resolved_once():
    options = ReshardOptions({"tp": 2}, topology_mapper={"a": "b"})
    assert options.mapper.map_fqn("a") == "b"


@pytest.mark.parametrize("kwargs, message", [
    ({"dst_mesh": None}, "reshard needs dst_mesh"),
    ({"dst_mesh": {"tp": 2}, "max_memory": 0}, "max_memory must be a positive number of bytes, found 0"),
    ({"dst_mesh": {"tp": 2}, "max_memory": 1.5}, "max_memory must be a positive number of bytes, found 1.5"),
])
def test_bad_options_fail_before_the_source_is_opened(tmp_path, kwargs, message):
    missing = str(tmp_path / "no-such-checkpoint")  # opening it would raise another error
    with pytest.raises(ValueError, match=message):
        reshard(missing, str(tmp_path / "out"), **kwargs)
    assert not os.path.exists(tmp_path / "out")


def test_a_failing_planning_phase_raises_the_ranks_own_error_and_writes_nothing(tmp_path):
    # one process: the planning phase's error comes back as itself, not wrapped, and the
    # destination is never prepared
    save({"w": make_tensor((6, 4))}, str(tmp_path / "src"), no_dist=True)
    tp4 = Layout((4,), ("tp",))
    with pytest.raises(ValueError, match=r"'w' \(shape \[6, 4\]\): rule .* does not fit"):
        reshard(str(tmp_path / "src"), str(tmp_path / "out"), dst_mesh=tp4, rules={"w": tp4("tp", "None", "None")})
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")
