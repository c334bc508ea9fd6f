"""Real clients, unchanged: the DCP call sequences of widely used training code, run with
ours imported where the client has ``import torch.distributed.checkpoint as dcp`` (issue 32,
issue 44 item 9).

Each sequence is copied from the client's own code (named in each test) and runs on 2 real
gloo ranks with an FSDP2 model and AdamW. A run saves with one implementation and resumes
with another, ``(save, load)``: ``torch->torch`` proves the sequence itself is right;
``ours->ours`` is the drop-in; ``torch->ours`` resumes with ours from a checkpoint stock torch
wrote in its own format (pickled ``.metadata``, read directly: no conversion, no
``trust=True``); and where the client builds its own writer, ``ours-torch-format->torch``
writes torch's format through ours' documented switch (``TorchFormatWriter``) for stock torch
to resume from. The values the fresh model and optimizer hold after the load are compared bit
for bit with those at save time, and a further training step on the saved and the restored
state must give the same loss, bit for bit.

``ours`` resolves every ``torch.distributed.checkpoint`` module a client imports
(``default_planner``, ``stateful``, ``staging``, ``state_dict_saver``, ``format_utils``,
``state_dict_loader``) to ours of the same name; ``torch.distributed.checkpoint.state_dict``
(the model/optimizer side: FSDP state dicts) stays torch's, as it does for a user who swaps only
the checkpoint import.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import sys
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multiprocess import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

OURS_TORCH_FORMAT = "ours-torch-format"  # ours, writing torch's own format through TorchFormatWriter
MODULES = {"torch": "torch.distributed.checkpoint", "ours": "hyper_parallel.core.distributed_checkpoint",
           OURS_TORCH_FORMAT: "hyper_parallel.core.distributed_checkpoint"}
VOCAB, DIM, HIDDEN, SEQ = 37, 16, 50, 8  # 37 and 50 rows: uneven FSDP shards on 2 ranks
WS = 2
ACCELERATE_DIRS = ("pytorch_model_fsdp_0", "optimizer_0")  # where accelerate puts model and optimizer


def dcp_for(impl: str) -> Any:
    """The module a client gets from ``import torch.distributed.checkpoint as dcp``."""
    return importlib.import_module(MODULES[impl])


def face(impl: str, name: str) -> Any:
    """The module a client gets from ``from torch.distributed.checkpoint.<name> import ...``."""
    return importlib.import_module(f"{MODULES[impl]}.{name}")


# ---------------------------------------------------------------------------- model, data


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        return self.head(x + self.down(F.gelu(self.up(x))))


def build(ws: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model (per-layer and root ``fully_shard``) and its AdamW; ``seed`` sets the init."""
    torch.manual_seed(seed)
    model = TinyNet()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    for layer in (model.up, model.down):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, ws: int) -> float:
    """One step on this rank's part of the step's global batch (depends only on ``step``)."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (2 * ws, SEQ + 1), generator=g)[2 * rank:2 * rank + 2]
    loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def snapshot(tree: Any) -> Any:
    """Full values (DTensors gathered) as (dtype, shape, raw bytes): picklable, compared bit-exact."""
    if isinstance(tree, DTensor):
        tree = tree.full_tensor()
    if isinstance(tree, torch.Tensor):
        t = tree.detach().cpu().contiguous()
        return ("tensor", str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(tree, dict):
        return {k: snapshot(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [snapshot(v) for v in tree]
    return tree


def training_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": snapshot(model.state_dict()), "optimizer": snapshot(get_optimizer_state_dict(model, opt))}


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal structure and values; tensors equal in dtype, shape and every bit."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: expected a dict, got {type(got).__name__}"
        assert sorted(map(str, got)) == sorted(map(str, want)), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, tuple) and want and want[0] == "tensor":
        assert isinstance(got, tuple) and got[:3] == want[:3], f"{where}: {got[:3]} != {want[:3]}"
        assert got[3] == want[3], f"{where}: the values differ"
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def written_by(path: str) -> str:
    """Which format the checkpoint at ``path`` is in: ours seals a JSON ``.metadata``, torch pickles it."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return "ours" if b'"format":"hyper-parallel-dcp"' in f.read(4096) else "torch"


