"""Checkpoints stock torch DCP wrote, loaded directly by ours: in place, resharded, never running code.

The checkpoints come from ``torch.distributed.checkpoint.save`` itself (torch 2.13) on 4 gloo
ranks: DTensors on a 2-D and a 1-D mesh (uneven shards), a replicated plain tensor, an
optimizer-like nested state and plain values, written with one file per rank and with a file
per item, each with torch's dedup spread over the holders and on the lowest rank. They load on
2 ranks into other layouts (Shard(0) saved -> Shard(1) and Replicate), bit-exact, and in one
process with no target. A ``.metadata`` or a byte item carrying a hostile pickle fails with a
CheckpointError and the payload (it would create a marker file) never runs.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as tdcp
from helpers import assert_same, local_expected, make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    FileSystemReader,
    MetadataError,
    StateDictMismatchError,
    UnsupportedValueError,
    load,
)
from hyper_parallel.core.distributed_checkpoint.offline_transform import import_torch_dcp

# (single_file_per_rank, dedup_save_to_lowest_rank) of each checkpoint torch writes
VARIANTS = {"per_rank": (True, False), "per_rank_lowest": (True, True), "per_item": (False, False),
            "per_item_lowest": (False, True)}


def full_values() -> dict:
    """The global value of everything torch saves (the same on every rank)."""
    return {
        "model": {"s0s1": make_tensor((7, 5), seed=1), "rs0": make_tensor((9, 3), torch.bfloat16, seed=2),
                  "s0": make_tensor((10, 6), seed=3), "plain": make_tensor((3, 4), torch.float64, seed=4)},
        "optim": {"state": {"model.s0": {"exp_avg": make_tensor((10, 6), seed=5), "step": torch.tensor(7.0)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": ["model.s0"]}]},
        "extra": {"step": 7, "name": "run-a", "none": None, "flag": True, "blob": b"\x00bin\xff",
                  "array": np.arange(6, dtype=np.int32).reshape(2, 3)},
    }


def rank_torch_saves(rank: int, ws: int, root: str) -> None:
    """Stock torch DCP saves the state of :func:`full_values` sharded over 4 ranks, once per variant."""
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh1 = init_device_mesh("cpu", (4,), mesh_dim_names=("w",))
    full = full_values()
    sd = {
        "model": {"s0s1": make_dtensor(full["model"]["s0s1"], mesh2, [Shard(0), Shard(1)]),
                  "rs0": make_dtensor(full["model"]["rs0"], mesh2, [Replicate(), Shard(0)]),
                  "s0": make_dtensor(full["model"]["s0"], mesh1, [Shard(0)]),
                  "plain": full["model"]["plain"]},
        "optim": {"state": {"model.s0": {"exp_avg": make_dtensor(full["optim"]["state"]["model.s0"]["exp_avg"],
                                                                 mesh1, [Shard(0)]),
                                         "step": torch.tensor(7.0)}},
                  "param_groups": full["optim"]["param_groups"]},
        "extra": full["extra"],
    }
    for name, (per_rank, lowest) in VARIANTS.items():
        tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(os.path.join(root, name), single_file_per_rank=per_rank),
                  planner=tdcp.DefaultSavePlanner(dedup_save_to_lowest_rank=lowest))


@pytest.fixture(scope="module")
def torch_written(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("torch_written"))
    run_ranks(rank_torch_saves, 4, root)
    return root


def _target(mesh: object, full: dict) -> tuple[dict, dict]:
    """A zeroed target on a 2-rank mesh in other layouts than saved, and what each leaf must hold."""
    placements = {"s0s1": [Shard(1)], "rs0": [Replicate()], "s0": [Shard(1)]}
    model = {k: make_dtensor(torch.zeros_like(full["model"][k]), mesh, p) for k, p in placements.items()}
    model["plain"] = torch.zeros(3, 4, dtype=torch.float64)
    exp_avg = make_dtensor(torch.zeros(10, 6), mesh, [Replicate()])
    target = {"model": model,
              "optim": {"state": {"model.s0": {"exp_avg": exp_avg, "step": torch.tensor(0.0)}},
                        "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]},
              "extra": {"step": 0, "name": "", "none": 1, "flag": False, "blob": b"", "array": None}}
    expected = {k: local_expected(full["model"][k], mesh, p) for k, p in placements.items()}
    expected["plain"] = full["model"]["plain"]
    expected["exp_avg"] = full["optim"]["state"]["model.s0"]["exp_avg"]
    return target, expected


def rank_loads_in_other_layouts(rank: int, ws: int, root: str) -> list[str]:
    """Each variant loaded by ours on 2 ranks (Shard(0) saved -> Shard(1) / Replicate): what differs."""
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("x",))
    full = full_values()
    wrong: list[str] = []
    for name in VARIANTS:
        target, expected = _target(mesh, full)
        out = load(target, checkpoint_id=os.path.join(root, name))
        assert out is target
        for k in ("s0s1", "rs0", "s0"):
            got = target["model"][k]
            if not (isinstance(got, DTensor) and torch.equal(got.to_local(), expected[k])):
                wrong.append(f"{name}: model.{k}")
        if not torch.equal(target["model"]["plain"], expected["plain"]):
            wrong.append(f"{name}: model.plain")
        state = target["optim"]["state"]["model.s0"]
        if not torch.equal(state["exp_avg"].to_local(), expected["exp_avg"]) or state["step"].item() != 7.0:
            wrong.append(f"{name}: optim state")
        try:
            assert_same(target["optim"]["param_groups"], full["optim"]["param_groups"])
            assert_same(target["extra"], full["extra"])
        except AssertionError as exc:
            wrong.append(f"{name}: {exc}")
    return wrong


def test_torch_written_checkpoints_load_resharded_on_two_ranks(torch_written):
    assert run_ranks(rank_loads_in_other_layouts, 2, torch_written) == [[], []]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_torch_written_checkpoints_load_whole_without_a_target(torch_written, variant):
    out = load(path=os.path.join(torch_written, variant))
    assert_same(out, full_values())


def test_every_reader_entry_point_reads_torchs_format(torch_written):
    path = os.path.join(torch_written, "per_rank")
    expected = full_values()["model"]["s0s1"]
    for reader in (FileSystemReader(path), tdcp.FileSystemReader(path)):  # ours, and torch's mapped onto ours
        target = {"model": {"s0s1": torch.zeros(7, 5)}}
        load(target, storage_reader=reader)
        assert torch.equal(target["model"]["s0s1"], expected), type(reader)
        assert torch.equal(load(storage_reader=reader)["model"]["s0s1"], expected)
    target = {"model": {"s0s1": torch.zeros(7, 5)}}
    load(target, path)  # positional path
    assert torch.equal(target["model"]["s0s1"], expected)


def test_strict_and_partial_loads_behave_as_for_our_format(torch_written):
    path = os.path.join(torch_written, "per_item")
    target = {"model": {"plain": torch.zeros(3, 4, dtype=torch.float64), "new": torch.full((2,), 5.0)}}
    with pytest.raises(StateDictMismatchError, match=r"does not hold: 'model.new'.*strict=False"):
        load(target, checkpoint_id=path)
    with pytest.warns(UserWarning, match="skipped key.*'model.new'"):
        load(target, checkpoint_id=path, strict=False)
    assert torch.equal(target["model"]["plain"], full_values()["model"]["plain"])
    assert torch.equal(target["model"]["new"], torch.full((2,), 5.0))  # left as it was
    target["model"]["plain"].zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(target, checkpoint_id=path, planner=tdcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(target["model"]["plain"], full_values()["model"]["plain"])
    with pytest.raises(StateDictMismatchError, match=r"strict='all'.*asked for by no rank"):
        load({"model": {"plain": torch.zeros(3, 4, dtype=torch.float64)}}, checkpoint_id=path, strict="all")
    with pytest.raises(StateDictMismatchError, match=r"Size mismatch.*model.plain"):
        load({"model": {"plain": torch.zeros(4, 4, dtype=torch.float64)}}, checkpoint_id=path)


def test_torch_written_checkpoint_on_an_object_store_loads(tmp_path):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    url = f"memory://{tmp_path.name}/ck"
    with pytest.warns(UserWarning):  # torch: no process group
        tdcp.save({"w": make_tensor((5, 3)), "step": 4}, storage_writer=FsspecWriter(url), no_dist=True)
    out = load(path=url)
    assert torch.equal(out["w"], make_tensor((5, 3))) and out["step"] == 4


def test_import_torch_dcp_still_converts(torch_written, tmp_path):
    import_torch_dcp(os.path.join(torch_written, "per_rank"), str(tmp_path / "ours"), trust=True)
    assert_same(load(path=str(tmp_path / "ours"))["model"], full_values()["model"])


# ---------------------------------------------------------------------------- hostile and forged files


class Payload:
    """Unpickling it runs ``touch <marker>``: a stand-in for any code a checkpoint could carry."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class Note:
    """A harmless class of this module: its pickle needs a global weights-only loading refuses."""

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other):
        return isinstance(other, Note) and other.text == self.text


