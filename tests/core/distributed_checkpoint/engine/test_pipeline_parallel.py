"""Pipeline parallelism: a checkpoint moves between pipeline splits, on real gloo ranks.

The model is four Linear layers and a LayerNorm (``layers.0-3``, ``norm``). PP=2 puts
``layers.0-1`` on stage 0 and ``layers.2-3`` plus ``norm`` on stage 1, split two ways:

- by ``torch.distributed.pipelining`` (``pipeline`` + ``SplitPoint``, stages built with
  ``build_stage`` and run by ``ScheduleGPipe`` over gloo): stage modules keep the whole
  model's names, so no mapping is needed;
- by hand, each stage numbering its layers from 0 (stage 1 calls layer 2 ``layers.0``), so
  a TopologyMapper renames them: on save, on load, or offline.

Values are compared exactly (``torch.equal``) with the whole model. Rank launches are the
expensive part: module fixtures run four (2, 2, 4 and 2 ranks) and the tests read them.
"""

from __future__ import annotations

import os
import re
import time
import traceback
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from helpers import local_expected, make_tensor
from multiprocess import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor

from hyper_parallel import fully_shard, init_device_mesh
from hyper_parallel.core.distributed_checkpoint import (
    FileSystemReader,
    StandardLoadPlanner,
    StandardSavePlanner,
    StateDictMismatchError,
    TopologyMapper,
    load,
    offline_transform,
    save,
)
from hyper_parallel.core.distributed_checkpoint._src.engine.metadata_reader import read_checkpoint_metadata
from hyper_parallel.core.distributed_checkpoint._src.resharding.reshard import reshard

DIMS = (6, 5, 7, 3, 4)  # layer i maps DIMS[i] -> DIMS[i + 1]; 5, 7 and 3 rows split unevenly over 2 ranks
PER_STAGE = 2
OPTIM_KEY = "optim.state.layers.0.weight.exp_avg"


class Net(nn.Module):
    """The whole model (PP=1): ``layers.0-3`` then ``norm``."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIMS[i], DIMS[i + 1]) for i in range(len(DIMS) - 1))
        self.norm = nn.LayerNorm(DIMS[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x)


class Stage(nn.Module):
    """Stage ``p`` of a hand-made PP=2 split, its layers numbered from 0 (the last stage has ``norm``)."""

    def __init__(self, p: int):
        super().__init__()
        whole = whole_model()
        self.layers = whole.layers[PER_STAGE * p:PER_STAGE * (p + 1)]  # a ModuleList renumbered from 0
        self.norm = whole.norm if p == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x) if self.norm is not None else x


def whole_model() -> Net:
    torch.manual_seed(0)
    return Net()


def reference() -> dict[str, torch.Tensor]:
    """The whole model's state dict, the same in every process."""
    return {k: v.detach().clone() for k, v in whole_model().state_dict().items()}


def to_global(p: int) -> TopologyMapper:
    """Stage ``p``'s local names -> the whole model's, wherever ``layers.<i>.`` sits in a key."""
    return TopologyMapper(rules=[(r"(^|\.)layers\.(\d+)\.", lambda m: f"{m[1]}layers.{int(m[2]) + PER_STAGE * p}.")])


def keys_of(path: str) -> list[str]:
    return sorted(read_checkpoint_metadata(FileSystemReader(path)).entries)


def zeroed(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for t in module.state_dict().values():
            t.zero_()
    return module


def assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}"
    assert torch.equal(got, want), f"{what}: values differ"


def check(results: dict, name: str, fn: Callable[[], object]) -> None:
    """Run one check inside a rank; record "ok" or its traceback under ``name``."""
    try:
        fn()
        results[name] = "ok"
    except Exception:
        results[name] = "FAILED\n" + traceback.format_exc()


def expect_ok(per_rank: list[dict], name: str) -> None:
    failed = [f"rank {r}: {res[name]}" for r, res in enumerate(per_rank) if res[name] != "ok"]
    assert not failed, "\n".join(failed)


