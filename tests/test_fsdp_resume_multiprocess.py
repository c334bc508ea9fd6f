"""Exact training resume with FSDP2, HSDP and TP + FSDP on real gloo ranks.

Each mode trains a small transformer for N steps and saves the whole training state
(:class:`TrainState`: model, Adam, LR scheduler, RNG, step, data position) at step K; a
fresh set of processes (a fresh process group) loads it into a fresh model and optimizer
and trains from K + 1 to N. To keep launches few, one set of fresh processes resumes
under two layouts one after the other (e.g. HSDP, then FSDP).

- Same layout: every loss after resume is bit-identical to the uninterrupted run.
- Different layout (FSDP 4 -> 2 ranks, HSDP -> FSDP, FSDP -> TP + FSDP): losses agree with
  the uninterrupted run within 1e-5 relative (only float summation order changes).
- Right after load, the full (unsharded) parameters and Adam states (exp_avg, exp_avg_sq,
  step) equal those at save time, bit for bit, on every layout.

The data of a step depends only on the step (a global batch, split by data-parallel rank),
so every layout sees the same samples.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multiprocess import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hyper_parallel import fully_shard, init_device_mesh
from hyper_parallel.core.distributed_checkpoint import TrainState, load, save

VOCAB, DIM, HEADS, HIDDEN, LAYERS = 37, 32, 4, 50, 2  # 37 rows and 50 hidden units: uneven shards
SEQ, GLOBAL_BATCH = 8, 8
STEPS, SAVE_AT = 6, 3
REL_TOL = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential()
        self.mlp.w1, self.mlp.act, self.mlp.w2 = nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(att)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class SyntheticData:
    """Batches that depend only on the position (step), split by data-parallel rank; Stateful."""

    def __init__(self, dp_rank: int, dp_size: int) -> None:
        self.dp_rank, self.dp_size, self.position = dp_rank, dp_size, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
        seq = (start * 5 + 3 * torch.arange(SEQ + 1)) % VOCAB  # learnable: next = f(previous)
        per = GLOBAL_BATCH // self.dp_size
        mine = seq[self.dp_rank * per:(self.dp_rank + 1) * per]
        return mine[:, :-1], mine[:, 1:]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.position = sd["position"]


def build(mode: str, rank: int, ws: int) -> tuple[nn.Module, SyntheticData]:
    """The model under ``mode``: "fsdp" (1-D), "hsdp" (2 x ws/2), "tp_fsdp" (dp x tp = 2 x 2)."""
    torch.manual_seed(0)  # the same full initial weights on every rank and layout
    model = TinyLM()
    if mode == "fsdp":
        mesh = dp_mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
        dp_rank, dp_size = rank, ws
    elif mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        dp_mesh, dp_rank, dp_size = mesh, rank, ws
    elif mode == "tp_fsdp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
        dp_mesh, dp_rank, dp_size = mesh["dp"], mesh["dp"].get_local_rank(), 2
        for block in model.blocks:
            parallelize_module(block.mlp, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    else:
        raise ValueError(mode)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model, SyntheticData(dp_rank, dp_size)


def to_numpy(tree: Any) -> Any:
    """Tensors -> numpy arrays, which pickle by value back to the test process."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy().copy()
    if isinstance(tree, dict):
        return {k: to_numpy(v) for k, v in tree.items()}
    return tree


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Unsharded parameters and Adam states on rank 0 (gathered by torch, not by our code)."""
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return to_numpy({"model": msd, "optim": osd["state"] if osd else {}})


def rank_train(rank: int, ws: int, mode: str, path: str, resume: bool) -> dict:
    """Train to STEPS; save at SAVE_AT (fresh run) or first load from ``path`` (resume)."""
    model, data = build(mode, rank, ws)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda e: min(1.0, (e + 1) / 4))
    state = TrainState(model, optim, sched, extra={"data": data})
    out: dict = {"losses": {}}
    if resume:
        torch.manual_seed(12345 + rank)  # an RNG state that the load must replace
        load({"app": state}, checkpoint_id=path)
        out["rng_draw"] = torch.rand(4).tolist()
        out["full"] = full_state(model, optim)
        out["resumed_at"] = (state.step, data.position, sched.last_epoch)
        out["rng_restored"] = state.rng_restored
    for step in range(state.step + 1, STEPS + 1):
        tokens, targets = data.next_batch()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"][step] = (total / ws).item()
        if step == SAVE_AT and not resume:
            state.step = step
            save({"app": state}, checkpoint_id=path)
            out["rng_draw"] = torch.rand(4).tolist()  # what a run resumed from here draws first
            out["full"] = full_state(model, optim)
    return out if rank == 0 else {"losses": out["losses"]}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_training_state(saved: dict, loaded: dict) -> None:
    """Full parameters and Adam states (exp_avg, exp_avg_sq, step) are bit-identical."""
    assert saved["model"].keys() == loaded["model"].keys()
    for k, v in saved["model"].items():
        assert same_bits(v, loaded["model"][k]), f"parameter {k} differs after resume"
    assert saved["optim"] and saved["optim"].keys() == loaded["optim"].keys()
    for fqn, st in saved["optim"].items():
        assert set(st) == {"exp_avg", "exp_avg_sq", "step"}, st.keys()
        for name, v in st.items():
            assert same_bits(v, loaded["optim"][fqn][name]), f"Adam {name} of {fqn} differs after resume"
        assert float(st["step"]) == SAVE_AT


def rank_resume(rank: int, ws: int, path: str, modes: list[str]) -> list[dict]:
    """Resume from ``path`` once per mode, one after another, in this fresh process group."""
    return [rank_train(rank, ws, mode, path, True) for mode in modes]


def train_save_resume(tmp_path_factory: pytest.TempPathFactory, mode: str, resume_modes: list[str]) -> dict:
    """Two launches of 4 ranks: the uninterrupted run (saving at SAVE_AT), then the resumes."""
    path = str(tmp_path_factory.mktemp(mode) / "ckpt")
    reference = run_ranks(rank_train, 4, mode, path, False)[0]
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1))
    assert reference["losses"][STEPS] < reference["losses"][1], "the model should learn"
    resumed = run_ranks(rank_resume, 4, path, resume_modes)[0]
    return {"path": path, "reference": reference, "resumed": dict(zip(resume_modes, resumed, strict=True))}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """FSDP2 on 4 ranks, saved at SAVE_AT; resumed under FSDP2 and under TP + FSDP, 4 ranks."""
    return train_save_resume(tmp_path_factory, "fsdp", ["fsdp", "tp_fsdp"])


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    """HSDP on a (2, 2) mesh, saved at SAVE_AT; resumed under HSDP and under FSDP2."""
    return train_save_resume(tmp_path_factory, "hsdp", ["hsdp", "fsdp"])


@pytest.fixture(scope="module")
def tp_fsdp_run(tmp_path_factory):
    """TP + FSDP on a (2, 2) mesh, saved at SAVE_AT; resumed under TP + FSDP."""
    return train_save_resume(tmp_path_factory, "tp_fsdp", ["tp_fsdp"])


def check_exact_resume(reference: dict, resumed: dict) -> None:
    assert resumed["resumed_at"] == (SAVE_AT, SAVE_AT, SAVE_AT), "step, data position, scheduler"
    assert resumed["rng_restored"] and resumed["rng_draw"] == reference["rng_draw"], "RNG state not restored"
    assert_same_training_state(reference["full"], resumed["full"])
    assert resumed["losses"] == {s: reference["losses"][s] for s in range(SAVE_AT + 1, STEPS + 1)}


def check_close_resume(reference: dict, resumed: dict) -> None:
    assert resumed["resumed_at"] == (SAVE_AT, SAVE_AT, SAVE_AT), "step, data position, scheduler"
    assert_same_training_state(reference["full"], resumed["full"])
    assert sorted(resumed["losses"]) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in resumed["losses"].items():
        assert math.isclose(loss, reference["losses"][step], rel_tol=REL_TOL), (step, loss, reference["losses"][step])


def test_fsdp_resume_on_the_same_four_ranks_is_exact(fsdp_run):
    check_exact_resume(fsdp_run["reference"], fsdp_run["resumed"]["fsdp"])


def test_fsdp_checkpoint_from_four_ranks_resumes_on_two(fsdp_run):
    check_close_resume(fsdp_run["reference"], run_ranks(rank_train, 2, "fsdp", fsdp_run["path"], True)[0])


def test_fsdp_checkpoint_resumes_under_tp_fsdp(fsdp_run):
    check_close_resume(fsdp_run["reference"], fsdp_run["resumed"]["tp_fsdp"])


def test_hsdp_resume_on_the_same_mesh_is_exact(hsdp_run):
    check_exact_resume(hsdp_run["reference"], hsdp_run["resumed"]["hsdp"])


def test_hsdp_checkpoint_resumes_under_fsdp(hsdp_run):
    check_close_resume(hsdp_run["reference"], hsdp_run["resumed"]["fsdp"])


def test_tp_fsdp_resume_on_the_same_mesh_is_exact(tp_fsdp_run):
    check_exact_resume(tp_fsdp_run["reference"], tp_fsdp_run["resumed"]["tp_fsdp"])


def rank_checkpoint_at_step_0(rank: int, ws: int, path: str) -> list[list[float]]:
    """FSDP2 losses of three runs in one process group: no checkpoint; a checkpoint before the
    first step; a fresh job resumed from that checkpoint."""
    runs = []
    for how in ("plain", "save", "resume"):
        model, data = build("fsdp", rank, ws)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        state = TrainState(model, optim, extra={"data": data}, rng=False)
        if how == "save":
            save({"app": state}, checkpoint_id=path)
        elif how == "resume":
            load({"app": state}, checkpoint_id=path)
        losses = []
        for _ in range(3):
            tokens, targets = data.next_batch()
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            optim.step()
            optim.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
        runs.append(losses)
    return runs


def test_an_fsdp2_checkpoint_before_the_first_step_changes_no_training(tmp_path):
    """torch's get_state_dict gives a never-stepped AdamW the state of one step; it no longer
    stays in the optimizer or in the checkpoint (losses were 0.6146 against 0.5936)."""
    plain, saved, resumed = run_ranks(rank_checkpoint_at_step_0, 2, str(tmp_path / "step0"))[0]
    assert saved == plain and resumed == plain


def rank_two_optimizers_one_fresh(rank: int, ws: int) -> float:
    """FSDP2, two optimizers: the head's has stepped, the body's has not; the state dict is
    gathered (full_state_dict: copies of the states). Resuming must step the body's optimizer
    as a fresh one does."""
    from hyper_parallel.core.distributed_checkpoint import get_train_state_dict, set_train_state_dict

    options = StateDictOptions(full_state_dict=True)

    def build() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        for part in (model[0], model[1], model):
            fully_shard(part)
        return (model, torch.optim.Adam(model[0].parameters(), lr=1e-2, weight_decay=0.1),
                torch.optim.Adam(model[1].parameters(), lr=1e-2))

    def step_body(model: nn.Module, body: torch.optim.Optimizer) -> torch.Tensor:
        torch.manual_seed(1)
        model(torch.randn(4, 8)).sum().backward()
        body.step()
        return model[0].weight.full_tensor()

    model, body, head = build()
    torch.manual_seed(2)
    model(torch.randn(4, 8)).sum().backward()
    head.step()
    for p in model.parameters():
        p.grad = None
    sd = get_train_state_dict(model, [body, head], options=options)
    resumed_model, resumed_body, resumed_head = build()
    get_train_state_dict(resumed_model, [resumed_body, resumed_head], options=options)
    set_train_state_dict(resumed_model, [resumed_body, resumed_head], sd, options=options)
    fresh_model, fresh_body, fresh_head = build()
    set_train_state_dict(fresh_model, [fresh_body, fresh_head], sd, options=options)
    fresh_body.state.clear()
    return float((step_body(resumed_model, resumed_body) - step_body(fresh_model, fresh_body)).abs().max())


def test_a_never_stepped_optimizer_beside_a_stepped_one_resumes_fresh_from_gathered_states():
    # only the tensors the fresh optimizer itself held were zeroed; full_state_dict gives copies
    assert run_ranks(rank_two_optimizers_one_fresh, 2) == [0.0, 0.0]