def run_name(save: str, load: str) -> str:
    return f"{save}->{load}"


def check(results: list[dict[str, Any]]) -> None:
    """Every rank and run: restored == saved, the next loss is equal, and the checkpoint is in the
    format its saver writes (torch's for ``torch`` and ``ours-torch-format``)."""
    for rank, out in enumerate(results):
        for name, run in out.items():
            save = name.split("->")[0]
            assert_same(run["loaded"], run["saved"], f"rank {rank} {name}: loaded vs saved")
            assert run["next_loss"][0] == run["next_loss"][1], f"rank {rank} {name}: {run['next_loss']}"
            fmt = "ours" if save == "ours" else "torch"
            assert set(run["written_by"]) == {fmt}, f"rank {rank} {name}: written by {run['written_by']}"


def ours_lacks(*names: str) -> bool:
    """Whether ours lacks one of ``names`` (a face module, or a public name of the package)."""
    ours = importlib.import_module(MODULES["ours"])
    return any(importlib.util.find_spec(f"{MODULES['ours']}.{n}") is None if n.islower() else not hasattr(ours, n)
               for n in names)


def pairs(*extra: tuple[str, str], ours_fails_with: str | None = None, until: tuple[str, ...] = ()) -> list[Any]:
    """The ``(save, load)`` pairs a client runs: torch's module alone, ours alone, ours resuming from
    a checkpoint stock torch wrote, and ``extra``. Pairs with ours are marked xfail (not strict)
    with the error it gives while the pieces named in ``until`` are missing; once they exist, ours
    must pass."""
    marks = [pytest.mark.xfail(ours_lacks(*until), strict=False, reason=ours_fails_with)] if ours_fails_with else []
    return [pytest.param(p, id=run_name(*p), marks=marks if "ours" in run_name(*p) else [])
            for p in (("torch", "torch"), ("ours", "ours"), ("torch", "ours"), *extra)]


# ---------------------------------------------------------------------------- (a) accelerate


