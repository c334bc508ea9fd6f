"""PlacedWrites: byte runs written at their places in a shared file (a consolidated Hugging
Face file), whole blocks with O_DIRECT and the rest buffered; box_runs: where a box's runs lie."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hyper_parallel.core.distributed_checkpoint._src.backends import direct_io, filesystem, placed_writes
from hyper_parallel.core.distributed_checkpoint._src.backends.placed_writes import box_runs
from hyper_parallel.core.distributed_checkpoint._src.base.box import Box


def test_placed_writes_queue_bounce_buffers_and_keep_every_byte_in_place(tmp_path, monkeypatch):
    """Runs from unaligned memory are copied into bounce buffers that a thread of the file
    writes while the next one is copied; every byte lands in place, and a failed write is
    raised in the caller."""

    path = str(tmp_path / "f.bin")
    monkeypatch.setattr(placed_writes, "BOUNCE_BYTES", 256 << 10)  # many pieces per run
    rng = np.random.default_rng(5)
    runs, at = [], 100
    for n in (3 << 20, 70 << 10, 5000, (1 << 20) + 17):
        data = rng.integers(0, 256, n + 3, dtype=np.uint8)[3:]  # off any alignment
        runs.append((at, data))
        at += n + int(rng.integers(1, 9000))
    f = placed_writes.PlacedWrites(path, direct=direct_io.direct_io_default(str(tmp_path)))
    os.ftruncate(f.fd, at)
    for off, data in runs:
        f.write(memoryview(data), off)
    f.drain()
    f.close()
    with open(path, "rb") as fh:
        whole = fh.read()
    for off, data in runs:
        assert whole[off:off + data.nbytes] == data.tobytes()

    def broken(fd, views, offset):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(filesystem, "pwrite_all", broken)  # the file's writer thread writes with it
    f = placed_writes.PlacedWrites(path, direct=True)
    with pytest.raises(OSError, match="I/O error"):
        f.write(memoryview(runs[0][1]), 4096 + 5)
        f.drain()
    f.close()


@pytest.mark.parametrize("shape,box", [
    ((6, 8), Box((0, 0), (6, 8))),  # whole: one run
    ((6, 8), Box((2, 0), (3, 8))),  # whole rows: one run
    ((6, 8), Box((1, 3), (4, 2))),  # a column band: a run per row
    ((4, 5, 6), Box((1, 2, 0), (2, 3, 6))),  # whole trailing dim
])
def test_box_runs_are_where_the_box_lies_in_the_row_major_tensor(shape, box):
    full = torch.arange(int(np.prod(shape)), dtype=torch.int32).reshape(shape)
    offsets, run = box_runs(shape, box, 4)
    raw = full.reshape(-1).view(torch.uint8).numpy()
    got = b"".join(raw[o:o + run].tobytes() for o in offsets)
    assert got == full[box.relative_to(Box.full(shape))].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
