"""No rank waits out a timeout for another rank's local error; ranks agree on cached plans."""

from __future__ import annotations

import os
import time

import pytest
import torch
from helpers import make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import CheckpointError, RankFailedError, async_save, load, save


def state(ws: int, step: int) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    return {"w": make_dtensor(make_tensor((16, 8), seed=step), mesh, [Shard(0)]), "step": step}


def rank_solo_saves_then_collective(rank: int, ws: int, path: str) -> int:
    save(state(ws, 1), os.path.join(path, "a"))  # both ranks cache this structure's plan
    if rank == 1:  # rank 1 alone saves 12 other structures: its cached plan is evicted
        for i in range(12):
            save({f"x{i}": torch.zeros(i + 1)}, os.path.join(path, f"solo-{rank}-{i}"), no_dist=True)
    save(state(ws, 2), os.path.join(path, "b"))  # same structure: rank 0 hits, rank 1 misses
    save(state(ws, 3), os.path.join(path, "c"))  # now both hit
    target = {"w": make_dtensor(torch.zeros(16, 8), init_device_mesh("cpu", (ws,)), [Shard(0)]), "step": 0}
    load(target, os.path.join(path, "c"))
    assert torch.equal(target["w"].to_local(), state(ws, 3)["w"].to_local()) and target["step"] == 3
    return target["step"]


def test_a_rank_with_an_evicted_plan_cache_still_saves_with_the_others(tmp_path):
    # A miss anywhere is a miss everywhere; before, rank 1 ran the plan exchange alone and hung.
    assert run_ranks(rank_solo_saves_then_collective, 2, str(tmp_path), timeout_s=90) == [3, 3]


def rank_loads_a_bad_target(rank: int, ws: int, path: str) -> tuple[str, float]:
    save(state(ws, 1), path)
    if rank == 1:  # two values flatten to the same key: rank 1's target is bad
        target = {"w": {"x": torch.zeros(2)}, "w.x": torch.zeros(2)}
    else:
        target = {"w": make_dtensor(torch.zeros(16, 8), init_device_mesh("cpu", (ws,)), [Shard(0)]), "step": 0}
    start = time.monotonic()
    try:
        load(target, path)  # the default timeout (30 min) applies
    except RankFailedError as exc:
        assert "rank(s) [1]" in str(exc) and "same key" in str(exc), str(exc)
        return "raised", time.monotonic() - start
    return "loaded", time.monotonic() - start


def test_a_bad_target_on_one_rank_fails_every_rank_within_seconds(tmp_path):
    results = run_ranks(rank_loads_a_bad_target, 2, str(tmp_path / "c"), timeout_s=60, pg_timeout_s=1800)
    assert [r[0] for r in results] == ["raised", "raised"]
    assert max(r[1] for r in results) < 30, results


def rank_interrupted(rank: int, ws: int, path: str) -> str:
    class Interrupting:
        def state_dict(self):
            if rank == 1:
                raise KeyboardInterrupt
            return {"n": 1}

        def load_state_dict(self, sd):
            pass

    try:
        save({"app": Interrupting(), "w": torch.ones(3)}, path)
    except KeyboardInterrupt:
        return "KeyboardInterrupt"  # the interrupted rank keeps its interruption...
    except RankFailedError as exc:  # ...and the others learn of it at once
        assert "KeyboardInterrupt" in str(exc)
        return "RankFailedError"
    return "saved"


def test_a_keyboard_interrupt_on_one_rank_reaches_every_rank(tmp_path):
    assert run_ranks(rank_interrupted, 2, str(tmp_path / "c"), timeout_s=60) == ["RankFailedError",
                                                                                  "KeyboardInterrupt"]


def rank_exchanges_objects(rank: int, ws: int) -> tuple:
    from hyper_parallel.core.distributed_checkpoint._src.coordination.coordinator import Coordinator

    coord = Coordinator()
    mine = {"rank": rank, "blob": bytes(range(256)) * (1 + 4000 * rank)}  # ~1 MB on rank 1, 256 B on rank 0
    everyone = coord.exchange("x", lambda: mine)
    gathered = coord.gather_to_coordinator("g", lambda: [rank] * (rank + 1))
    from_one = coord.broadcast_from(1, mine if rank == 1 else None)
    return ([e["rank"] for e in everyone], [len(e["blob"]) for e in everyone], gathered, from_one["rank"],
            len(from_one["blob"]))


def test_objects_of_different_sizes_reach_every_rank():
    out = run_ranks(rank_exchanges_objects, 2, timeout_s=90)
    big = 256 * 4001
    assert out[0] == ([0, 1], [256, big], [[0], [1, 1]], 1, big)
    assert out[1] == ([0, 1], [256, big], None, 1, big)