def accelerate_sequence(rank: int, ws: int, root: str, runs: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """accelerate 1.15 ``utils/fsdp_utils.py``, FSDP2 + SHARDED_STATE_DICT, as written there:
    save_fsdp_model / save_fsdp_optimizer, then load_fsdp_model / load_fsdp_optimizer. The client
    builds its writer (``dist_cp.FileSystemWriter(ckpt_dir)``); ``ours-torch-format`` builds ours'
    ``filesystem.TorchFormatWriter`` there instead, the one name a team changes to write torch's format."""
    out = {}
    for save, load in runs:
        dist_cp, save_planners = dcp_for(save), face(save, "default_planner")
        writer = face(save, "filesystem").TorchFormatWriter if save == OURS_TORCH_FORMAT else dist_cp.FileSystemWriter
        output_dir = os.path.join(root, f"{save}-{load}")
        # _prepare_sd_options for SHARDED_STATE_DICT (the plugin's default offload_to_cpu=True)
        sd_options = StateDictOptions(full_state_dict=False, cpu_offload=True, broadcast_from_rank0=False)
        model, opt = build(ws, seed=0)
        for step in range(2):
            train_step(model, opt, step, rank, ws)
        saved = training_state(model, opt)

        # save_fsdp_model
        state_dict = get_model_state_dict(model, options=sd_options)
        ckpt_dir = os.path.join(output_dir, "pytorch_model_fsdp_0")
        os.makedirs(ckpt_dir, exist_ok=True)
        dist_cp.save(state_dict={"model": state_dict}, storage_writer=writer(ckpt_dir),
                     planner=save_planners.DefaultSavePlanner())
        # save_fsdp_optimizer
        optim_state = get_optimizer_state_dict(model, opt, options=sd_options)
        ckpt_dir = os.path.join(output_dir, "optimizer_0")
        os.makedirs(ckpt_dir, exist_ok=True)
        dist_cp.save(state_dict={"optimizer": optim_state}, storage_writer=writer(ckpt_dir),
                     planner=save_planners.DefaultSavePlanner())

        dist_cp, planners = dcp_for(load), face(load, "default_planner")  # the resumed job's import
        fresh, fresh_opt = build(ws, seed=1)
        # load_fsdp_model
        dist.barrier()
        ckpt_dir = os.path.join(output_dir, "pytorch_model_fsdp_0")
        state_dict = {"model": get_model_state_dict(fresh, options=sd_options)}
        dist_cp.load(state_dict=state_dict, storage_reader=dist_cp.FileSystemReader(ckpt_dir),
                     planner=planners.DefaultLoadPlanner())
        set_model_state_dict(fresh, state_dict["model"], options=sd_options)
        dist.barrier()
        # load_fsdp_optimizer
        dist.barrier()
        ckpt_dir = os.path.join(output_dir, "optimizer_0")
        optim_state = {"optimizer": get_optimizer_state_dict(fresh, fresh_opt, options=sd_options)}
        dist_cp.load(state_dict=optim_state, storage_reader=dist_cp.FileSystemReader(ckpt_dir),
                     planner=planners.DefaultLoadPlanner())
        set_optimizer_state_dict(fresh, fresh_opt, optim_state["optimizer"], options=sd_options)
        dist.barrier()

        loaded = training_state(fresh, fresh_opt)
        next_loss = (train_step(model, opt, 2, rank, ws), train_step(fresh, fresh_opt, 2, rank, ws))
        out[run_name(save, load)] = {"saved": saved, "loaded": loaded, "next_loss": next_loss,
                                     "written_by": [written_by(os.path.join(output_dir, d)) for d in ACCELERATE_DIRS]}
    return out


@pytest.mark.parametrize("pair", pairs(
    (OURS_TORCH_FORMAT, "torch"),
    ours_fails_with="ModuleNotFoundError: No module named 'hyper_parallel.core.distributed_checkpoint.default_planner'",
    until=("default_planner",)))
def test_accelerate_style_fsdp2_model_and_optimizer(tmp_path, pair):
    """accelerate's sharded save/load: ``dist_cp.save(state_dict=..., storage_writer=
    dist_cp.FileSystemWriter(d), planner=DefaultSavePlanner())`` and the matching load; also ours
    writing torch's format (``TorchFormatWriter``) for stock torch to resume from."""
    check(run_ranks(accelerate_sequence, WS, str(tmp_path), (pair,), timeout_s=180))


# ---------------------------------------------------------------------------- (c) Lightning


def lightning_consolidate(impl: str, checkpoint_folder: str) -> dict[str, Any]:
    """Lightning Fabric's consolidation helper (``strategies/fsdp.py`` ``_load_distributed_checkpoint``,
    run by ``utilities/consolidate_checkpoint.py`` in one process): the whole sharded checkpoint
    into an empty dict, then Fabric's ``meta.pt`` merged in."""
    FileSystemReader = dcp_for(impl).FileSystemReader  # noqa: N806 (the client's imported name)
    _EmptyStateDictLoadPlanner = face(impl, "format_utils")._EmptyStateDictLoadPlanner  # noqa: N806
    _load_state_dict = face(impl, "state_dict_loader")._load_state_dict
    checkpoint: dict[str, Any] = {}
    _load_state_dict(checkpoint, storage_reader=FileSystemReader(checkpoint_folder),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    extra_file = os.path.join(checkpoint_folder, "meta.pt")
    checkpoint.update(torch.load(extra_file, map_location="cpu") if os.path.isfile(extra_file) else {})
    return checkpoint


def lightning_sequence(rank: int, ws: int, root: str, runs: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """Lightning Fabric ``strategies/model_parallel.py`` (FSDP2): ``_save_checkpoint`` and
    ``_load_checkpoint`` of a sharded checkpoint; ``_distributed_checkpoint_save/_load`` are
    ``save(converted_state, checkpoint_id=path)`` / ``load(module_state, checkpoint_id=path)``.
    Then rank 0 consolidates the checkpoint as Lightning's helper does."""
    out = {}
    for save, load in runs:
        dcp = dcp_for(save)
        path = os.path.join(root, f"{save}-{load}", "epoch=0-step=2.ckpt")
        model, opt = build(ws, seed=0)
        for step in range(2):
            train_step(model, opt, step, rank, ws)
        saved = training_state(model, opt)

        # _save_checkpoint(path, state={"model": model, "optimizer": opt, "step": 2}, full_state_dict=False)
        options = StateDictOptions(full_state_dict=False, cpu_offload=True)
        converted_state = {"model": get_model_state_dict(model, options=options),
                           "optimizer": get_optimizer_state_dict(model, opt, options=options)}
        metadata = {"step": 2}
        os.makedirs(path, exist_ok=True)
        dcp.save(converted_state, checkpoint_id=path)
        if rank == 0:
            torch.save(metadata, os.path.join(path, "meta.pt"))
        dist.barrier()

        # _load_checkpoint(path, state={"model": fresh, "optimizer": fresh_opt, "step": 0})
        dcp = dcp_for(load)  # the resumed job's import
        fresh, fresh_opt = build(ws, seed=1)
        module_state = {"model": get_model_state_dict(fresh)}
        dcp.load(module_state, checkpoint_id=path)
        fresh.load_state_dict(module_state["model"], strict=True)
        optim_state = {"optimizer": get_optimizer_state_dict(fresh, fresh_opt)}
        dcp.load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(fresh, fresh_opt, optim_state_dict=optim_state["optimizer"],
                                 options=StateDictOptions(cpu_offload=True))
        assert torch.load(os.path.join(path, "meta.pt")) == metadata

        loaded = training_state(fresh, fresh_opt)
        next_loss = (train_step(model, opt, 2, rank, ws), train_step(fresh, fresh_opt, 2, rank, ws))
        consolidated = snapshot(lightning_consolidate(load, path)) if rank == 0 else None
        dist.barrier()
        out[run_name(save, load)] = {"saved": saved, "loaded": loaded, "next_loss": next_loss,
                                     "written_by": [written_by(path)], "consolidated": consolidated}
    return out


@pytest.mark.parametrize("pair", pairs())
def test_lightning_style_checkpoint_id(tmp_path, pair):
    """Lightning's ``save(state, checkpoint_id=path)`` / ``load(state, checkpoint_id=path)``, with
    its own ``meta.pt`` written into the checkpoint directory beside DCP's files; its consolidation
    helper gives the full saved model and optimizer state and ``meta.pt``'s entries."""
    results = run_ranks(lightning_sequence, WS, str(tmp_path), (pair,), timeout_s=180)
    check(results)
    for name, run in results[0].items():
        assert_same(run["consolidated"], {**run["saved"], "step": 2}, f"rank 0 {name}: consolidated vs saved")


# ---------------------------------------------------------------------------- (b) torchtitan


def titan_components(stateful: type) -> tuple[type, ...]:
    """torchtitan's Stateful wrappers (``components/checkpointer/base.py``, ``optimizer.py``,
    ``lr_scheduler.py``, ``data/loader.py``, ``trainer.py``), trimmed to what DCP sees; each
    subclasses the ``Stateful`` of the implementation under test, as torchtitan's do."""

    class ModelWrapper(stateful):
        def __init__(self, model: nn.Module) -> None:
            self.model = [model]

        def state_dict(self) -> dict[str, Any]:
            return {k: v for m in self.model for k, v in m.state_dict().items()}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            for m in self.model:  # strict=False: the flattened dict also holds non-model keys
                m.load_state_dict(state_dict, strict=False)

    class OptimizersContainer(stateful):
        options = StateDictOptions(flatten_optimizer_state_dict=True)

        def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
            self.model, self.opt = model, opt

        def state_dict(self) -> dict[str, Any]:
            return get_optimizer_state_dict(self.model, self.opt, options=self.options)

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            set_optimizer_state_dict(self.model, self.opt, optim_state_dict=state_dict, options=self.options)

    class LRSchedulersContainer(stateful):
        def __init__(self, schedulers: list[Any]) -> None:
            self.schedulers = schedulers

        def state_dict(self) -> dict[str, Any]:
            return {"last_epoch": self.schedulers[0].last_epoch}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            for s in self.schedulers:
                s.last_epoch = state_dict["last_epoch"]

    class DataLoader(stateful):  # one key per data-parallel rank, as torchtitan's loader has
        def __init__(self, dp_rank: int, dp_world_size: int) -> None:
            self.rank_id, self.dp_world_size, self.next_index = f"dp_rank_{dp_rank}", dp_world_size, 0

        def state_dict(self) -> dict[str, Any]:
            return {"version": 1, "dp_world_size": self.dp_world_size, self.rank_id: {"next_index": self.next_index}}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            assert state_dict["version"] == 1 and state_dict["dp_world_size"] == self.dp_world_size, state_dict
            self.next_index = state_dict[self.rank_id]["next_index"]

    class TrainState(stateful):
        def __init__(self) -> None:
            self.step, self.ntokens_seen = 0, 0

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step, "ntokens_seen": self.ntokens_seen}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]

    return ModelWrapper, OptimizersContainer, LRSchedulersContainer, DataLoader, TrainState


class Trainer:
    """The objects of a torchtitan run and its ``states`` dict; ``step()`` is one training step."""

    def __init__(self, impl: str, rank: int, ws: int, seed: int) -> None:
        model_wrapper, optimizers, schedulers, data_loader, train_state = titan_components(
            face(impl, "stateful").Stateful)
        self.rank, self.ws = rank, ws
        self.model, self.opt = build(ws, seed)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + s))
        self.states = {"train_state": train_state(), "model": model_wrapper(self.model),
                       "optimizer": optimizers(self.model, self.opt), "dataloader": data_loader(rank, ws),
                       "lr_scheduler": schedulers([self.scheduler])}

    def step(self) -> float:
        ts, dl = self.states["train_state"], self.states["dataloader"]
        ts.step += 1
        loss = train_step(self.model, self.opt, dl.next_index, self.rank, self.ws)
        dl.next_index += 1
        ts.ntokens_seen += 2 * SEQ
        self.scheduler.step()
        return loss

    def flattened(self, states: dict[str, Any] | None = None) -> dict[str, Any]:
        """CheckpointManager._flattened_model_states_sd: model entries at the top level."""
        states = self.states if states is None else states
        sd = {k: v for k, v in states.items() if k != "model"}
        sd.update(states["model"].state_dict())
        return sd

    def values(self) -> dict[str, Any]:
        return {k: snapshot(v.state_dict()) for k, v in self.states.items()}


