"""This library's background threads yield the CPU to training (Linux niceness, best effort).

An async save's writer and a local tier's replication run beside a training loop that wants
every core. At equal priority the scheduler splits a contended core between them, so a
checkpoint slows the loop (on an accelerator: delays its kernel launches) for as long as it
runs. At a higher niceness the background work takes what the loop leaves: the loop goes
first, and the save finishes in the gaps, later where the loop leaves none.

Linux gives each thread its own niceness (``setpriority`` on a thread id), and threads inherit
their creator's, so the threads a background thread starts (copy helpers, file writers) run
at its level. Elsewhere, or without permission, nothing changes.
"""

from __future__ import annotations

import contextlib
import os
import threading

BACKGROUND_NICE = 10  # CFS gives a nice-10 thread about a tenth of a nice-0 one's share


def thread_ids(gloo_only: bool = False) -> set[int]:
    """This process's thread ids (Linux /proc), optionally only gloo's I/O and worker threads."""
    try:
        tids = {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()
    if not gloo_only:
        return tids
    out = set()
    for tid in tids:
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(("gloo", "pt_gloo")):
                    out.add(tid)
    return out


def lower_priority(tids: set[int] | list[int], nice: int = BACKGROUND_NICE) -> None:
    """Raise the niceness of threads ``tids`` to at least ``nice`` (never lower it)."""
    for tid in tids:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))


def lower_this_thread(nice: int = BACKGROUND_NICE) -> None:
    """Run the calling thread (and the threads it starts from now on) at niceness ``nice``."""
    if nice > 0:
        lower_priority([threading.get_native_id()], nice)
