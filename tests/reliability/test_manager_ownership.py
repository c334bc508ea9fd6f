"""One writer per manager directory: managers started at the same moment, for real.

Eight processes, released together by a barrier, each open a ``CheckpointManager`` on one
directory (local files, and the loopback S3 server): exactly one may win; the others get a
clear error and never sweep the directory. While the winner has a step in flight (data
files, no ``.metadata`` yet), a second wave of starts must not touch it.
"""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import time
import traceback

import multiprocess  # noqa: F401 - sets the forkserver's preload
import pytest

from hyper_parallel.core.distributed_checkpoint import CheckpointError, CheckpointManager, list_steps
from hyper_parallel.core.distributed_checkpoint._src.manager.ownership import OWNER_FILE

CONTENDERS = 8
IN_FLIGHT = "step_00000001/data-r00000-0-0123456789abcdef.safetensors"  # the winner's save, not committed yet
_CTX = mp.get_context("forkserver")  # its preload (torch, this package) is set by the multi-rank runner


def _put(directory: str, name: str, data: bytes, opts: dict | None) -> None:
    if opts is None:
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    else:
        import fsspec

        fs, root = fsspec.core.url_to_fs(directory, **opts)
        fs.pipe_file(f"{root}/{name}", data)


def _exists(directory: str, name: str, opts: dict | None) -> bool:
    if opts is None:
        return os.path.exists(os.path.join(directory, name))
    import fsspec

    fs, root = fsspec.core.url_to_fs(directory, **opts)
    fs.invalidate_cache()
    return fs.exists(f"{root}/{name}")


def _start_soon(go) -> None:
    go.value = time.monotonic() + 0.2  # every contender is ready: all leave their spin at this moment


def _contender(i: int, directory: str, opts: dict | None, barrier, go, out, release) -> None:
    if opts is not None:
        import s3fs  # noqa: F401 - imported before the start, so the contenders meet at the claim
    barrier.wait()
    while time.monotonic() < go.value:  # all at once: a barrier alone wakes them one by one
        pass
    try:
        mgr = CheckpointManager(directory, storage_options=opts)
    except CheckpointError as exc:
        out.put((i, "refused", str(exc)))
        return
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((i, "error", traceback.format_exc()))
        return
    # The winner has a save in flight: data written, no .metadata yet. A start that swept now
    # would delete it.
    _put(directory, IN_FLIGHT, b"in flight", opts)
    out.put((i, "won", None))
    release.wait(120)
    intact = _exists(directory, IN_FLIGHT, opts)
    mgr.close()
    out.put((i, "intact" if intact else "swept", None))


def _wave(n: int, directory: str, opts: dict | None, release) -> tuple[list[tuple[int, str, str | None]], list]:
    """Start ``n`` contenders at the same moment; their first reports, and the processes."""
    go, out = _CTX.Value("d", 0.0, lock=False), _CTX.Queue()
    barrier = _CTX.Barrier(n, action=functools.partial(_start_soon, go))
    procs = [_CTX.Process(target=_contender, args=(i, directory, opts, barrier, go, out, release))
             for i in range(n)]
    for p in procs:
        p.start()
    reports = []
    deadline = time.monotonic() + 120
    while len(reports) < n and time.monotonic() < deadline:
        try:
            reports.append(out.get(timeout=1))
        except queue.Empty:
            if all(p.exitcode not in (None, 0) for p in procs):
                break
    return reports, [procs, out]


def _race(directory: str, opts: dict | None) -> None:
    release = _CTX.Event()
    first, (procs, out) = _wave(CONTENDERS, directory, opts, release)
    later: list = []
    try:
        assert len(first) == CONTENDERS, f"{CONTENDERS - len(first)} contender(s) never reported: {first}"
        errors = [r for r in first if r[1] == "error"]
        assert not errors, errors[0][2]
        winners = [r[0] for r in first if r[1] == "won"]
        assert len(winners) == 1, f"{len(winners)} of {CONTENDERS} simultaneous starts opened the directory"
        for _, _, message in (r for r in first if r[1] == "refused"):
            assert "in use by another CheckpointManager" in message, message
        # a second wave while the winner's step is in flight: refused, and nothing swept
        second, (later, _) = _wave(4, directory, opts, release)
        assert sorted(r[1] for r in second) == ["refused"] * 4, second
        assert _exists(directory, IN_FLIGHT, opts)
    finally:
        release.set()
        ends = []
        deadline = time.monotonic() + 60
        while len(ends) < 1 and time.monotonic() < deadline and any(r[1] == "won" for r in first):
            try:
                ends.append(out.get(timeout=1))
            except queue.Empty:
                pass
        for p in [*procs, *later]:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [e[1] for e in ends] == ["intact"], ends
    assert [i.step for i in list_steps(directory, storage_options=opts)] == [1]  # the winner's, never swept


# Before the claim was atomic, most rounds let several contenders in (up to 8 of 8 on S3), so
# a few rounds make a pass by luck unlikely.
ROUNDS = 3


def test_simultaneous_starts_on_local_files_one_wins(tmp_path):
    for r in range(ROUNDS):
        _race(str(tmp_path / f"run{r}"), None)


@pytest.mark.parametrize("stale", ["dead", "garbage"])
def test_simultaneous_takeovers_of_a_stale_owner_one_wins(tmp_path, stale):
    """The owner file of a job that is gone (a pid that no longer runs), or one that does not
    parse, is taken over by exactly one of the managers that start together."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "token": "old"})
    for r in range(ROUNDS):
        d = tmp_path / f"run{r}"
        d.mkdir()
        (d / OWNER_FILE).write_text(record if stale == "dead" else "{not json")
        _race(str(d), None)


def test_simultaneous_starts_and_takeovers_on_an_s3_server_one_wins(s3_bucket):
    """On S3: a fresh directory (If-None-Match decides) and one with a stale owner record
    (If-Match on its ETag decides). Every S3 round costs seconds here: 8 clients, all HTTP."""
    import fsspec

    bucket, opts = s3_bucket
    for r, stale in enumerate((False, True, False)):
        if stale:
            fsspec.filesystem("s3", **opts).pipe_file(f"{bucket}/run{r}/{OWNER_FILE}", b"{not json")
        _race(f"s3://{bucket}/run{r}", opts)