def pipelining_stage(model: nn.Module, rank: int):
    """A real ``torch.distributed.pipelining`` stage of ``model`` split before ``layers.2``."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's pytree deprecation notes
        pipe = pipeline(model, mb_args=(torch.zeros(2, DIMS[0]),),
                        split_spec={f"layers.{PER_STAGE}": SplitPoint.BEGINNING})
    return pipe.build_stage(rank, torch.device("cpu"))


def run_pipeline(stage, rank: int, x: torch.Tensor) -> torch.Tensor | None:
    """One GPipe forward over the two ranks; the last stage returns the output."""
    from torch.distributed.pipelining import ScheduleGPipe

    schedule = ScheduleGPipe(stage, n_microbatches=2)
    return schedule.step(x) if rank == 0 else schedule.step()


# ------------------------------------------------------------------------------- PP=2 -> PP=1


def _save_pp2(rank: int, ws: int, root: str) -> list[str]:
    """Each of 2 ranks holds one stage and saves it three ways."""
    stage = pipelining_stage(whole_model(), rank)
    x = make_tensor((4, DIMS[0]), seed=7)
    out = run_pipeline(stage, rank, x)
    if rank == 1:
        assert torch.allclose(out, whole_model()(x)), "the pipeline's output differs from the whole model's"
    save({"model": stage.submod.state_dict()}, os.path.join(root, "global"))
    local = Stage(rank)
    save({"model": local.state_dict()}, os.path.join(root, "mapped"),
         planner=StandardSavePlanner(topology_mapper=to_global(rank)))
    save({f"stage{rank}": local.state_dict()}, os.path.join(root, "staged"))
    return list(stage.submod.state_dict())


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> str:
    """A directory of three PP=2 checkpoints: ``global`` (a pipelining split, whole-model names),
    ``mapped`` (stage-local names saved through a TopologyMapper), ``staged`` (stage-local
    names under ``stage0.``/``stage1.``)."""
    root = str(tmp_path_factory.mktemp("pp2"))
    names = run_ranks(_save_pp2, 2, root)
    assert names == [["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"],
                     ["layers.2.weight", "layers.2.bias", "layers.3.weight", "layers.3.bias",
                      "norm.weight", "norm.bias"]], names
    return root


def test_pp2_pipelining_stages_load_as_one_whole_model(pp2):
    target = {"model": zeroed(Net()).state_dict()}
    load(target, os.path.join(pp2, "global"), strict="all")
    ref = reference()
    for k, v in target["model"].items():
        assert_equal(v, ref[k], k)


def test_pp2_stage_local_names_saved_through_a_mapper_load_as_one_whole_model(pp2):
    path = os.path.join(pp2, "mapped")
    assert keys_of(path) == sorted(f"model.{k}" for k in reference())
    target = {"model": zeroed(Net()).state_dict()}
    load(target, path, strict="all")
    ref = reference()
    for k, v in target["model"].items():
        assert_equal(v, ref[k], k)
    # renamed keys keep their nesting: a load without a target gives {"model": {whole-model names}}
    everything = load(path=path)
    assert sorted(everything) == ["model"] and sorted(everything["model"]) == sorted(ref)


def test_a_pp1_job_loads_a_stage_prefixed_pp2_checkpoint_through_a_load_mapper(pp2):
    # on load a mapper goes target name -> checkpoint name
    mapper = TopologyMapper(rules=[
        (r"^layers\.(\d+)\.", lambda m: f"stage{int(m[1]) // PER_STAGE}.layers.{int(m[1]) % PER_STAGE}."),
        (r"^norm\.", "stage1.norm."),
    ])
    target = zeroed(Net()).state_dict()
    load(target, os.path.join(pp2, "staged"), planner=StandardLoadPlanner(topology_mapper=mapper), strict="all")
    ref = reference()
    for k, v in target.items():
        assert_equal(v, ref[k], k)


def test_a_whole_model_load_from_one_stage_names_the_missing_layers(tmp_path):
    stage0 = {k: v for k, v in reference().items() if k.startswith(("layers.0.", "layers.1."))}
    save(stage0, tmp_path / "stage0")
    with pytest.raises(StateDictMismatchError, match=r"does not hold: 'layers\.2\.weight'.*'norm\.bias'"):
        load(zeroed(Net()).state_dict(), tmp_path / "stage0")
    # strict=False loads what exists and warns with the rest; the rest stays as it was
    target = zeroed(Net()).state_dict()
    with pytest.warns(UserWarning, match=r"skipped key\(s\).*'layers\.3\.bias'"):
        load(target, tmp_path / "stage0", strict=False)
    for k, v in target.items():
        assert_equal(v, stage0[k] if k in stage0 else torch.zeros_like(v), k)


def test_a_missing_key_under_a_mapper_is_named_by_both_names(tmp_path):
    save({"layers.0.weight": reference()["layers.0.weight"]}, tmp_path / "ckpt")
    planner = StandardLoadPlanner(topology_mapper=to_global(1))
    with pytest.raises(StateDictMismatchError, match=re.escape("'layers.0.weight' (checkpoint key 'layers.2.weight')")):
        load(zeroed(Stage(1)).state_dict(), tmp_path / "ckpt", planner=planner)


def test_stage_keys_mapped_to_one_name_on_save_are_refused_naming_both(tmp_path):
    local = Stage(0).state_dict()
    planner = StandardSavePlanner(topology_mapper=lambda k: re.sub(r"layers\.\d+\.", "layers.0.", k))
    with pytest.raises(StateDictMismatchError, match=r"'layers\.0\.weight' and 'layers\.1\.weight'"):
        save(local, tmp_path / "ckpt", planner=planner)
    assert not os.path.exists(tmp_path / "ckpt" / ".metadata")


def test_topology_mapper_accepts_a_mapping_a_callable_and_rules():
    as_dict = StandardLoadPlanner(topology_mapper={"layers.0.weight": "layers.2.weight"}).topology_mapper
    as_fn = StandardLoadPlanner(topology_mapper=lambda k: k.upper()).topology_mapper
    as_rules = StandardLoadPlanner(topology_mapper=[(r"^layers\.0\.", "layers.2.")]).topology_mapper
    assert as_dict.map_fqn("layers.0.weight") == "layers.2.weight" and as_dict.map_fqn("x") == "x"
    assert as_fn.map_fqn("norm.bias") == "NORM.BIAS"
    assert as_rules.map_fqn("layers.0.bias") == "layers.2.bias"
    with pytest.raises(TypeError, match="topology_mapper must be"):
        StandardLoadPlanner(topology_mapper=42)


# ------------------------------------------------------------------------------- offline rename


def stage_prefix_to_global() -> list:
    """Offline, a mapper goes source name -> new name: ``stage1.layers.0.`` -> ``layers.2.``."""
    return [(r"^stage(\d+)\.layers\.(\d+)\.", lambda m: f"layers.{PER_STAGE * int(m[1]) + int(m[2])}."),
            (r"^stage1\.norm\.", "norm.")]


def test_offline_transform_renames_a_pp2_checkpoint_for_a_pp1_job(pp2, tmp_path):
    dst = tmp_path / "pp1"
    meta = offline_transform(os.path.join(pp2, "staged"), dst, dst_layout={"dp": 1},
                             topology_mapper=stage_prefix_to_global())
    assert sorted(meta.entries) == sorted(reference())
    target = zeroed(Net()).state_dict()
    load(target, dst, strict="all")  # no mapper needed any more
    ref = reference()
    for k, v in target.items():
        assert_equal(v, ref[k], k)


def test_offline_rename_of_two_keys_to_one_name_is_refused_naming_both(pp2, tmp_path):
    with pytest.raises(ValueError, match=r"'stage0\.layers\.0\.weight' and 'stage1\.layers\.0\.weight'"):
        offline_transform(os.path.join(pp2, "staged"), tmp_path / "out", dst_layout={"dp": 1},
                          topology_mapper=[(r"^stage\d+\.", "")])
    assert not os.path.exists(tmp_path / "out" / ".metadata")


# ------------------------------------------------------------------------------- PP=1 -> PP=2


def _load_pp2(rank: int, ws: int, path: str) -> dict[str, str]:
    """Each of 2 ranks loads its stage of a whole-model checkpoint, two ways."""
    results: dict[str, str] = {}
    ref = reference()

    def pipelining() -> None:
        stage = pipelining_stage(zeroed(whole_model()), rank)
        sd = stage.submod.state_dict()
        load({"model": sd}, path)  # strict=True: the other stage's keys are fine
        for k, v in sd.items():
            assert_equal(v, ref[k], k)
        x = make_tensor((4, DIMS[0]), seed=7)
        out = run_pipeline(stage, rank, x)
        if rank == 1:
            assert torch.allclose(out, whole_model()(x)), "the loaded pipeline computes another function"

    def stage_local() -> None:
        sd = zeroed(Stage(rank)).state_dict()
        mapper = to_global(rank)
        load({"model": sd}, path, planner=StandardLoadPlanner(topology_mapper=mapper))
        for k, v in sd.items():
            assert_equal(v, ref[mapper.map_fqn(k)], f"{k} (as {mapper.map_fqn(k)})")

    def union_covers_all() -> None:
        # strict="all": every checkpoint key asked for by SOME rank; the two stages together do
        sd = zeroed(Stage(rank)).state_dict()
        load({"model": sd}, path, planner=StandardLoadPlanner(topology_mapper=to_global(rank)), strict="all")

    check(results, "pipelining", pipelining)
    check(results, "stage-local", stage_local)
    check(results, "union", union_covers_all)
    return results


@pytest.fixture(scope="module")
def pp1(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pp1") / "ckpt")
    save({"model": whole_model().state_dict()}, path)
    return path


@pytest.fixture(scope="module")
def pp1_to_pp2(pp1) -> list[dict[str, str]]:
    return run_ranks(_load_pp2, 2, pp1)


def test_pp1_checkpoint_loads_into_each_pipelining_stage_and_the_pipeline_runs(pp1_to_pp2):
    expect_ok(pp1_to_pp2, "pipelining")


def test_pp1_checkpoint_loads_into_stage_local_names_through_a_load_mapper(pp1_to_pp2):
    expect_ok(pp1_to_pp2, "stage-local")


def test_strict_all_counts_the_keys_every_stage_asks_for_together(pp1_to_pp2, pp1):
    expect_ok(pp1_to_pp2, "union")
    # one stage alone leaves the other stage's keys unasked
    with pytest.raises(StateDictMismatchError, match=r"asked for by no rank: 'model\.layers\.2\.bias'"):
        load({"model": zeroed(Stage(0)).state_dict()}, pp1, strict="all")


# ------------------------------------------------------------------------------- PP=2 x FSDP=2 -> PP=1 x FSDP=2


def _save_pp2_fsdp2(rank: int, ws: int, path: str) -> dict[str, np.ndarray] | None:
    """4 ranks on a (pp=2, dp=2) mesh: each stage (stage-local names) fully sharded over its dp
    pair, one Adam step, model + optimizer saved under whole-model names."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_coordinate()
    stage = Stage(pp)
    fully_shard(stage, mesh=mesh["dp"])
    opt = torch.optim.Adam(stage.parameters(), lr=0.1)
    stage(make_tensor((3, DIMS[PER_STAGE * pp]), seed=10 + dp)).square().sum().backward()
    opt.step()
    msd, osd = get_state_dict(stage, opt)
    mapper = to_global(pp)
    save({"model": msd, "optim": osd}, path, planner=StandardSavePlanner(topology_mapper=mapper))
    # what was saved, whole (numpy: tensors would leave through shared memory, gone with the rank)
    trained = {mapper.map_fqn(k): v.full_tensor().numpy() for k, v in msd.items()}
    return trained if dp == 0 else None