def to_hf(sd: dict[str, Any]) -> dict[str, Any]:
    """A state-dict adapter's ``to_hf``: HF names for the model's keys."""
    return {f"model.{k}": v for k, v in sd.items()}


def from_hf(sd: dict[str, Any]) -> dict[str, Any]:
    return {k.removeprefix("model."): v for k, v in sd.items()}


def find_load_step(folder: str) -> int:
    """CheckpointManager._find_load_step: the highest step-N holding .metadata or an HF index."""
    steps = [int(name.split("-")[1]) for name in os.listdir(folder) if name.startswith("step-")
             and (os.path.isfile(os.path.join(folder, name, ".metadata"))
                  or os.path.isfile(os.path.join(folder, name, "model.safetensors.index.json")))]
    return max(steps, default=-1)


def torchtitan_sequence(rank: int, ws: int, root: str, runs: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """torchtitan ``components/checkpointer/dcp.py`` (CheckpointManager), interval 2, 3 steps:
    step 2 saved with ``async_mode="async_with_pinned_mem"`` (``dcp.async_save`` with
    ``AsyncCheckpointerType.PROCESS`` and a ``DefaultStager``; staging awaited before the next
    step, the upload before the next save), the last step model-only in HF safetensors
    (``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``). Then a
    fresh run resumes from step 2 with ``DefaultLoadPlanner(allow_partial_load=True)`` and a
    state the checkpoint lacks, and a third loads the HF step as ``initial_load_in_hf`` does; the
    restarted jobs import ``load``'s module."""
    from safetensors.torch import load_file

    out = {}
    for save, load in runs:
        dcp, staging, saver = dcp_for(save), face(save, "staging"), face(save, "state_dict_saver")
        folder = os.path.join(root, f"{save}-{load}", "checkpoint")
        pg = dist.new_group(backend="gloo")
        run = Trainer(save, rank, ws, seed=0)
        losses = [run.step() for _ in range(2)]
        saved = run.values()

        # _save(2): async_with_pinned_mem (pinned memory needs an accelerator; this box has none)
        stager = staging.DefaultStager(staging.StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                              use_async_staging=True, use_non_blocking_copy=False))
        result = dcp.async_save(run.flattened(), storage_writer=None, checkpoint_id=os.path.join(folder, "step-2"),
                                process_group=pg, async_checkpointer_type=saver.AsyncCheckpointerType.PROCESS,
                                async_stager=stager)
        staging_future, save_future = result.staging_completion, result.upload_completion
        staging_future.result()  # maybe_wait_for_staging, before the next optimizer step
        losses.append(run.step())  # step 3 changes every parameter after the snapshot
        save_future.result()  # maybe_wait_for_saving, before the next save
        # _save_last_step(3): last_save_model_only, last_save_in_hf, export dtype float32
        last = snapshot(run.states["model"].state_dict())
        writer = dcp.HuggingFaceStorageWriter(path=os.path.join(folder, "step-3"), save_distributed=True,
                                              fqn_to_index_mapping=None, enable_consolidation=True)
        dcp.save(to_hf(run.states["model"].state_dict()), storage_writer=writer, checkpoint_id=None)
        stager.close()
        dist.barrier()

        # A restarted job: _load(step=2) into fresh objects, plus a state the checkpoint lacks.
        assert find_load_step(folder) in (2, 3), os.listdir(folder)
        dcp, planners = dcp_for(load), face(load, "default_planner")
        resumed = Trainer(load, rank, ws, seed=1)
        resumed.states["ema"] = {"shadow": torch.full((3,), 7.0)}
        sd = resumed.flattened()
        dcp.load(sd, checkpoint_id=os.path.join(folder, "step-2"),
                 planner=planners.DefaultLoadPlanner(allow_partial_load=True))
        resumed.states["model"].load_state_dict(sd)
        assert torch.equal(sd["ema"]["shadow"], torch.full((3,), 7.0)), sd["ema"]
        loaded = {k: snapshot(v.state_dict()) for k, v in resumed.states.items() if k != "ema"}
        next_loss = (losses[2], resumed.step())

        # initial_load_in_hf: dcp_load(from_hf=True) of the last step into a fresh model
        hf_run = Trainer(load, rank, ws, seed=2)
        hf_sd = to_hf(hf_run.states["model"].state_dict())
        dcp.load(hf_sd, storage_reader=dcp.HuggingFaceStorageReader(os.path.join(folder, "step-3")))
        hf_run.states["model"].load_state_dict(from_hf(hf_sd))
        hf_files = {}
        for f in sorted(glob.glob(os.path.join(folder, "step-3", "*.safetensors"))):
            hf_files.update(load_file(f))
        out[run_name(save, load)] = {"saved": saved, "loaded": loaded, "next_loss": next_loss,
                                     "written_by": [written_by(os.path.join(folder, "step-2"))],
                                     "last": last, "hf_loaded": snapshot(hf_run.states["model"].state_dict()),
                                     "hf_files": snapshot(from_hf(hf_files))}
    return out


