"""Chaos soak: a training job with a CheckpointManager (async, incremental, local tier) that a
driver keeps breaking (SIGKILLed ranks, stalled ranks, full disks, failing storage calls,
bits flipped in local-tier copies) and restarting on a random world size, while the job
writes part of its state behind torch's version counter; every resume is checked bit for bit.

The job (``--world-size`` picked at random from ``--sizes`` at every start, ranks as 2
simulated nodes: ``node_rank = rank * 2 // world_size``, one local directory per node):

- its state is FSDP-style ``Shard(0)`` DTensors (fp32, bf16 and int64, uneven shards, one
  tensor that changes every 8 steps and three "frozen" ones that change only through rare
  sparse writes, so incremental saves reference earlier steps' files) plus plain values (the
  step, bytes, a numpy array, a dict of floats);
- each step applies an update to the previous state (elementwise, in exact arithmetic:
  multiples of 1/256 well inside float32's range, integers for bf16/int64), so the state at
  step k is a pure function of k, whatever the world size and wherever the job restarted:
  ``Job.state(k)`` (:func:`_value`) computes it in closed form, and the first runs
  (fault-free, every step checked against it) show that the closed form is the fault-free
  run's state;
- part of the update is written behind torch's version counter, at random steps that are a
  pure function of the step number (:func:`behind_plan`, :func:`sparse_write`): a tensor's
  whole update, or a few of its rows (the rest by ordinary in-place ops), through
  ``t.data[rows] += delta`` or through a numpy view of ``dt.to_local()`` (bf16 through an
  int16 view), and, at one step in four, a sparse write (one element, or 2 to 4 rows) of one
  of the frozen tensors through either path: the write a counter-trusting incremental save
  committed stale. The values are the same as with ordinary ops, so the closed form holds
  (the frozen tensors' sum of sparse writes is kept between calls, :func:`_sparse_total`).
  With ``--incremental-check version_counter`` (the opt-in that trusts the counter) the soak
  reports wrong committed steps (and resumes of them): the frozen tensors are each larger than a
  save's spot check, and its rotating full hash takes about one of them per save;
- ``CheckpointManager(dir, save_interval_steps=4, keep_latest=2, async_save=True,
  incremental=True, local_dir=node dir, local_interval_steps=1, replicas=2)`` (the default
  ``incremental_check="content"``), ``timeout`` ``--timeout`` seconds; each start ``load``s
  (local tier or durable) and checks the state it got against the closed form for that step,
  then trains ``--steps`` steps.

The faults (one per start, at a random moment: a random step of the run plus a random delay
within the step, or during the manager's start and recovery):

- ``kill``: SIGKILL of one rank, of one node's ranks (whose local directory is then wiped
  with probability 1/2: the node was replaced), or of every rank (a preemption);
- ``stall``: SIGSTOP of one rank (it is SIGKILLed once the others have given up);
- ``disk_full``: the durable directory, or one node's local directory, is on a small tmpfs
  of its own (``mount -t tmpfs -o size=...``; root only) that the driver fills with a file
  until ENOSPC; the file is removed before the next start. Without root (``--disk inject``
  or ``auto`` when mounting fails) the durable storage writer fails a write with ENOSPC
  halfway through a file instead, and only the durable tier is filled;
- ``storage``: one call of the durable storage fails with EIO on one rank (a wrapper around
  the manager's storage writer/reader and directory: ``write_file`` (before any byte, or
  halfway through the file), ``commit`` (before, or *after* the rename: a storage that raises
  although the commit took effect), ``read_committed``, ``remove``, ``read_metadata``,
  ``read_into``, ``file_size``, the manager's start-up ``listing`` and metadata reads, its
  deletions), picked at random, on the n-th call of that kind;
- ``local_bitflip``: while the job is stopped, before a start (on the last start's world
  size), one bit of one local-tier shard file of a random node is flipped
  (:func:`flip_local_bit`): a file of the node's newest step 3 times in 4; in its header half
  the time (the first 8 + N bytes: the length and the JSON header, whose manifest holds every
  non-tensor value), else in one payload of it (the node's own copy, which its ranks read, 3
  times in 4; else a replica). The start must resume with exactly the closed-form values (from
  another replica, an older local step or the durable tier) and train on without an error:
  a failure of that start counts as unexpected (as does any start's failure before its fault
  struck, unless the disk was kept full from the last fault and every error is that disk's
  ENOSPC, named clearly). Recovery's warnings (rank 0 names each copy
  that failed its check) are captured to see whether the flipped copy was left out.

``--first`` forces the kinds of the first faults (``local_bitflip:header`` names the region
too), e.g. so that a short run certainly covers a kind.

Reported: faults injected (by kind; a storage fault whose call never came is not counted),
starts and resumes (by source), committed steps lost (a start resuming before the newest
step committed in the durable directory when it began), wrong values (a resume, or any step
of the fault-free runs, that differs from :func:`expected` by one bit), hangs (a rank still
alive ``--timeout`` + ``--grace`` seconds after its fault, or long past the run's expected end),
errors that are not clear (a survivor raising something other than a ``CheckpointError`` or
the injected ``OSError``), failures with no fault fired, and the time survivors took to raise;
the bit flips (the flipped copy left out, by region, or never read; what loaded instead),
the resumes whose recovery left out a local copy that failed its check, and how many shard
updates the completed starts wrote behind the version counter (by path).

Usage::

    python benchmarks/bench_chaos.py                     # full soak (~25 min on 2 cores)
    python benchmarks/bench_chaos.py --faults 8 --steps 6   # a smoke run (under a minute)
    python benchmarks/bench_chaos.py --kinds local_bitflip --faults 14 --steps 4   # bit flips only
    python benchmarks/bench_chaos.py --faults 4 --incremental-check version_counter  # reports stale steps
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import write_json  # noqa: E402

# ----------------------------------------------------------------------------- the state: a pure function of the step

# name, global shape, dtype, period (the tensor changes at steps divisible by it; 0: never)
SPECS = (
    ("model.layers.0.weight", (1001, 96), "float32", 1),
    ("model.layers.0.bias", (1001,), "float32", 1),
    ("model.layers.1.weight", (509, 96), "bfloat16", 1),
    ("model.embed.weight", (2003, 32), "float32", 8),
    ("model.frozen.0.weight", (2053, 64), "float32", 0),
    ("model.frozen.1.weight", (2053, 64), "float32", 0),
    ("model.frozen.2.weight", (2053, 64), "float32", 0),
    ("optim.exp_avg", (1001, 96), "float32", 1),
    ("optim.count", (1001,), "int64", 1),
)
_SHAPES = {spec[0]: spec[1] for spec in SPECS}


def _ids(shape: tuple[int, ...], row0: int, rows: int):
    """The global linear index of every element of the rows ``[row0, row0 + rows)``."""
    import torch

    cols = 1
    for s in shape[1:]:
        cols *= s
    return torch.arange(row0 * cols, (row0 + rows) * cols, dtype=torch.int64).reshape(rows, *shape[1:])


def _base(ids, salt: int):
    return (ids * 2654435761 + salt * 40503) % 4093 - 2046  # units of 1/256


def _inc(ids, salt: int):
    return (ids * 40503 + salt * 97) % 17 - 8  # units of 1/256


def _changes(period: int, k: int) -> int:
    """How many updates a tensor of ``period`` has had by step ``k``."""
    return 0 if period == 0 else k // period


def _value(spec: tuple, ids, k: int):
    """A tensor's value at step ``k`` (closed form): ``_changes`` updates, plus (the tensor
    that never changes otherwise) the sparse writes of every step up to ``k``."""
    import torch

    name, _, dtype, period = spec
    salt = SPECS.index(spec) + 1
    n = _changes(period, k)
    if dtype == "float32":
        units = _base(ids, salt) + n * _inc(ids, salt)
        if name in FROZEN:
            units = units + _sparse_total(k)[name].reshape(-1)[ids]
        return (units.to(torch.float64) / 256).to(torch.float32)
    if dtype == "bfloat16":
        return (torch.remainder(_base(ids, salt) + n * _inc(ids, salt), 256) - 128).to(torch.bfloat16)
    return ids + n  # int64


# ----------------------------------------------------------------------------- writes behind torch's version counter

# The tensors that "never change" (period 0) change only through sparse writes (one element,
# or a few rows of one of them) at random steps, always behind torch's version counter: the
# case a counter-trusting incremental save committed stale. There are several, each larger
# than a save's spot check, so that the opt-in ``incremental_check="version_counter"`` (whose
# rotating full hash takes about one of them per save) commits some of them stale: run the
# soak with it and it reports wrong committed steps.
FROZEN = tuple(spec[0] for spec in SPECS if spec[3] == 0)
BEHIND_P = 0.3  # chance that one tensor's update at one step is written behind the counter
SPARSE_P = 0.25  # chance that a step writes one of FROZEN


def behind_plan(k: int, name: str, rows: int) -> tuple[str, int, int] | None:
    """How the update of tensor ``name`` (``rows`` global rows) at step ``k`` is written:
    None (all through ordinary in-place ops, which move the version counter), or ``(path,
    lo, hi)``: global rows ``[lo, hi)`` (all of them, or 1 to 8) through ``path`` (``"data"``:
    ``t.data[...]``; ``"numpy"``: a numpy view of ``dt.to_local()``), the rest ordinarily.
    A pure function of the step (the same on every rank, at every world size)."""
    rnd = random.Random(f"behind-{k}-{name}")
    if rnd.random() >= BEHIND_P:
        return None
    path = rnd.choice(("data", "numpy"))
    if rnd.random() < 0.5:
        return path, 0, rows
    lo = rnd.randrange(rows)
    return path, lo, min(rows, lo + rnd.randint(1, 8))


def sparse_write(k: int) -> tuple[str, str, int, int, int | None, int] | None:
    """The sparse write of one of ``FROZEN`` at step ``k``, or None: ``(name, path, lo, hi,
    col, delta)``: rows ``[lo, hi)`` (``col``: only that column of one row) of tensor
    ``name`` get ``delta`` / 256 added, through ``path`` (as in :func:`behind_plan`)."""
    rnd = random.Random(f"sparse-{k}")
    if rnd.random() >= SPARSE_P:
        return None
    name = rnd.choice(FROZEN)
    rows, cols = _SHAPES[name]
    path = rnd.choice(("data", "numpy"))
    lo = rnd.randrange(rows)
    if rnd.random() < 0.5:
        hi, col = lo + 1, rnd.randrange(cols)
    else:
        hi, col = min(rows, lo + rnd.randint(2, 4)), None
    return name, path, lo, hi, col, rnd.choice((-3, -2, -1, 1, 2, 3))


_SPARSE_CACHE: dict[str, Any] = {"k": None, "total": None}


def _sparse_total(k: int) -> dict[str, Any]:
    """What the sparse writes of steps 1..k added to each of ``FROZEN`` (int64, units of
    1/256, its global shape); kept between calls (steps are mostly asked in ascending order)."""
    import torch

    c = _SPARSE_CACHE
    if c["k"] is None or k < c["k"]:
        c["k"], c["total"] = 0, {name: torch.zeros(_SHAPES[name], dtype=torch.int64) for name in FROZEN}
    for j in range(c["k"] + 1, k + 1):
        w = sparse_write(j)
        if w is not None:
            name, _, lo, hi, col, delta = w
            if col is None:
                c["total"][name][lo:hi] += delta
            else:
                c["total"][name][lo, col] += delta
    c["k"] = k
    return c["total"]


def _write_rows(dt, local, new, lo: int, hi: int, path: str, add: bool) -> None:
    """Rows ``[lo, hi)`` of the local shard ``local`` (of DTensor ``dt``) become ``new``'s:
    ``add``: ``new`` is a delta added (float32, int64), else the new value (bf16);
    ``path``: ``"op"`` (in-place ops: the counter moves), ``"data"`` or ``"numpy"`` (behind it)."""
    import torch

    if hi <= lo:
        return
    if path == "op":
        if add:
            local[lo:hi].add_(new[lo:hi])
        else:
            local[lo:hi].copy_(new[lo:hi])
    elif path == "data":  # p.data[i] += x: .data is an alias with a version counter of its own
        if add:
            local.data[lo:hi] += new[lo:hi]
        else:
            local.data[lo:hi] = new[lo:hi]
    else:  # numpy view of the shard (bf16 through an int16 view: numpy has no bfloat16)
        view = dt.to_local()
        if view.dtype == torch.bfloat16:
            view.view(torch.int16).numpy()[lo:hi] = new.view(torch.int16).numpy()[lo:hi]
        elif add:
            view.numpy()[lo:hi] += new.numpy()[lo:hi]
        else:
            view.numpy()[lo:hi] = new.numpy()[lo:hi]


def _update(spec: tuple, dt, ids, k: int, row0: int) -> str | None:
    """Step ``k``'s update of one tensor, in place, exact arithmetic, part of it (or all, per
    :func:`behind_plan`) written behind torch's version counter; returns that path or None.
    ``row0``: the local shard's first global row."""
    import torch

    name, shape, dtype, _ = spec
    salt = SPECS.index(spec) + 1
    local = dt._local_tensor
    add = dtype != "bfloat16"
    if dtype == "float32":
        new = (_inc(ids, salt).to(torch.float64) / 256).to(torch.float32)
    elif dtype == "bfloat16":
        new = (torch.remainder(local.to(torch.int64) + 128 + _inc(ids, salt), 256) - 128).to(torch.bfloat16)
    else:
        new = torch.ones_like(local)
    rows = local.shape[0] if local.dim() else 0
    plan = behind_plan(k, name, shape[0])
    if plan is None:
        _write_rows(dt, local, new, 0, rows, "op", add)
        return None
    path, lo, hi = plan
    lo, hi = min(max(lo - row0, 0), rows), min(max(hi - row0, 0), rows)  # this shard's part
    _write_rows(dt, local, new, 0, lo, "op", add)
    _write_rows(dt, local, new, lo, hi, path, add)
    _write_rows(dt, local, new, hi, rows, "op", add)
    return path if hi > lo else None


