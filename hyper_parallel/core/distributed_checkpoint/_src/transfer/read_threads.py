"""The loader's threads, kept from one load to the next, and lanes that bound work on them.

A load used to start its threads afresh: one per file being read, up to four more per file
reading ahead, and some to read indexes — a dozen for a 2-rank ``Shard(0)`` ->
``Shard(1)`` load. ``Thread.start`` returns only once the new thread has run; on a machine
whose cores are busy (2 cores shared by several jobs: a load average of 17) that wait
measured 10-40 ms a thread, 0.1-0.4 s a load in all, beside reading that takes 0.8 s.
Here the threads are started once per load and reused by its files, and the
thread that finishes a call of a lane runs the lane's next one itself (handing it to an
idle thread costs one more wake-up: a first version that did was no faster than fresh
threads). 2 ranks, 436 tensors, 1 GiB, cold, 8 alternating repetitions at a load average of
13: same-layout load 0.94 -> 0.74 s, ``Shard(0)`` -> ``Shard(1)`` 1.06 -> 0.97 s (medians).

Two pools, so no task can wait on one that cannot run: :func:`file_pool` runs the readers
of whole files (they wait on reads they started ahead), :func:`fetch_pool` runs reads and
index reads (they never wait on other tasks). A :class:`Lane` puts a bound on how many of a
group of tasks run at once (one file's reads ahead, the files of one load) and starts them
in the order given, so one file is still read front to back by as many threads as before.

No thread outlives the loads using it: the pools exist while a :class:`Lane` is open and are
shut down (their threads joined) when the last one closes, so a load returns with the
process's thread count as it found it (HyperParallel's pipelined-load test checks that three
loads in a row leave no thread behind). After ``fork`` the child has none of the parent's
threads: the pools are dropped there and started again on first use.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

MAX_FILE_THREADS = 32  # files read at once, over every load running in this process
MAX_FETCH_THREADS = 64  # reads in flight at once, over every load running in this process

_lock = threading.Lock()
_pools: dict[str, ThreadPoolExecutor] = {}
_open_lanes = 0  # the pools live while this is above 0
_in_file_thread = threading.local()


def _pool(name: str, size: int) -> ThreadPoolExecutor:
    pool = _pools.get(name)
    if pool is None:
        with _lock:
            pool = _pools.get(name)
            if pool is None:
                pool = _pools[name] = ThreadPoolExecutor(size, thread_name_prefix=name)
    return pool


def file_pool() -> ThreadPoolExecutor:
    """Threads that read whole files (each may wait on reads of :func:`fetch_pool`)."""
    return _pool("dcp-read", MAX_FILE_THREADS)


def fetch_pool() -> ThreadPoolExecutor:
    """Threads that run single reads; a task here never waits on another task."""
    return _pool("dcp-prefetch", MAX_FETCH_THREADS)


def in_file_thread() -> bool:
    """True on a thread of :func:`file_pool` (a load started there reads its files itself)."""
    return getattr(_in_file_thread, "on", False)


def _mark_file_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        _in_file_thread.on = True
        try:
            return fn(*args)
        finally:
            _in_file_thread.on = False
    return run


class Lane:
    """Runs calls on the threads of ``pool`` (:func:`file_pool` or :func:`fetch_pool`), at most
    ``width`` at a time, started in submission order.

    :meth:`close` cancels the calls not yet started and waits for those running, so no
    call touches the caller's memory after it returns.
    """

    def __init__(self, pool: Callable[[], ThreadPoolExecutor], width: int):
        global _open_lanes
        with _lock:  # counted before the pool is taken, so a closing lane cannot shut it under us
            _open_lanes += 1
        self._closed = False
        self._pool, self._width = pool(), max(1, width)
        self._mark = pool is file_pool
        self._queue: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self._running = 0
        self._cond = threading.Condition()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        with self._cond:
            self._queue.append((fut, _mark_file_thread(fn) if self._mark else fn, args))
            self._start()
        return fut

    def _start(self) -> None:  # under self._cond
        while self._running < self._width and self._queue:
            fut, fn, args = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            self._running += 1
            try:
                self._pool.submit(self._run, fut, fn, args)
            except RuntimeError as exc:  # the interpreter is shutting down: no new threads
                self._running -= 1
                fut.set_exception(exc)

    def _run(self, fut: Future, fn: Callable[..., Any], args: tuple) -> None:
        # Runs calls until the lane has none waiting: the thread that finishes one goes on
        # to the next itself, as a thread of the lane's own would, instead of waking another
        # (each wake-up waits for a core on a busy machine).
        while True:
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to whoever waits on the future
                fut.set_exception(exc)
            else:
                fut.set_result(result)
            with self._cond:
                nxt = None
                while self._queue and nxt is None:
                    cand = self._queue.popleft()
                    if cand[0].set_running_or_notify_cancel():
                        nxt = cand
                if nxt is None:
                    self._running -= 1
                    self._cond.notify_all()
                    return
            fut, fn, args = nxt

    def close(self) -> None:
        """Cancel what has not started; wait for what has. The last lane to close shuts the
        pools down (see the module docstring)."""
        with self._cond:
            for fut, _, _ in self._queue:
                fut.cancel()
            self._queue.clear()
            while self._running:
                self._cond.wait()
        if not self._closed:
            self._closed = True
            _release()


def _release() -> None:
    global _open_lanes
    with _lock:
        _open_lanes -= 1
        idle = list(_pools.values()) if _open_lanes == 0 else []
        if idle:
            _pools.clear()
    on_pool = threading.current_thread().name.startswith(("dcp-read", "dcp-prefetch"))
    for pool in idle:  # a pool's own thread cannot join itself: it only lets the others go
        pool.shutdown(wait=not on_pool)


def _forget_pools() -> None:  # in a forked child: the parent's threads are not there
    global _lock, _open_lanes
    _pools.clear()
    _open_lanes = 0
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)
