"""TrainState and the training-state helpers: model, optimizer, scheduler, RNG, step, data position.

One-process tests (no process group) plus one 2-rank launch for per-rank RNG states. The
multi-rank FSDP2/HSDP/TP resume tests are in tests/test_fsdp_resume_multiprocess.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from multiprocess import run_ranks
from torch import nn

from hyper_parallel.core.distributed_checkpoint import (
    StateDictMismatchError,
    TrainState,
    get_train_state_dict,
    load,
    load_rng_state_dict,
    rng_state_dict,
    save,
    set_train_state_dict,
)


class Position:
    """A Stateful data position, as a sampler or data loader would have."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, sd: dict) -> None:
        self.index = sd["index"]


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda e: min(1.0, (e + 1) / 10))
    return model, optim, sched


def train_step(model: nn.Module, optim: torch.optim.Optimizer, sched: object, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optim.step()
    sched.step()
    optim.zero_grad()
    return loss.item()


def draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist()


def trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model, optim, sched = make()
    for step in range(1, steps + 1):
        train_step(model, optim, sched, step)
    return model, optim, sched


def test_a_fresh_model_and_never_stepped_optimizer_resume_exactly(tmp_path):
    model, optim, sched = trained(3)
    state = TrainState(model, optim, sched, step=3)
    save({"app": state}, tmp_path / "ckpt")
    expected = [train_step(model, optim, sched, s) for s in (4, 5, 6)]

    model2, optim2, sched2 = make(seed=1)  # other weights; Adam has no state yet
    assert not optim2.state
    state2 = TrainState(model2, optim2, sched2)
    load({"app": state2}, tmp_path / "ckpt")
    assert state2.step == 3
    assert [train_step(model2, optim2, sched2, s) for s in (4, 5, 6)] == expected


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),  # mu_product is not zero after torch's step
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.5),
}


def _run(kind: str, saves_at_0: str | None, resume_from: str | None, steps: int = 4) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    optim = OPTIMIZERS[kind](model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda e: 1.0)
    if resume_from:
        load({"app": TrainState(model, optim, sched, rng=False)}, resume_from)
    if saves_at_0:
        save({"app": TrainState(model, optim, sched, rng=False)}, saves_at_0)
    return [train_step(model, optim, sched, s) for s in range(1, steps + 1)]


def test_a_checkpoint_before_the_first_step_with_flattened_optimizer_keys(tmp_path):
    # torchtitan's flatten_optimizer_state_dict=True: "state.<fqn>.step" keys were not zeroed
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions(flatten_optimizer_state_dict=True)

    def run(save_to=None, resume_from=None):
        torch.manual_seed(0)
        model = nn.Linear(6, 3)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda e: 1.0)
        if resume_from:
            load({"app": TrainState(model, optim, rng=False, options=options)}, resume_from)
        if save_to:
            save({"app": TrainState(model, optim, rng=False, options=options)}, save_to)
        return [train_step(model, optim, sched, s) for s in (1, 2, 3)]

    plain = run()
    ckpt = str(tmp_path / "step0")
    assert run(save_to=ckpt) == plain
    assert run(resume_from=ckpt) == plain


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_checkpoint_before_the_first_step_changes_no_training(tmp_path, kind):
    """torch's get_state_dict steps a never-stepped optimizer (zero gradients, lr 0) to give it a
    state; that state (Adam's step 1) used to stay, so saving at step 0 changed every later step,
    and resuming from that checkpoint did too."""
    plain = _run(kind, None, None)
    ckpt = str(tmp_path / "step0")
    assert _run(kind, ckpt, None) == plain
    assert _run(kind, None, ckpt) == plain


