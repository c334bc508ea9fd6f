"""Training state <-> state dict: model, optimizer, LR scheduler, RNG states, step, data position.

One object holds everything a training job needs to resume exactly, and checkpoints in one
call::

    state = TrainState(model, optimizer, scheduler, extra={"data": {"position": 0}})
    state.step = 100
    save({"app": state}, "/ckpt/step100")          # every rank saves its own shards
    ...
    state = TrainState(model, optimizer, scheduler, extra={"data": {"position": 0}})
    load({"app": state}, "/ckpt/step100")          # fresh model/optimizer, any layout
    start = state.step + 1

Model and optimizer states come from torch's
``torch.distributed.checkpoint.state_dict.get_state_dict`` (FQN keys; FSDP2/TP parameters
and Adam moments stay sharded DTensors, so a checkpoint saved under one parallel layout
loads under another) and go back through ``set_state_dict``. ``get_state_dict`` gives a
never-stepped optimizer its state (a step with zero gradients and lr 0, which changes no
parameter), so a fresh optimizer is a complete load target: no warm-up step is needed. That
state is taken back afterwards and saved as zeros, so a checkpoint taken before the first step
changes no training, and a job resumed from it starts its optimizer fresh.

RNG states differ per rank. :func:`rng_state_dict` gathers every rank's states into one
``bytes`` value (JSON inside, no pickle); :func:`load_rng_state_dict` gives each rank its
own back when the job resumes on the same number of ranks. On a different number of
ranks a saved rank's stream has no owner: the states are left as they are, with a warning.
"""

from __future__ import annotations

import base64
import json
import random
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..coordination.coordinator import Coordinator
from .flatten import update_in_place

if TYPE_CHECKING:  # importing torch.distributed.checkpoint costs ~0.5 s; done on first use
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = [
    "TrainState",
    "get_train_state_dict",
    "set_train_state_dict",
    "rng_state_dict",
    "load_rng_state_dict",
]

RNG_FORMAT = "hyper_parallel.rng/1"

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


def get_train_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    scheduler: Any = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The state dict of a model, its optimizer(s) and (optionally) an LR scheduler.

    Built on ``torch.distributed.checkpoint.state_dict.get_state_dict``: keys are parameter
    FQNs (wrapper prefixes such as FSDP's or ``torch.compile``'s are removed), and sharded
    parameters and optimizer states stay DTensors, so every rank saves only its shards.
    An optimizer that has never stepped gets its state first (torch steps it once with zero
    gradients and lr 0; parameters do not change), so its state dict is a complete target
    for :func:`load`.

    Args:
        model: the model (plain, FSDP2 ``fully_shard``-ed, TP-parallelized, or a mix).
        optimizers: one optimizer or several, over the model's parameters.
        scheduler: an LR scheduler whose ``state_dict()`` is added under ``"scheduler"``.
        options: ``StateDictOptions`` passed to torch (e.g. ``full_state_dict=True``).

    Returns:
        ``{"model": ..., "optim": ...}`` plus ``"scheduler"`` when one is given.

    Example::

        sd = get_train_state_dict(model, optimizer)
        save(sd, "/ckpt/step100")
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optims = _as_list(optimizers)
    fresh = {o: getattr(o, "_opt_called", None) for o in optims if not o.state}
    model_sd, optim_sd = get_state_dict(model, optims if len(optims) != 1 else optims[0], options=options)
    if fresh:
        _undo_initial_step(model, fresh, optims, optim_sd)
    out: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    if scheduler is not None:
        out["scheduler"] = scheduler.state_dict()
    return out


