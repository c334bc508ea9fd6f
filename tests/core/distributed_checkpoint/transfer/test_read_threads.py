"""The loader's kept threads: lanes bound how many calls run and start them in order, close
leaves nothing running, errors reach the caller, and a forked child gets threads of its own."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import FileSystemReader, load, save
from hyper_parallel.core.distributed_checkpoint._src.transfer import read_threads
from hyper_parallel.core.distributed_checkpoint._src.transfer.read_threads import Lane, fetch_pool, file_pool


def test_a_lane_runs_at_most_its_width_at_once_in_submission_order():
    lock, running, peak, started = threading.Lock(), [0], [0], []

    def task(i: int) -> int:
        with lock:
            started.append(i)
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return i * i

    lane = Lane(fetch_pool, 2)
    futures = [lane.submit(task, i) for i in range(8)]
    assert [f.result(timeout=10) for f in futures] == [i * i for i in range(8)]
    lane.close()
    assert peak[0] == 2
    assert started == list(range(8))


def test_close_drops_calls_not_started_and_waits_for_the_running_one():
    release, done = threading.Event(), []

    def slow() -> None:
        release.wait(10)
        time.sleep(0.05)
        done.append("slow")

    lane = Lane(fetch_pool, 1)
    first = lane.submit(slow)
    later = [lane.submit(done.append, i) for i in range(3)]
    closer = threading.Thread(target=lane.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # the running call is not finished: close waits
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert done == ["slow"] and first.done()
    assert all(f.cancelled() for f in later)


def test_an_error_in_a_call_reaches_whoever_waits_and_the_lane_goes_on():
    def fail() -> None:
        raise ValueError("bad read")

    lane = Lane(fetch_pool, 1)
    bad, good = lane.submit(fail), lane.submit(lambda: 7)
    with pytest.raises(ValueError, match="bad read"):
        bad.result(timeout=10)
    assert good.result(timeout=10) == 7
    lane.close()


def test_calls_on_file_threads_know_it_so_a_load_there_reads_its_files_itself():
    assert not read_threads.in_file_thread()
    lane = Lane(file_pool, 1)
    assert lane.submit(read_threads.in_file_thread).result(timeout=10) is True
    lane.close()
    assert not read_threads.in_file_thread()


def _child(q) -> None:
    lane = Lane(fetch_pool, 2)
    try:
        q.put(sum(f.result(timeout=5) for f in [lane.submit(lambda i=i: i) for i in range(4)]))
    except Exception as exc:  # a pool of the parent's threads would never run the calls
        q.put(repr(exc))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_starts_threads_of_its_own():
    lane = Lane(fetch_pool, 4)  # the parent's threads exist, idle: each would take a call
    for f in [lane.submit(time.sleep, 0.05) for _ in range(4)]:
        f.result(timeout=10)
    try:  # forked while the lane is open: the pool's threads exist in the parent only
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(q,))
        p.start()
        assert q.get(timeout=30) == 6
        p.join(30)
    finally:
        lane.close()


def test_loads_leave_no_thread_behind(tmp_path):
    """The pools live while a load's lanes are open (HyperParallel's pipelined-load test counts
    the threads after each load)."""
    full = {f"t{i}": torch.randn(256, 1024) for i in range(4)}
    path = str(tmp_path / "ckpt")
    save(full, path, no_dist=True)
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    load(target, path, storage_reader=FileSystemReader(path), no_dist=True)
    before = {t.ident for t in threading.enumerate()}
    for _ in range(3):
        for v in target.values():
            v.zero_()
        load(target, path, storage_reader=FileSystemReader(path), no_dist=True)
        assert all(torch.equal(target[k], full[k]) for k in full)
        started = {t.ident for t in threading.enumerate()} - before
        assert not started, [t.name for t in threading.enumerate() if t.ident in started]
    assert not any(t.name.startswith(("dcp-read", "dcp-prefetch")) for t in threading.enumerate())
