"""Copies between CPU tensors on the calling thread, outside torch's intra-op thread pool.

The saver and loader copy bytes between scratch buffers and tensors from their own thread
pools while other threads wait on storage. ``Tensor.copy_`` splits a large copy over
torch's intra-op (OpenMP) threads, one per core by default: every rank of a node then
wakes a core's worth of spinning threads per copy, on top of our readers and writers and
the other ranks. On this 2-core machine that made a 2-rank load of a 436-tensor state
1.6-8x slower than the same copies on one thread, and its time erratic (0.67-3.4 s against
0.31-0.43 s, warm cache). :func:`copy_into` copies with numpy instead: one thread (the
caller's, which is already one of our workers), the GIL released, any strides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.autograd.graph import increment_version

# numpy's view of a tensor's elements as same-sized integers (bit patterns, any dtype).
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MIN_BYTES = 64 << 10  # below this torch copies on one thread anyway (its grain size)
FED_BYTES = 1 << 20  # a piece of copy_fed: still in this core's cache when it is consumed


def _as_numpy(t: torch.Tensor) -> np.ndarray | None:
    """A numpy array over ``t``'s memory with its strides, or None where there is none."""
    if (t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg()
            or t.dim() == 0 or any(s < 0 for s in t.stride())):
        return None
    as_int = _AS_INT.get(t.element_size())
    if as_int is None or t.dtype.is_complex:
        return None
    try:
        return t.detach().view(as_int).numpy()
    except (RuntimeError, TypeError):  # a subclass or view numpy cannot take: torch copies
        return None


def side_by_side(values: list[Any]) -> int | None:
    """The step, in elements, between ``values`` when they are equal views (device, dtype,
    shape, strides) of one storage, each starting that step after the one before (the column
    bands of one tensor); None where they are not, or are fewer than two."""
    if len(values) < 2 or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    first = values[0]
    size = first.element_size()
    step = values[1].data_ptr() - first.data_ptr()
    if step <= 0 or step % size:
        return None
    storage = first.untyped_storage().data_ptr()
    for k, v in enumerate(values):
        if (v.device != first.device or v.dtype != first.dtype or v.shape != first.shape
                or v.stride() != first.stride() or v.data_ptr() != first.data_ptr() + k * step
                or v.untyped_storage().data_ptr() != storage):
            return None
    return step // size


def copy_into(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest.copy_(src)``; for same-dtype, same-shape CPU tensors on this thread alone."""
    if (dest.dtype == src.dtype and dest.shape == src.shape
            and dest.numel() * dest.element_size() >= MIN_BYTES):
        d, s = _as_numpy(dest), _as_numpy(src)
        if d is not None and s is not None:
            np.copyto(d, s, casting="no")
            increment_version(dest)  # as copy_ would: autograd sees the tensor was written
            return
    with torch.no_grad():
        dest.copy_(src)


def copy_fed(dest: memoryview, src: torch.Tensor, consume: Callable[[memoryview], None]) -> bool:
    """Copy CPU tensor ``src`` (any strides) into ``dest`` as row-major bytes, a piece of
    about FED_BYTES at a time, calling ``consume`` on each piece of ``dest`` just after it is
    copied. A checksum consumed this way reads the piece from the cache, not a second pass
    over memory (here: checksumming 8 MiB slices and then copying them took 45-61 ms per
    256 MiB, fused 29-31 ms). Returns False, having done nothing, where numpy cannot view ``src``.
    """
    s = _as_numpy(src)
    if s is None or dest.nbytes != s.nbytes:
        return False
    if s.flags.c_contiguous:
        s = s.reshape(-1)
    d = np.frombuffer(dest, dtype=s.dtype).reshape(s.shape)
    row = s.nbytes // s.shape[0] if s.shape[0] else 0
    step = max(1, FED_BYTES // max(1, row))
    for r0 in range(0, s.shape[0], step):
        r1 = min(s.shape[0], r0 + step)
        np.copyto(d[r0:r1], s[r0:r1], casting="no")
        consume(dest[r0 * row:r1 * row])
    return True


def gather_fed(dest: memoryview, pitch: int, src: torch.Tensor, consume: Callable[[int, memoryview], None]) -> bool:
    """Copy every ``src[k]`` (a CPU tensor of any strides, e.g. the column bands of one box)
    into ``dest`` as row-major bytes at ``k * pitch``, all of them in one copy per piece of
    about FED_BYTES, calling ``consume(k, piece)`` on each one's piece just after it is copied
    (in order per ``k``). One numpy call per piece instead of one per band and piece: a box of
    four 128 KiB bands took 210 us band by band, most of it per-call overhead. Returns False,
    having done nothing, where numpy cannot view ``src``."""
    s = _as_numpy(src)
    if s is None or s.ndim < 2 or not s.shape[0]:
        return False
    n, rows = s.shape[0], s.shape[1]
    row = s[0].nbytes // rows if rows else 0
    if dest.nbytes < pitch * (n - 1) + rows * row:
        return False
    inner = [s.itemsize]
    for size in reversed(s.shape[2:]):
        inner.insert(0, inner[0] * size)
    d = np.ndarray(s.shape, s.dtype, buffer=dest, strides=(pitch, *inner))  # the bands at their pitch
    step = max(1, FED_BYTES // max(1, n * row))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        np.copyto(d[:, r0:r1], s[:, r0:r1], casting="no")
        for k in range(n):
            consume(k, dest[k * pitch + r0 * row:k * pitch + r1 * row])
    return True
