"""RemapLoadPlanner (``distributed_checkpoint.remap_planner``, real code in ``planning/remap*.py``):
loads into tensors named and laid out differently from the checkpoint's, each rank reading only
the regions its shards need.

The block math is checked on its own; the planner runs under torch's own
``torch.distributed.checkpoint.load`` (its protocol) on Hugging Face safetensors files (torch's
``HuggingFaceStorageReader``) and on checkpoints torch's ``FileSystemWriter`` wrote, in one
process and on 2 gloo ranks holding DTensor shards; HyperParallel's hook names are driven by a
small read loop below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader, load, save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlanner as TorchLoadPlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hyper_parallel.core.distributed_checkpoint._src.base.box import Box
from hyper_parallel.core.distributed_checkpoint._src.planning.remap_blocks import direct_view, gather
from hyper_parallel.core.distributed_checkpoint.metadata import CHUNK_INFO, ChunkInfo, ChunkStorageMetadata
from hyper_parallel.core.distributed_checkpoint.planner import BroadcastSource
from hyper_parallel.core.distributed_checkpoint.remap_planner import DeferredRead, RemapBlock, RemapLoadPlanner

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

EYE2 = ((1, 0), (0, 1))


def rows(source: str, first: int, count: int, width: int, at: int = 0) -> RemapBlock:
    """``count`` whole rows of a matrix ``source`` from row ``first``, landing at row ``at``."""
    return RemapBlock((at, 0), (count, width), source, (first, 0), EYE2)


def hf_checkpoint(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def load_hf(directory: Path, state_dict: dict[str, Any], planner: RemapLoadPlanner) -> None:
    load(state_dict, storage_reader=HuggingFaceStorageReader(str(directory)), planner=planner,
         no_dist=not dist.is_initialized())


def plan_only(directory: Path, state_dict: dict[str, Any], planner: RemapLoadPlanner) -> Any:
    """Set the planner up on the checkpoint's metadata and plan this rank's reads (no reading)."""
    planner.set_up_planner(state_dict, HuggingFaceStorageReader(str(directory)).read_metadata(), True)
    return planner.create_local_plan()


def reads(plan: Any) -> list[tuple[str, tuple, tuple, tuple]]:
    """(checkpoint tensor, saved chunk offsets, offsets in it, lengths) of every read, sorted."""
    return sorted((i.storage_index.fqn, tuple(i.storage_index.offset), tuple(i.storage_offsets), tuple(i.lengths))
                  for i in plan.items)


def interleaved_qkv_blocks(heads: int, head_dim: int, hidden: int) -> list[RemapBlock]:
    """A fused QKV weight laid out head by head ([q_h, k_h, v_h] for each head h) from HF's q, k, v."""
    blocks = []
    for h in range(heads):
        for j, name in enumerate(("q", "k", "v")):
            blocks.append(rows(name, h * head_dim, head_dim, hidden, at=(3 * h + j) * head_dim))
    return blocks


def interleaved_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    split = [t.reshape(heads, -1, t.shape[-1]) for t in (q, k, v)]
    return torch.stack(split, dim=1).reshape(-1, q.shape[-1])


# --------------------------------------------------------------------------- the block math


def test_a_block_names_its_source_in_every_validation_error():
    cases = [
        dict(offsets=(0, 0), lengths=(2,), base=(0,), coeff=((1, 0),)),           # lengths per offset
        dict(offsets=(0,), lengths=(0,), base=(0,), coeff=((1,),)),               # empty box
        dict(offsets=(0,), lengths=(2,), base=(4,), coeff=((-1,),)),              # stepping backwards
        dict(offsets=(0,), lengths=(2,), base=(0, 0), coeff=((1,),)),             # a row per base entry
        dict(offsets=(0, 0), lengths=(2, 2), base=(0,), coeff=((1,),)),           # a step per dest dim
        dict(offsets=(-1,), lengths=(2,), base=(0,), coeff=((1,),)),              # negative offset
        dict(offsets=(0,), lengths=(2.5,), base=(0,), coeff=((1,),)),             # not integers
        dict(offsets=(0,), lengths=(2,), base=(0,), coeff=((1,),), post=("x",)),  # post not callable
    ]
    for case in cases:
        with pytest.raises(ValueError, match="'layers.0.wq'"):
            RemapBlock(source="layers.0.wq", **case)


def test_a_deferred_read_needs_distinct_sources():
    with pytest.raises(ValueError, match="distinct"):
        DeferredRead(("a", "a"), print)
    with pytest.raises(ValueError, match="distinct"):
        DeferredRead((), print)