def _sparse_update(name: str, dt, k: int, row0: int) -> str | None:
    """Step ``k``'s sparse write of tensor ``name`` (this shard's part of it, if it is the one
    written), behind the counter."""
    import torch

    w = sparse_write(k)
    if w is None or w[0] != name:
        return None
    _, path, lo, hi, col, delta = w
    local = dt._local_tensor
    rows = local.shape[0]
    lo, hi = min(max(lo - row0, 0), rows), min(max(hi - row0, 0), rows)
    if hi <= lo:
        return None
    d = torch.tensor(delta / 256, dtype=torch.float32)
    if col is None:
        _write_rows(dt, local, d.expand(local.shape).contiguous(), lo, hi, path, True)
    elif path == "data":
        local.data[lo, col] += d
    else:
        dt.to_local().numpy()[lo, col] += d.numpy()
    return path


def plain_values(k: int) -> dict[str, Any]:
    """The non-tensor values at step ``k``."""
    import numpy as np

    return {"step": k, "rng": hashlib.sha256(f"rng-{k}".encode()).digest(),
            "data": {"order": np.arange(6, dtype=np.int64) * k + 1, "sched": {"lr": 1.0 / (k + 1), "epoch": k // 10}}}


def verify_committed(directory: str, step: int) -> list[str]:
    """Load committed durable ``step`` whole, in the driver (no process group), and list the
    keys that differ from the fault-free state at that step."""
    import numpy as np
    import torch

    from hyper_parallel.core.distributed_checkpoint import load
    from hyper_parallel.core.distributed_checkpoint._src.format.metadata import step_dir_name

    try:
        got = load(path=os.path.join(directory, step_dir_name(step)), no_dist=True)
    except Exception as exc:  # a committed step that does not load is as wrong as a wrong value
        return [f"load failed: {type(exc).__name__}: {exc}"[:300]]
    want = plain_values(step)
    bad = []
    for spec in SPECS:
        name, shape, _, period = spec
        group, key = name.split(".", 1)
        t = got.get(group, {}).get(key)
        full = _value(spec, _ids(shape, 0, shape[0]), step)
        if not (isinstance(t, torch.Tensor) and t.dtype == full.dtype and t.shape == full.shape
                and torch.equal(t.contiguous().view(torch.uint8), full.view(torch.uint8))):
            bad.append(name)
    if got.get("step") != want["step"] or got.get("rng") != want["rng"]:
        bad.append("step/rng")
    data = got.get("data", {})
    order = data.get("order")
    if not (isinstance(order, np.ndarray) and order.tobytes() == want["data"]["order"].tobytes()) or \
            data.get("sched") != want["data"]["sched"]:
        bad.append("data")
    return bad


def _shard(spec: tuple, mesh) -> tuple[int, int]:
    """(first row, rows) of this rank's Shard(0) piece of a tensor (torch's uneven split)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(spec[1], mesh, [Shard(0)])
    return offsets[0], sizes[0]


class Job:
    """This rank's part of the state, and the update every step applies to it."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.shards = {spec[0]: _shard(spec, mesh) for spec in SPECS}
        self.ids = {spec[0]: _ids(spec[1], *self.shards[spec[0]]) for spec in SPECS}
        self.behind: Counter = Counter()  # writes behind the version counter, by path (and "sparse")

    def state(self, k: int | None) -> dict[str, Any]:
        """The state at step ``k`` (closed form); None: a load target full of sentinels."""
        import numpy as np
        import torch
        from torch.distributed.tensor import DTensor, Shard

        tensors = {}
        for spec in SPECS:
            name, shape, dtype, period = spec
            ids = self.ids[name]
            local = _value(spec, ids, k) if k is not None else torch.full(
                ids.shape, -7, dtype=getattr(torch, dtype))
            tensors[name] = DTensor.from_local(local, self.mesh, [Shard(0)], shape=torch.Size(shape),
                                               stride=torch.empty(shape, device="meta").stride(), run_check=False)
        plain = plain_values(k if k is not None else 0)
        if k is None:
            plain = {"step": -1, "rng": b"", "data": {"order": np.zeros(6, dtype=np.int64),
                                                      "sched": {"lr": -1.0, "epoch": -1}}}
        return {"model": {n[6:]: v for n, v in tensors.items() if n.startswith("model.")},
                "optim": {n[6:]: v for n, v in tensors.items() if n.startswith("optim.")}, **plain}

    def advance(self, state: dict[str, Any], k: int) -> None:
        """Step ``k``: update the state of step ``k - 1`` in place (part of it, at random
        steps, behind torch's version counter: :func:`behind_plan`, :func:`sparse_write`)."""
        for spec in SPECS:
            name, _, _, period = spec
            group, key = name.split(".", 1)
            row0 = self.shards[name][0]
            if period and k % period == 0:
                path = _update(spec, state[group][key], self.ids[name], k, row0)
                if path is not None:
                    self.behind[path] += 1
            elif name in FROZEN and _sparse_update(name, state[group][key], k, row0) is not None:
                self.behind["sparse"] += 1
        state.update(plain_values(k))

    def differences(self, state: dict[str, Any], k: int) -> list[str]:
        """Keys whose value differs (by one bit) from the fault-free state at step ``k``."""
        import numpy as np
        import torch

        want = self.state(k)
        bad = []
        for group in ("model", "optim"):
            for key, dt in want[group].items():
                got = state[group].get(key)
                a, b = dt.to_local(), got.to_local() if got is not None else None
                if b is None or a.shape != b.shape or a.dtype != b.dtype or not torch.equal(
                        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
                    bad.append(f"{group}.{key}")
        for key in ("step", "rng"):
            if state.get(key) != want[key] or type(state.get(key)) is not type(want[key]):
                bad.append(key)
        data = state.get("data", {})
        if not (isinstance(data.get("order"), np.ndarray) and data["order"].tobytes() == want["data"]["order"].tobytes()
                and data["order"].dtype == np.int64):
            bad.append("data.order")
        if data.get("sched") != want["data"]["sched"]:
            bad.append("data.sched")
        return bad


# ----------------------------------------------------------------------------- faults inside a rank


class Injector:
    """Fails the ``plan["nth"]`` call of storage operation ``plan["op"]`` on this rank."""

    def __init__(self, plan: dict | None, log: EventLog):
        self.plan, self.log = plan, log
        self.calls: Counter = Counter()
        self.lock = threading.Lock()

    def due(self, op: str) -> bool:
        if self.plan is None or self.plan["op"] != op:
            return False
        with self.lock:
            self.calls[op] += 1
            return self.calls[op] == self.plan["nth"]

    def fail(self, op: str) -> OSError:
        code = self.plan["errno"]
        self.log("fired", op=op, when=self.plan["when"], nth=self.plan["nth"])
        return OSError(code, f"chaos: injected {errno.errorcode[code]} on storage call {op} "
                             f"#{self.plan['nth']} ({self.plan['when']})")

    def wrap(self, op: str, real):
        def call(*args, **kwargs):
            if not self.due(op):
                return real(*args, **kwargs)
            when = self.plan["when"]
            if when == "before":
                raise self.fail(op)
            if when == "partial":  # write_file: the first part goes out, then the storage fails
                name, parts = args[0], args[1]

                def half():
                    for i, part in enumerate(parts):
                        if i:
                            raise self.fail(op)
                        yield part
                    raise self.fail(op)
                return real(name, half(), *args[2:], **kwargs)
            real(*args, **kwargs)  # "after": it happened, and still the call raises
            raise self.fail(op)
        return call

    def instrument(self, obj, ops: tuple[str, ...]):
        for op in ops:
            if hasattr(obj, op):
                setattr(obj, op, self.wrap(op, getattr(obj, op)))
        return obj


# A rank still alive this many timeouts (plus --grace) after a kill or stall is hung, and killed.
# Survivors should raise within about 2 timeouts (an exchange whose peer died mid-collective
# waits one, and the next exchange may wait another); more is reported as late.
HANG_TIMEOUTS = 6
LATE_TIMEOUTS = 2

WRITER_OPS = ("prepare", "write_file", "read_committed", "commit", "remove")
READER_OPS = ("read_metadata", "read_into", "file_size")
DIRECTORY_OPS = ("listing", "dir_read_metadata", "remove_tree", "uncommit")


def manager_class(injector: Injector | None):
    """CheckpointManager whose durable directory goes through ``injector``."""
    from hyper_parallel.core.distributed_checkpoint import CheckpointManager
    from hyper_parallel.core.distributed_checkpoint._src.manager.step_directory import LocalDirectory

    if injector is None or injector.plan is None:
        return CheckpointManager

    class FaultyDirectory(LocalDirectory):
        def __init__(self, path: str):
            super().__init__(path)
            injector.instrument(self, ("listing", "remove_tree", "uncommit"))
            self.step_metadata = injector.wrap("dir_read_metadata", self.step_metadata)

        def writer(self, name):
            return injector.instrument(super().writer(name), WRITER_OPS)

        def reader(self, name):
            return injector.instrument(super().reader(name), READER_OPS)

    class ChaosManager(CheckpointManager):
        def _root_for(self, directory, storage_options):
            return FaultyDirectory(os.fspath(directory))

    return ChaosManager


# ----------------------------------------------------------------------------- a rank


class EventLog:
    """One JSON line per event, appended to this rank's log (the driver reads it as it grows)."""

    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)
        self.lock = threading.Lock()

    def __call__(self, ev: str, **fields: Any) -> None:
        with self.lock:
            self.f.write(json.dumps({"t": time.time(), "ev": ev, **fields}, default=str) + "\n")


def _clear(exc: BaseException) -> bool:
    from hyper_parallel.core.distributed_checkpoint import CheckpointError

    return isinstance(exc, CheckpointError) or (isinstance(exc, OSError) and "chaos: injected" in str(exc))


# What the manager's warnings say when recovery leaves out a local copy that failed its check
# (its header at listing, a payload as it is read): rank 0 warns, naming each file.
REFUSED_MARKS = ("failed its integrity check", "failed their integrity check", "damaged copies")


def rank_main(rank: int, ws: int, cfg: dict, log: EventLog) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    job = Job(mesh)
    plan = cfg["storage_fault"] if cfg["storage_fault"] and cfg["storage_fault"]["rank"] == rank else None
    injector = Injector(plan, log)
    node = rank * 2 // ws
    log("phase", phase="start")
    mgr = manager_class(injector)(
        cfg["dir"], save_interval_steps=cfg["durable_every"], keep_latest=2, async_save=True, incremental=True,
        incremental_check=cfg["incremental_check"], timeout=cfg["timeout"],
        local_dir=os.path.join(cfg["nodes"], f"node{node}"), local_interval_steps=1, local_keep=2, replicas=2,
        node_rank=node, replication_timeout=cfg["timeout"] / 2)
    try:
        log("phase", phase="load")
        state = job.state(None)
        with warnings.catch_warnings(record=True) as caught:  # the worker ignores warnings: see these
            warnings.simplefilter("always")
            k = mgr.load(state)
        refused = [str(w.message)[:3000] for w in caught if any(m in str(w.message) for m in REFUSED_MARKS)]
        rec = mgr.local_tier.last_recovery
        source = "fresh" if k is None else rec.source if rec is not None else "durable"
        if k is None:
            k, state = 0, job.state(0)
        log("resumed", step=k, source=source, wrong=job.differences(state, k), refused=refused)
        log("phase", phase="train")
        for step in range(k + 1, k + cfg["steps"] + 1):
            time.sleep(cfg["step_s"])  # the forward and backward pass
            job.advance(state, step)
            if cfg["check_every_step"]:
                wrong = job.differences(state, step)
                if wrong:
                    log("drift", step=step, wrong=wrong)
            mgr.save(step, state)
            log("step", step=step)
        log("phase", phase="wait")
        mgr.wait()
        log("done", step=k + cfg["steps"], wrong=job.differences(state, k + cfg["steps"]), behind=dict(job.behind))
        log("phase", phase="close")
        mgr.close()
    except BaseException:
        with contextlib.suppress(Exception):
            mgr.__exit__(*sys.exc_info())
        raise
    log("phase", phase="exit")


def _worker(rank: int, ws: int, store: str, cfg: dict) -> None:
    try:  # die with the driver
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    warnings.filterwarnings("ignore")
    log = EventLog(os.path.join(cfg["logs"], f"r{rank}.jsonl"))
    log("phase", phase="init", pid=os.getpid())
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ws,
                                timeout=timedelta(seconds=cfg["timeout"]))
        rank_main(rank, ws, cfg, log)
    except BaseException as exc:
        log("error", type=type(exc).__name__, clear=_clear(exc), message=str(exc)[:3000],
            trace=traceback.format_exc()[-4000:])
        os._exit(3)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    log("gone")


# ----------------------------------------------------------------------------- the driver


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor",
                                "hyper_parallel.core.distributed_checkpoint", "benchmarks.bench_chaos"])
    return ctx