@pytest.mark.parametrize("pair", pairs(
    ours_fails_with="ModuleNotFoundError: No module named 'hyper_parallel.core.distributed_checkpoint."
    "default_planner'; then UnsupportedValueError: async_stager=<DefaultStager>: torch DCP's stagers are not "
    "supported; then AttributeError: module 'hyper_parallel.core.distributed_checkpoint' has no attribute "
    "'HuggingFaceStorageWriter'",
    until=("default_planner", "HuggingFaceStorageWriter")))
def test_torchtitan_style_manager(tmp_path, pair):
    """torchtitan's CheckpointManager sequence; the consolidated HF files hold the last step's
    full tensors, and loading them through ``HuggingFaceStorageReader`` restores them."""
    results = run_ranks(torchtitan_sequence, WS, str(tmp_path), (pair,), timeout_s=240)
    check(results)
    for rank, out in enumerate(results):
        for name, run in out.items():
            assert_same(run["hf_loaded"], run["last"], f"rank {rank} {name}: HF load vs last step")
            assert_same(run["hf_files"], run["last"], f"rank {rank} {name}: HF files vs last step")


# ---------------------------------------------------------------------------- accelerate's own code


@contextmanager
def torch_dcp_resolves_to(module: Any):
    """While active, ``import torch.distributed.checkpoint as dist_cp`` gives ``module``.

    accelerate imports DCP inside each function body, so the name is looked up at call time:
    ``import a.b.c as x`` takes ``sys.modules["a.b.c"]`` if present and then the attribute
    ``c`` of ``a.b``; both are pointed at ``module`` and restored afterwards. Submodule imports
    (``from torch.distributed.checkpoint.default_planner import DefaultSavePlanner``) still
    find torch's modules in ``sys.modules``, so accelerate hands torch's planner objects to
    ours, as a user who swaps only the package would. ``import torch.distributed.checkpoint.
    format_utils as m`` (``merge_fsdp_weights``) finds torch's ``format_utils`` in ``sys.modules``
    and takes the attribute of ``module``; both are imported first, so that the swapped package is
    never asked to import a submodule under torch's name (a second copy of it).
    """
    name = "torch.distributed.checkpoint"
    for sub in ("format_utils",):
        importlib.import_module(f"{name}.{sub}")
        importlib.import_module(f"{module.__name__}.{sub}")
    before = sys.modules[name]
    sys.modules[name] = module
    try:
        with mock.patch.object(torch.distributed, "checkpoint", module):
            yield
    finally:
        sys.modules[name] = before


