"""DTensor.backward with a plain-tensor gradient: read as this rank's local gradient, as HyperParallel does.

HyperParallel's tests seed a tensor-parallel loss (a ``Partial`` DTensor) with
``loss.backward(torch.tensor(1.0 / tp_size))``; torch passed the plain seed into the backward of
DTensor operators, which refused it ("aten.mm.default got mixed torch.Tensor and DTensor").
"""

from __future__ import annotations

import torch
from multiprocess import run_ranks
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hyper_parallel import SkipDTensorDispatch, fully_shard, init_device_mesh

SEED = 0.5


def _weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x and three weights, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.rand(shape, generator=gen) for shape in ((3, 4), (4, 4), (4, 6), (6, 4)))  # type: ignore[return-value]


def _reference_grads(gradient: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One process: d(sum(x @ w1 @ a @ b)) / d(w1, a, b), times the seed."""
    x, *ws = _weights()
    ws = [w.clone().requires_grad_() for w in ws]
    (x @ ws[0] @ ws[1] @ ws[2]).sum().backward(torch.tensor(SEED) if gradient is None else gradient)
    return [w.grad for w in ws]


class _TpNet(torch.nn.Module):
    """x @ w1 (tp-replicated) @ a (columns split) @ b (rows split), summed: a Partial(sum) loss."""

    def __init__(self, tp) -> None:
        super().__init__()
        _, w1, a, b = _weights()
        self.tp = tp
        self.w1 = torch.nn.Parameter(distribute_tensor(w1, tp, [Replicate()]))
        self.a = torch.nn.Parameter(distribute_tensor(a, tp, [Shard(1)]))
        self.b = torch.nn.Parameter(distribute_tensor(b, tp, [Shard(0)]))

    def forward(self, x: torch.Tensor) -> DTensor:
        x = DTensor.from_local(x, self.tp, [Replicate()])
        return torch.sum(x @ self.w1 @ self.a @ self.b)


def _partial_loss_plain_seed(rank: int, world: int) -> dict:
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = _TpNet(tp)
    loss = model(_weights()[0])
    placements = tuple(loss.placements)
    loss.backward(torch.tensor(SEED))           # HyperParallel's seed: this rank's local gradient
    return {"placements": str(placements), "grads": [p.grad.full_tensor().tolist() for p in model.parameters()]}


def test_a_plain_seed_on_a_partial_loss_gives_the_seed_times_the_gradient():
    want = _reference_grads()
    for out in run_ranks(_partial_loss_plain_seed, 2):
        assert out["placements"] == "(Partial(sum),)"   # the case that failed
        for got, ref in zip(out["grads"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), ref)


def _sharded_output_plain_grad(rank: int, world: int) -> dict:
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x, _, a, _ = _weights()
    a = torch.nn.Parameter(distribute_tensor(a, tp, [Shard(1)]))
    out = DTensor.from_local(x, tp, [Replicate()]) @ a             # (3, 6), Shard(1): (3, 3) here
    full_grad = torch.arange(18.0).reshape(3, 6)
    out.backward(full_grad[:, 3 * rank:3 * rank + 3])             # this rank's columns of the gradient
    wrong = None
    out2 = DTensor.from_local(x, tp, [Replicate()]) @ a
    try:
        out2.backward(full_grad)                                  # the global shape is not this rank's
    except ValueError as exc:
        wrong = str(exc)
    return {"grad": a.grad.full_tensor().tolist(), "wrong": wrong}


def test_a_plain_gradient_of_a_sharded_output_is_this_ranks_shard():
    x, _, a, _ = _weights()
    a = a.clone().requires_grad_()
    (x @ a).backward(torch.arange(18.0).reshape(3, 6))
    for out in run_ranks(_sharded_output_plain_grad, 2):
        torch.testing.assert_close(torch.tensor(out["grad"]), a.grad)
        assert out["wrong"] is not None and "local shape (3, 3)" in out["wrong"] and "(3, 6)" in out["wrong"]


def _fully_shard_tp_train_step(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = _TpNet(mesh["tp"])
    fully_shard(model, mesh=mesh["dp"])
    model.set_reduce_op_type("sum")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    loss = model(_weights()[0])
    loss.backward(torch.tensor(SEED))
    grads = [p.grad.full_tensor().tolist() for p in model.parameters()]
    with SkipDTensorDispatch(no_skip={torch.zeros_like, torch.ones_like}):   # HyperParallel's optimizer step
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"grads": grads, "params": [p.full_tensor().tolist() for p in model.parameters()],
            "state": [type(opt.state[p]["exp_avg"]).__name__ for p in model.parameters()]}


def test_fully_shard_tp_training_step_with_a_plain_seed_matches_one_process():
    want = _reference_grads()
    ref = [torch.nn.Parameter(w.clone()) for w in _weights()[1:]]
    for p, g in zip(ref, want, strict=True):
        p.grad = g
    torch.optim.AdamW(ref, lr=0.1).step()
    for out in run_ranks(_fully_shard_tp_train_step, 2):
        for got, g in zip(out["grads"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), g)
        for got, p in zip(out["params"], ref, strict=True):
            torch.testing.assert_close(torch.tensor(got), p.detach())
        assert out["state"] == ["DTensor"] * 3


def _three_seeds(rank: int, world: int) -> dict:
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = _weights()[0]
    grads = {}
    seeds = {"plain": torch.tensor(SEED), "dtensor": DTensor.from_local(torch.tensor(SEED), tp, [Replicate()]),
             "none": None}
    for name, seed in seeds.items():
        model = _TpNet(tp)
        model(x).backward(seed)
        grads[name] = [p.grad.full_tensor().tolist() for p in model.parameters()]
    return grads


def test_a_dtensor_gradient_or_none_goes_to_torch_and_agrees():
    for out in run_ranks(_three_seeds, 2):
        for plain, dt, none in zip(out["plain"], out["dtensor"], out["none"], strict=True):
            torch.testing.assert_close(torch.tensor(plain), torch.tensor(dt))
            torch.testing.assert_close(torch.tensor(plain), SEED * torch.tensor(none))

