"""Train a small transformer with FSDP2 on CPU (gloo), checkpoint asynchronously, resume.

A :class:`CheckpointManager` owns ``--ckpt-dir``: every ``--save-every`` steps the whole
training state (model, Adam, LR scheduler, RNG states, step, data position: one
:class:`TrainState`) goes to ``<ckpt-dir>/step_NNNNNNNN`` asynchronously (training continues
while a background thread writes it), with the step's loss as a metric. Retention keeps the
newest 2 steps, every 20th and the one with the lowest loss. At start the job resumes from
the newest COMMITTED step there, on however many processes it now has: the checkpoint
reshards on load.

    python examples/train_fsdp.py --nproc 4 --steps 30 --save-every 10 --ckpt-dir /tmp/run
    python examples/train_fsdp.py --nproc 2 --steps 50 --save-every 10 --ckpt-dir /tmp/run  # resumes at 30

The data of a step depends only on the step (a global batch split across data-parallel
ranks), so a resumed run sees exactly the samples an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.nn.functional as F
from torch import nn

from hyper_parallel import fully_shard, init_device_mesh
from hyper_parallel.core.distributed_checkpoint import CheckpointManager, TrainState, list_steps


@dataclass
class Config:
    """Model, data and run settings (small enough for a 2-core CPU)."""

    vocab: int = 96
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 32
    global_batch: int = 16
    lr: float = 3e-3
    warmup: int = 5
    seed: int = 0
    steps: int = 30  # train until this step (inclusive)
    save_every: int = 10
    keep_latest: int = 2  # retention: the newest 2 steps, every 20th, and the lowest loss
    keep_every: int = 20
    keep_best: int = 1
    stop_at: int = 0  # > 0: stop after this step without saving (simulates a crash)
    ckpt_dir: str = "checkpoints"
    pg_timeout_s: float = 120.0


# ------------------------------------------------------------------------------ model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A decoder-only language model: embedding, blocks, final norm, output head."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class SyntheticData:
    """Token sequences with a learnable rule; the batch at ``position`` depends only on it.

    Each sequence is an arithmetic progression modulo ``vocab`` with a random start and
    stride, so the next token follows from the two before it. The global batch of a
    position is the same whatever the number of ranks; each data-parallel rank takes its
    slice. ``position`` is the data position the checkpoint keeps.
    """

    def __init__(self, cfg: Config, dp_rank: int, dp_size: int) -> None:
        if cfg.global_batch % dp_size:
            raise ValueError(f"global batch {cfg.global_batch} does not split over {dp_size} ranks")
        self.cfg, self.dp_rank, self.dp_size, self.position = cfg, dp_rank, dp_size, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.position)
        self.position += 1
        start = torch.randint(0, cfg.vocab, (cfg.global_batch, 1), generator=g)
        stride = torch.randint(1, 8, (cfg.global_batch, 1), generator=g)
        seq = (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab
        per = cfg.global_batch // self.dp_size
        mine = seq[self.dp_rank * per:(self.dp_rank + 1) * per]
        return mine[:, :-1], mine[:, 1:]


def build(cfg: Config, rank: int, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, SyntheticData]:
    """The FSDP2 model (one all-gather unit per block), AdamW, warmup schedule, data."""
    torch.manual_seed(cfg.seed)  # the same full initial weights on every rank
    model = TinyTransformer(cfg)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda e: min(1.0, (e + 1) / cfg.warmup))
    return model, optim, sched, SyntheticData(cfg, rank, world_size)


# ------------------------------------------------------------------------ checkpoints


def manager(cfg: Config) -> CheckpointManager:
    """The job's checkpoints: async saves every ``save_every`` steps, retention, resume."""
    return CheckpointManager(cfg.ckpt_dir, save_interval_steps=cfg.save_every, keep_latest=cfg.keep_latest,
                             keep_every_steps=cfg.keep_every, keep_best=cfg.keep_best, best_metric="loss",
                             async_save=True)


def latest_checkpoint(root: str) -> tuple[int, str] | None:
    """The newest committed step under ``root``: ``(step, path)`` or None (read-only; a step
    counts once its ``.metadata`` is committed, so a save in flight or interrupted does not)."""
    committed = [(i.step, i.path) for i in list_steps(root) if i.state == "committed"] if os.path.isdir(root) else []
    return max(committed) if committed else None


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# --------------------------------------------------------------------------- training


