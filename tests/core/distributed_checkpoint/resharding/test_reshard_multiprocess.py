"""Save with one world size / mesh, load with another, on real gloo ranks; reshard TP=8 -> TP=4.

Launching ranks is the expensive part, so a module fixture runs five launches (8, 2, 4, 2
ranks and this process) and every rank records the outcome of each check by name; the tests
below read one check each. Every global tensor has sizes that no world size here divides.

Order: 8 ranks save TP=8 and this process reshards it to TP=4; 2 ranks save on (2,); this
process saves a 1-rank checkpoint; 4 ranks save on (4,) and (2,2), load everything else into
4-rank layouts and reshard with a process group; 2 ranks load the 4-rank checkpoints.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from helpers import assert_same, local_expected, make_dtensor, make_tensor, zeros_like_tree
from multiprocess import run_ranks
from test_reshard import tp_rules, transformer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import (
    FileSystemReader,
    Layout,
    TensorLayout,
    get_current_layout,
    load,
    save,
)
from hyper_parallel.core.distributed_checkpoint._src.resharding.reshard import Box, reshard

# key -> (global shape, seed); the values are make_tensor(shape, seed=seed) everywhere
GLOBALS = {"s0": ((7, 5), 1), "s1": ((3, 7), 2), "rep": ((5, 3), 3), "emb": ((11, 6), 4), "plain": ((3, 2), 5)}
RATIO_SHAPE = (1024, 96)  # 384 KiB of float32, saved Shard(0), reloaded Shard(1)


def full(key: str) -> torch.Tensor:
    shape, seed = GLOBALS[key]
    return make_tensor(shape, seed=seed)


def build(mesh, placements: dict[str, list]) -> dict:
    """DTensors of the GLOBALS on ``mesh`` with the given placements; "plain" stays a tensor."""
    sd = {k: make_dtensor(full(k), mesh, p) for k, p in placements.items()}
    sd["plain"] = full("plain")
    sd["step"] = 11
    return sd


def target(mesh, placements: dict[str, list]) -> dict:
    return zeros_like_tree(build(mesh, placements)) | {"step": 0}


def check_filled(sd: dict) -> None:
    """Every value of a loaded target equals its global tensor's part, bit for bit."""
    assert sd["step"] == 11, f"step is {sd['step']}"
    for k, v in sd.items():
        if k == "step":
            continue
        if isinstance(v, DTensor):
            want = local_expected(full(k), v.device_mesh, list(v.placements))
            assert_same(want.contiguous(), v.to_local(), k)
        else:
            assert_same(full(k), v, k)


def check(results: dict, name: str, fn: Callable[[], object], keep: bool = False) -> None:
    """Run one check; record "ok" (or its return value with ``keep``) or its traceback."""
    try:
        out = fn()
        results[name] = out if keep and out is not None else "ok"
    except Exception:
        results[name] = "FAILED\n" + traceback.format_exc()


# ------------------------------------------------------------------------------ rank functions