class EagerMomentum(torch.optim.Optimizer):
    """An optimizer that makes its state in __init__, not at its first step."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["buf"] = torch.zeros_like(p)

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state[p]["buf"]
                buf.mul_(0.9).add_(p.grad)
                p.data.add_(buf, alpha=-group["lr"])


def test_an_optimizer_with_state_from_its_constructor_keeps_it_through_a_resume(tmp_path):
    # its all-zero state was taken for "never stepped" and dropped on load: KeyError at step()
    model = nn.Linear(3, 2)
    save({"app": TrainState(model, EagerMomentum(model.parameters()), rng=False)}, tmp_path / "ckpt")
    model2 = nn.Linear(3, 2)
    optim2 = EagerMomentum(model2.parameters())
    load({"app": TrainState(model2, optim2, rng=False)}, tmp_path / "ckpt")
    model2(torch.randn(4, 3)).sum().backward()
    optim2.step()
    assert all("buf" in st for st in optim2.state.values())


def test_a_never_stepped_optimizer_is_saved_as_never_stepped(tmp_path):
    model, optim, sched = make()
    save({"app": TrainState(model, optim, sched, rng=False)}, tmp_path / "ckpt")
    assert not optim.state  # the state torch gave it for the save is gone again
    steps = [v for k, v in _flat(load(None, tmp_path / "ckpt")).items() if k.startswith("app.optim.state.")
             and k.endswith(".step")]
    assert len(steps) == 4 and all(float(v) == 0 for v in steps), steps


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_adam_moments_and_step_equal_the_saved_ones(tmp_path):
    model, optim, sched = trained(4)
    save({"app": TrainState(model, optim, sched)}, tmp_path / "ckpt")
    model2, optim2, sched2 = make(seed=1)
    load({"app": TrainState(model2, optim2, sched2)}, tmp_path / "ckpt")
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, p2)
        saved, loaded = optim.state[p], optim2.state[p2]
        assert set(loaded) == {"step", "exp_avg", "exp_avg_sq"}
        for name in saved:
            assert torch.equal(saved[name], loaded[name]), name
    assert optim2.param_groups[0]["lr"] == optim.param_groups[0]["lr"]
    assert optim2.param_groups[0]["betas"] == (0.9, 0.999)
    assert sched2.last_epoch == 4 and sched2.get_last_lr() == sched.get_last_lr()


def test_rng_states_are_restored(tmp_path):
    model, optim, sched = make()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    draws()
    save({"app": TrainState(model, optim, sched)}, tmp_path / "ckpt")
    expected = draws()
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    state = TrainState(*make())
    load({"app": state}, tmp_path / "ckpt")
    assert state.rng_restored
    assert draws() == expected


def test_extra_data_position_is_restored_in_place(tmp_path):
    model, optim, sched = make()
    pos = Position()
    pos.index = 40
    extra = {"data": pos, "epoch": 2, "seen": torch.tensor([1.0, 2.0])}
    save({"app": TrainState(model, optim, sched, extra=extra, step=5)}, tmp_path / "ckpt")

    pos2 = Position()
    extra2 = {"data": pos2, "epoch": 0, "seen": torch.zeros(2)}
    state = TrainState(*make(), extra=extra2)
    load({"app": state}, tmp_path / "ckpt")
    assert state.extra is extra2 and extra2["data"] is pos2
    assert (pos2.index, extra2["epoch"], extra2["seen"].tolist(), state.step) == (40, 2, [1.0, 2.0], 5)


def test_json_only_extra_is_replaced_in_place(tmp_path):
    save({"app": TrainState(*make(), extra={"data": {"position": 17}})}, tmp_path / "ckpt")
    extra = {"data": {"position": 0}}
    load({"app": TrainState(*make(), extra=extra)}, tmp_path / "ckpt")
    assert extra == {"data": {"position": 17}}


def test_the_checkpoint_reads_without_the_model(tmp_path):
    model, optim, sched = trained(2)
    save({"app": TrainState(model, optim, sched, extra={"data": {"position": 2}}, step=2)}, tmp_path / "ckpt")
    app = load(path=tmp_path / "ckpt")["app"]
    assert set(app) == {"model", "optim", "scheduler", "step", "extra", "rng"}
    assert app["step"] == 2 and app["extra"] == {"data": {"position": 2}}
    assert app["scheduler"]["last_epoch"] == 2
    assert set(app["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # FQNs, no wrapper prefixes
    assert set(app["optim"]["state"]) == set(app["model"])
    assert isinstance(app["rng"]["states"], bytes) and app["rng"]["world_size"] == 1


def test_helpers_produce_and_consume_the_training_state_dict(tmp_path):
    model, optim, sched = trained(3)
    save(get_train_state_dict(model, optim, scheduler=sched), tmp_path / "ckpt")
    model2, optim2, sched2 = make(seed=1)
    sd = load(get_train_state_dict(model2, optim2, scheduler=sched2), tmp_path / "ckpt")
    set_train_state_dict(model2, optim2, sd, scheduler=sched2)
    assert train_step(model2, optim2, sched2, 4) == train_step(model, optim, sched, 4)


def test_a_scheduler_missing_from_the_checkpoint_is_a_key_mismatch(tmp_path):
    model, optim, _ = make()
    save({"app": TrainState(model, optim)}, tmp_path / "ckpt")
    with pytest.raises(StateDictMismatchError, match="app.scheduler"):
        load({"app": TrainState(*make())}, tmp_path / "ckpt")


def test_set_train_state_dict_names_a_missing_part():
    model, optim, sched = make()
    sd = get_train_state_dict(model, optim)
    with pytest.raises(KeyError, match="scheduler"):
        set_train_state_dict(model, optim, sd, scheduler=sched)


def test_load_rng_state_dict_rejects_other_formats():
    with pytest.raises(ValueError, match="format"):
        load_rng_state_dict({"states": b"[]", "world_size": 1})


def rank_rng(rank: int, ws: int, path: str) -> dict:
    torch.manual_seed(100 + rank)  # every rank has its own stream
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    save({"rng": rng_state_dict()}, path)
    expected = draws()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    sd = load({"rng": rng_state_dict()}, path)
    restored = load_rng_state_dict(sd["rng"])
    return {"restored": restored, "expected": expected, "after_load": draws()}


def test_each_rank_gets_its_own_rng_states_back_and_other_world_sizes_keep_theirs(tmp_path):
    path = str(tmp_path / "ckpt")
    r0, r1 = run_ranks(rank_rng, 2, path)
    assert r0["restored"] and r1["restored"]
    assert r0["after_load"] == r0["expected"] and r1["after_load"] == r1["expected"]
    assert r0["expected"] != r1["expected"]
    # one process, two saved ranks: nothing to own, states left alone, with a warning
    torch.manual_seed(5)
    before = torch.get_rng_state()
    sd = load(path=path)
    with pytest.warns(RuntimeWarning, match="saved by 2 rank"):
        assert load_rng_state_dict(sd["rng"]) is False
    assert torch.equal(torch.get_rng_state(), before)


class FakeDeviceModule:
    """Stands in for torch.cuda / torch.npu: per-device RNG states (no accelerator here)."""

    def __init__(self, states: list[torch.Tensor]) -> None:
        self.states = states

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.states]

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        self.states = [s.clone() for s in states]


def test_accelerator_rng_states_round_trip(tmp_path, monkeypatch):
    import hyper_parallel.core.distributed_checkpoint._src.state.train_state as sdm

    saved = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    device = FakeDeviceModule(saved)
    monkeypatch.setattr(sdm, "_accelerator_module", lambda: ("cuda", device))
    save({"rng": rng_state_dict()}, tmp_path / "ckpt")
    device.states = [torch.zeros(16, dtype=torch.uint8)] * 2
    sd = load({"rng": rng_state_dict()}, tmp_path / "ckpt")
    assert load_rng_state_dict(sd["rng"])
    assert [s.tolist() for s in device.states] == [s.tolist() for s in saved]
    # a process without that accelerator keeps going, with a warning
    monkeypatch.setattr(sdm, "_accelerator_module", lambda: None)
    with pytest.warns(RuntimeWarning, match="cuda RNG states"):
        assert load_rng_state_dict(sd["rng"])
