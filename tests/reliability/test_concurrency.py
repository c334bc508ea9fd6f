"""Racing saves and a reader loading while a writer overwrites: each load sees one complete
checkpoint or raises a clear error."""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from hyper_parallel.core.distributed_checkpoint import CheckpointError, load, save


def _state(step: int) -> dict:
    # every tensor encodes the step, so a mix of two saves is visible
    return {"a": torch.full((256, 256), float(step)), "b": torch.full((1000,), step, dtype=torch.int64),
            "step": step}


def _writer(path: str, first: int, count: int) -> None:
    for step in range(first, first + count):
        save(_state(step), path, no_dist=True, sync_files=False)


def _consistent(out: dict) -> bool:
    s = out["step"]
    return bool((out["a"] == float(s)).all() and (out["b"] == s).all())


def test_reader_during_overwrites_sees_whole_checkpoints_or_errors(tmp_path):
    path = str(tmp_path / "c")
    save(_state(0), path, no_dist=True)
    ctx = mp.get_context("forkserver")
    writers = [ctx.Process(target=_writer, args=(path, 1, 25)), ctx.Process(target=_writer, args=(path, 1000, 25))]
    for w in writers:
        w.start()
    loads = errors = 0
    deadline = time.monotonic() + 60
    try:
        while any(w.is_alive() for w in writers) and time.monotonic() < deadline:
            try:
                out = load(path=path)
            except CheckpointError:
                errors += 1
                continue
            assert _consistent(out), f"load returned a mix of saves (step {out['step']})"
            loads += 1
    finally:
        for w in writers:
            w.join(30)
            if w.is_alive():
                w.kill()
    print(f"\nconcurrent loads: {loads} consistent, {errors} clear errors, 0 mixed")
    assert all(w.exitcode == 0 for w in writers)
    assert loads > 0
    final = load(path=path)  # the race's winner is one complete checkpoint
    assert _consistent(final) and final["step"] in (25, 1024)