def _one_process_torch_save(path: str, sd: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: no process group, one process
        tdcp.save(sd, checkpoint_id=path, no_dist=True)


def _plant_byte_item(path: str, key: str, value: object) -> None:
    """Rewrite the stored bytes of ``key`` to ``torch.save(value)`` (appended to its file), as an
    attacker with write access to the checkpoint would."""
    meta = tdcp.FileSystemReader(path).read_metadata()  # our own file: trusted here
    info = meta.storage_data[MetadataIndex(key)]
    buf = io.BytesIO()
    torch.save(value, buf)
    file = os.path.join(path, info.relative_path)
    offset = os.path.getsize(file)
    with open(file, "ab") as f:
        f.write(buf.getvalue())
    meta.storage_data[MetadataIndex(key)] = type(info)(info.relative_path, offset, len(buf.getvalue()))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def test_a_hostile_metadata_pickle_is_refused_and_never_run(tmp_path):
    path, marker = str(tmp_path / "ck"), str(tmp_path / "ran")
    _one_process_torch_save(path, {"w": torch.ones(2)})
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Payload(marker), f)

    class Reading(tdcp.FileSystemReader):  # torch's reader with a hook of its own: torch's read_metadata
        def read_data(self, plan, planner):
            return super().read_data(plan, planner)

    calls = [lambda: load(path=path), lambda: load({"w": torch.zeros(2)}, checkpoint_id=path),
             lambda: load({"w": torch.zeros(2)}, storage_reader=FileSystemReader(path)),
             lambda: load({"w": torch.zeros(2)}, storage_reader=tdcp.FileSystemReader(path)),
             lambda: load({"w": torch.zeros(2)}, storage_reader=Reading(path), no_dist=True)]
    for call in calls:
        with pytest.raises(MetadataError, match=r"\.metadata: the pickle names posix\.system.*refused without "
                                                r"running it"):
            call()
    assert not os.path.exists(marker)


