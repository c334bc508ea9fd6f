"""HFLoadPlanner against the legacy whole-tensor loader on a Qwen3-MoE checkpoint transformers itself
wrote (separate q/k/v, one tensor per expert), loaded into a model with grouped QKV and stacked experts:
equal values bit for bit, equal reports, region reads for everything that traces and whole-tensor
reads only for the one step that does not; in one process and on 2 gloo ranks holding Shard(0)
DTensors, where each rank reads only its own experts.

Until this library's ``load`` runs torch-protocol planners on its own Hugging Face reader, the planner
is driven by torch's ``torch.distributed.checkpoint.load`` with torch's ``HuggingFaceStorageReader``
(and by our ``load`` over torch's reader, which works).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_moe import extra_rules, fused_model, grouped_qkv, save_checkpoint
from torch import nn
from torch.distributed.checkpoint import load as torch_load
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader as TorchHFReader

from hyper_parallel.components.checkpoint import (
    HFLoadPlanner,
    HuggingFaceCheckpointer,
    LoadReport,
    MissingWeightsError,
    load_hf_checkpoint,
)
from hyper_parallel.components.checkpoint.whole_tensor_loader import load_whole_tensors
from hyper_parallel.core.distributed_checkpoint import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint import load as our_load

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def plan_load(model: nn.Module, directory: Path, driver: str = "torch", **planner_kwargs: Any) -> HFLoadPlanner:
    planner = HFLoadPlanner(model, **planner_kwargs)
    state_dict = planner.state_dict_for_load()
    if driver == "torch":
        torch_load(state_dict, storage_reader=TorchHFReader(str(directory)), planner=planner)
    else:
        our_load(state_dict, storage_reader=TorchHFReader(str(directory)), planner=planner,
                 no_dist=not dist.is_initialized())
    planner.finish(directory)
    return planner


def assert_same_tensors(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        x, y = sa[name], sb[name]
        x = x.to_local() if hasattr(x, "to_local") else x
        y = y.to_local() if hasattr(y, "to_local") else y
        assert x.dtype == y.dtype and torch.equal(x, y), f"{name} differs"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.mark.parametrize("driver", ["torch", "ours"])
def test_the_planner_loads_what_the_legacy_loader_loads_bit_for_bit(moe_dir, driver):
    legacy = fused_model()
    legacy_report = load_whole_tensors(legacy, moe_dir, extra_weights_mapping=extra_rules())
    model = fused_model()
    planner = plan_load(model, moe_dir, driver, extra_weights_mapping=extra_rules())
    assert planner.report == legacy_report
    assert legacy_report.missing_keys == () and legacy_report.unexpected_keys == ()
    assert_same_tensors(legacy, model)


def test_the_values_are_the_conversions_written_out_by_hand(moe_dir):
    ckpt = checkpoint_tensors(moe_dir)
    model = fused_model()
    plan_load(model, moe_dir, extra_weights_mapping=extra_rules())
    sd = model.state_dict()
    for i in range(2):
        p = f"model.layers.{i}."
        assert torch.equal(sd[p + "self_attn.linear_qkv.weight"],
                           grouped_qkv(*(ckpt[p + f"self_attn.{x}_proj.weight"] for x in "qkv")))
        gate = torch.stack([ckpt[p + f"mlp.experts.{e}.gate_proj.weight"] for e in range(4)])
        up = torch.stack([ckpt[p + f"mlp.experts.{e}.up_proj.weight"] for e in range(4)])
        assert torch.equal(sd[p + "mlp.experts.gate_up_proj"], torch.cat([gate, up], dim=1))
        assert torch.equal(sd[p + "mlp.experts.down_proj"],
                           torch.stack([ckpt[p + f"mlp.experts.{e}.down_proj.weight"] for e in range(4)]))
        q_norm = ckpt[p + "self_attn.q_norm.weight"]
        assert torch.equal(sd[p + "self_attn.q_norm.weight"], torch.cat([q_norm[2:], q_norm[:2]]))
        assert torch.equal(sd[p + "self_attn.k_norm.weight"], torch.flip(ckpt[p + "self_attn.k_norm.weight"], [0]) * 2)
    assert torch.equal(sd["model.norm.weight"], ckpt["model.norm.weight"] + 1.0)
    assert torch.equal(sd["lm_head.weight"], ckpt["lm_head.weight"])


def test_only_the_step_that_does_not_trace_reads_whole_tensors(moe_dir):
    planner = plan_load(fused_model(), moe_dir, extra_weights_mapping=extra_rules())
    assert sorted(read.sources for read in planner.deferred) == [
        ("model.layers.0.self_attn.k_norm.weight",), ("model.layers.1.self_attn.k_norm.weight",)]
    assert "model.layers.0.self_attn.k_norm.weight" not in planner.table
    gate_up = planner.table["model.layers.0.mlp.experts.gate_up_proj"]
    assert sorted(b.source for b in gate_up) == sorted(f"model.layers.0.mlp.experts.{e}.{w}_proj.weight"
                                                       for e in range(4) for w in ("gate", "up"))
    assert len(planner.table["model.layers.0.self_attn.linear_qkv.weight"]) == 6  # 2 kv heads x q, k, v


def test_loading_into_another_dtype_casts_after_converting_as_the_legacy_loader_does(tmp_path):
    directory = save_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16, seed=3)
    legacy, model = fused_model(), fused_model()
    load_whole_tensors(legacy, directory, extra_weights_mapping=extra_rules())
    plan_load(model, directory, extra_weights_mapping=extra_rules())
    assert_same_tensors(legacy, model)
    assert model.model.norm.weight.dtype == torch.float32 and model.model.norm.weight.abs().sum() > 0


def test_a_sharded_checkpoint_with_an_index_loads_the_same(tmp_path):
    directory = save_checkpoint(tmp_path / "sharded", max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(weight_map) == 45 and len(set(weight_map.values())) > 1
    legacy, model = fused_model(), fused_model()
    report = load_whole_tensors(legacy, directory, extra_weights_mapping=extra_rules())
    assert plan_load(model, directory, extra_weights_mapping=extra_rules()).report == report
    assert_same_tensors(legacy, model)


@pytest.mark.parametrize("layout", ["one file", "index"])
def test_load_hf_checkpoint_reads_straight_from_the_files_what_the_legacy_loader_loads(tmp_path, layout):
    directory = save_checkpoint(tmp_path / "ckpt", **({"max_shard_size": "20KB"} if layout == "index" else {}))
    legacy, model = fused_model(), fused_model()
    report = load_whole_tensors(legacy, directory, extra_weights_mapping=extra_rules())
    assert load_hf_checkpoint(model, directory, planner=HFLoadPlanner(model, extra_weights_mapping=extra_rules())) \
        == report
    assert_same_tensors(legacy, model)
    # and through load with this library's reader (the path taken with load arguments) alike
    again = fused_model()
    assert load_hf_checkpoint(again, directory, planner=HFLoadPlanner(again, extra_weights_mapping=extra_rules()),
                              no_dist=True) == report
    assert_same_tensors(legacy, again)


def test_a_truncated_file_fails_the_straight_read_naming_it(tmp_path):
    directory = save_checkpoint(tmp_path / "ckpt")
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    model = fused_model()
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        load_hf_checkpoint(model, directory, planner=HFLoadPlanner(model, extra_weights_mapping=extra_rules()))


class _TracingEveryLayer(HFLoadPlanner):
    reuse_traced_layers = False


def _blocks(planner: HFLoadPlanner) -> dict[str, list[tuple]]:
    return {key: [(b.offsets, b.lengths, b.source, b.base, b.coeff, len(b.post)) for b in blocks]
            for key, blocks in planner.table.items()}


def test_reusing_one_layers_trace_plans_what_tracing_every_layer_plans(tmp_path):
    from hyper_parallel.components.checkpoint.local_region_load import open_local_safetensors

    directory = save_checkpoint(tmp_path / "ckpt", layers=3)
    checkpoint = open_local_safetensors(directory)
    traced = {}
    for cls in (HFLoadPlanner, _TracingEveryLayer):
        planner = cls(fused_model(layers=3), extra_weights_mapping=extra_rules())
        count = []
        run = planner._plan_conversion
        planner._plan_conversion = lambda conversion, run=run, count=count: count.append(1) or run(conversion)
        planner.set_up_planner(planner.state_dict_for_load(), checkpoint.metadata(), True)
        traced[cls] = (len(count), _blocks(planner), planner.report)
    checkpoint.close()
    (reused, blocks, report), (every, expected, expected_report) = traced.values()
    assert blocks == expected and report == expected_report
    assert every > reused, f"tracing every layer traced {every} conversions, reusing {reused}"
    for key, key_blocks in blocks.items():  # each layer reads its own tensors
        layer = key.split(".")[2] if key.startswith("model.layers.") else None
        assert layer is None or all(f"layers.{layer}." in source for _, _, source, *_ in key_blocks), key


def test_a_model_tensor_nothing_loads_fails_a_strict_load_naming_it(moe_dir):
    rules = extra_rules()[1:]  # no rule makes linear_qkv out of q/k/v
    with pytest.raises(BaseException, match=r"model\.layers\.0\.self_attn\.linear_qkv\.weight") as caught:
        plan_load(fused_model(), moe_dir, extra_weights_mapping=rules)
    assert "model.layers.1.self_attn.linear_qkv.weight" in str(caught.value)
    with pytest.raises(MissingWeightsError, match=r"2 model tensor\(s\).*linear_qkv"):
        load_whole_tensors(fused_model(), moe_dir, extra_weights_mapping=extra_rules()[1:])


def test_a_lenient_load_reports_missing_and_unexpected_alike(moe_dir):
    legacy, model = fused_model(), fused_model()
    report = load_whole_tensors(legacy, moe_dir, extra_weights_mapping=extra_rules()[1:], strict=False)
    planner = plan_load(model, moe_dir, extra_weights_mapping=extra_rules()[1:], strict=False)
    assert planner.report == report
    assert report.missing_keys == ("model.layers.0.self_attn.linear_qkv.weight",
                                   "model.layers.1.self_attn.linear_qkv.weight")
    assert "model.layers.0.self_attn.q_proj.weight" in report.unexpected_keys
    assert set(report.loaded_keys).isdisjoint(report.missing_keys)
    assert torch.count_nonzero(model.model.layers[0].self_attn.linear_qkv.weight) == 0  # left as it was
    assert_same_tensors(legacy, model)


def test_a_converted_shape_that_differs_from_the_model_is_named(moe_dir):
    model = fused_model()
    model.lm_head = nn.Linear(16, 65, bias=False)
    needle = r"shape mismatch for model tensor 'lm_head\.weight'.*\(64, 16\).*\(65, 16\)"
    with pytest.raises(BaseException, match=needle):
        plan_load(model, moe_dir, extra_weights_mapping=extra_rules())


def test_tied_weights_load_once_and_report_both_names(tmp_path):
    tensors = {"embed.weight": torch.randn(4, 3), "norm.weight": torch.randn(3)}
    save_file(tensors, str(tmp_path / "model.safetensors"))

    def tied() -> nn.Module:
        model = nn.Module()
        model.embed, model.head, model.norm = nn.Embedding(4, 3), nn.Linear(3, 4, bias=False), nn.LayerNorm(3)
        model.head.weight = model.embed.weight
        return model

    legacy, model = tied(), tied()
    report = load_whole_tensors(legacy, tmp_path, weights_mapping=[], strict=False)
    planner = plan_load(model, tmp_path, weights_mapping=[], strict=False)
    assert planner.report == report == LoadReport(
        loaded_keys=("embed.weight", "head.weight", "norm.weight"), missing_keys=("norm.bias",), unexpected_keys=())
    assert torch.equal(model.head.weight, tensors["embed.weight"])


def test_the_checkpointer_runs_either_loader_and_reports(moe_dir, monkeypatch):
    states = {}
    for loader in ("legacy", "dcp"):
        state = {"model": fused_model()}
        checkpointer = HuggingFaceCheckpointer(loader=loader, extra_weights_mapping=extra_rules())
        try:
            states[loader] = checkpointer.load(str(moe_dir), state)
        except AttributeError as exc:  # our load does not yet read our HF reader for torch planners
            pytest.xfail(f"load with this library's HuggingFaceStorageReader and a torch planner: {exc}")
    assert states["legacy"]["load_report"] == states["dcp"]["load_report"]
    assert_same_tensors(states["legacy"]["model"], states["dcp"]["model"])
    monkeypatch.setenv("HYPER_PARALLEL_HF_LOADER", "dcp")
    assert HuggingFaceCheckpointer().loader == "dcp"


def test_the_checkpointer_refuses_what_it_cannot_do(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_HF_LOADER", "fast")
    with pytest.raises(ValueError, match=r"'fast' \(from \$HYPER_PARALLEL_HF_LOADER\)"):
        HuggingFaceCheckpointer()
    checkpointer = HuggingFaceCheckpointer(loader="legacy")
    with pytest.raises(TypeError, match="nn.Module"):
        checkpointer.load("somewhere", {"model": {}})
    with pytest.raises(ValueError, match="training state"):
        checkpointer.load("somewhere", {"model": nn.Linear(1, 1)}, extra_state_skeleton={})
    with pytest.raises(NotImplementedError, match="save_pretrained"):
        checkpointer.save("somewhere", {}, global_step=1)


def test_load_hf_checkpoint_reads_a_single_file_of_any_name(tmp_path):
    tensors = {"w.weight": torch.randn(3, 2)}
    save_file(tensors, str(tmp_path / "weights.safetensors"))
    model = nn.Module()
    model.w = nn.Linear(2, 3, bias=False)
    try:
        report = load_hf_checkpoint(model, tmp_path / "weights.safetensors", weights_mapping=[])
    except AttributeError as exc:  # our load does not yet read our HF reader for torch planners
        pytest.xfail(f"load with this library's HuggingFaceStorageReader and a torch planner: {exc}")
    assert report.loaded_keys == ("w.weight",) and torch.equal(model.w.weight, tensors["w.weight"])
    assert model.w.weight._is_hf_initialized


# ---------------------------------------------------------------- 2 gloo ranks


def _sharded_fused_model(mesh: Any) -> nn.Module:
    """The fused model with every matrix Shard(0) over ``mesh`` and every vector replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model = fused_model()
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            placement = Shard(0) if param.dim() >= 2 else Replicate()
            module._parameters[name] = nn.Parameter(distribute_tensor(param.detach(), mesh, [placement]),
                                                    requires_grad=False)
    return model


