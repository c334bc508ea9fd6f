"""A tensor's version stamp: what says, without reading its bytes, that they did not change.

torch counts in-place writes to a tensor's memory: every tensor has a version counter (shared
by the tensor, its views and ``detach()``-ed aliases) that each in-place op dispatched through
torch bumps, with or without ``torch.no_grad()`` and, for normal tensors, under
``torch.inference_mode()`` too. A :class:`VersionStamp` records that counter together with the
identity of the memory: the storage (held weakly: once it is freed the stamp matches nothing,
so a new tensor allocated at the same address is never taken for the old one), its address
and size, and the tensor's offset, strides, shape, dtype and device. Two equal stamps mean:
the same memory, viewed the same way, and no in-place op dispatched through torch since.

Caught (the counter moves, or the identity changes): in-place ops on the tensor or on any
view or ``detach()`` of it (``add_``, ``copy_``, ``t[i] = x``, non-fused optimizers, including
``foreach``), ``load_state_dict`` (``copy_``), ``set_()`` and ``param.data = other`` (another
storage), a tensor replaced by a new one (another storage, even at a reused address), and this
library's own loads (:func:`mark_written`: they bump the counter of every target they fill,
also where they read straight into its memory).

Not caught (bytes change, the counter does not): writes through ``.data`` (``p.data.add_(...)``:
``.data`` has a counter of its own); torch's fused optimizers (``Adam``/``AdamW``/``SGD`` with
``fused=True`` update parameters and moments without bumping them, measured on torch 2.13);
numpy views (``t.numpy()``), DLPack, ``ctypes``/``data_ptr()`` writes and custom kernels given
raw pointers (e.g. bitsandbytes' 8-bit optimizers); in-place collectives (``dist.broadcast``,
``dist.all_reduce`` into a tensor: measured on gloo, torch 2.13); memory shared with another process
(``share_memory_()``, ``torch.from_file``). Inference tensors have no counter and get no stamp.
This is why a stamp is never trusted alone (see :mod:`..engine.incremental`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["VersionStamp", "stamp_of", "mark_written"]


@dataclass(frozen=True, eq=False)
class VersionStamp:
    """A tensor's memory identity and version counter at one moment (see the module docstring)."""

    storage: weakref.ref  # dead once the memory is freed
    identity: tuple  # (storage address, storage bytes, offset, stride, shape, dtype, device)
    version: int

    def same_as(self, other: VersionStamp | None) -> bool:
        """Whether the tensor stamped now is the one stamped as ``other``, unwritten since."""
        if other is None or self.version != other.version or self.identity != other.identity:
            return False
        storage = self.storage()
        return storage is not None and storage is other.storage()

    def written_since(self, other: VersionStamp | None) -> bool:
        """Whether this is ``other``'s memory, viewed the same way, written in place since."""
        if other is None or self.version == other.version or self.identity != other.identity:
            return False
        storage = self.storage()
        return storage is not None and storage is other.storage()


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def stamp_of(tensor: Any) -> VersionStamp | None:
    """The stamp of a plain strided tensor, or None where there is none to trust: inference
    tensors (no counter), meta/sparse/nested tensors, and tensor subclasses (whose counter
    need not follow the memory they wrap)."""
    if (type(tensor) not in _PLAIN or tensor.layout != torch.strided or tensor.is_nested
            or tensor.device.type == "meta" or tensor.is_inference()):
        return None
    try:
        storage = tensor.untyped_storage()
        ref = weakref.ref(storage)
        version = tensor._version
    except (RuntimeError, TypeError):  # no storage or no counter to read: nothing to trust
        return None
    identity = (storage.data_ptr(), storage.nbytes(), tensor.storage_offset(), tensor.stride(),
                tuple(tensor.shape), tensor.dtype, tensor.device)
    return VersionStamp(ref, identity, version)


def mark_written(value: Any) -> None:
    """Tell torch's version counter that ``value`` (a tensor, or a DTensor's local tensor) was
    written: for writes into its memory that bypass torch (``preadv`` straight into a load
    target), so no stamp taken before them still matches."""
    t = getattr(value, "_local_tensor", value)
    if isinstance(t, torch.Tensor) and t.device.type != "meta" and not t.is_inference():
        torch.autograd.graph.increment_version(t)