@pytest.fixture(scope="module")
def pp2_fsdp2(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """(checkpoint, the trained whole model's values)."""
    path = str(tmp_path_factory.mktemp("pp2_fsdp2") / "ckpt")
    out = run_ranks(_save_pp2_fsdp2, 4, path)
    trained = {k: torch.from_numpy(v) for k, v in {**out[0], **out[2]}.items()}
    assert sorted(trained) == sorted(reference())
    assert not any(torch.equal(trained[k], v) for k, v in reference().items()), "the step changed nothing"
    return path, trained


def _load_fsdp2(rank: int, ws: int, paths: dict[str, str], trained: dict[str, np.ndarray]) -> dict[str, str]:
    """2 ranks, the whole model fully sharded over dp=2, load only the model."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    results: dict[str, str] = {}
    trained = {k: torch.from_numpy(v) for k, v in trained.items()}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = zeroed(whole_model())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def verify() -> None:
        for k, v in model.state_dict().items():
            assert isinstance(v, DTensor), f"{k}: not sharded"
            assert_equal(v.to_local(), local_expected(trained[k], mesh, list(v.placements)), k)

    def model_only() -> None:
        msd = get_model_state_dict(model)
        load({"model": msd}, paths["ckpt"])  # the optimizer's keys are not asked for: fine
        set_model_state_dict(model, msd)
        verify()

    def resharded_and_renamed() -> None:
        zeroed(model)
        load(model.state_dict(), paths["renamed"])  # flat whole-model names, one data file per rank
        verify()

    check(results, "model-only", model_only)
    check(results, "renamed", resharded_and_renamed)
    return results


@pytest.fixture(scope="module")
def fsdp2_loaded(pp2_fsdp2, tmp_path_factory) -> list[dict[str, str]]:
    path, trained = pp2_fsdp2
    renamed = str(tmp_path_factory.mktemp("renamed") / "ckpt")
    reshard(path, renamed, dst_mesh={"dp": 2}, topology_mapper=[(r"^model\.", "")])
    return run_ranks(_load_fsdp2, 2, {"ckpt": path, "renamed": renamed}, {k: v.numpy() for k, v in trained.items()})


def test_pp2_fsdp2_checkpoint_loads_on_pp1_fsdp2_model_only(fsdp2_loaded):
    expect_ok(fsdp2_loaded, "model-only")


def test_reshard_renames_a_pp2_fsdp2_checkpoint_and_keeps_dp_sharding(fsdp2_loaded):
    expect_ok(fsdp2_loaded, "renamed")


def test_model_only_load_of_a_model_and_optimizer_checkpoint_in_one_process(pp2_fsdp2):
    path, trained = pp2_fsdp2
    target = {"model": zeroed(Net()).state_dict()}
    load(target, path)  # strict=True: every key asked for exists; "optim.*" is not asked for
    for k, v in target["model"].items():
        assert_equal(v, trained[k], k)
    assert OPTIM_KEY in keys_of(path)
    # stage 1's optimizer state, renamed on save, stays nested as torch's get_state_dict made it
    state = load(path=path)["optim"]["state"]
    assert sorted(state) == sorted(reference())
    assert sorted(state["layers.2.weight"]) == ["exp_avg", "exp_avg_sq", "step"]
    with pytest.raises(StateDictMismatchError, match=re.escape(repr(OPTIM_KEY))):
        load({"model": zeroed(Net()).state_dict()}, path, strict="all")


# ------------------------------------------------------------------------------- the documented example


def test_the_pipeline_parallel_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "examples"))
    import pipeline_parallel

    pipeline_parallel.main(str(tmp_path))
    assert "4. offline_transform renamed" in capsys.readouterr().out


def stages_on_meshes_of_their_own(rank: int, ws: int, root: str, world: bool, use_async: bool = False) -> str:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyper_parallel import init_device_mesh
    from hyper_parallel.core.distributed_checkpoint import CheckpointError, async_save, save

    pp = rank // 2
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), rank_list=(2 * pp, 2 * pp + 1))
    w = distribute_tensor(torch.full((4, 4), float(pp + 1)), mesh, [Shard(0)], src_data_rank=None)
    if not world and pp == 1:  # stage 1 saves after stage 0 committed (commits racing within a few ms both win)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(root, ".metadata")) and time.monotonic() < deadline:
            time.sleep(0.05)
    sd = {f"layers.{pp}.weight": w, "optim": {"param_groups": [{"lr": 0.1}]}}  # a plain key both share
    try:
        if use_async:  # the background save runs on a dedicated group: the guard must still apply
            async_save(sd, root, process_group=dist.group.WORLD if world else None).result()
        else:
            save(sd, root, process_group=dist.group.WORLD if world else None)
    except CheckpointError as exc:
        return str(exc)
    return "ok"


def test_stages_on_meshes_of_their_own_never_silently_replace_each_other(tmp_path):
    # each stage's save runs on its mesh's ranks alone; the later of the two must not replace
    # the other's checkpoint (one stage's keys) while reporting success
    out = run_ranks(stages_on_meshes_of_their_own, 4, str(tmp_path / "ck"), False, timeout_s=120)
    assert out[:2] == ["ok", "ok"], out
    assert all("tensors this save does not have" in msg and "process_group=dist.group.WORLD" in msg
               for msg in out[2:]), out
    assert sorted(load(path=str(tmp_path / "ck"), no_dist=True)) == ["layers.0.weight", "optim"]  # stage 0's
    # through one group, both stages land in one checkpoint
    assert run_ranks(stages_on_meshes_of_their_own, 4, str(tmp_path / "one"), True, timeout_s=120) == ["ok"] * 4
    both = load(path=str(tmp_path / "one"), no_dist=True)
    assert sorted(both) == ["layers.0.weight", "layers.1.weight", "optim"]
    assert torch.equal(both["layers.1.weight"], torch.full((4, 4), 2.0))
    # saving over that whole checkpoint stage by stage fails on both stages and keeps it whole
    out = run_ranks(stages_on_meshes_of_their_own, 4, str(tmp_path / "one"), False, timeout_s=120)
    assert all("tensors this save does not have" in msg for msg in out), out
    assert sorted(load(path=str(tmp_path / "one"), no_dist=True)) == sorted(both)


def test_async_saves_of_stages_on_meshes_of_their_own_never_silently_replace_each_other(tmp_path):
    out = run_ranks(stages_on_meshes_of_their_own, 4, str(tmp_path / "ck"), False, True, timeout_s=120)
    assert out[:2] == ["ok", "ok"], out
    assert all("tensors this save does not have" in msg for msg in out[2:]), out
    assert sorted(load(path=str(tmp_path / "ck"), no_dist=True)) == ["layers.0.weight", "optim"]