def test_a_hostile_byte_item_is_refused_naming_the_key_and_never_run(tmp_path):
    path, marker = str(tmp_path / "ck"), str(tmp_path / "ran")
    _one_process_torch_save(path, {"w": torch.ones(2), "extra": {"step": 3}})
    _plant_byte_item(path, "extra.step", Payload(marker))

    class Reading(tdcp.FileSystemReader):
        def read_data(self, plan, planner):
            return super().read_data(plan, planner)

    calls = [lambda: load(path=path), lambda: load({"extra": {"step": 0}}, checkpoint_id=path),
             lambda: load({"extra": {"step": 0}}, checkpoint_id=path, planner=tdcp.DefaultLoadPlanner()),
             lambda: load({"extra": {"step": 0}}, storage_reader=Reading(path), no_dist=True)]
    for call in calls:
        with pytest.raises(CheckpointError, match=r"'extra.step'.*weights-only loading refuses.*posix.system.*not "
                                                  r"run"):
            call()
    assert not os.path.exists(marker)
    out = load({"w": torch.zeros(2)}, checkpoint_id=path)  # the other keys are fine
    assert torch.equal(out["w"], torch.ones(2))


def test_a_byte_item_outside_weights_only_rules_loads_only_with_allow_pickle(tmp_path):
    path = str(tmp_path / "ck")
    _one_process_torch_save(path, {"note": Note("hello"), "w": torch.ones(2)})
    with pytest.raises(UnsupportedValueError, match=r"'note'.*Note.*allow_pickle=True"):
        load(path=path)
    assert load(path=path, allow_pickle=True)["note"] == Note("hello")
    target = {"note": None}
    load(target, checkpoint_id=path, allow_pickle=True)
    assert target["note"] == Note("hello")