def test_the_region_a_part_reads_follows_the_affine_map():
    transpose = RemapBlock((0, 0), (3, 2), "w", (0, 0), ((0, 1), (1, 0)))
    assert transpose.region(Box((1, 0), (2, 2))) == Box((0, 1), (2, 2))
    every_other = RemapBlock((2,), (5,), "v", (1,), ((2,),))
    assert every_other.region(Box((3,), (3,))) == Box((3,), (5,))  # elements 3, 5, 7: gaps included
    repeated = RemapBlock((0, 0), (4, 3), "b", (5, 0), ((0, 0), (0, 1)))
    assert repeated.region(repeated.box) == Box((5, 0), (1, 3))


def test_unit_steps_land_straight_and_the_rest_is_gathered():
    assert RemapBlock((0, 0), (3, 2), "w", (0, 0), ((0, 1), (1, 0))).cut(Box((0, 0), (3, 2))).direct
    assert not RemapBlock((0,), (5,), "v", (0,), ((2,),)).cut(Box((0,), (5,))).direct
    assert not RemapBlock((0,), (5,), "v", (0,), ((1,),), post=(torch.neg,)).cut(Box((0,), (5,))).direct
    # a dimension the part does not walk (length 1) does not stop a straight read
    stacked = RemapBlock((2, 0, 0), (1, 3, 4), "e2", (0, 0), ((0, 1, 0), (0, 0, 1)))
    assert stacked.cut(Box((0, 0, 0), (4, 3, 4))).direct
    assert stacked.cut(Box((0, 0, 0), (2, 3, 4))) is None


def test_a_straight_view_writes_the_destination_in_the_checkpoints_order():
    dest = torch.zeros(3, 2)
    piece = RemapBlock((0, 0), (3, 2), "w", (0, 0), ((0, 1), (1, 0))).cut(Box((0, 0), (3, 2)))
    view = direct_view(dest, piece.walker, piece.region.sizes)
    assert view.shape == (2, 3) and view.data_ptr() == dest.data_ptr()
    view.copy_(torch.arange(6.0).reshape(2, 3))
    assert torch.equal(dest, torch.arange(6.0).reshape(2, 3).t())


def test_gather_picks_strided_and_repeated_elements():
    region = torch.arange(9.0)
    piece = RemapBlock((0,), (5,), "v", (0,), ((2,),)).cut(Box((0,), (5,)))
    assert torch.equal(gather(piece, region), region[::2])
    repeated = RemapBlock((0, 0), (2, 3), "b", (0, 0), ((0, 0), (0, 1)), post=(lambda t: t.add_(1),))
    assert torch.equal(gather(repeated.cut(repeated.box), torch.arange(3.0).reshape(1, 3)),
                       torch.tensor([[1.0, 2, 3], [1, 2, 3]]))


def test_a_post_operation_that_changes_the_shape_is_refused():
    block = RemapBlock((0,), (4,), "v", (0,), ((1,),), post=(lambda t: t.sum(),))
    with pytest.raises(ValueError, match="'v'.*elementwise"):
        gather(block.cut(block.box), torch.arange(4.0))


# --------------------------------------------------------------------------- one process, torch's load


def test_two_hf_tensors_fill_one_fused_tensor_cast_to_its_dtype(tmp_path):
    q = torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)
    k = torch.arange(100, 106, dtype=torch.bfloat16).reshape(2, 3)
    fused = torch.zeros(6, 3)
    load_hf(hf_checkpoint(tmp_path, {"q": q, "k": k}), {"qk": fused},
            RemapLoadPlanner({"qk": [rows("q", 0, 4, 3), rows("k", 0, 2, 3, at=4)]}))
    assert torch.equal(fused, torch.cat([q, k]).float())


def test_interleaved_qkv_from_three_hf_tensors(tmp_path):
    heads, head_dim, hidden = 3, 2, 4
    q, k, v = (torch.randn(heads * head_dim, hidden) for _ in range(3))
    fused = torch.zeros(3 * heads * head_dim, hidden)
    planner = RemapLoadPlanner({"attn.qkv": interleaved_qkv_blocks(heads, head_dim, hidden)})
    load_hf(hf_checkpoint(tmp_path, {"q": q, "k": k, "v": v}), {"attn": {"qkv": fused}}, planner)
    assert torch.equal(fused, interleaved_reference(q, k, v, heads))