def rank_save_tp8(rank: int, ws: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    rules = tp_rules(Layout((ws,), ("tp",)))
    sd = {}
    for k, v in transformer().items():
        tl = rules_match(rules, k)
        sd[k] = make_dtensor(v, mesh, tl.to_placements())
    sd["step"] = 100
    save(sd, path)


def rules_match(rules: dict, key: str) -> TensorLayout:
    from hyper_parallel.core.distributed_checkpoint._src.sharding.strategy import match_layout

    return match_layout(rules, key)


def rank_two(rank: int, ws: int, paths: dict) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    res: dict = {}
    if paths["phase"] == "save":
        check(res, "save 2", lambda: save(build(mesh, {"s0": [Shard(0)], "s1": [Shard(1)], "rep": [Replicate()],
                                                       "emb": [Shard(1)]}), paths["ckpt2"]))
        return res

    def four_to_two():
        t = target(mesh, {"s0": [Shard(1)], "s1": [Shard(1)], "rep": [Replicate()], "emb": [Shard(0)]})
        load(t, paths["ckpt4"])
        check_filled(t)

    def resharded_by_group():
        t = target(mesh, {"s0": [Shard(0)], "s1": [Shard(1)], "rep": [Replicate()], "emb": [Shard(0)]})
        reader = RecordingReader(paths["ckpt4_dp2"])
        load(t, storage_reader=reader)
        check_filled(t)
        return sorted(reader.files)

    check(res, "4->2", four_to_two)
    check(res, "group reshard -> 2 ranks", resharded_by_group, keep=True)
    return res


class RecordingReader(FileSystemReader):
    """A FileSystemReader that remembers which data files it read."""

    def __init__(self, path: str):
        super().__init__(path)
        self.files: set[str] = set()

    def read_into(self, name, offset, buffer):
        self.files.add(name)
        return super().read_into(name, offset, buffer)


class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(10, 7)  # 7 and 10 rows: uneven over 4 ranks
        self.down = torch.nn.Linear(7, 10)


def rank_four(rank: int, ws: int, paths: dict) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    m22 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    res: dict = {}
    saved4 = {"s0": [Shard(0)], "s1": [Shard(1)], "rep": [Replicate()], "emb": [Shard(0)]}
    check(res, "save 4", lambda: save(build(dp, saved4), paths["ckpt4"]))

    def into(mesh, placements, path):
        def run():
            t = target(mesh, placements)
            load(t, path)
            check_filled(t)
        return run

    check(res, "(4,)->(2,2)", into(m22, {"s0": [Shard(1), Shard(0)], "s1": [Shard(0), Replicate()],
                                         "rep": [Shard(0), Shard(1)], "emb": [Shard(0), Shard(0)]}, paths["ckpt4"]))
    check(res, "Shard(0)->Shard(1)", into(dp, {"s0": [Shard(1)], "emb": [Shard(1)], "s1": [Shard(1)],
                                               "rep": [Replicate()]}, paths["ckpt4"]))
    check(res, "Replicate<->Shard", into(dp, {"rep": [Shard(0)], "emb": [Replicate()], "s0": [Replicate()],
                                              "s1": [Shard(0)]}, paths["ckpt4"]))
    saved22 = {"s0": [Shard(0), Shard(1)], "s1": [Shard(1), Shard(1)], "rep": [Replicate(), Shard(0)],
               "emb": [Shard(0), Shard(0)]}
    check(res, "save (2,2)", lambda: save(build(m22, saved22), paths["ckpt22"]))
    check(res, "(2,2)->(4,)", into(dp, {"s0": [Shard(0)], "s1": [Replicate()], "rep": [Shard(1)],
                                        "emb": [Shard(1)]}, paths["ckpt22"]))
    check(res, "2->4", into(dp, {"s0": [Shard(0)], "s1": [Shard(0)], "rep": [Shard(1)], "emb": [Shard(0)]},
                            paths["ckpt2"]))
    check(res, "1->4", into(m22, {"s0": [Shard(0), Shard(1)], "s1": [Replicate(), Shard(1)],
                                  "rep": [Shard(1), Replicate()], "emb": [Shard(1), Shard(0)]}, paths["ckpt1"]))

    def fsdp_to_tp():
        model = TinyMLP()
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        fully_shard(model, mesh=dp)
        sd = model.state_dict()
        assert all(isinstance(v, DTensor) and v.placements == (Shard(0),) for v in sd.values())
        strategy = get_current_layout(model)
        assert strategy["up.weight"] == Layout((4,), ("dp",))("dp", "None")
        save(sd, paths["fsdp"])
        tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        tp_model = TinyMLP()
        for p in tp_model.parameters():
            p.data.zero_()
        parallelize_module(tp_model, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        tsd = tp_model.state_dict()
        assert tsd["down.weight"].placements == (Shard(1),) and tsd["up.weight"].placements == (Shard(0),)
        load(tsd, paths["fsdp"])
        for k, v in tsd.items():
            assert_same(local_expected(expected[k], tp, list(v.placements)).contiguous(), v.to_local(), k)

    check(res, "FSDP dp Shard(0) -> TP Shard(1)", fsdp_to_tp)

    def tp4_from_reshard():
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        rules = tp_rules(Layout((4,), ("tp",)))
        want = transformer()
        sd = {k: make_dtensor(torch.zeros_like(v), mesh, rules_match(rules, k).to_placements())
              for k, v in want.items()} | {"step": 0}
        reader = RecordingReader(paths["tp4"])
        load(sd, storage_reader=reader)
        assert sd["step"] == 100
        for k, v in sd.items():
            if k != "step":
                assert_same(local_expected(want[k], mesh, list(v.placements)).contiguous(), v.to_local(), k)
        return sorted(reader.files)

    check(res, "TP8 -> reshard -> TP4 load", tp4_from_reshard, keep=True)

    def bytes_ratio():
        g = torch.arange(RATIO_SHAPE[0] * RATIO_SHAPE[1], dtype=torch.float32).reshape(RATIO_SHAPE)
        save({"w": make_dtensor(g, dp, [Shard(0)])}, paths["ratio"])
        out = {}
        for verify in (False, True):
            t = {"w": make_dtensor(torch.zeros_like(g), dp, [Shard(1)])}
            reader = FileSystemReader(paths["ratio"])
            load(t, storage_reader=reader, verify=verify)
            assert torch.equal(t["w"].to_local(), local_expected(g, dp, [Shard(1)]))
            out[verify] = (reader.bytes_read, t["w"].to_local().numel() * 4)
        return out

    check(res, "bytes read", bytes_ratio, keep=True)

    def layout_boxes_on_real_ranks():
        for mesh, pl, shape in [(dp, [Shard(0)], (7, 3)), (dp, [Shard(1)], (2, 9)), (m22, [Shard(0), Shard(0)], (9, 2)),
                                (m22, [Shard(1), Replicate()], (3, 5)), (m22, [Replicate(), Shard(0)], (1, 4))]:
            dt = make_dtensor(torch.zeros(shape), mesh, pl)
            c = dt.__create_chunk_list__()[0]
            tl = TensorLayout.from_dtensor(dt)
            assert tl.chunk_box(dist.get_rank(), shape) == Box(tuple(c.offsets), tuple(c.sizes)), (pl, shape)
        made = Layout((2, 2), ("a", "b")).to_device_mesh()
        assert made.mesh_dim_names == ("a", "b") and made.get_coordinate() == m22.get_coordinate()

    check(res, "layout boxes", layout_boxes_on_real_ranks)

    def reshard_with_group():
        meta = reshard(paths["ckpt4"], paths["ckpt4_dp2"], dst_mesh={"dp": 2}, process_group=dist.group.WORLD,
                       max_memory=1 << 10)
        return None if meta is None else meta.file_names()

    check(res, "reshard with a process group", reshard_with_group, keep=True)
    return res


# ------------------------------------------------------------------------------ the launches


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard_mp")
    paths = {k: str(d / k) for k in ["tp8", "tp4", "ckpt1", "ckpt2", "ckpt4", "ckpt22", "ckpt4_dp2", "fsdp", "ratio"]}
    run_ranks(rank_save_tp8, 8, paths["tp8"], timeout_s=180)
    reshard(paths["tp8"], paths["tp4"], dst_mesh={"tp": 4})  # one process, no process group
    save(build_plain(), paths["ckpt1"], no_dist=True)
    two_save = run_ranks(rank_two, 2, {**paths, "phase": "save"})
    four = run_ranks(rank_four, 4, paths, timeout_s=180)
    two_load = run_ranks(rank_two, 2, {**paths, "phase": "load"})
    return {"paths": paths, "2": [a | b for a, b in zip(two_save, two_load, strict=True)], "4": four}


def build_plain() -> dict:
    return {k: full(k) for k in GLOBALS} | {"step": 11}


def outcome(runs, world: str, name: str) -> list:
    results = [r[name] for r in runs[world]]
    failed = [f"rank {i}: {r}" for i, r in enumerate(results) if isinstance(r, str) and r.startswith("FAILED")]
    assert not failed, "\n".join(failed)
    return results


def test_4_ranks_to_2_ranks(runs):
    outcome(runs, "4", "save 4")
    outcome(runs, "2", "4->2")


def test_2_ranks_to_4_ranks(runs):
    outcome(runs, "2", "save 2")
    outcome(runs, "4", "2->4")


def test_4_ranks_to_1_process_without_a_process_group(runs):
    path = runs["paths"]["ckpt4"]
    t = {k: torch.zeros_like(full(k)) for k in GLOBALS} | {"step": 0}
    load(t, path, no_dist=True)
    assert_same(build_plain(), t)
    assert_same(build_plain(), load(path=path, no_dist=True))


def test_1_process_to_4_ranks(runs):
    outcome(runs, "4", "1->4")


def test_mesh_4_to_2x2_and_back(runs):
    outcome(runs, "4", "(4,)->(2,2)")
    outcome(runs, "4", "save (2,2)")
    outcome(runs, "4", "(2,2)->(4,)")


def test_shard0_to_shard1(runs):
    outcome(runs, "4", "Shard(0)->Shard(1)")


def test_replicate_to_shard_and_shard_to_replicate(runs):
    outcome(runs, "4", "Replicate<->Shard")


def test_fsdp_shard0_on_dp_mesh_loads_into_tp_shard1(runs):
    outcome(runs, "4", "FSDP dp Shard(0) -> TP Shard(1)")


def test_layout_boxes_equal_dtensor_shards_on_real_ranks(runs):
    outcome(runs, "4", "layout boxes")


def test_tp8_checkpoint_resharded_to_tp4_loads_bit_exact_from_one_file_per_rank(runs):
    files_read = outcome(runs, "4", "TP8 -> reshard -> TP4 load")
    from hyper_parallel.core.distributed_checkpoint._src.format.metadata import Metadata  # our document

    path = runs["paths"]["tp4"]
    with open(os.path.join(path, ".metadata"), "rb") as f:
        meta = Metadata.from_json(f.read())
    for rank, files in enumerate(files_read):
        own = {f for f in meta.file_names() if f.startswith(f"data-r{rank:05d}-")}
        assert len(own) == 1
        # everything the rank loads, shards and replicated norms alike, comes from its own file
        assert set(files) == own, (rank, files)


def test_bytes_read_against_bytes_needed_for_a_shard0_to_shard1_reload(runs):
    ratios = outcome(runs, "4", "bytes read")
    exact = [read / need for read, need in (r[False] for r in ratios)]
    verified = [read / need for read, need in (r[True] for r in ratios)]
    print(f"\nShard(0) saved on 4 ranks -> Shard(1) on 4 ranks, {RATIO_SHAPE} float32: "
          f"bytes read / bytes needed per rank: verify=False {exact}, verify=True {verified}")
    assert max(exact) <= 1.1
    # verify=True reads whole checksummed rows: about world-size times what a column shard needs
    assert all(3.9 <= r <= 4.1 for r in verified), verified


def test_reshard_with_a_process_group_splits_destination_ranks_and_loads(runs):
    files = outcome(runs, "4", "reshard with a process group")
    committed = [f for f in files if f != "ok"]
    assert len(committed) == 4 and all(c == committed[0] for c in committed), "every rank gets the metadata"
    assert [f.split("-")[1] for f in committed[0]] == ["r00000", "r00001"]
    for rank, read in enumerate(outcome(runs, "2", "group reshard -> 2 ranks")):
        # replicated data has a copy in every rank's file: each rank reads only its own
        assert {f.split("-")[1] for f in read} == {f"r{rank:05d}"}, read
    assert_same(build_plain(), load(path=runs["paths"]["ckpt4_dp2"], no_dist=True))


def _reshard_with_disagreeing_ranks(rank: int, ws: int, src: str, dst: str, what: str) -> str:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    save({"w": make_dtensor(make_tensor((16, 4)), mesh, [Shard(0)])}, src)
    mine = dst + "-other" if what == "dst" and rank == 1 else dst
    dp = 3 if what == "mesh" and rank == 1 else 4
    split = 1 if what == "rules" and rank == 1 else 0
    rules = {"w": Layout((4,), ("dp",))("dp", "None") if split == 0 else Layout((4,), ("dp",))("None", "dp")}
    try:
        reshard(src, mine, dst_mesh={"dp": dp}, process_group=dist.group.WORLD, timeout=30,
                rules=rules if what == "rules" else None)
    except ValueError as exc:
        return str(exc)
    return "resharded"


@pytest.mark.parametrize("what", ["dst", "mesh", "rules"])
def test_ranks_that_disagree_on_the_destination_write_nothing(tmp_path, what):
    # each rank had written its share where its own arguments said and the coordinator committed:
    # a checkpoint missing the other ranks' files (or holding chunks cut for another mesh),
    # replacing a good one
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    save({"w": make_tensor((16, 4))}, dst, no_dist=True)  # the checkpoint already there stays
    out = run_ranks(_reshard_with_disagreeing_ranks, 2, src, dst, what)
    assert out[0] == out[1] and "different arguments" in out[0] and "Nothing was written" in out[0], out
    assert ("rank 1: " in out[0]) == (what != "rules") and ("dst-other" in out[0]) == (what == "dst"), out
    assert not os.path.exists(dst + "-other")  # nothing written, not even a directory
    assert torch.equal(load(path=dst)["w"], make_tensor((16, 4)))