def _sharded_rank(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    legacy, model = _sharded_fused_model(mesh), _sharded_fused_model(mesh)
    report = load_whole_tensors(legacy, directory, extra_weights_mapping=extra_rules())
    planner = plan_load(model, Path(directory), extra_weights_mapping=extra_rules())
    assert planner.report == report
    assert_same_tensors(legacy, model)
    for driver in ("ours",):
        again = _sharded_fused_model(mesh)
        plan_load(again, Path(directory), driver, extra_weights_mapping=extra_rules())
        assert_same_tensors(legacy, again)
    straight = _sharded_fused_model(mesh)
    assert load_hf_checkpoint(straight, directory,
                              planner=HFLoadPlanner(straight, extra_weights_mapping=extra_rules())) == report
    assert_same_tensors(legacy, straight)
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj
    whole = gate_up.full_tensor()
    # this rank's reads: plan again on the same metadata and list the checkpoint tensors read
    replan = HFLoadPlanner(_sharded_fused_model(mesh), extra_weights_mapping=extra_rules())
    replan.set_up_planner(replan.state_dict_for_load(), TorchHFReader(directory).read_metadata(), rank == 0)
    read = {item.storage_index.fqn for item in replan.create_local_plan().items}
    return {"local_shape": tuple(gate_up.to_local().shape), "whole": whole.tolist(), "read": sorted(read)}


def test_two_ranks_holding_shards_load_what_the_legacy_loader_loads_and_read_only_their_experts(moe_dir):
    results = run_ranks(_sharded_rank, 2, str(moe_dir), timeout_s=300)
    ckpt = checkpoint_tensors(moe_dir)
    gate = torch.stack([ckpt[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in range(4)])
    up = torch.stack([ckpt[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] for e in range(4)])
    for rank, result in enumerate(results):
        assert result["local_shape"] == (2, 16, 16)
        assert result["whole"] == torch.cat([gate, up], dim=1).tolist()
        experts_read = {int(name.split(".")[5]) for name in result["read"] if ".mlp.experts." in name}
        assert experts_read == {2 * rank, 2 * rank + 1}, f"rank {rank} read experts {experts_read}"


def _one_rank_fails_to_plan(rank: int, world_size: int, directory: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    model = _sharded_fused_model(init_device_mesh("cpu", (world_size,)))
    if rank == 1:  # a model tensor of another shape: planning fails here only
        model.model.norm.weight = nn.Parameter(torch.zeros(3))
    try:
        load_hf_checkpoint(model, directory, planner=HFLoadPlanner(model, extra_weights_mapping=extra_rules()))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_rank_that_fails_to_plan_fails_the_straight_read_on_every_rank(moe_dir):
    results = run_ranks(_one_rank_fails_to_plan, 2, str(moe_dir), timeout_s=300)
    assert "model.norm.weight" in results[1] and "shape" in results[1]
    assert results[0].startswith("RuntimeError") and "rank(s) [1]" in results[0]
