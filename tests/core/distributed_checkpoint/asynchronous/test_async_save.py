"""async_save: the checkpoint holds the state at call time; failures reach every rank; exit and
kill never leave a half-written checkpoint that looks complete; staging buffers are reused.

Multi-rank checks run on 2 real gloo processes, several per launch (launching is the cost).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import Counter, assert_same, make_dtensor, make_tensor, zeros_like_tree
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import (
    AsyncCheckpointer,
    AsyncSaveError,
    AsyncStagingError,
    CheckpointError,
    FileSystemWriter,
    NotACheckpointError,
    RankFailedError,
    async_save,
    load,
    register_optimizer_hook,
    save,
)
from hyper_parallel.core.distributed_checkpoint._src.asynchronous import buffers as staging_buffers

# ----------------------------------------------------------------------------- helpers


def build_state(ws: int, seed: int = 0) -> dict:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    return {
        "model": {
            "s0": make_dtensor(make_tensor((7, 5), seed=seed + 1), mesh, [Shard(0)]),
            "s1": make_dtensor(make_tensor((3, 9), seed=seed + 2), mesh, [Shard(1)]),
            "rep": make_dtensor(make_tensor((4, 4), seed=seed + 3), mesh, [Replicate()]),
            "half": make_dtensor(make_tensor((6, 2), torch.bfloat16, seed=seed + 4), mesh, [Shard(0)]),
            "plain": make_tensor((3, 2), seed=seed + 5),
            "view": make_tensor((6, 4), seed=seed + 6)[1:5, ::2],
            "ints": make_tensor((5,), torch.int64, seed=seed + 7),
        },
        "optim": {"state": {0: {"exp_avg": make_tensor((8,), seed=seed + 8), "step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
        "array": np.arange(12, dtype=np.float32).reshape(3, 4) + seed,
        "blob": b"\x00bytes",
        "counter": Counter(4),
        "step": 10 + seed,
        "list": [make_tensor((2,), seed=seed + 9), 5],
    }


def snapshot(sd: dict) -> dict:
    """An independent copy of what the checkpoint must hold (Stateful -> its state dict)."""
    out = zeros_like_tree({k: (v.state_dict() if isinstance(v, Counter) else v) for k, v in sd.items()})
    copy_into(out, {k: (v.state_dict() if isinstance(v, Counter) else v) for k, v in sd.items()})
    return out


def copy_into(dst, src) -> None:
    for k in src:
        a, b = dst[k], src[k]
        if isinstance(b, DTensor):
            a.to_local().copy_(b.to_local())
        elif isinstance(b, torch.Tensor):
            a.copy_(b)
        elif isinstance(b, np.ndarray):
            a[...] = b
        elif isinstance(b, dict):
            copy_into(a, b)
        elif isinstance(b, list):
            copy_into(dict(enumerate(a)), dict(enumerate(b)))


def mutate(sd: dict) -> None:
    """What training does right after async_save returns: in-place updates, frees, reassignments."""
    with torch.no_grad():
        for key in ("s0", "s1", "rep", "half"):
            sd["model"][key].to_local().add_(1000)
        sd["model"]["plain"].add_(1000)
        sd["model"]["ints"].mul_(-1)
        sd["optim"]["state"][0]["exp_avg"].add_(1000)
        sd["optim"]["state"][0]["step"] += 1
    sd["optim"]["param_groups"][0]["lr"] = 99.0  # a plain value changed in place
    sd["array"] += 1000
    sd["counter"].n += 1
    sd["counter"].hist.add_(1000)
    sd["list"][0] = torch.full((2,), 1000.0)  # reassigned
    sd["step"] += 1


def load_back(expected: dict, path: str) -> dict:
    """Load into a zeroed target of the same layout, with every plain value blanked."""
    target = zeros_like_tree(expected)
    target["step"], target["blob"], target["optim"]["param_groups"] = None, b"", None
    target["counter"]["n"], target["list"][1] = None, None
    load(target, path)
    return target


# ----------------------------------------------------------------------------- 2 ranks: snapshot


def rank_snapshot(rank: int, ws: int, root: str) -> dict:
    ckpt = AsyncCheckpointer()
    sd = build_state(ws)
    calls: list = []
    expected, responses = [], []
    for i in range(3):  # three back-to-back saves, training changes everything in between
        expected.append(snapshot(sd))
        responses.append(ckpt.save(sd, os.path.join(root, f"step{i}"), callback=calls.append))
        mutate(sd)
        # training collectives on the default group while the save runs on its own group
        for _ in range(5):
            t = torch.full((4,), float(rank + 1))
            dist.all_reduce(t)
            assert torch.equal(t, torch.full((4,), float(ws * (ws + 1) // 2))), "training collective corrupted"
    metas = [r.result(timeout=60) for r in responses]
    assert calls == responses, "the callback runs once per save, before result() returns"
    assert all(r.done() and r.persist_completion.done() for r in responses)
    for i, exp in enumerate(expected):
        assert_same(exp, load_back(exp, os.path.join(root, f"step{i}")), f"step{i}")
    # the first save's tensors are freed right after the call: the snapshot is independent
    sd2 = build_state(ws, seed=50)
    exp2 = snapshot(sd2)
    resp = ckpt.save(sd2, os.path.join(root, "freed"))
    for t in (sd2["model"]["s0"].to_local(), sd2["model"]["plain"], sd2["optim"]["state"][0]["exp_avg"]):
        t.untyped_storage().resize_(0)
    del sd2
    resp.result(timeout=60)
    assert_same(exp2, load_back(exp2, os.path.join(root, "freed")), "freed")
    # the same planning as a synchronous save: identical entries, chunk boxes and checksums
    sd3 = build_state(ws, seed=7)
    sync_meta = save(sd3, os.path.join(root, "sync"))
    async_meta = ckpt.save(sd3, os.path.join(root, "async")).result(timeout=60)
    if rank == 0:
        def entries(meta):
            return {k: (e.kind, e.path, e.dtype, e.shape, e.layout, e.value,
                        [(c.offsets, c.sizes, c.crc32c) for c in e.chunks]) for k, e in meta.entries.items()}
        assert entries(sync_meta) == entries(async_meta), "async planning differs from save()"
    stats = ckpt.stats
    ckpt.close()
    return {"allocations": stats.allocations, "reuses": stats.reuses,
            "meta_types": [type(m).__mro__[1].__name__ for m in metas]}  # a view of the committed Metadata


def test_checkpoint_holds_the_values_at_call_time_across_back_to_back_saves(tmp_path):
    out = run_ranks(rank_snapshot, 2, str(tmp_path))
    assert out[0]["meta_types"] == ["Metadata"] * 3 and out[1]["meta_types"] == ["Metadata"] * 3  # every rank
    for info in out:
        # one structure (the same keys, shapes and layouts every time): one staging allocation
        assert info["allocations"] == 1 and info["reuses"] == 4, info


def rank_load_between_saves(rank: int, ws: int, root: str) -> dict:
    """A job that saves and loads in turn: a load in between keeps the staging buffer (it is
    found by the state's structure, not by its tensors), and the call right after a load
    still snapshots the values of that moment."""
    ckpt = AsyncCheckpointer()
    sd = build_state(ws)
    ckpt.save(sd, os.path.join(root, "first")).result(timeout=60)
    allocated = ckpt.stats.allocations
    for i in range(2):
        mutate(sd)
        load(sd, os.path.join(root, "first"))  # in place: the same tensors get the saved values
        expected = snapshot(sd)
        resp = ckpt.save(sd, os.path.join(root, f"after_load{i}"))  # the first call after a load
        mutate(sd)  # training changes everything right after the call returns
        resp.result(timeout=60)
        assert_same(expected, load_back(expected, os.path.join(root, f"after_load{i}")), f"after_load{i}")
    fresh = build_state(ws, seed=3)  # a state rebuilt with new tensors and a new mesh, then loaded
    load(fresh, os.path.join(root, "first"))
    expected = snapshot(fresh)
    resp = ckpt.save(fresh, os.path.join(root, "rebuilt"))
    mutate(fresh)
    resp.result(timeout=60)
    assert_same(expected, load_back(expected, os.path.join(root, "rebuilt")), "rebuilt")
    stats = ckpt.stats
    ckpt.close()
    return {"first": allocated, "allocations": stats.allocations, "reuses": stats.reuses}


def test_a_load_between_saves_keeps_the_staging_buffer_and_the_values_at_call_time(tmp_path):
    for info in run_ranks(rank_load_between_saves, 2, str(tmp_path)):
        assert info == {"first": 1, "allocations": 1, "reuses": 3}, info


# ----------------------------------------------------------------------------- 2 ranks: failures


class FailingWriter(FileSystemWriter):
    """Fails while writing data on rank ``bad`` only."""

    def __init__(self, path: str, bad: int):
        super().__init__(path)
        self.bad = bad

    def write_file(self, name, parts):
        if dist.get_rank() == self.bad:
            raise OSError(28, "No space left on device (injected)")
        return super().write_file(name, parts)


def rank_failures(rank: int, ws: int, root: str) -> str:
    ckpt = AsyncCheckpointer()
    sd = build_state(ws)
    blocker = os.path.join(root, "a_file")
    if rank == 0:
        open(blocker, "w").close()
    dist.barrier()
    # 1. an unwritable destination (a path under a regular file): every rank fails
    resp = ckpt.save(sd, os.path.join(blocker, "ckpt"))
    with pytest.raises(RankFailedError, match="Not a directory") as info:
        resp.result(timeout=60)
    assert sorted(info.value.failures) == [0, 1], str(info.value)
    # ... and again on the next async_save, which starts nothing
    with pytest.raises(AsyncSaveError, match="a_file") as again:
        ckpt.save(sd, os.path.join(root, "never"))
    assert isinstance(again.value.__cause__, RankFailedError)
    assert ckpt.in_flight == 0 and not os.path.exists(os.path.join(root, "never"))
    # 2. a write failing on rank 1 only fails every rank, names rank 1; wait() reports it again
    resp = ckpt.save(sd, os.path.join(root, "b"), storage_writer=FailingWriter(os.path.join(root, "b"), bad=1))
    with pytest.raises(RankFailedError, match="No space left") as info:
        resp.result(timeout=60)
    assert list(info.value.failures) == [1], str(info.value)
    with pytest.raises(AsyncSaveError, match="No space left"):
        ckpt.wait()
    ckpt.wait()  # reported once
    # 3. a snapshot failing on rank 1 only (a tensor without data) fails every rank, cleanly
    bad = dict(sd, extra=torch.empty(3, device="meta") if rank == 1 else torch.zeros(3))
    resp = ckpt.save(bad, os.path.join(root, "c"))
    with pytest.raises(RankFailedError, match="snapshot") as info:
        resp.result(timeout=60)
    assert list(info.value.failures) == [1], str(info.value)
    assert not os.path.exists(os.path.join(root, "c", ".metadata"))
    with pytest.raises(AsyncSaveError):
        ckpt.wait()
    # 4. the checkpointer keeps working afterwards
    exp = snapshot(sd)
    ckpt.save(sd, os.path.join(root, "d")).result(timeout=60)
    assert_same(exp, load_back(exp, os.path.join(root, "d")))
    ckpt.close()
    return "ok"


def test_background_failures_surface_on_every_rank_and_on_the_next_call(tmp_path):
    assert run_ranks(rank_failures, 2, str(tmp_path)) == ["ok", "ok"]


# ----------------------------------------------------------------------------- 2 ranks: lazy


def slow_copies(delay: float):
    real = staging_buffers.copy_into

    def copy_slowly(pairs):
        time.sleep(delay)
        real(pairs)

    return copy_slowly


def rank_lazy(rank: int, ws: int, path: str) -> dict:
    staging_buffers.copy_into = slow_copies(0.5)  # the snapshot is surely not done at step()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()  # creates momentum buffers
    ckpt = AsyncCheckpointer()
    handle = register_optimizer_hook(opt, ckpt)
    mesh = init_device_mesh("cpu", (ws,))
    sd = {"model": model.state_dict(), "optim": opt.state_dict(),
          "shard": make_dtensor(make_tensor((5, 3)), mesh, [Shard(0)])}
    ckpt.save(sd, path + "_warmup").result(timeout=60)  # the first call also makes the gloo group
    before = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    resp = ckpt.save(sd, path, staging="lazy")
    returned_unstaged = not resp.staged()
    model(torch.randn(4, 6)).sum().backward()  # forward/backward overlap the copies
    t0 = time.perf_counter()
    opt.step()  # the hook waits for the snapshot before parameters change
    waited = time.perf_counter() - t0
    assert resp.staged()
    assert not torch.equal(model[0].weight, before["0.weight"]), "step changed nothing"
    resp.result(timeout=60)
    handle.remove()
    out = load(path=path)
    for k, v in before.items():
        assert torch.equal(out["model"][k], v), f"model.{k}: not the value at async_save time"
    for i, m in enumerate(momentum):
        assert torch.equal(out["optim"]["state"][i]["momentum_buffer"], m), f"momentum {i}"
    assert torch.equal(out["shard"], make_tensor((5, 3)))
    ckpt.close()
    return {"unstaged": returned_unstaged, "blocking_s": resp.blocking_s, "waited": waited}


def test_lazy_staging_returns_at_once_and_the_optimizer_hook_protects_the_snapshot(tmp_path):
    for info in run_ranks(rank_lazy, 2, str(tmp_path / "ckpt")):
        assert info["unstaged"], info
        assert info["blocking_s"] < 0.25, info  # copies take >= 0.5 s here; none happen in the call
        assert info["waited"] > 0.05, info


# ----------------------------------------------------------------------------- exit and kill


class HookedWriter(FileSystemWriter):
    """Sleeps before writing data, or SIGKILLs its own process in the middle of a data file."""

    def __init__(self, path: str, sleep: float = 0.0, kill: bool = False):
        super().__init__(path)
        self.sleep, self.kill = sleep, kill

    def write_file(self, name, parts):
        time.sleep(self.sleep)
        if not self.kill:
            return super().write_file(name, parts)

        def half():
            it = iter(parts)
            yield next(it)  # the safetensors header, then die
            os.kill(os.getpid(), signal.SIGKILL)

        return super().write_file(name, half())


def exit_child(rank: int, ws: int, init_file: str, path: str, mode: str, arg: float) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=20))
    mesh = init_device_mesh("cpu", (ws,))
    old = {"w": make_dtensor(make_tensor((64, 32), seed=1), mesh, [Shard(0)]), "b": make_tensor((9,), seed=2)}
    new = {"w": make_dtensor(make_tensor((64, 32), seed=3), mesh, [Shard(0)]), "b": make_tensor((9,), seed=4)}
    if mode != "kill-fresh":
        save(old, path)
    if mode in ("kill", "kill-fresh"):
        async_save(new, path, storage_writer=HookedWriter(path, kill=True))
    elif mode == "kill-after":
        async_save(new, path)
        time.sleep(arg)
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "exit":  # return with the save in flight: process exit waits for it
        async_save(new, path, storage_writer=HookedWriter(path, sleep=arg))
    elif mode == "abandon":  # exit waits only 0.2 s: the save is abandoned, never committed
        ckpt = AsyncCheckpointer(exit_timeout_s=0.2)
        ckpt.save(new, path, storage_writer=HookedWriter(path, sleep=arg))
    if mode.startswith("kill"):
        time.sleep(60)  # killed before this ends


def launch(mode: str, path: str, arg: float = 0.0, ws: int = 2) -> list[int | None]:
    """Run ``exit_child`` on ``ws`` processes that exit by themselves; return their exit codes."""
    ctx = mp.get_context("forkserver")
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=exit_child, args=(r, ws, os.path.join(d, "store"), path, mode, arg))
                 for r in range(ws)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [p.exitcode for p in procs]


def outcome(path: str) -> str:
    """'none', 'old' or 'new' — a checkpoint that loads mixed or corrupt data fails the test."""
    try:
        out = load(path=path, no_dist=True)
    except NotACheckpointError:
        return "none"
    for name, seeds in (("old", (1, 2)), ("new", (3, 4))):
        if torch.equal(out["w"], make_tensor((64, 32), seed=seeds[0])):
            assert torch.equal(out["b"], make_tensor((9,), seed=seeds[1])), f"mixed checkpoint ({name} w)"
            return name
    raise AssertionError("the checkpoint holds neither the old nor the new values")


def test_a_process_killed_with_a_save_in_flight_leaves_a_complete_checkpoint_or_none(tmp_path):
    codes = launch("kill", str(tmp_path / "a"))
    assert codes == [-signal.SIGKILL] * 2, codes
    assert outcome(str(tmp_path / "a")) == "old"  # killed mid-write: the old one is intact
    assert launch("kill-fresh", str(tmp_path / "b")) == [-signal.SIGKILL] * 2
    assert outcome(str(tmp_path / "b")) == "none"
    seen = set()
    for i, delay in enumerate((0.0, 0.05, 0.3)):  # killed anywhere: old or new, whole
        assert launch("kill-after", str(tmp_path / f"r{i}"), delay) == [-signal.SIGKILL] * 2
        seen.add(outcome(str(tmp_path / f"r{i}")))
    assert seen <= {"old", "new"}, seen


def test_process_exit_waits_for_a_save_in_flight_or_abandons_it_uncommitted(tmp_path):
    assert launch("exit", str(tmp_path / "a"), 0.5) == [0, 0]
    assert outcome(str(tmp_path / "a")) == "new"
    assert launch("abandon", str(tmp_path / "b"), 5.0) == [0, 0]
    assert outcome(str(tmp_path / "b")) == "old"


SCRIPT = """
import sys, time, torch, torch.distributed as dist
from datetime import timedelta
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from hyper_parallel.core.distributed_checkpoint import async_save, FileSystemWriter

class Slow(FileSystemWriter):
    def write_file(self, name, parts):
        time.sleep(0.5)
        return super().write_file(name, parts)

rank, store, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                        timeout=timedelta(seconds=20))
mesh = init_device_mesh("cpu", (2,))
w = DTensor.from_local(torch.full((3, 4), float(rank)), mesh, [Shard(0)], run_check=False)
async_save({"w": w, "step": 5}, path, storage_writer=Slow(path))
print("returned with the save in flight", flush=True)
"""


def test_a_script_ending_with_a_save_in_flight_commits_it_at_exit(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    root = str(pathlib.Path(__file__).resolve().parents[4])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    store, path = str(tmp_path / "store"), str(tmp_path / "ckpt")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), store, path], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    out = load(path=path, no_dist=True)
    assert torch.equal(out["w"], torch.tensor([[0.0] * 4] * 3 + [[1.0] * 4] * 3)) and out["step"] == 5


# ----------------------------------------------------------------------------- one process


def test_response_api_and_callback_in_one_process(tmp_path):
    ckpt = AsyncCheckpointer()
    seen = []
    sd = {"w": make_tensor((16, 4)), "n": 1}
    resp = async_save(sd, checkpoint_id=str(tmp_path / "a"), no_dist=True, checkpointer=ckpt,
                      callback=lambda r: seen.append((r, r.done(), r.persist_completion.done(), r.result())))
    meta = resp.result(timeout=30)
    assert meta is resp.persist_completion.result() and "w" in meta.entries
    assert seen == [(resp, False, True, meta)], "callback: after the future resolves, before done()"
    assert resp.done() and resp.staged() and resp.exception() is None
    assert resp.blocking_s >= 0 and resp.total_s >= resp.blocking_s
    ckpt.close()


def test_bad_arguments_raise_at_once(tmp_path):
    ckpt = AsyncCheckpointer()
    with pytest.raises(ValueError, match="staging"):
        ckpt.save({"w": torch.ones(2)}, str(tmp_path), no_dist=True, staging="later")
    with pytest.raises(ValueError, match="disagree"):
        ckpt.save({"w": torch.ones(2)}, str(tmp_path / "a"), checkpoint_id=str(tmp_path / "b"), no_dist=True)
    with pytest.raises(ValueError, match="where"):
        ckpt.save({"w": torch.ones(2)}, no_dist=True)
    with pytest.raises(ValueError, match="state_dict"):
        ckpt.save(None, str(tmp_path), no_dist=True)
    assert ckpt.in_flight == 0


def test_staging_buffers_are_reused_per_structure(tmp_path):
    ckpt = AsyncCheckpointer(max_cached_structures=2)
    a = {"w": make_tensor((256, 64)), "b": make_tensor((64,)), "step": 1}
    b = {"w": make_tensor((256, 64)), "b": make_tensor((64,)), "extra": np.ones(5)}
    c = {"w": make_tensor((128, 64))}

    def run(sd, name):
        ckpt.save(sd, str(tmp_path / name), no_dist=True).result(timeout=30)
        return ckpt.stats.allocations

    assert run(a, "1") == 1
    a["step"] = 2  # plain values are not part of the structure
    assert run(a, "2") == 1, "the second save of the same structure allocated staging memory"
    assert run(b, "3") == 2
    assert run(a, "4") == 2
    assert run(c, "5") == 3  # a third structure evicts the least recently used one (b)
    assert run(a, "6") == 3
    assert run(b, "7") == 4
    assert ckpt.stats.held_bytes <= 2 * (256 * 64 * 4 + 64 * 4 + 5 * 8 + 3 * 64)
    ckpt.close()
    assert ckpt.stats.held_bytes == 0


def test_each_save_in_flight_has_its_own_buffer_and_saves_commit_in_order(tmp_path):
    ckpt = AsyncCheckpointer(max_in_flight=2)
    writer = lambda name: HookedWriter(str(tmp_path / name), sleep=0.3)
    sd = {"w": torch.zeros(1000)}
    order = []
    r1 = ckpt.save(sd, storage_writer=writer("1"), no_dist=True, callback=order.append)
    sd["w"] += 1
    r2 = ckpt.save(sd, storage_writer=writer("2"), no_dist=True, callback=order.append)
    assert ckpt.in_flight == 2 and not r1.done(), "a second save must not wait when 2 may be in flight"
    sd["w"] += 1
    t0 = time.perf_counter()
    r3 = ckpt.save(sd, storage_writer=writer("3"), no_dist=True, callback=order.append)
    assert r1.done() and time.perf_counter() - t0 > 0.1, "a third save waits for the oldest"
    ckpt.wait()
    assert [load(path=str(tmp_path / n))["w"][0].item() for n in "123"] == [0.0, 1.0, 2.0]
    assert order == [r1, r2, r3]
    assert ckpt.stats.allocations == 2
    ckpt.close()


def test_lazy_snapshot_waits_and_failures_in_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(staging_buffers, "copy_into", slow_copies(0.3))
    ckpt = AsyncCheckpointer()
    sd = {"w": torch.zeros(100), "nested": ({"t": torch.ones(3)}, [1, (2, 3)])}
    resp = ckpt.save(sd, str(tmp_path / "lazy"), no_dist=True, staging="lazy")
    assert not resp.staged()
    with pytest.raises(TimeoutError):
        resp.wait_staged(timeout=0.01)
    ckpt.wait_staged()
    sd["w"] += 1
    resp.result(timeout=30)
    out = load(path=str(tmp_path / "lazy"))
    assert torch.equal(out["w"], torch.zeros(100))
    assert isinstance(out["nested"], tuple) and out["nested"][1] == [1, (2, 3)]
    # a snapshot that cannot be taken fails the save, on result() and on the next call
    resp = ckpt.save({"m": torch.empty(2, device="meta")}, str(tmp_path / "bad"), no_dist=True)
    with pytest.raises(AsyncStagingError, match="snapshot"):
        resp.result(timeout=30)
    with pytest.raises(AsyncSaveError):
        ckpt.save(sd, str(tmp_path / "next"), no_dist=True)
    assert not os.path.exists(tmp_path / "bad")
    ckpt.close()


def test_the_hook_blocks_a_step_only_until_staged(monkeypatch, tmp_path):
    monkeypatch.setattr(staging_buffers, "copy_into", slow_copies(0.3))
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=1.0)
    ckpt = AsyncCheckpointer()
    resp = ckpt.save({"p": p}, str(tmp_path / "c"), no_dist=True, staging="lazy")
    handle = register_optimizer_hook(opt, resp)
    p.grad = torch.ones(4)
    opt.step()
    assert resp.staged()
    handle.remove()
    resp.result(timeout=30)
    assert torch.equal(load(path=str(tmp_path / "c"))["p"], torch.zeros(4))
    ckpt.close()


class _Position:
    """A Stateful whose state holds no tensors (a data loader position)."""

    def __init__(self, n: int):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def test_async_and_sync_saves_write_the_same_keys_for_tensorless_statefuls(tmp_path):
    sd = {"extra": {"data": _Position(7)}, "w": torch.ones(3)}
    async_save(sd, str(tmp_path / "a"), no_dist=True).result()
    save(sd, str(tmp_path / "s"), no_dist=True)
    for name in ("a", "s"):
        target = {"extra": {"data": _Position(0)}, "w": torch.zeros(3)}
        load(target, str(tmp_path / name))
        assert target["extra"]["data"].n == 7 and torch.equal(target["w"], torch.ones(3)), name


class SlowWriter(FileSystemWriter):
    """A storage that hangs for a while on every data file (a stuck NFS mount)."""

    def __init__(self, path, delay: float = 4.0, **kwargs):
        super().__init__(path, **kwargs)
        self.delay = delay

    def write_file(self, name, parts):
        time.sleep(self.delay)
        return super().write_file(name, parts)


def test_waits_for_a_stuck_save_are_bounded(tmp_path):
    ckpt = AsyncCheckpointer(wait_timeout_s=0.5)
    first = ckpt.save({"w": torch.ones(4)}, storage_writer=SlowWriter(str(tmp_path / "a")), no_dist=True)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still running"):
        first.result()  # default: the checkpointer's bound, not forever
    with pytest.raises(AsyncSaveError, match="still running"):
        ckpt.save({"w": torch.ones(4)}, str(tmp_path / "b"), no_dist=True)  # no room: refused, not hung
    for call in (lambda: save({"w": torch.ones(4)}, str(tmp_path / "a"), no_dist=True),
                 lambda: load(path=str(tmp_path / "a"), no_dist=True)):  # the same place: refused, not hung
        with pytest.raises(CheckpointError, match="still running"):
            call()
    assert time.monotonic() - start < 3.5
    assert first.result(timeout=None) is not None  # an explicit None still waits to the end
    ckpt.close()


@pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT")
def test_large_staged_tensors_are_written_with_o_direct_from_staging_memory(tmp_path, monkeypatch):
    """Staging puts large tensors on page boundaries, so the background write needs no bounce copy."""
    from hyper_parallel.core.distributed_checkpoint._src.backends import direct_io

    path = str(tmp_path / "c")
    os.makedirs(path)
    try:
        FileSystemWriter(path, direct_io=True).prepare()
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    views: list[tuple[int, int]] = []
    real = os.pwritev

    def pwritev(fd, bufs, offset):
        views.extend((direct_io.address(memoryview(b)), memoryview(b).nbytes) for b in bufs)
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    sd = {"small": make_tensor((3, 5)), "v": make_tensor((300, 301))}
    async_save(sd, storage_writer=FileSystemWriter(path, direct_io=True), no_dist=True).result()
    # "v"'s whole pages are written from its staging memory; only its last partial page is copied
    assert (300 * 301 * 4) // 4096 * 4096 in [n for _, n in views], views
    out = load(path=path)
    assert_same(out, sd)


def per_call_timeouts(rank: int, ws: int, root: str) -> list:
    from hyper_parallel.core.distributed_checkpoint import LostContactError, async_save

    sd = {"x": torch.ones(4)}
    async_save(sd, checkpoint_id=os.path.join(root, "first"), timeout=2).result(timeout=60)
    out = []
    for name, timeout, late in (("late", 2, 5), ("reports", 2, 0), ("after", 2, 0), ("patient", 30, 3)):
        dist.barrier()
        if rank == 1:
            time.sleep(late)
        try:
            async_save(sd, checkpoint_id=os.path.join(root, name), timeout=timeout).result(timeout=60)
            out.append("ok")
        except (LostContactError, RankFailedError) as exc:
            out.append(f"lost {exc}")
        except AsyncSaveError as exc:  # an earlier failure, reported by the next call
            out.append(f"reported {exc}")
    return out


def test_each_async_save_keeps_its_own_timeout_and_a_timeout_does_not_poison_later_saves(tmp_path):
    # the group of the first call (2 s) fails in the background when rank 1 is 5 s late; it is
    # made again for the next save; a call with its own timeout gets a group with it
    for result in run_ranks(per_call_timeouts, 2, str(tmp_path), timeout_s=120):
        assert result[0].startswith("lost") and "0:00:02" in result[0], result
        assert result[1].startswith("reported"), result  # once, by the next call, as documented
        assert result[2] == "ok", result
        assert result[3] == "ok", result  # 3 s late, within its own 30 s


@pytest.mark.parametrize("observe", [True, False])
def test_process_exit_warns_only_of_failures_nobody_saw(tmp_path, observe):
    script = textwrap.dedent(f"""
        import torch
        from hyper_parallel.core.distributed_checkpoint import async_save
        class Opaque: pass
        resp = async_save({{"x": torch.ones(2), "o": Opaque()}}, checkpoint_id={str(tmp_path / "bad")!r}, no_dist=True)
        resp.wait_staged()
        if {observe}:
            assert resp.exception() is not None
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ("nobody waited for it" in proc.stderr) is not observe, proc.stderr