def test_stacked_experts_from_one_hf_tensor_per_expert_transposed(tmp_path):
    experts, out_f, in_f = 4, 3, 5
    weights = {f"experts.{e}.w": torch.randn(out_f, in_f) for e in range(experts)}
    stacked = torch.zeros(experts, in_f, out_f)  # the model keeps them (in, out)
    blocks = [RemapBlock((e, 0, 0), (1, in_f, out_f), f"experts.{e}.w", (0, 0), ((0, 0, 1), (0, 1, 0)))
              for e in range(experts)]
    planner = RemapLoadPlanner({"moe.w": blocks})
    load_hf(hf_checkpoint(tmp_path, weights), {"moe.w": stacked}, planner)
    assert torch.equal(stacked, torch.stack([weights[f"experts.{e}.w"].t() for e in range(experts)]))
    assert reads(planner.create_local_plan()) == sorted((f"experts.{e}.w", (0, 0), (0, 0), (out_f, in_f))
                                                        for e in range(experts))


def test_post_operations_run_in_the_checkpoint_dtype_before_the_cast(tmp_path):
    # 256 + 1 is 256 in bfloat16 and 257 in float32: the result says where the addition ran
    source = torch.tensor([256.0, 0, 2, 0, 4, 0], dtype=torch.bfloat16)
    target = torch.zeros(3)
    block = RemapBlock((0,), (3,), "v", (0,), ((2,),), post=(lambda t: t + 1.0,))
    load_hf(hf_checkpoint(tmp_path, {"v": source}), {"v": target}, RemapLoadPlanner({"v": [block]}))
    assert target.tolist() == [256.0, 3.0, 5.0]


def test_resolve_gives_a_view_for_unit_steps_and_a_buffer_in_the_checkpoint_dtype_otherwise(tmp_path):
    w = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    directory = hf_checkpoint(tmp_path, {"w": w})
    t, g = torch.zeros(3, 2), torch.zeros(1, 3)
    planner = RemapLoadPlanner({"t": [RemapBlock((0, 0), (3, 2), "w", (0, 0), ((0, 1), (1, 0)))],
                                "g": [RemapBlock((0, 0), (1, 3), "w", (1, 0), EYE2, post=(torch.neg,))]})
    planner.set_up_planner({"t": t, "g": g}, HuggingFaceStorageReader(str(directory)).read_metadata())
    by_dest = {item.dest_index.fqn: item for item in planner.create_local_plan().items}
    view = planner.resolve_tensor(by_dest["t"])
    assert view.data_ptr() == t.data_ptr() and view.shape == (2, 3) and view.dtype == torch.float32
    buffer = planner.resolve_tensor(by_dest["g"])
    assert buffer.dtype == torch.bfloat16 and buffer.shape == (1, 3)
    assert not (g.data_ptr() <= buffer.data_ptr() < g.data_ptr() + g.nbytes)


def test_a_deferred_read_hands_whole_tensors_to_its_function_once(tmp_path):
    a, b = torch.arange(4.0), torch.ones(2, 2, dtype=torch.bfloat16)
    calls: list[dict] = []
    target = torch.zeros(2, 2)
    planner = RemapLoadPlanner({"b": [rows("b", 0, 2, 2)]}, deferred=[DeferredRead(("a", "b"), calls.append)])
    load_hf(hf_checkpoint(tmp_path, {"a": a, "b": b}), {"b": target}, planner)
    assert len(calls) == 1 and sorted(calls[0]) == ["a", "b"]
    assert torch.equal(calls[0]["a"], a) and calls[0]["b"].dtype == torch.bfloat16 and torch.equal(calls[0]["b"], b)
    assert torch.equal(target, b.float())


