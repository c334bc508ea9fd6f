"""paused_gc: one pause for the process, shared by nested and concurrent blocks."""

from __future__ import annotations

import gc
import threading

from hyper_parallel.core.distributed_checkpoint._src.base.gc_pause import paused_gc


def test_the_collector_stays_paused_until_the_last_concurrent_block_ends():
    assert gc.isenabled()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused_gc():
            inside.set()
            leave.wait(10)

    with paused_gc():
        t = threading.Thread(target=other)
        t.start()
        assert inside.wait(10)
    # this thread's block ended first: the other thread's is still running
    assert not gc.isenabled(), "the first block to end turned the collector back on"
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_nested_blocks_and_a_collector_that_was_off():
    with paused_gc():
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
