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

import numpy as np
import torch
from torch.autograd.graph import increment_version

# numpy's view of a tensor's elements as same-sized integers (bit patterns, any dtype).
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MIN_BYTES = 64 << 10  # below this torch copies on one thread anyway (its grain size)


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