def rank_gathers_small_and_large_objects(rank: int, ws: int) -> list:
    from hyper_parallel.core.distributed_checkpoint._src.coordination.coordinator import SLOT_BYTES, Coordinator

    coord = Coordinator()
    out = []
    # fits the first collective's slot on every rank; on one rank only; on none; exactly at the edge
    for size in ([3, 5], [3, SLOT_BYTES * 4], [SLOT_BYTES * 2, SLOT_BYTES * 3], [SLOT_BYTES, SLOT_BYTES]):
        out.append(coord.exchange("x", lambda size=size: bytes([rank + 1]) * size[rank]))
    out.append(coord.exchange("x", lambda: ("ok", None, {"rank": rank})))
    return out


def test_small_objects_take_one_collective_and_large_ones_still_arrive_whole():
    from hyper_parallel.core.distributed_checkpoint._src.coordination.coordinator import SLOT_BYTES

    out = run_ranks(rank_gathers_small_and_large_objects, 2, timeout_s=90)
    assert out[0] == out[1]
    sizes = ([3, 5], [3, SLOT_BYTES * 4], [SLOT_BYTES * 2, SLOT_BYTES * 3], [SLOT_BYTES, SLOT_BYTES])
    for got, size in zip(out[0], sizes, strict=False):
        assert got == [b"\x01" * size[0], b"\x02" * size[1]]
    assert out[0][-1] == [("ok", None, {"rank": 0}), ("ok", None, {"rank": 1})]


def rank_counts_collectives_of_a_status_exchange(rank: int, ws: int) -> list[int]:
    import torch.distributed as dist

    from hyper_parallel.core.distributed_checkpoint._src.coordination.coordinator import Coordinator

    coord = Coordinator()
    calls = []
    real = dist.all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_gather = counting
    try:
        coord.exchange("load", lambda: None)
        small = len(calls)
        coord.exchange("load", lambda: bytes(1000))
    finally:
        dist.all_gather = real
    return [small, len(calls) - small]


def test_a_status_exchange_is_one_collective():
    assert run_ranks(rank_counts_collectives_of_a_status_exchange, 2, timeout_s=90) == [[1, 2], [1, 2]]


def rank_settles_a_collective(rank: int, ws: int) -> list[int]:
    import torch.distributed as dist

    from hyper_parallel.core.distributed_checkpoint._src.coordination.coordinator import _settle

    counts = []
    for _ in range(20):
        t = torch.zeros(1024)
        dist.broadcast(t, src=0)
        _settle([t])
        # gloo's worker thread let go: dropping the tensor now needs no other thread's GIL
        counts.append(t._use_count())
    return counts


def test_settle_returns_once_gloo_let_go_of_the_tensor():
    # A worker dropping a Python-made tensor takes the GIL; at interpreter exit that aborts
    # the process, so every exchange settles its tensors before returning (checked here on
    # a bare broadcast, where gloo often still holds the tensor when wait() returns).
    assert run_ranks(rank_settles_a_collective, 2, timeout_s=90) == [[1] * 20] * 2


def _bad_timeouts(rank: int, ws: int, path: str) -> list[str]:
    out = []
    for bad in (-1, 0, "30", float("nan"), True):
        for call in (lambda bad=bad: save({"w": torch.ones(2)}, path, timeout=bad),
                     lambda bad=bad: load({"w": torch.ones(2)}, checkpoint_id=path, timeout=bad)):
            try:
                call()
                out.append(f"{bad!r}: accepted")
            except (TypeError, ValueError) as exc:
                out.append(f"{type(exc).__name__}: {exc}")
    save({"w": torch.ones(2)}, path, timeout=5.5)  # the group still works: nothing half-done
    return out


def test_a_bad_timeout_is_refused_alike_on_every_rank_before_any_collective(tmp_path):
    # timeout=-1 had failed inside gloo ("Invalid timeout") and was reported as a lost rank;
    # "30" failed with torch's TypeError; in one process both were accepted
    results = run_ranks(_bad_timeouts, 2, str(tmp_path / "ck"), timeout_s=60)
    assert results[0] == results[1]
    assert all(msg.startswith(("TypeError: timeout must be", "ValueError: timeout must be")) for msg in results[0]), \
        results[0]
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        save({"w": torch.ones(2)}, str(tmp_path / "one"), no_dist=True, timeout=-1)
    with pytest.raises(TypeError, match="timeout must be a number of seconds > 0"):
        async_save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "two"), no_dist=True, timeout="30")