def train(rank: int, world_size: int, cfg: Config) -> dict[str, Any]:
    """One rank's job: resume if a committed checkpoint exists, train, save periodically."""
    model, optim, sched, data = build(cfg, rank, world_size)
    state = TrainState(model, optim, sched, extra={"data_position": data.position})
    report: dict[str, Any] = {"world_size": world_size, "losses": {}, "saves": [], "resumed_from": None}

    with manager(cfg) as mgr:  # every rank: the coordinator lists the directory, all agree
        started = time.perf_counter()
        resumed = mgr.load({"app": state})  # the newest committed step, or None on a fresh start
        if resumed is not None:
            data.position = state.extra["data_position"]
            report["resumed_from"] = {"step": resumed, "path": mgr.step_path(resumed),
                                      "load_s": time.perf_counter() - started, "data_position": data.position,
                                      "lr": sched.get_last_lr()[0], "rng_restored": state.rng_restored}

        for step in range(state.step + 1, cfg.steps + 1):
            tokens, targets = data.next_batch()
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            report["losses"][step] = (mean / world_size).item()
            if cfg.stop_at and step >= cfg.stop_at:
                break  # a "crash": whatever was not committed is lost
            state.step, state.extra["data_position"] = step, data.position
            # saves every save_every steps (and the last one); returns once the state is
            # snapshotted, a background thread writes and commits
            mgr.save(step, {"app": state}, metrics={"loss": report["losses"][step]}, force=step == cfg.steps)
    # leaving the block waited for the save in flight (raising if it failed on any rank)
    report["saves"] = [{"step": t.step, "path": mgr.step_path(t.step), "blocking_s": t.blocking_s,
                        "total_s": t.total_s} for t in mgr.save_timings]
    report["kept"] = mgr.all_steps()
    return report


def _worker(rank: int, world_size: int, cfg: Config, init_file: str, report_file: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # harmless view warning
    warnings.filterwarnings("ignore", message="RNG states were saved by")  # reported as rng_restored
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=cfg.pg_timeout_s))
    try:
        report = train(rank, world_size, cfg)
        if rank == 0:
            with open(report_file, "w") as f:
                json.dump(report, f)
    finally:
        dist.destroy_process_group()


def launch(cfg: Config, nproc: int) -> dict[str, Any]:
    """Run :func:`train` on ``nproc`` gloo processes; return rank 0's report."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "hyper_parallel.core.distributed_checkpoint"])
    scratch = tempfile.mkdtemp(prefix="hp_train_")
    try:
        report_file = os.path.join(scratch, "report.json")
        tmp.start_processes(_worker, args=(nproc, cfg, os.path.join(scratch, "store"), report_file),
                            nprocs=nproc, join=True, start_method="forkserver")
        with open(report_file) as f:
            report = json.load(f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report["losses"] = {int(k): v for k, v in report["losses"].items()}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes (FSDP2 shards)")
    parser.add_argument("--steps", type=int, default=Config.steps, help="train until this step")
    parser.add_argument("--save-every", type=int, default=Config.save_every)
    parser.add_argument("--stop-at", type=int, default=0, help="stop after this step without saving")
    parser.add_argument("--ckpt-dir", default=Config.ckpt_dir)
    args = parser.parse_args()
    cfg = Config(steps=args.steps, save_every=args.save_every, stop_at=args.stop_at, ckpt_dir=args.ckpt_dir)
    report = launch(cfg, args.nproc)
    if report["resumed_from"]:
        r = report["resumed_from"]
        print(f"resumed from {r['path']} (step {r['step']}) in {r['load_s']:.2f}s; "
              f"RNG states {'restored' if r['rng_restored'] else 'kept (different number of processes)'}")
    for step, loss in sorted(report["losses"].items()):
        print(f"step {step:4d}  loss {loss:.4f}")
    print(json.dumps({k: v for k, v in asdict(cfg).items()}, indent=None))
    if math.isnan(report["losses"][max(report["losses"])]):
        raise SystemExit("training diverged")


if __name__ == "__main__":
    main()