def set_train_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    state_dict: dict[str, Any],
    *,
    scheduler: Any = None,
    options: StateDictOptions | None = None,
) -> None:
    """Restore a model, its optimizer(s) and an LR scheduler from :func:`get_train_state_dict`'s form.

    Args:
        model, optimizers, scheduler, options: as for :func:`get_train_state_dict`.
        state_dict: ``{"model": ..., "optim": ..., "scheduler": ...}``, e.g. filled by
            ``load(get_train_state_dict(model, optimizer), path)``.

    Raises:
        KeyError: ``state_dict`` lacks ``"model"``/``"optim"``, or ``"scheduler"`` when a
            scheduler is given.
        RuntimeError: (from torch) model keys are missing or unexpected.

    Example::

        sd = load(get_train_state_dict(model, optimizer), "/ckpt/step100")
        set_train_state_dict(model, optimizer, sd)
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    for key in ("model", "optim") + (("scheduler",) if scheduler is not None else ()):
        if key not in state_dict:
            raise KeyError(f"the training state dict has no {key!r} entry (keys: {sorted(state_dict)})")
    optims = _as_list(optimizers)
    lazy = [o for o in optims if not o.state]  # state made at the first step: it can be made again
    set_state_dict(
        model, optims if len(optims) != 1 else optims[0], model_state_dict=state_dict["model"],
        optim_state_dict=state_dict["optim"], options=options,
    )
    for o in lazy:
        if o.state and _never_stepped(o):
            o.state.clear()  # saved before its first step: it starts as a fresh one would
    if scheduler is not None:
        scheduler.load_state_dict(state_dict["scheduler"])


def _as_list(optimizers: Optimizers) -> list[torch.optim.Optimizer]:
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def _undo_initial_step(model: nn.Module, fresh: dict[torch.optim.Optimizer, Any], optims: list[torch.optim.Optimizer],
                       optim_sd: dict[str, Any]) -> None:
    """Give never-stepped optimizers back their empty state, and save them as never stepped.

    torch's ``get_state_dict`` steps an optimizer without state once (zero gradients, lr 0) so
    that its state dict has every entry. Parameters do not change, but the state does: Adam's
    ``step`` becomes 1 and NAdam's ``mu_product`` moves, so a job that saved before its first
    step trained differently from one that did not, and so did a job resumed from that save.
    The optimizer gets its empty state back, and its saved state (now held only by
    ``optim_sd``) is zeroed: an all-zero state is how :func:`set_train_state_dict` recognises
    a never-stepped optimizer and starts it fresh again.
    """
    fqns: set[str] | None = None  # the parameters of the fresh optimizers; None: every one
    if len(fresh) != len(optims):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # each fresh optimizer's own keys (sharded: no collective; it has its state by now, so
        # torch does not step it again); optim_sd may hold copies (full_state_dict, cpu_offload)
        fqns = set()
        for o in fresh:
            fqns.update(get_optimizer_state_dict(model, o).get("state", {}))
    for o, opt_called in fresh.items():
        o.state.clear()
        if opt_called is None:
            o.__dict__.pop("_opt_called", None)
        else:
            o._opt_called = opt_called  # an LR scheduler's "optimizer.step() was called" flag
    state = optim_sd.get("state")
    if isinstance(state, dict):
        for fqn, per_param in state.items():
            if fqns is None or fqn in fqns:
                for name, v in per_param.items():
                    per_param[name] = _zeroed(v)
    else:  # StateDictOptions(flatten_optimizer_state_dict=True): "state.<fqn>.<name>" keys
        for key, v in optim_sd.items():
            if key.startswith("state.") and (fqns is None or key[len("state."):].rsplit(".", 1)[0] in fqns):
                optim_sd[key] = _zeroed(v)


def _zeroed(value: Any) -> Any:
    """``value`` as zero: tensors in place, numbers anew; anything else as it is."""
    if isinstance(value, torch.Tensor):
        with torch.no_grad():
            value.zero_()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return type(value)(0)
    return value


def _never_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every state value is zero: what :func:`_undo_initial_step` saves (a stepped Adam
    has ``step`` >= 1; the check stops at the first non-zero value)."""
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                if local.numel() and bool(local.ne(0).any()):
                    return False
            elif isinstance(v, (int, float)) and v != 0:
                return False
    return True


# ---------------------------------------------------------------------------------- RNG


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")