@pytest.mark.parametrize("block, needle", [
    (rows("w", 0, 3, 3), "'w'"),                                   # three rows of a two-row tensor
    (rows("missing", 0, 2, 3), "'missing'"),                       # not in the checkpoint
    (RemapBlock((0,), (3,), "w", (0,), ((1,),)), "'w'"),           # 1-d base for a 2-d tensor
    (RemapBlock((0, 0), (3, 3), "w", (2, 0), ((0, 0), (0, 1))), "'w'"),  # row 2 repeated: no row 2
])
def test_a_block_reading_outside_the_checkpoint_names_the_tensor(tmp_path, block, needle):
    directory = hf_checkpoint(tmp_path, {"w": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=needle):
        plan_only(directory, {"t": torch.zeros(3, 3)}, RemapLoadPlanner({"t": [block]}))


def test_torchs_load_reports_the_planners_error(tmp_path):
    directory = hf_checkpoint(tmp_path, {"w": torch.zeros(2, 3)})
    with pytest.raises(CheckpointException, match="'missing'"):
        load_hf(directory, {"t": torch.zeros(2, 3)}, RemapLoadPlanner({"t": [rows("missing", 0, 2, 3)]}))


def test_table_mistakes_are_named(tmp_path):
    directory = hf_checkpoint(tmp_path, {"w": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="'absent'"):
        plan_only(directory, {"t": torch.zeros(2, 3)}, RemapLoadPlanner({"absent": [rows("w", 0, 2, 3)]}))
    with pytest.raises(ValueError, match="'t'.*outside"):
        plan_only(directory, {"t": torch.zeros(1, 3)}, RemapLoadPlanner({"t": [rows("w", 0, 2, 3)]}))
    with pytest.raises(ValueError, match="'t'.*overlap"):
        RemapLoadPlanner({"t": [rows("w", 0, 2, 3), rows("w", 0, 1, 3, at=1)]})


def test_a_byte_read_is_not_a_remap_read(tmp_path):
    planner = RemapLoadPlanner({})
    with pytest.raises(ValueError, match="no byte reads"):
        planner.apply_bytes(type("Item", (), {"dest_index": MetadataIndex("x")})(), b"")


def test_it_is_a_torch_load_planner_with_hyperparallels_hook_names_too():
    planner = RemapLoadPlanner()
    assert isinstance(planner, TorchLoadPlanner)
    for name in ("configure_planner", "build_local_plan", "build_global_plan", "finalize_plan", "acquire_tensor",
                 "apply_tensor", "apply_bytes"):
        assert callable(getattr(planner, name))


def _seed_read_loop(directory: Path, planner: RemapLoadPlanner, state_dict: dict, rank: int = 0) -> Any:
    """What a reader in HyperParallel's shape does with the planner: its hook names, in its order."""
    metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    planner.configure_planner(state_dict, metadata, is_coordinator=True, rank=rank)
    local = planner.build_local_plan()
    plan = planner.finalize_plan(planner.build_global_plan([local]))
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        for item in plan.items:
            region = f.get_slice(item.storage_index.fqn)[tuple(
                slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))]
            into = planner.acquire_tensor(item)
            assert tuple(into.shape) == tuple(region.shape)
            into.copy_(region)
            planner.apply_tensor(item, into)
    return plan


def test_hyperparallels_hook_names_run_the_same_plan(tmp_path):
    q, k = torch.randn(4, 3), torch.randn(2, 3)
    directory = hf_checkpoint(tmp_path, {"q": q, "k": k})
    shard = torch.zeros(3, 3)  # rows 3..5 of the fused tensor, as HyperParallel marks a plain shard
    setattr(shard, CHUNK_INFO, ChunkInfo(chunk=ChunkStorageMetadata(offsets=(3, 0), sizes=(3, 3)),
                                         global_shape=(6, 3)))
    planner = RemapLoadPlanner({"qk": [rows("q", 0, 4, 3), rows("k", 0, 2, 3, at=4)]})
    plan = _seed_read_loop(directory, planner, {"qk": shard})
    assert torch.equal(shard, torch.cat([q, k])[3:])
    assert reads(plan) == [("k", (0, 0), (0, 0), (2, 3)), ("q", (0, 0), (3, 0), (1, 3))]


def _shard(rows_from: int, count: int, total: int, width: int) -> torch.Tensor:
    t = torch.zeros(count, width)
    setattr(t, CHUNK_INFO, ChunkInfo(chunk=ChunkStorageMetadata(offsets=(rows_from, 0), sizes=(count, width)),
                                     global_shape=(total, width)))
    return t


def test_the_global_step_marks_shards_several_ranks_load_the_same(tmp_path):
    directory = hf_checkpoint(tmp_path, {"q": torch.zeros(4, 3), "k": torch.zeros(2, 3)})
    metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    table = {"qk": [rows("q", 0, 4, 3), rows("k", 0, 2, 3, at=4)]}

    def plans(shards: list[torch.Tensor], **options: Any) -> tuple[list[Any], list[Any]]:
        planners = [RemapLoadPlanner(table, broadcast_replicated_tensors=True, **options) for _ in shards]
        local = []
        for rank, (planner, shard) in enumerate(zip(planners, shards, strict=True)):
            planner.configure_planner({"qk": shard}, metadata, rank=rank)
            local.append(planner.build_local_plan())
        return [planner.build_global_plan(local) for planner in planners], planners[0].create_global_plan(local)

    # three ranks: 0 and 2 hold rows 0..2, rank 1 rows 3..5
    seed_plans, torch_plans = plans([_shard(0, 3, 6, 3), _shard(3, 3, 6, 3), _shard(0, 3, 6, 3)])
    shared = BroadcastSource(group_ranks=(0, 2), src_rank=0)
    for marked in (seed_plans, torch_plans):
        assert [item.source for item in marked[0].items] == [shared]
        assert [item.source for item in marked[2].items] == [shared]
        assert all(item.source is None for item in marked[1].items)
    # a deferred read that does not say what it writes could be overwritten by a broadcast: no marks
    seed_plans, _ = plans([_shard(0, 3, 6, 3), _shard(0, 3, 6, 3)],
                          deferred=[DeferredRead(("k",), lambda tensors: None)])
    assert all(item.source is None for plan in seed_plans for item in plan.items)
    seed_plans, _ = plans([_shard(0, 3, 6, 3), _shard(0, 3, 6, 3)],
                          deferred=[DeferredRead(("k",), lambda tensors: None, targets=("other",))])
    marked = [item for item in seed_plans[1].items if item.dest_index.fqn == "qk"]
    assert [item.source for item in marked] == [BroadcastSource((0, 1), 0)]
    assert all(item.source is None for item in seed_plans[1].items if item.dest_index.fqn != "qk")


def test_the_element_size_of_a_shard_is_the_state_dicts(tmp_path):
    directory = hf_checkpoint(tmp_path, {"w": torch.zeros(2)})
    planner = RemapLoadPlanner({"w": [RemapBlock((0,), (2,), "w", (0,), ((1,),))]})
    planner.configure_planner({"w": torch.zeros(2, dtype=torch.float16)},
                              HuggingFaceStorageReader(str(directory)).read_metadata(), rank=0)
    assert planner._shard_element_size(MetadataIndex("w")) == 2
    assert planner._shard_element_size(MetadataIndex("<deferred>/0/w")) == 4


# --------------------------------------------------------------------------- 2 gloo ranks


def _qkv_rank(rank: int, world: int, directory: str) -> dict:
    heads, head_dim, hidden = 3, 2, 4
    mesh = init_device_mesh("cpu", (world,))
    fused = distribute_tensor(torch.zeros(3 * heads * head_dim, hidden), mesh, [Shard(0)])
    planner = _Recording({"qkv": interleaved_qkv_blocks(heads, head_dim, hidden)})
    load({"qkv": fused}, storage_reader=HuggingFaceStorageReader(directory), planner=planner)
    with safe_open(f"{directory}/model.safetensors", framework="pt") as f:
        q, k, v = (f.get_tensor(n) for n in "qkv")
    expected = interleaved_reference(q, k, v, heads)[rank * 9:(rank + 1) * 9]
    return {"equal": torch.equal(fused.to_local(), expected), "reads": reads(planner.final)}


class _Recording(RemapLoadPlanner):
    """Keeps the plan this rank executes."""

    def finish_plan(self, central_plan: Any) -> Any:
        self.final = super().finish_plan(central_plan)
        return self.final


def test_each_rank_reads_only_the_rows_of_its_shard_of_a_fused_qkv(tmp_path):
    hf_checkpoint(tmp_path, {n: torch.randn(6, 4) for n in "qkv"})
    out = run_ranks(_qkv_rank, 2, str(tmp_path))
    assert all(r["equal"] for r in out)
    # rows 0..8: head 0 whole, head 1's q and the first row of its k; rows 9..17: the rest
    assert out[0]["reads"] == [("k", (0, 0), (0, 0), (2, 4)), ("k", (0, 0), (2, 0), (1, 4)),
                               ("q", (0, 0), (0, 0), (2, 4)), ("q", (0, 0), (2, 0), (2, 4)),
                               ("v", (0, 0), (0, 0), (2, 4))]
    assert out[1]["reads"] == [("k", (0, 0), (3, 0), (1, 4)), ("k", (0, 0), (4, 0), (2, 4)),
                               ("q", (0, 0), (4, 0), (2, 4)), ("v", (0, 0), (2, 0), (2, 4)),
                               ("v", (0, 0), (4, 0), (2, 4))]


def _experts_rank(rank: int, world: int, directory: str) -> dict:
    experts, out_f, in_f = 4, 3, 2
    mesh = init_device_mesh("cpu", (world,))
    stacked = distribute_tensor(torch.zeros(experts, out_f, in_f), mesh, [Shard(0)])
    planner = _Recording({"w": [RemapBlock((e, 0, 0), (1, out_f, in_f), f"e{e}", (0, 0), ((0, 1, 0), (0, 0, 1)))
                                for e in range(experts)]})
    load({"w": stacked}, storage_reader=HuggingFaceStorageReader(directory), planner=planner)
    expected = torch.stack([torch.full((out_f, in_f), float(e)) for e in range(experts)])[rank * 2:rank * 2 + 2]
    return {"equal": torch.equal(stacked.to_local(), expected), "reads": reads(planner.final)}


def test_each_rank_reads_only_its_experts_of_a_stacked_tensor(tmp_path):
    hf_checkpoint(tmp_path, {f"e{e}": torch.full((3, 2), float(e), dtype=torch.bfloat16) for e in range(4)})
    out = run_ranks(_experts_rank, 2, str(tmp_path))
    assert all(r["equal"] for r in out)
    assert out[0]["reads"] == [("e0", (0, 0), (0, 0), (3, 2)), ("e1", (0, 0), (0, 0), (3, 2))]
    assert out[1]["reads"] == [("e2", (0, 0), (0, 0), (3, 2)), ("e3", (0, 0), (0, 0), (3, 2))]


def _replicated_rank(rank: int, world: int, directory: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    fused = distribute_tensor(torch.zeros(6, 3), mesh, [Replicate()])
    planner = _Recording({"qk": [rows("q", 0, 4, 3), rows("k", 0, 2, 3, at=4)]}, broadcast_replicated_tensors=True)
    load({"qk": fused}, storage_reader=HuggingFaceStorageReader(directory), planner=planner)
    with safe_open(f"{directory}/model.safetensors", framework="pt") as f:
        expected = torch.cat([f.get_tensor("q"), f.get_tensor("k")])
    return {"equal": torch.equal(fused.to_local(), expected),
            "sources": [(item.storage_index.fqn, item.source) for item in planner.final.items]}


def test_replicated_regions_are_marked_for_one_rank_to_read_and_broadcast(tmp_path):
    hf_checkpoint(tmp_path, {"q": torch.randn(4, 3), "k": torch.randn(2, 3)})
    out = run_ranks(_replicated_rank, 2, str(tmp_path))
    assert all(r["equal"] for r in out)
    shared = BroadcastSource(group_ranks=(0, 1), src_rank=0)
    assert out[0]["sources"] == out[1]["sources"] == [("q", shared), ("k", shared)]


def _dcp_rank(rank: int, world: int, directory: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(24.0).reshape(6, 4)
    save({"w": distribute_tensor(w, mesh, [Shard(0)])}, checkpoint_id=directory)  # saved as rows 0..2, 3..5
    wt = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0)])  # the transpose, rows split
    half = distribute_tensor(torch.zeros(3, 4), mesh, [Shard(1)])  # every other row, doubled
    planner = _Recording({
        "wt": [RemapBlock((0, 0), (4, 6), "w", (0, 0), ((0, 1), (1, 0)))],
        "half": [RemapBlock((0, 0), (3, 4), "w", (0, 0), ((2, 0), (0, 1)), post=(lambda t: t * 2,))]})
    load({"wt": wt, "half": half}, storage_reader=FileSystemReader(directory), planner=planner)
    return {"wt": torch.equal(wt.to_local(), w.t()[rank * 2:rank * 2 + 2]),
            "half": torch.equal(half.to_local(), (w[::2] * 2)[:, rank * 2:rank * 2 + 2]),
            "reads": reads(planner.final)}


def test_regions_straddling_saved_chunks_of_a_torch_dcp_checkpoint(tmp_path):
    out = run_ranks(_dcp_rank, 2, str(tmp_path / "ckpt"))
    assert all(r["wt"] and r["half"] for r in out)
    # each read lies inside one saved chunk: rows 0..2 and 3..5 of "w", never the whole tensor
    assert out[0]["reads"] == [("w", (0, 0), (0, 0), (3, 2)), ("w", (0, 0), (0, 0), (3, 2)),
                               ("w", (3, 0), (0, 0), (2, 2)), ("w", (3, 0), (0, 0), (3, 2))]
    assert out[1]["reads"] == [("w", (0, 0), (0, 2), (3, 2)), ("w", (0, 0), (0, 2), (3, 2)),
                               ("w", (3, 0), (0, 2), (2, 2)), ("w", (3, 0), (0, 2), (3, 2))]