def _forge(path: str, forge) -> None:
    meta = tdcp.FileSystemReader(path).read_metadata()  # our own file: trusted here
    forge(meta)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def _grow(meta, shape, chunk=None):
    m = meta.state_dict_metadata["w"]
    m.size = torch.Size(shape)
    if chunk is not None:
        m.chunks[0].sizes = torch.Size(chunk)


FORGED = {
    "shape and chunk of 2**56 elements": (lambda m: _grow(m, [1 << 28, 1 << 28], [1 << 28, 1 << 28]),
                                          CorruptCheckpointError, r"'w': chunk at \[0, 0\] \(\d+ bytes\) is stored at"),
    "shape twice what the chunks hold": (lambda m: _grow(m, [12, 4]), MetadataError, r"'w'.*chunks hold 24 of the 48"),
    "chunk outside the shape": (lambda m: _grow(m, [6, 4], [7, 4]), MetadataError, r"'w'.*lies outside its shape"),
    "a file outside the checkpoint": (
        lambda m: m.storage_data.__setitem__(MetadataIndex("w", [0, 0]), type(next(iter(m.storage_data.values())))(
            "../../etc/passwd", 0, 10)), MetadataError, r"not a plain file name"),
    "a list where a dict belongs": (lambda m: setattr(m, "state_dict_metadata", [1]), MetadataError,
                                    r"state_dict_metadata must be a dict"),
    "a huge list index in planner_data": (lambda m: m.planner_data.__setitem__("w", ("w", 1 << 40)), MetadataError,
                                          r"planner_data path"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_metadata_fails_before_anything_is_allocated_or_read(tmp_path, case):
    forge, error, message = FORGED[case]
    path = str(tmp_path / "ck")
    _one_process_torch_save(path, {"w": make_tensor((6, 4)), "b": make_tensor((3,), seed=1)})
    _forge(path, forge)
    with pytest.raises(error, match=message):
        load(path=path)
    with pytest.raises(error, match=message):
        load({"w": torch.zeros(6, 4)}, checkpoint_id=path)


def test_an_unknown_stream_transform_is_refused_naming_the_key(tmp_path):
    path = str(tmp_path / "ck")
    _one_process_torch_save(path, {"w": make_tensor((6, 4))})

    def transformed(meta):
        index = MetadataIndex("w", [0, 0])
        info = meta.storage_data[index]
        meta.storage_data[index] = type(info)(info.relative_path, info.offset, info.length, ["no-such-transform"])

    _forge(path, transformed)
    with pytest.raises(UnsupportedValueError, match=r"'w' was written through torch's stream transforms "
                                                    r"\['no-such-transform'\]"):
        load(path=path)


def test_our_planners_options_that_torchs_cannot_carry_out_are_refused(tmp_path):
    from hyper_parallel.core.distributed_checkpoint import StandardPlanner

    class Prefixed(StandardPlanner):
        def transform_key(self, key):
            return "v2." + key

    path = str(tmp_path / "ck")
    _one_process_torch_save(path, {"w": make_tensor((6, 4))})
    with pytest.raises(UnsupportedValueError, match=r"topology_mapper=.*torch DCP's planner protocol"):
        load({"layer": torch.zeros(6, 4)}, checkpoint_id=path, planner=StandardPlanner(topology_mapper={"layer": "w"}))
    with pytest.raises(UnsupportedValueError, match=r"Prefixed overrides transform_key"):
        load({"w": torch.zeros(6, 4)}, checkpoint_id=path, planner=Prefixed())
    target = {"w": torch.zeros(6, 4)}
    load(target, checkpoint_id=path, planner=StandardPlanner())  # ours without either: torch's default stands in
    assert torch.equal(target["w"], make_tensor((6, 4)))