def _bad_user_metadata_on_rank_1(rank: int, ws: int, path: str) -> list[str]:
    import numpy as np

    from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer

    um = {"loss": np.float32(0.25) if rank == 1 else 0.25, "step": 3}
    out = []
    ck = AsyncCheckpointer()
    for call in (lambda: save({"w": torch.ones(2)}, path, user_metadata=um, timeout=60),
                 lambda: ck.save({"w": torch.ones(2)}, checkpoint_id=path, user_metadata=um, timeout=60).result()):
        t0 = time.monotonic()
        try:
            call()
            out.append("saved")
        except CheckpointError as exc:  # async: AsyncSaveError from the RankFailedError
            out.append(f"{time.monotonic() - t0 < 20} {exc} | {exc.__cause__}")
    with pytest.raises(CheckpointError, match="user_metadata"):  # reported once more, on every rank alike
        ck.close()
    return out


def test_a_bad_user_metadata_on_one_rank_fails_every_rank_at_once(tmp_path):
    # it was refused on that rank alone, before any exchange: the others waited out the timeout
    # and then blamed a crashed rank
    results = run_ranks(_bad_user_metadata_on_rank_1, 2, str(tmp_path / "ck"), timeout_s=100)
    for out in results:
        assert len(out) == 2 and all(o.startswith("True") for o in out), out
        assert all("rank 1" in o and "user_metadata['loss'] is a numpy.float32" in o for o in out), out


# ----------------------------------------------------------------------------- making gloo groups


def rank_making_a_group(rank: int, ws: int, out: str, absent: str, timeout_s: float) -> str:
    import json
    import signal
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from hyper_parallel.core.distributed_checkpoint._src.coordination.coordinator import group_timeout, new_gloo_group

    timeout = timedelta(seconds=timeout_s)
    if rank == ws - 1:
        if absent == "never":  # never calls: the others must not wait for it much past the timeout
            time.sleep(1.5 * timeout_s + 1)
            return "absent"
        # checks in, then dies while the others connect (gloo used to try 5 times, 5x the timeout)
        threading.Thread(target=new_gloo_group, args=(None, timeout), daemon=True).start()
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.6)
    start = time.monotonic()
    try:
        group = new_gloo_group(None, timeout)
        outcome = ["made", group_timeout(group).total_seconds(), dist.get_world_size(group)]
    except RuntimeError as exc:
        outcome = [type(exc).__name__, str(exc)[:200]]
    with open(os.path.join(out, str(rank)), "w") as f:
        json.dump([*outcome, time.monotonic() - start], f)
    return outcome[0]


@pytest.mark.parametrize("absent", ["never", "dies"])
def test_a_rank_lost_while_a_gloo_group_is_made_fails_the_others_within_the_timeout(tmp_path, absent):
    import json

    from multiprocess import RankFailure

    timeout_s = 4.0
    try:
        run_ranks(rank_making_a_group, 3, str(tmp_path), absent, timeout_s, timeout_s=40)
    except RankFailure as exc:  # the rank that killed itself
        assert absent == "dies" and "rank 2" in str(exc), exc
    for rank in (0, 1):
        kind, *_, took = json.loads((tmp_path / str(rank)).read_text())
        assert kind != "made", f"rank {rank} made a group without rank 2"
        assert took < 1.5 * timeout_s, f"rank {rank} raised after {took:.1f}s (timeout {timeout_s}s)"


def rank_made_group_keeps_the_full_timeout(rank: int, ws: int) -> list:
    from datetime import timedelta

    import torch.distributed as dist

    from hyper_parallel.core.distributed_checkpoint._src.coordination.coordinator import group_timeout, new_gloo_group

    group = new_gloo_group(None, timedelta(seconds=3))
    sub = new_gloo_group([0, 2], timedelta(seconds=5)) if rank != 1 else None
    t = torch.ones(1)
    if rank == 1:
        time.sleep(1.0)  # later than the connect phase's share of the timeout, within the timeout
    dist.all_reduce(t, group=group)
    out = [group_timeout(group).total_seconds(), t.item()]
    if sub is not None:
        dist.all_reduce(t, group=sub)
        out += [group_timeout(sub).total_seconds(), dist.get_world_size(sub), t.item()]
    return out


def test_a_new_gloo_group_has_the_full_timeout_for_its_collectives():
    assert run_ranks(rank_made_group_keeps_the_full_timeout, 3) == [
        [3.0, 3.0, 5.0, 2, 6.0], [3.0, 3.0], [3.0, 3.0, 5.0, 2, 6.0]]
