"""The local tier of CheckpointManager under a killed (or stalled) peer, on 4 real gloo ranks
simulating 2 nodes (``node_rank = rank // 2``, one ``local_dir`` per node).

A peer dies (SIGKILL, at a chosen point of the replication or of the recovery protocol) or
stalls; the surviving ranks must raise a clear error (a ``CheckpointError``) within the
manager's timeout instead of hanging, and the next start must resume from a step that is
complete in the surviving local directories (the newest one, checked by a scan of the files
independent of the tier's own choice), bit for bit.

Peers: ranks 0,1 (node 0) send their copies to 2,3 (node 1) and back: rank r's copy is kept
by rank (r + 2) % 4.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
from helpers import make_dtensor, make_tensor
from multiprocess import RankFailure, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import CheckpointError, CheckpointManager
from hyper_parallel.core.distributed_checkpoint._src.manager import local_recovery as recovery
from hyper_parallel.core.distributed_checkpoint._src.manager import local_replication as replication
from hyper_parallel.core.distributed_checkpoint._src.manager import local_tier as tier
from hyper_parallel.core.distributed_checkpoint._src.manager.local_format import (
    parse_shard_file_name,
    rank_of_dir,
    read_manifest,
)

WS = 4
ROWS, COLS = 512, 256  # 512 KiB of fp32, 128 KiB per rank: a body travels in more than one piece
TIMEOUT = 15.0  # the manager's timeout: every survivor must raise well within it
REPLICATION_TIMEOUT = 8.0
STALL_TIMEOUT = 5.0  # the timeout of the runs where a peer stalls (a shorter test)


def state_at(step: int, mesh) -> dict:
    """The training state at ``step``: a pure function of the step (a fault-free run's state)."""
    return {"w": make_dtensor(make_tensor((ROWS, COLS), seed=step), mesh, [Shard(0)]),
            "b": make_dtensor(make_tensor((ROWS,), dtype=torch.bfloat16, seed=10_000 + step), mesh, [Shard(0)]),
            "step": step}


def empty_state(mesh) -> dict:
    return {"w": make_dtensor(torch.full((ROWS, COLS), -1.0), mesh, [Shard(0)]),
            "b": make_dtensor(torch.zeros(ROWS, dtype=torch.bfloat16), mesh, [Shard(0)]), "step": -1}


def exact(target: dict, step: int, mesh) -> bool:
    want = state_at(step, mesh)
    return target["step"] == step and all(
        torch.equal(target[k].to_local().view(torch.uint8), want[k].to_local().view(torch.uint8)) for k in ("w", "b"))


def manager(root: str, rank: int, timeout: float = TIMEOUT) -> CheckpointManager:
    node = rank // 2
    return CheckpointManager(f"{root}/run", save_interval_steps=1000, local_dir=f"{root}/node{node}", node_rank=node,
                             timeout=timeout, replication_timeout=REPLICATION_TIMEOUT)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def report(root: str, rank: int, out: dict) -> None:
    with open(f"{root}/out-r{rank}.json", "w") as f:
        json.dump(out, f)


def reports(root: str) -> dict[int, dict]:
    out = {}
    for r in range(WS):
        path = f"{root}/out-r{r}.json"
        if os.path.exists(path):
            with open(path) as f:
                out[r] = json.load(f)
            os.unlink(path)
    return out


def failure(exc: BaseException, started: float) -> dict:
    return {"error": type(exc).__name__, "clear": isinstance(exc, CheckpointError), "message": str(exc)[:2000],
            "seconds": time.monotonic() - started}


def complete_steps(root: str, nodes: list[int]) -> list[int]:
    """Steps whose every rank has a whole shard file of one timeline in some surviving node's
    directory (the scan a person would do: names, then each file's manifest and size)."""
    have: dict[tuple[int, str], set[int]] = {}
    for node in nodes:
        base = f"{root}/node{node}"
        for tier_dir in os.listdir(base) if os.path.isdir(base) else []:
            for sub in os.listdir(os.path.join(base, tier_dir)):
                owner = rank_of_dir(sub)
                for name in os.listdir(os.path.join(base, tier_dir, sub)) if owner is not None else []:
                    parsed = parse_shard_file_name(name)
                    if parsed is None:
                        continue
                    man = read_manifest(os.path.join(base, tier_dir, sub, name))  # raises if not whole
                    assert (man.rank, man.step, man.timeline, man.world_size) == (owner, *parsed, WS)
                    have.setdefault(parsed, set()).add(owner)
    return sorted(step for (step, _), owners in have.items() if owners == set(range(WS)))


# ----------------------------------------------------------------------------- killed during replication


def arm_replication_fault(rank: int, victim: int, where: str, at_step: int) -> None:
    """In the victim, die at ``where`` of the local save (and replication) of step ``at_step``."""
    if rank != victim:
        return
    current = {"step": None}
    real_save, real_replicate = tier.LocalTier.save, replication.Replicator.replicate
    real_confirm = replication.Replicator.confirm
    real_isend, real_irecv = dist.isend, dist.irecv

    def save(self, step, state_dict):
        if where == "first_save" and step == at_step:
            die()  # before the replication group exists: the others make it without this rank
        return real_save(self, step, state_dict)

    def replicate(self, step, timeline, shard):
        current["step"] = step
        if where == "before_send" and step == at_step:
            die()
        return real_replicate(self, step, timeline, shard)

    def confirm(self, ok):
        if where == "confirm" and current["step"] == at_step:
            die()
        return real_confirm(self, ok)

    def isend(tensor, dst=None, group=None, tag=0, **kw):
        work = real_isend(tensor, dst=dst, group=group, tag=tag, **kw)
        if where == "mid_send" and tag == replication.TAG_BODY and current["step"] == at_step:
            die()  # the body is posted, not known to have arrived
        return work

    def irecv(tensor, src=None, group=None, tag=0, **kw):
        work = real_irecv(tensor, src=src, group=group, tag=tag, **kw)
        if where == "mid_receive" and tag == replication.TAG_BODY and current["step"] == at_step:
            die()  # a copy is on its way in
        return work

    tier.LocalTier.save, replication.Replicator.replicate, replication.Replicator.confirm = save, replicate, confirm
    replication.dist.isend, replication.dist.irecv = isend, irecv


def rank_killed_during_replication(rank: int, ws: int, root: str, victim: int, where: str, at_step: int,
                                   last: int) -> None:
    arm_replication_fault(rank, victim, where, at_step)
    mesh = init_device_mesh("cpu", (ws,))
    out: dict = {"error": None}
    mgr = manager(root, rank)
    started = time.monotonic()
    try:
        for step in range(1, last + 1):  # local saves go on after the peer is gone
            mgr.save(step, state_at(step, mesh))
        mgr.local_tier.wait()
        out["replication_error"] = mgr.local_tier.replication_error
        started = time.monotonic()
        # the next collective of the manager, a durable save, must fail
        mgr.save(last + 1, state_at(last + 1, mesh), force=True)
    except Exception as exc:
        out.update(failure(exc, started))
    finally:
        started = time.monotonic()
        mgr.close()
        out["close_s"] = time.monotonic() - started
        report(root, rank, out)


def rank_resume(rank: int, ws: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    target = empty_state(mesh)
    with manager(root, rank) as mgr:
        step = mgr.load(target)
        rec = mgr.local_tier.last_recovery
        return {"step": step, "source": rec.source, "exact": step is not None and exact(target, step, mesh),
                "holder": rec.holders.get(rank)}


@pytest.mark.parametrize(("where", "victim", "lost_node"), [
    ("first_save", 2, None),  # rank 2 dies before its first local save: the others make the group alone
    ("before_send", 3, None),  # rank 3 dies before sending its copy of step 4; nothing else is lost
    ("mid_send", 3, 1),  # ... dies with its copy on the wire, and node 1 is then lost
    ("mid_receive", 1, 0),  # rank 1 dies receiving rank 3's copy, and node 0 is then lost
    ("confirm", 2, 1),  # rank 2 dies after the copies moved, before confirming; node 1 is then lost
])
def test_a_peer_killed_during_replication_fails_the_survivors_in_time_and_the_restart_picks_a_complete_step(
        tmp_path, where, victim, lost_node):
    root, last = str(tmp_path), 7
    at_step = 1 if where == "first_save" else 4
    with pytest.raises(RankFailure):
        run_ranks(rank_killed_during_replication, WS, root, victim, where, at_step, last, grace_s=TIMEOUT + 20)
    survivors = reports(root)
    assert sorted(survivors) == sorted(set(range(WS)) - {victim}), survivors
    for rank, out in survivors.items():
        # the survivors noticed (replication stopped), and the next collective failed fast and clearly
        assert out["error"] is not None and out["clear"], (rank, out)
        assert out["replication_error"], (rank, out)
        assert out["seconds"] < TIMEOUT and out["close_s"] < TIMEOUT, (rank, out)
    if lost_node is not None:
        shutil.rmtree(f"{root}/node{lost_node}")
    nodes = [n for n in (0, 1) if n != lost_node]
    complete = complete_steps(root, nodes)
    assert complete[-1:] in ([], [at_step - 1], [at_step]), complete  # steps after the death never complete
    results = run_ranks(rank_resume, WS, root)
    expected = (complete[-1], "local", True) if complete else (None, "durable", False)
    for rank, r in enumerate(results):
        assert (r["step"], r["source"], r["exact"]) == expected, (rank, r, complete)


# ----------------------------------------------------------------------------- killed during recovery


def rank_train(rank: int, ws: int, root: str, last: int) -> list:
    mesh = init_device_mesh("cpu", (ws,))
    with manager(root, rank) as mgr:
        for step in range(1, last + 1):
            mgr.save(step, state_at(step, mesh))
        mgr.wait()
        return [t.confirmed for t in mgr.local_tier.timings]


def arm_recovery_fault(rank: int, victim: int, where: str) -> None:
    """In the victim, die (or stall for a minute) at ``where`` of the recovery."""
    if rank != victim:
        return
    real_send, real_recv, real_read = replication.send_file, replication.recv_file, recovery.Recoverer._read

    def send_file(mapped, dst, group, tag):
        work = real_send(mapped, dst, group, tag)
        if where == "send":
            die()  # a copy is on the wire to a rank of the lost node
        if where == "stall_send":
            time.sleep(3 * STALL_TIMEOUT)
        return work

    def recv_file(mapped, src, group, tag):
        work = real_recv(mapped, src, group, tag)
        if where == "receive":
            die()  # receiving its copy into a temporary file
        return work

    def read(self, chosen, holder, target):
        if where == "read":
            die()  # the others have read their copies into their targets
        return real_read(self, chosen, holder, target)

    recovery.send_file, recovery.recv_file, recovery.Recoverer._read = send_file, recv_file, read


def rank_recover_with_a_fault(rank: int, ws: int, root: str, victim: int, where: str, timeout: float) -> None:
    arm_recovery_fault(rank, victim, where)
    mesh = init_device_mesh("cpu", (ws,))
    target = empty_state(mesh)
    out: dict = {"error": None}
    mgr = manager(root, rank, timeout)
    try:
        started = time.monotonic()
        try:
            out["step"] = mgr.load(target)
        except Exception as exc:
            out.update(failure(exc, started))
    finally:
        started = time.monotonic()
        mgr.close()
        out["close_s"] = time.monotonic() - started
        report(root, rank, out)


@pytest.mark.parametrize(("where", "victim"), [
    ("send", 0),  # rank 0 dies sending rank 2's copy to it (node 1 was lost)
    ("receive", 3),  # rank 3 dies receiving its copy from rank 1
    ("read", 1),  # rank 1 dies reading its own file, while the others read theirs
    ("stall_send", 1),  # rank 1 stalls (alive) before rank 3's copy is sent: bounded by the timeout
])
def test_a_peer_killed_or_stalled_during_recovery_fails_the_survivors_in_time_and_the_next_start_recovers(
        tmp_path, where, victim):
    root, last = str(tmp_path), 3
    assert run_ranks(rank_train, WS, root, last) == [[True] * last] * WS
    shutil.rmtree(f"{root}/node1")  # node 1 is lost: ranks 2 and 3 fetch their copies from node 0
    stall = where.startswith("stall")
    timeout = STALL_TIMEOUT if stall else TIMEOUT
    try:
        run_ranks(rank_recover_with_a_fault, WS, root, victim, where, timeout, grace_s=3 * timeout, timeout_s=240)
    except RankFailure:
        assert not stall
    survivors = reports(root)
    survivors.pop(victim, None)  # a stalled rank reports too, once it wakes
    assert sorted(survivors) == sorted(set(range(WS)) - {victim}), survivors
    # a stall is noticed after one timeout by the ranks waiting for the staller (a transfer, then the
    # exchange it never reaches): at most two timeouts in all; a death at once
    bound = 2 * timeout + 3 if stall else timeout
    for rank, out in survivors.items():
        assert out["error"] is not None and out["clear"], (rank, out)
        assert out["seconds"] < bound and out["close_s"] < timeout, (rank, out)
    assert complete_steps(root, [0]) == [last - 1, last]  # node 0's copies are untouched
    results = run_ranks(rank_resume, WS, root)
    for rank, r in enumerate(results):
        assert (r["step"], r["source"], r["exact"]) == (last, "local", True), (rank, r)


# ----------------------------------------------------------------------------- a full local directory at recovery


@pytest.fixture
def full_node1(tmp_path):
    """Node 1's local directory on an 8 MiB tmpfs of its own (needs root; skipped otherwise),
    filled to the last byte by the caller's ``fill()``."""
    mnt = tmp_path / "node1"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {out.stderr.decode().strip()}")

    def fill() -> None:
        with open(mnt / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)

    yield fill
    subprocess.run(["umount", str(mnt)], check=False)


def rank_train_with_durable(rank: int, ws: int, root: str, last: int, durable: int | None) -> None:
    mesh = init_device_mesh("cpu", (ws,))
    with manager(root, rank) as mgr:
        for step in range(1, last + 1):
            mgr.save(step, state_at(step, mesh), force=step == durable)
        mgr.wait()


def rank_resume_or_fail(rank: int, ws: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    target = empty_state(mesh)
    with manager(root, rank) as mgr:
        try:
            step = mgr.load(target)
        except CheckpointError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"step": step, "source": mgr.local_tier.last_recovery.source, "exact": exact(target, step, mesh)}


@pytest.mark.parametrize("durable", [2, None])
def test_a_full_local_directory_at_recovery_falls_back_to_the_durable_step_or_fails_clearly(tmp_path, full_node1,
                                                                                            durable):
    """Node 1 lost its files and its local directory (a tmpfs, like /dev/shm) is full: its ranks
    cannot store the copies they fetch. They received into a mapped sparse file, which cannot
    grow on a full tmpfs: the transfer failed inside gloo, every rank waited the whole timeout
    and raised "lost contact" (a write from Python there is a SIGBUS). Now every rank learns it
    before any transfer and loads the durable step (if any), else raises an error naming the
    ranks and ENOSPC, keeping the local steps."""
    root, last = str(tmp_path), 3
    run_ranks(rank_train_with_durable, WS, root, last, durable)
    for name in os.listdir(f"{root}/node1"):
        shutil.rmtree(f"{root}/node1/{name}")
    full_node1()
    results = run_ranks(rank_resume_or_fail, WS, root)
    for rank, r in enumerate(results):
        if durable is not None:
            assert r == {"step": durable, "source": "durable", "exact": True}, (rank, r)
        else:
            assert r["error"] == "CheckpointError" and "No space left" in r["message"], (rank, r)
            assert "rank 2" in r["message"] and "rank 3" in r["message"], r["message"]
    if durable is None:  # the local steps are still there for a start with room
        assert complete_steps(root, [0]) == [last - 1, last]