def accelerate_functions(rank: int, ws: int, root: str, runs: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """accelerate 1.15's own save_fsdp_model / save_fsdp_optimizer / load_fsdp_model /
    load_fsdp_optimizer with a real ``Accelerator`` and ``FullyShardedDataParallelPlugin``
    (fsdp_version=2, SHARDED_STATE_DICT); the model is FSDP2-sharded by ``fully_shard``
    directly, as accelerate's own FSDP2 preparation needs a GPU. Then ``merge_fsdp_weights`` of
    the model's checkpoint into one safetensors file, as accelerate's CLI ``merge-weights`` does."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_WORLD_SIZE=str(ws))
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import (
        load_fsdp_model,
        load_fsdp_optimizer,
        merge_fsdp_weights,
        save_fsdp_model,
        save_fsdp_optimizer,
    )
    from safetensors.torch import load_file

    accelerator = Accelerator(cpu=True)  # joins the process group already set up
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    out = {}
    for save, load in runs:
        output_dir = os.path.join(root, f"{save}-{load}")
        model, opt = build(ws, seed=0)
        for step in range(2):
            train_step(model, opt, step, rank, ws)
        saved = training_state(model, opt)
        fresh, fresh_opt = build(ws, seed=1)
        with torch_dcp_resolves_to(dcp_for(save)):
            save_fsdp_model(plugin, accelerator, model, output_dir)
            save_fsdp_optimizer(plugin, accelerator, opt, model, output_dir)
        with torch_dcp_resolves_to(dcp_for(load)):
            load_fsdp_model(plugin, accelerator, fresh, output_dir)
            load_fsdp_optimizer(plugin, accelerator, fresh_opt, fresh, output_dir)
            merged = os.path.join(output_dir, "merged")
            merge_fsdp_weights(os.path.join(output_dir, ACCELERATE_DIRS[0]), merged)
        loaded = training_state(fresh, fresh_opt)
        next_loss = (train_step(model, opt, 2, rank, ws), train_step(fresh, fresh_opt, 2, rank, ws))
        out[run_name(save, load)] = {
            "saved": saved, "loaded": loaded, "next_loss": next_loss,
            "written_by": [written_by(os.path.join(output_dir, d)) for d in ACCELERATE_DIRS],
            "merged": snapshot(load_file(os.path.join(merged, "model.safetensors"))) if rank == 0 else None}
    return out


@pytest.mark.parametrize("pair", pairs(
    ours_fails_with="UnsupportedValueError: planner=DefaultSavePlanner(): torch.distributed.checkpoint's planners "
    "do not fit this library's planner protocol; pass StandardPlanner() (or a subclass of it) instead",
    until=("default_planner",)))
def test_accelerate_own_functions(tmp_path, pair):
    """accelerate's own FSDP checkpoint functions, unchanged, with ``dist_cp`` resolving to ours;
    ``merge_fsdp_weights`` writes the full saved model."""
    pytest.importorskip("accelerate")
    results = run_ranks(accelerate_functions, WS, str(tmp_path), (pair,), timeout_s=180)
    check(results)
    for name, run in results[0].items():
        assert_same(run["merged"], run["saved"]["model"], f"rank 0 {name}: merged vs saved model")