def read_log(path: str) -> list[dict]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


class Disk:
    """Where the durable directory and the nodes' local directories live, and how to fill them."""

    def __init__(self, work: str, mode: str, durable_mib: int, node_mib: int):
        self.work, self.mounts = work, []
        self.durable_root = os.path.join(work, "durable")
        self.nodes = os.path.join(work, "nodes")
        paths = [(self.durable_root, durable_mib)] + [(os.path.join(self.nodes, f"node{n}"), node_mib)
                                                      for n in (0, 1)]
        for p, _ in paths:
            os.makedirs(p, exist_ok=True)
        self.mode = "inject"
        if mode in ("tmpfs", "auto"):
            try:
                for p, mib in paths:
                    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", p],
                                         capture_output=True, text=True, timeout=30)
                    if out.returncode:
                        raise OSError(out.stderr.strip() or f"mount exited {out.returncode}")
                    self.mounts.append(p)
                self.mode = "tmpfs"
            except (OSError, subprocess.SubprocessError) as exc:
                self.release()
                if mode == "tmpfs":
                    raise SystemExit(f"cannot mount a small tmpfs ({exc}); use --disk inject") from exc
        self.dir = os.path.join(self.durable_root, "run")
        self.full_until: int | None = None  # the start after which a kept filler goes
        self.verified: set[int] = set()  # committed durable steps checked against the fault-free state

    def fill(self, where: str) -> int:
        """Write a file into ``where``'s filesystem until it is full; returns its size."""
        path = os.path.join(self.durable_root if where == "durable" else os.path.join(self.nodes, where), ".filler")
        chunk = b"\0" * (1 << 20)
        written = 0
        with open(path, "wb", buffering=0) as f:
            try:
                while True:
                    written += f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
            with contextlib.suppress(OSError):
                while True:
                    written += f.write(b"\0" * 4096)
        return written

    def unfill(self) -> None:
        self.full_until = None
        for p in [self.durable_root] + [os.path.join(self.nodes, f"node{n}") for n in (0, 1)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(p, ".filler"))

    def wipe_node(self, node: int) -> None:
        p = os.path.join(self.nodes, f"node{node}")
        for name in os.listdir(p):
            full = os.path.join(p, name)
            shutil.rmtree(full) if os.path.isdir(full) and not os.path.islink(full) else os.unlink(full)

    def release(self) -> None:
        for p in reversed(self.mounts):
            subprocess.run(["umount", "-l", p], capture_output=True, timeout=30)
        self.mounts = []