def _tensor_b64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _accelerator_module() -> tuple[str, Any] | None:
    """("cuda"/"npu"/..., its torch device module) when one is in use in this process."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    device_type = acc.current_accelerator().type
    module = torch.get_device_module(device_type)
    is_initialized = getattr(module, "is_initialized", None)
    if is_initialized is not None and not is_initialized():
        return None  # never touched: nothing to save, and reading it would initialise it
    return device_type, module


def _local_rng_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": [version, list(internal), gauss_next],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    acc = _accelerator_module()
    if acc is not None:
        device_type, module = acc
        state["accelerator"] = {"type": device_type, "states": [_b64(s) for s in module.get_rng_state_all()]}
    return state


def _set_local_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_tensor_b64(state["torch"]))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    saved = state.get("accelerator")
    if saved is not None:
        acc = _accelerator_module()
        if acc is None or acc[0] != saved["type"]:
            warnings.warn(
                f"the checkpoint holds {saved['type']} RNG states but this process uses "
                f"{acc[0] if acc else 'no accelerator'}; they were not restored",
                RuntimeWarning, stacklevel=3,
            )
        else:
            acc[1].set_rng_state_all([_tensor_b64(s) for s in saved["states"]])


def _group_rank_and_size(process_group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    return 0, 1


def rng_state_dict(process_group: Any = None) -> dict[str, Any]:
    """Every rank's RNG states (torch CPU, the accelerator's, Python's ``random``, NumPy's).

    A collective: all ranks of ``process_group`` call it, and all get the same value, which
    the checkpoint stores once. Without a process group it holds this process's states.

    Args:
        process_group: the ranks whose states are gathered (default: the whole world).

    Returns:
        ``{"format": ..., "world_size": n, "states": bytes}``; ``states`` is JSON text (no
        pickle) listing each rank's states in rank order.

    Example::

        save({"rng": rng_state_dict()}, path)
    """
    _, world_size = _group_rank_and_size(process_group)
    if world_size > 1:  # our gloo exchange: any backend, a timeout, and a failing rank fails all
        states = Coordinator(process_group).exchange("rng_state_dict", _local_rng_state)
    else:
        states = [_local_rng_state()]
    return {
        "format": RNG_FORMAT,
        "world_size": len(states),
        "states": json.dumps(states, separators=(",", ":")).encode(),
    }


def load_rng_state_dict(state_dict: dict[str, Any], process_group: Any = None) -> bool:
    """Give this rank back its own RNG states from :func:`rng_state_dict`'s value.

    Args:
        state_dict: the value :func:`rng_state_dict` returned (e.g. as filled by ``load``).
        process_group: the group it was gathered over (default: the whole world).

    Returns:
        True when restored. False, with a ``RuntimeWarning``, when the states were saved by
        a different number of ranks (the job resumed on another layout): each saved rank's
        stream then has no owner, and the current states are left unchanged. Accelerator
        states this process cannot take (no such accelerator in use) are skipped with a
        ``RuntimeWarning``; the CPU, Python and NumPy states are still restored.

    Raises:
        ValueError: the value is not in this module's format.

    Example::

        sd = load({"rng": rng_state_dict()}, path)
        load_rng_state_dict(sd["rng"])
    """
    if not isinstance(state_dict, dict) or state_dict.get("format") != RNG_FORMAT:
        found = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"expected RNG states in format {RNG_FORMAT!r}, found {found!r}")
    rank, world_size = _group_rank_and_size(process_group)
    saved_world_size = state_dict["world_size"]
    if saved_world_size != world_size:
        warnings.warn(
            f"RNG states were saved by {saved_world_size} rank(s) and this job has {world_size}; "
            "they were not restored (random streams continue from their current state)",
            RuntimeWarning, stacklevel=2,
        )
        return False
    states = json.loads(bytes(state_dict["states"]))
    if len(states) != saved_world_size:
        raise ValueError(f"RNG states list {len(states)} ranks but say world_size={saved_world_size}")
    _set_local_rng_state(states[rank])
    return True


# ---------------------------------------------------------------------------- app state


class TrainState:
    """Everything a training job resumes from, as one Stateful object for ``save``/``load``.

    ``state_dict()`` returns ``{"model", "optim", ["scheduler"], "step", ["extra"], ["rng"]}``;
    ``load_state_dict()`` restores each part. ``load`` fills the sharded tensors in place
    (resharding to the current layout), then calls ``load_state_dict`` with the result.

    Args:
        model: the model (plain, FSDP2, HSDP, TP, or a mix).
        optimizer: one optimizer or several. A fresh one loads without a warm-up step.
        scheduler: an LR scheduler, or None.
        extra: a dict of further state (e.g. the data position ``{"epoch": 0, "index": 512}``,
            tensors, or Stateful objects such as a sampler). It is saved as it is at
            ``save`` time, and updated in place on load, so references to it stay valid.
        step: the training step; set ``state.step`` before each save.
        rng: save the RNG states of every rank, and restore them on load (same rank count).
        options: ``StateDictOptions`` for torch's ``get_state_dict``/``set_state_dict``.
        process_group: the ranks RNG states are gathered over (default: the whole world).

    Attributes:
        step: the step, restored by load.
        extra: the extra dict, restored in place by load.
        rng_restored: after a load, whether this rank's RNG states were restored.

    Note:
        ``state_dict()`` is a collective when ``rng=True`` (every rank calls it, as every
        rank calls ``save``/``load``).

        Load into an optimizer that has stepped, or into a fresh one whose parameters have
        no gradients (torch initialises a never-stepped optimizer's state only then). With
        gradients present and no state, the target lacks the optimizer entries and ``load``
        reports them as keys "in the checkpoint but not in the target": call
        ``optimizer.zero_grad(set_to_none=True)`` first.

    Example::

        state = TrainState(model, optimizer, scheduler, extra={"data": {"position": 0}})
        load({"app": state}, checkpoint_id=latest)   # model, optimizer, ... restored
        for step in range(state.step + 1, total_steps + 1):
            ...
            state.step = step
            save({"app": state}, checkpoint_id=f"ckpt/step{step}")
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizers,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        *,
        step: int = 0,
        rng: bool = True,
        options: StateDictOptions | None = None,
        process_group: Any = None,
    ):
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict, found {type(extra).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extra = extra
        self.step = step
        self.rng = rng
        self.options = options
        self.process_group = process_group
        self.rng_restored = False

    def state_dict(self) -> dict[str, Any]:
        """The whole training state (sharded tensors stay DTensors)."""
        sd = get_train_state_dict(self.model, self.optimizer, scheduler=self.scheduler, options=self.options)
        sd["step"] = int(self.step)
        if self.extra is not None:
            sd["extra"] = self.extra
        if self.rng:
            sd["rng"] = rng_state_dict(self.process_group)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore everything ``state_dict()`` produced; RNG states last."""
        set_train_state_dict(self.model, self.optimizer, state_dict, scheduler=self.scheduler, options=self.options)
        self.step = int(state_dict["step"])
        if self.extra is not None:
            loaded = state_dict.get("extra", {})
            if loaded is not self.extra:
                update_in_place(self.extra, loaded)
        if self.rng:
            self.rng_restored = load_rng_state_dict(state_dict["rng"], self.process_group)