def test_a_save_or_load_after_an_async_save_to_the_same_path_waits_for_it(tmp_path):
    # the earlier async save committed after the later synchronous one, replacing it with older state
    path = str(tmp_path / "ck")
    sd = {"w": torch.ones(64, 64), "version": 1}
    resp = async_save(sd, storage_writer=SlowWriter(path, delay=0.5))
    sd["w"].fill_(2.0)
    sd["version"] = 2
    save(sd, path + "/")  # the same place, named differently
    assert resp.done()
    resp.result()
    out = load(path=path)
    assert out["version"] == 2 and torch.equal(out["w"], torch.full((64, 64), 2.0))
    # a load waits too: it read the older checkpoint (or lost its files to the commit)
    sd["w"].fill_(3.0)
    sd["version"] = 3
    resp = async_save(sd, storage_writer=SlowWriter(path, delay=0.5))
    out = load(path=path)
    assert resp.done() and out["version"] == 3 and torch.equal(out["w"], torch.full((64, 64), 3.0))


def test_async_saves_of_two_checkpointers_to_one_place_commit_in_the_order_they_started(tmp_path):
    # each checkpointer writes its own saves in order, but two did not wait for each other: the
    # earlier, slower save committed last and replaced the newer checkpoint
    path = str(tmp_path / "ck")
    first = AsyncCheckpointer().save({"w": torch.ones(8), "version": 1}, storage_writer=SlowWriter(path, delay=0.5))
    second = AsyncCheckpointer().save({"w": torch.full((8,), 2.0), "version": 2}, checkpoint_id=path)
    second.result(timeout=60)
    assert first.done()
    first.result()
    out = load(path=path)
    assert out["version"] == 2 and torch.equal(out["w"], torch.full((8,), 2.0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
@pytest.mark.parametrize("nice", [None, 0, 5])
def test_background_threads_yield_the_cpu_to_training(tmp_path, nice):
    # they ran at the training loop's own priority, taking half of each contended core from it
    seen = []
    kwargs = {} if nice is None else {"background_nice": nice}
    ckpt = AsyncCheckpointer(**kwargs)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    resp = ckpt.save({"w": torch.ones(8)}, tmp_path / "ck", no_dist=True,
                     callback=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    resp.result(timeout=60)
    ckpt.close()
    assert seen == [max(own, 10 if nice is None else nice)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the caller's stays
    with pytest.raises(ValueError, match="background_nice"):
        AsyncCheckpointer(background_nice=20)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_first_async_save_to_a_url_leaves_shared_threads_at_the_callers_priority(s3_bucket, s3_endpoint):
    # fsspec's process-wide I/O thread was started by the nice-10 writer thread: every later S3
    # call of the process, the training loop's own saves and loads too, ran at nice 10
    bucket, _ = s3_bucket
    script = textwrap.dedent(f"""
        import os, threading, torch
        os.environ["AWS_ENDPOINT_URL"] = {s3_endpoint!r}
        from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer
        AsyncCheckpointer().save({{"x": torch.arange(10.0)}}, "s3://{bucket}/a").result(timeout=60)
        io = [t for t in threading.enumerate() if t.name == "fsspecIO"]
        print(len(io), os.getpriority(os.PRIO_PROCESS, io[0].native_id) if io else None,
              os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ})
    assert out.returncode == 0, out.stderr
    count, io_nice, own = out.stdout.split()
    assert count == "1" and io_nice == own, out.stdout


def destroy_with_a_save_in_flight(rank: int, ws: int, path: str) -> str:
    from hyper_parallel.core.distributed_checkpoint import LostContactError

    save({"t": torch.zeros(1 << 20)}, path)
    resp = async_save({"t": torch.full((1 << 20,), 1.0 + rank), "rank": rank}, path)
    dist.destroy_process_group()
    try:
        resp.result(timeout=60)
    except LostContactError as exc:
        return "lost: " + str(exc)
    return "committed"


def test_destroying_the_process_group_fails_a_save_in_flight_without_committing(tmp_path):
    # each rank's background save had gone on alone, committing its own view as the checkpoint
    out = run_ranks(destroy_with_a_save_in_flight, 2, str(tmp_path / "ck"), timeout_s=120)
    # every rank fails (a rank that notices its group gone says so; one may see its peer vanish first)
    assert all(o.startswith("lost: ") for o in out), out
    back = load(path=str(tmp_path / "ck"))
    assert torch.equal(back["t"], torch.zeros(1 << 20)) and "rank" not in back


def test_a_relative_path_is_where_the_caller_was_when_it_called(tmp_path, monkeypatch):
    # it was resolved when the background write ran, after the caller had moved on
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    resp = async_save({"t": torch.ones(1 << 16)}, "rel", no_dist=True, staging="lazy")
    os.chdir(tmp_path / "b")
    resp.result(timeout=60)
    assert (tmp_path / "a" / "rel" / ".metadata").exists() and not (tmp_path / "b" / "rel").exists()
    assert resp.checkpoint_id == "rel"  # as the caller named it


def test_one_planner_object_serves_an_async_save_and_a_save_while_it_writes(tmp_path):
    # the background save planned with the caller's object, which the next call set up anew:
    # one of the two failed with a bare KeyError
    from hyper_parallel.core.distributed_checkpoint import StandardPlanner

    planner = StandardPlanner()
    first = {f"a{i}": torch.full((64, 64), float(i)) for i in range(40)}
    resp = async_save(first, storage_writer=SlowWriter(str(tmp_path / "a"), delay=0.3), planner=planner)
    save({"b0": torch.ones(4)}, str(tmp_path / "b"), planner=planner)
    resp.result()
    assert_same(first, load(path=str(tmp_path / "a")))
    assert torch.equal(load(path=str(tmp_path / "b"))["b0"], torch.ones(4))


def _close_with_a_short_timeout(rank: int, ws: int, path: str) -> str:
    ck = AsyncCheckpointer()
    sd = {"w": torch.full((4096, 2048), 3.0)}  # 32 MiB: still writing when close gives up
    resp = ck.save(sd, checkpoint_id=path)
    if rank == 0:
        with pytest.raises(TimeoutError, match="still in flight"):
            ck.close(timeout=0.001)
    meta = resp.result(timeout=60)  # the save went on: its group was not destroyed under it
    ck.close()
    return type(meta).__mro__[1].__name__  # TorchView -> Metadata (torch's and HyperParallel's)


def test_close_that_times_out_leaves_the_save_in_flight_running(tmp_path):
    # close(timeout=) raised TimeoutError and then destroyed the dedicated group under the save:
    # it failed on every rank with torch's "group is not registered" (or, with the timeout on one
    # rank only, the other waited out the group's timeout)
    path = str(tmp_path / "ck")
    assert run_ranks(_close_with_a_short_timeout, 2, path, timeout_s=120) == ["Metadata", "Metadata"]
    assert torch.equal(load(path=path)["w"], torch.full((4096, 2048), 3.0))