def local_files(disk: Disk) -> list[tuple[int, int, str]]:
    """``(node, step, path)`` of every committed local-tier shard file of both nodes."""
    from hyper_parallel.core.distributed_checkpoint._src.manager.local_format import parse_shard_file_name

    out = []
    for node in (0, 1):
        base = os.path.join(disk.nodes, f"node{node}")
        for root, _, names in sorted(os.walk(base)):
            for name in sorted(names):
                parsed = parse_shard_file_name(name)
                if parsed is not None:
                    out.append((node, parsed[0], os.path.join(root, name)))
    return out


def flip_local_bit(disk: Disk, seed: int, region: str) -> dict | None:
    """Flip one bit of one local-tier file of one node (the job is stopped); what was flipped,
    or None (no local file). The file: of the node's newest step 3 times in 4 (the one the
    next start would load), else of any step it holds; a payload flip hits the node's own
    copy 3 times in 4 (the one its ranks read; a replica is read only when that is missing).
    ``region``: ``"header"`` (the first 8 + N bytes: the length and the JSON header with the
    manifest, which holds every non-tensor value) or ``"payload"`` (a byte of one tensor,
    array or bytes payload, picked from the manifest)."""
    rnd = random.Random(seed)
    files = local_files(disk)
    if not files:
        return None
    node = rnd.choice(sorted({f[0] for f in files}))
    mine = [f for f in files if f[0] == node]
    newest = max(f[1] for f in mine)
    step = newest if rnd.random() < 0.75 else rnd.choice(sorted({f[1] for f in mine}))
    cands = sorted(f[2] for f in mine if f[1] == step)
    facts = {}
    for path in cands:  # the files are whole (or an earlier flip damaged them: then guess)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            size = os.fstat(f.fileno()).st_size
            text = f.read(n) if 0 < n <= size - 8 else b""
        try:
            man = json.loads(json.loads(text)["__metadata__"]["hp_local"])
            owner_node = man["rank"] * 2 // man["world_size"]
            spans = [(key, rec["start"], rec["nbytes"]) for key, rec in sorted(man["entries"].items())
                     if rec.get("nbytes")]
        except (ValueError, KeyError, TypeError, ZeroDivisionError):
            owner_node, spans = None, [("?", 0, max(0, size - 8 - n))]
        facts[path] = (n, size, owner_node == node, spans)
    if region == "payload" and rnd.random() < 0.75 and any(facts[p][2] for p in cands):
        cands = [p for p in cands if facts[p][2]]
    path = rnd.choice(cands)
    n, size, own, spans = facts[path]
    entry = None
    if region == "header" or not any(nb for _, _, nb in spans) or 8 + n >= size:
        region, offset = "header", rnd.randrange(min(size, 8 + n) or 1)
    else:
        entry, start, nbytes = rnd.choice([sp for sp in spans if sp[2]])
        offset = 8 + n + start + rnd.randrange(nbytes)
    bit = rnd.randrange(8)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ (1 << bit)]))
    return {"node": node, "step": step, "newest": step == newest, "own_copy": own,
            "file": os.path.relpath(path, disk.nodes), "region": region, "entry": entry,
            "offset": offset, "bit": bit, "header_bytes": 8 + n, "size": size}


