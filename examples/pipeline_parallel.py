"""Checkpoints across pipeline splits: PP=2 stages whose layers are numbered from 0 <-> PP=1.

1. PP=2: 2 processes (gloo) each hold one stage of a 4-layer model, its layers numbered
   from 0 (stage 1 calls the model's layer 2 ``layers.0``). Each saves its stage twice:
   through a TopologyMapper that stores every key under its whole-model name, and as it
   is, under ``stage0.``/``stage1.``.
2. PP=2 -> PP=1: this process loads the whole model from the first checkpoint, no mapper.
3. PP=1 -> PP=2: stage 1 loads its layers from it with the same mapper (on load it maps the
   stage's names to the checkpoint's).
4. Offline: the stage-prefixed checkpoint is renamed for a whole-model job by
   ``offline_transform(topology_mapper=...)`` (source name -> new name) and loads as is.

Every value is checked bit for bit against the model the stages came from.

Run: ``python examples/pipeline_parallel.py [DIR]`` (default: a temporary directory).
"""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch import nn

from hyper_parallel.core.distributed_checkpoint import (
    StandardPlanner,
    TopologyMapper,
    load,
    offline_transform,
    save,
)

DIMS = (8, 6, 6, 4, 4)  # layer i maps DIMS[i] -> DIMS[i + 1]
PER_STAGE = 2


def whole_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(DIMS[i], DIMS[i + 1]) for i in range(len(DIMS) - 1)))


def stage(p: int) -> nn.Sequential:
    """Stage ``p`` of PP=2: a Sequential of its layers, numbered from 0."""
    return nn.Sequential(*list(whole_model())[PER_STAGE * p:PER_STAGE * (p + 1)])


def to_whole_model_names(p: int) -> TopologyMapper:
    """Stage ``p``'s names -> the whole model's: ``"1.weight"`` on stage 1 is ``"3.weight"``."""
    return TopologyMapper(rules=[(r"^(\d+)\.", lambda m: f"{int(m[1]) + PER_STAGE * p}.")])


def _stage_worker(rank: int, world: int, store: str, root: str) -> None:
    """Step 1, on each of the 2 processes: rank ``p`` holds stage ``p``."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        sd = stage(rank).state_dict()  # {"0.weight", "0.bias", "1.weight", "1.bias"} on both stages
        save(sd, os.path.join(root, "pp2"), planner=StandardPlanner(topology_mapper=to_whole_model_names(rank)))
        save({f"stage{rank}": sd}, os.path.join(root, "pp2_staged"))
    finally:
        dist.destroy_process_group()


def check(loaded: dict[str, torch.Tensor], names: TopologyMapper | None = None) -> None:
    expected = whole_model().state_dict()
    for k, v in loaded.items():
        name = names.map_fqn(k) if names is not None else k
        assert torch.equal(v, expected[name]), f"{k}: differs from the whole model's {name}"


def zeros(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in model.state_dict().items()}


def main(root: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = os.path.join(root, "store")
    if os.path.exists(store):
        os.unlink(store)  # a rendezvous file of an earlier run
    tmp.get_context("forkserver").set_forkserver_preload(["torch", "hyper_parallel.core.distributed_checkpoint"])
    tmp.start_processes(_stage_worker, args=(2, store, root), nprocs=2, join=True, start_method="forkserver")
    print("1. PP=2: each stage saved its layers under whole-model names")

    whole = zeros(whole_model())
    load(whole, os.path.join(root, "pp2"), strict="all")  # every key there is asked for
    check(whole)
    print(f"2. PP=1 loaded all {len(whole)} tensors from the PP=2 checkpoint")

    stage1 = zeros(stage(1))
    load(stage1, os.path.join(root, "pp2"), planner=StandardPlanner(topology_mapper=to_whole_model_names(1)))
    check(stage1, to_whole_model_names(1))
    print("3. stage 1 of PP=2 loaded layers 2-3 of the whole model as its layers 0-1")

    # offline the mapper goes source name -> new name: "stage1.0.weight" -> "2.weight"
    rename = [(r"^stage(\d+)\.(\d+)\.", lambda m: f"{PER_STAGE * int(m[1]) + int(m[2])}.")]
    offline_transform(os.path.join(root, "pp2_staged"), os.path.join(root, "pp1"), dst_layout={"dp": 1},
                      topology_mapper=rename, overwrite=True)
    whole = zeros(whole_model())
    load(whole, os.path.join(root, "pp1"), strict="all")
    check(whole)
    print("4. offline_transform renamed stage1.0.weight -> 2.weight (and the rest); PP=1 loaded it")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        os.makedirs(sys.argv[1], exist_ok=True)
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory(prefix="hp_pp_") as d:
            main(d)