def committed_steps(directory: str) -> list[int]:
    from hyper_parallel.core.distributed_checkpoint import list_steps

    return [i.step for i in list_steps(directory) if i.state == "committed"]


KINDS = {"kill": 50, "storage": 25, "disk_full": 18, "stall": 7, "local_bitflip": 15}  # relative weights


def plan_fault(rng: random.Random, sizes: list[int], last_ws: int, disk: Disk,
               args: argparse.Namespace, forced: str | None = None) -> tuple[int, dict]:
    """The next start's world size and fault: its kind, its victims, and when it strikes.
    ``forced``: the kind (``local_bitflip:header``/``:payload`` names the region too)."""
    ws = rng.choice(sizes)
    kinds = [k for k in args.kinds.split(",") if k]
    kind = rng.choices(kinds, [KINDS[k] for k in kinds])[0]
    detail = None
    if forced:
        kind, _, detail = forced.partition(":")
    # when: during the manager's start and recovery, or at a random step of the run (+ up to a step more)
    trigger = {"phase": rng.choice(["start", "load"])} if rng.random() < 0.3 else {"step": rng.randint(1, args.steps)}
    trigger["delay_s"] = rng.uniform(0, 0.15)
    # a disk kept full from the last fault through this start may fail it before this fault strikes
    fault: dict[str, Any] = {"kind": kind, "trigger": trigger, "disk_still_full": disk.full_until is not None}
    if kind == "kill":
        scope = rng.choices(["rank", "node", "all"], [6, 3, 1])[0]
        node = rng.randrange(2)
        fault["victims"] = ([rng.randrange(ws)] if scope == "rank" else list(range(ws)) if scope == "all"
                            else [r for r in range(ws) if r * 2 // ws == node])
        fault["scope"] = scope
        fault["wipe_node"] = node if scope == "node" and rng.random() < 0.5 else None
    elif kind == "stall":
        fault["victims"] = [rng.randrange(ws)]
    elif kind == "local_bitflip":
        # between starts, while the job is stopped; the next start on the world size of the
        # last one (whose files the flip most likely hits) must load the right values
        ws = last_ws if last_ws in sizes else ws
        fault["region"] = detail or rng.choice(["header", "payload"])
        fault["seed"] = rng.getrandbits(32)
    elif kind == "disk_full":
        fault["where"] = "durable" if disk.mode == "inject" or rng.random() < 0.6 else f"node{rng.randrange(2)}"
        # the space comes back after the next start (which must cope with a full disk too)
        fault["keep_full"] = disk.mode == "tmpfs" and rng.random() < 0.3
        if disk.mode == "inject":
            fault["storage_fault"] = {"rank": rng.randrange(ws), "op": "write_file", "when": "partial",
                                      "nth": rng.randint(1, 3), "errno": errno.ENOSPC}
    else:
        op = rng.choice(WRITER_OPS + READER_OPS + DIRECTORY_OPS)
        when = "before"
        if op == "write_file":
            when = rng.choice(["before", "partial"])
        elif op == "commit":
            when = rng.choice(["before", "after"])
        if op in READER_OPS and len(sizes) > 1:  # reads of the durable tier: a start on another world size
            ws = rng.choice([s for s in sizes if s != last_ws])
        rank = 0 if op in ("read_committed", "commit") + DIRECTORY_OPS else rng.randrange(ws)  # the coordinator's calls
        fault["storage_fault"] = {"rank": rank, "op": op, "when": when, "nth": rng.randint(1, 3), "errno": errno.EIO}
    return ws, fault


def _triggered(trigger: dict, logs: list[list[dict]]) -> bool:
    events = [e for log in logs for e in log]
    if "phase" in trigger:
        return any(e["ev"] == "phase" and e["phase"] in (trigger["phase"], "train") for e in events)
    steps = [e["step"] for e in events if e["ev"] == "step"]
    resumed = [e["step"] for e in events if e["ev"] == "resumed"]
    return bool(resumed and steps and max(steps) - min(resumed) >= trigger["step"])


def run_once(n: int, ws: int, fault: dict | None, args: argparse.Namespace, disk: Disk, ctx) -> dict:
    """One start of the job, with ``fault`` injected; what happened."""
    logs_dir = os.path.join(args.work, "logs", f"run{n:05d}")
    os.makedirs(logs_dir)
    store = os.path.join(logs_dir, "store")
    cfg = {"dir": disk.dir, "nodes": disk.nodes, "logs": logs_dir, "timeout": args.timeout, "steps": args.steps,
           "durable_every": 4, "step_s": args.step_s,
           "check_every_step": fault is None or fault["kind"] == "local_bitflip",
           "incremental_check": args.incremental_check,
           "storage_fault": (fault or {}).get("storage_fault")}
    from benchmarks.bench_chaos import _worker as worker  # by its module name: the forkserver imported it

    committed_before = committed_steps(disk.dir)
    if fault is not None and fault["kind"] == "local_bitflip":
        fault["flip"] = flip_local_bit(disk, fault["seed"], fault["region"])
    started = time.monotonic()
    procs = [ctx.Process(target=worker, args=(r, ws, store, cfg), daemon=True) for r in range(ws)]
    for p in procs:
        p.start()
    paths = [os.path.join(logs_dir, f"r{r}.jsonl") for r in range(ws)]
    struck_at: float | None = None
    killed_stalled = False
    hang = False
    filled = 0
    # a start that runs long past the expected end is a hang too (nothing else bounds a livelock)
    expected_end = started + args.start_budget + args.steps * (args.step_s + args.step_budget)
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        now = time.monotonic()
        if fault is not None and struck_at is None and fault["kind"] in ("kill", "stall", "disk_full"):
            if _triggered(fault["trigger"], [read_log(p) for p in paths]):
                time.sleep(fault["trigger"]["delay_s"])
                struck_at = time.monotonic()
                if fault["kind"] == "disk_full":
                    if disk.mode == "tmpfs":
                        filled = disk.fill(fault["where"])
                else:
                    for r in fault["victims"]:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(procs[r].pid, signal.SIGSTOP if fault["kind"] == "stall" else signal.SIGKILL)
        if fault is not None and fault["kind"] == "stall" and struck_at is not None and not killed_stalled:
            others = [p for r, p in enumerate(procs) if r not in fault["victims"]]
            if all(p.exitcode is not None for p in others) or now > struck_at + 3 * args.timeout + args.grace:
                killed_stalled = True
                for r in fault["victims"]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(procs[r].pid, signal.SIGKILL)
        bound = expected_end + args.timeout + args.grace
        if struck_at is not None and fault["kind"] in ("kill", "stall"):
            bound = struck_at + HANG_TIMEOUTS * args.timeout + args.grace
        if now > bound:
            hang = True
            for p in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join(10)
            break
        time.sleep(0.01)
    for p in procs:
        p.join(10)
    wall = time.monotonic() - started
    logs = [read_log(p) for p in paths]
    if disk.full_until == n:
        disk.unfill()
    if fault is not None and fault["kind"] == "disk_full":
        if fault.get("keep_full"):
            disk.full_until = n + 1
        else:
            disk.unfill()
    if fault is not None and fault.get("wipe_node") is not None:
        disk.wipe_node(fault["wipe_node"])
    shutil.rmtree(logs_dir, ignore_errors=True) if not args.keep_logs else None
    record = summarize(n, ws, fault, logs, procs, committed_before, struck_at, hang, wall, filled, args)
    committed = committed_steps(disk.dir)
    record["committed_after"] = committed[-1] if committed else None
    fresh = [s for s in committed if s not in disk.verified]
    record["wrong_committed"] = {s: bad for s in fresh for bad in [verify_committed(disk.dir, s)] if bad}
    record["verified"] = len(fresh)
    disk.verified.update(committed)
    return record


def summarize(n: int, ws: int, fault: dict | None, logs: list[list[dict]], procs: list, committed_before: list[int],
              struck_at: float | None, hang: bool, wall: float, filled: int, args: argparse.Namespace) -> dict:
    fired = [e for log in logs for e in log if e["ev"] == "fired"]
    resumed = [next((e for e in log if e["ev"] == "resumed"), None) for log in logs]
    errors = {r: next(e for e in log if e["ev"] == "error") for r, log in enumerate(logs)
              if any(e["ev"] == "error" for e in log)}
    done = [any(e["ev"] == "done" for e in log) for log in logs]
    steps = [max([e["step"] for e in log if e["ev"] == "step"], default=None) for log in logs]
    victims = set(fault.get("victims", [])) if fault else set()
    struck = fault is not None and (struck_at is not None or bool(fired) or bool(fault.get("flip")))
    record: dict[str, Any] = {
        "run": n, "ws": ws, "fault": fault, "struck": struck, "wall_s": round(wall, 2), "hang": hang,
        "committed_before": committed_before[-1] if committed_before else None, "filled_bytes": filled,
        "exit_codes": [p.exitcode for p in procs], "reached": steps, "completed": all(done)}
    ok_resumes = [e for e in resumed if e is not None]
    if ok_resumes:
        got = {e["step"] for e in ok_resumes}
        record["resumed"] = sorted(got)
        record["source"] = sorted({e["source"] for e in ok_resumes})
        record["wrong"] = {r: e["wrong"] for r, e in enumerate(resumed) if e is not None and e["wrong"]}
        if len(got) > 1:
            record["wrong"]["disagree"] = sorted(got)
        newest = committed_before[-1] if committed_before else 0
        record["lost"] = max(0, newest - min(got))
    # local copies that failed their check and were left out (rank 0's warnings name each file)
    record["refused"] = [m for e in resumed if e is not None for m in e.get("refused", [])]
    flip = (fault or {}).get("flip")
    if flip:
        record["flip_detected"] = any(flip["file"] in m for m in record["refused"])
        if ok_resumes:  # what loaded instead of the flipped copy
            at, src = min(got), record["source"][0]
            record["flip_outcome"] = (
                "not read" if not record["flip_detected"] else src if src != "local"
                else "another copy" if at == flip["step"] else "an older local step" if at < flip["step"]
                else "a newer local step")
    behind = [e.get("behind", {}) for log in logs for e in log if e["ev"] == "done"]
    record["behind"] = dict(sum((Counter(b) for b in behind), Counter()))
    drift = [e for log in logs for e in log if e["ev"] in ("drift",) or (e["ev"] == "done" and e["wrong"])]
    if drift:
        record.setdefault("wrong", {})["fault_free_run"] = drift[:3]
    record["errors"] = {r: {"type": e["type"], "clear": e["clear"], "message": e["message"][:600],
                            "after_fault_s": round(e["t"] - (time.time() - (time.monotonic() - struck_at)), 2)
                            if struck_at is not None else None,
                            **({"trace": e["trace"]} if not e["clear"] or not struck else {})}
                        for r, e in errors.items()}
    survivors = [r for r in range(ws) if r not in victims]
    record["survivor_errors"] = [r for r in survivors if r in errors]
    record["late"] = [r for r in survivors if r in errors and record["errors"][r]["after_fault_s"] is not None
                      and fault["kind"] in ("kill", "stall")
                      and record["errors"][r]["after_fault_s"] > LATE_TIMEOUTS * args.timeout + 5]
    # a failure is expected only once a fault struck; anything else is a bug (or a missed fault)
    # (a flipped bit in a local copy must cost nothing: another copy or the durable tier loads)
    # A start on a disk kept full from the last fault may fail before its own fault strikes, with
    # the full disk's error and nothing else (every error clear and naming ENOSPC).
    full_disk_only = bool(fault and fault.get("disk_still_full") and errors and all(
        e["clear"] and "No space left on device" in e["message"] for e in record["errors"].values()))
    tolerated = full_disk_only or (struck and fault["kind"] != "local_bitflip")
    record["unexpected_failure"] = bool(errors or not all(done) or hang) and not tolerated
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", type=int, default=300, help="stop after this many faults struck")
    parser.add_argument("--minutes", type=float, default=30.0, help="... or after this long")
    parser.add_argument("--sizes", default="2,4", help="world sizes a start picks from")
    parser.add_argument("--steps", type=int, default=12, help="training steps per start")
    parser.add_argument("--step-s", type=float, default=0.02, help="compute time of a step (a sleep)")
    parser.add_argument("--timeout", type=float, default=10.0, help="the manager's timeout (s)")
    parser.add_argument("--grace", type=float, default=15.0,
                        help="seconds past the timeout a rank may take to exit before it counts as a hang")
    parser.add_argument("--start-budget", type=float, default=40.0, help="seconds a start may take to begin training")
    parser.add_argument("--step-budget", type=float, default=2.0, help="seconds a step may take (saves included)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds drawn from (of {', '.join(KINDS)})")
    parser.add_argument("--first", default="",
                        help="kinds of the first faults, in order (then drawn at random), e.g. "
                             "local_bitflip:header,local_bitflip:payload")
    parser.add_argument("--disk", choices=("auto", "tmpfs", "inject"), default="auto",
                        help="disk-full faults: a small tmpfs filled up (root), or an injected ENOSPC")
    parser.add_argument("--incremental-check", choices=("content", "version_counter"), default="content",
                        help="the manager's incremental_check (version_counter: the opt-in that trusts torch's "
                             "version counter, which the writes behind it defeat; the soak should then fail)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=None, help="working directory (default: a temporary one, removed)")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--json", default=None, help="write every start's record and the figures here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    first = [k for k in args.first.split(",") if k]
    for k in [k for k in args.kinds.split(",") if k] + [f.partition(":")[0] for f in first]:
        if k not in KINDS:
            parser.error(f"unknown fault kind {k!r} (kinds: {', '.join(KINDS)})")
    rng = random.Random(args.seed)
    made_work = args.work is None
    args.work = args.work or tempfile.mkdtemp(prefix="hp-chaos-")
    disk = Disk(args.work, args.disk, durable_mib=48, node_mib=32)
    ctx = _context()
    records: list[dict] = []
    began = time.monotonic()
    try:
        # the fault-free run: every step checked against the closed form, then a restart that resumes it
        for n in range(2):
            records.append(run_once(n, 4, None, args, disk, ctx))
            report_line(records[-1])
        n = 2
        while sum(r["struck"] for r in records) < args.faults and time.monotonic() - began < args.minutes * 60:
            planned = sum(1 for r in records if r["fault"] is not None)
            ws, fault = plan_fault(rng, sizes, records[-1]["ws"], disk, args,
                                   first[planned] if planned < len(first) else None)
            records.append(run_once(n, ws, fault, args, disk, ctx))
            report_line(records[-1])
            n += 1
        records.append(run_once(n, rng.choice(sizes), None, args, disk, ctx))  # and a last, clean resume
        report_line(records[-1])
    finally:
        disk.release()
        if made_work:
            shutil.rmtree(args.work, ignore_errors=True)
    figures = figures_of(records, time.monotonic() - began, disk.mode, args)
    print_figures(figures, args)
    if args.json:
        write_json(args.json, {"args": vars(args), "figures": figures, "runs": records})
    failed = figures["committed_steps_lost"] or figures["wrong_resumes"] or figures["hangs"] or \
        figures["unclear_errors"] or figures["unexpected_failures"] or figures["wrong_committed_steps"]
    sys.exit(1 if failed else 0)


def report_line(r: dict) -> None:
    f = r["fault"]
    flip = (f or {}).get("flip")
    what = "no fault" if f is None else f["kind"] + (f" {f.get('scope', '')} {f.get('victims', '')}" if "victims" in f
                                                      else f" {f.get('where', '')}" if f["kind"] == "disk_full"
                                                      else f" {f['region']} (no local file)"
                                                      if f["kind"] == "local_bitflip" and not flip
                                                      else f" {flip['region']} node{flip['node']} step {flip['step']}"
                                                      f"{'' if flip['own_copy'] else ' replica'}"
                                                      if f["kind"] == "local_bitflip"
                                                      else f" {f['storage_fault']['op']}/{f['storage_fault']['when']}"
                                                      f" #{f['storage_fault']['nth']} r{f['storage_fault']['rank']}")
    flags = [k for k in ("hang", "unexpected_failure", "late") if r.get(k)] + (
        ["WRONG"] if r.get("wrong") else []) + ([f"LOST {r['lost']}"] if r.get("lost") else []) + (
        [f"WRONG COMMITTED {r['wrong_committed']}"] if r.get("wrong_committed") else []) + (
        ["kept full"] if (r["fault"] or {}).get("keep_full") else []) + (
        ["copy refused" + (" (the flipped one)" if r.get("flip_detected") else "")] if r.get("refused") else [])
    print(f"run {r['run']:4d} ws={r['ws']} {what:<44} struck={int(r['struck'])} resumed={r.get('resumed')} "
          f"{r.get('source')} reached={max((s for s in r['reached'] if s is not None), default=None)} "
          f"errors={sorted({e['type'] for e in r['errors'].values()})} {r['wall_s']:.1f}s {' '.join(flags)}",
          flush=True)
    for rank, e in r["errors"].items():
        if "trace" in e and (not e["clear"] or not r["struck"]):
            print(f"    rank {rank}: {e['trace'][-1500:]}", flush=True)


def figures_of(records: list[dict], seconds: float, disk_mode: str, args: argparse.Namespace) -> dict:
    struck = [r for r in records if r["struck"]]
    kinds = Counter()
    for r in struck:
        f = r["fault"]
        kinds[f["kind"] if f["kind"] != "kill" else f"kill_{f['scope']}"] += 1
        if f["kind"] == "storage":
            kinds[f"storage:{f['storage_fault']['op']}/{f['storage_fault']['when']}"] += 1
        if f["kind"] == "local_bitflip":
            kinds[f"local_bitflip:{f['flip']['region']}"] += 1
    after = [e["after_fault_s"] for r in struck if r["fault"]["kind"] == "kill" for rank, e in r["errors"].items()
             if e["after_fault_s"] is not None and int(rank) not in r["fault"]["victims"]]
    stall_after = [e["after_fault_s"] for r in struck if r["fault"]["kind"] == "stall"
                   for rank, e in r["errors"].items()
                   if e["after_fault_s"] is not None and int(rank) not in r["fault"]["victims"]]
    resumes = [r for r in records if "resumed" in r]
    flips = [r for r in struck if r["fault"]["kind"] == "local_bitflip"]
    refused = [r for r in resumes if r.get("refused")]
    return {
        "seconds": round(seconds, 1), "disk_full_by": disk_mode, "starts": len(records),
        "faults_struck": len(struck), "faults_by_kind": dict(sorted(kinds.items())),
        "faults_planned_not_struck": sum(1 for r in records if r["fault"] is not None and not r["struck"]),
        "resumes": len(resumes), "resumes_by_source": dict(Counter(s for r in resumes for s in r["source"])),
        "resumes_by_world_size": dict(Counter(r["ws"] for r in resumes)),
        # local-tier bit flips: the flipped copy named in a warning (left out), or never read
        # (a replica whose own copy was read, a step older than the one loaded); and every
        # resume whose recovery left out a copy that failed its check, by what loaded instead
        "local_bitflips": len(flips),
        "local_bitflips_detected": {reg: sum(1 for r in flips if r["fault"]["flip"]["region"] == reg
                                             and r.get("flip_detected")) for reg in ("header", "payload")},
        "local_bitflips_not_read": sum(1 for r in flips if not r.get("flip_detected")),
        "local_bitflip_loaded_instead": dict(Counter(r.get("flip_outcome", "no resume") for r in flips)),
        "resumes_after_refused_copy": len(refused),
        "resumes_after_refused_copy_by_source": dict(Counter(s for r in refused for s in r["source"])),
        "refused_runs": [r["run"] for r in refused],
        "writes_behind_counter": dict(sum((Counter(r.get("behind", {})) for r in records), Counter())),
        "committed_steps_lost": sum(r.get("lost", 0) for r in records),
        "starts_losing_committed_steps": [r["run"] for r in records if r.get("lost")],
        "wrong_resumes": sum(1 for r in records if r.get("wrong")),
        "wrong_runs": [r["run"] for r in records if r.get("wrong")],
        "hangs": sum(1 for r in records if r["hang"]), "hang_runs": [r["run"] for r in records if r["hang"]],
        "late_errors": sum(len(r["late"]) for r in records), "late_runs": [r["run"] for r in records if r["late"]],
        "committed_steps_verified": sum(r["verified"] for r in records),
        "wrong_committed_steps": sum(len(r["wrong_committed"]) for r in records),
        "wrong_committed_runs": [r["run"] for r in records if r["wrong_committed"]],
        "unclear_errors": sum(1 for r in records for e in r["errors"].values() if not e["clear"]),
        "unclear_runs": [r["run"] for r in records if any(not e["clear"] for e in r["errors"].values())],
        "unexpected_failures": sum(1 for r in records if r["unexpected_failure"]),
        "unexpected_runs": [r["run"] for r in records if r["unexpected_failure"]],
        "survivor_error_s_after_kill": _dist(after), "survivor_error_s_after_stall": _dist(stall_after),
        "steps_redone_per_fault": _dist([max(s for s in prev["reached"] if s is not None) - min(nxt["resumed"])
                                         for prev, nxt in zip(records, records[1:], strict=False)
                                         if prev["struck"] and "resumed" in nxt
                                         and any(s is not None for s in prev["reached"])]),
        "timeout_s": args.timeout, "world_sizes": args.sizes, "steps_per_start": args.steps,
    }


def _dist(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    vals = sorted(values)
    return {"n": len(vals), "median": round(statistics.median(vals), 3),
            "p90": round(vals[int(0.9 * (len(vals) - 1))], 3), "max": round(vals[-1], 3)}


def print_figures(fig: dict, args: argparse.Namespace) -> None:
    print(f"\nchaos soak: {fig['faults_struck']} faults in {fig['starts']} starts, {fig['seconds']:.0f} s "
          f"(timeout {fig['timeout_s']:g} s, world sizes {fig['world_sizes']}, {fig['steps_per_start']} steps per "
          f"start, disk full by {fig['disk_full_by']})")
    print("  faults by kind: " + ", ".join(f"{k} {v}" for k, v in fig["faults_by_kind"].items()))
    print(f"  resumes {fig['resumes']} (by source {fig['resumes_by_source']}, by world size "
          f"{fig['resumes_by_world_size']}); steps redone per fault {fig['steps_redone_per_fault']}")
    print(f"  local-tier bit flips {fig['local_bitflips']}: the flipped copy refused (header / payload) "
          f"{fig['local_bitflips_detected']['header']} / {fig['local_bitflips_detected']['payload']}, never read "
          f"{fig['local_bitflips_not_read']}; what loaded: {fig['local_bitflip_loaded_instead']}")
    print(f"  resumes whose recovery left out a local copy that failed its check {fig['resumes_after_refused_copy']} "
          f"(resumed from {fig['resumes_after_refused_copy_by_source']})")
    print(f"  shard updates written behind the version counter (completed starts, all ranks): "
          f"{fig['writes_behind_counter']}")
    print(f"  survivors raised after a kill (s): {fig['survivor_error_s_after_kill']}; after a stall: "
          f"{fig['survivor_error_s_after_stall']}")
    print(f"  committed durable steps loaded whole by the driver and checked bit for bit: "
          f"{fig['committed_steps_verified']}")
    for key, runs in (("committed_steps_lost", "starts_losing_committed_steps"), ("wrong_resumes", "wrong_runs"),
                      ("wrong_committed_steps", "wrong_committed_runs"), ("hangs", "hang_runs"),
                      ("late_errors", "late_runs"), ("unclear_errors", "unclear_runs"),
                      ("unexpected_failures", "unexpected_runs")):
        print(f"  {key.replace('_', ' '):<24} {fig[key]}  {fig[runs] if fig[runs] else ''}")


if __name__ == "__main__":
    main()
