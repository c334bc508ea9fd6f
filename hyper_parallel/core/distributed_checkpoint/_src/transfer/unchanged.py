"""Whether a chunk is unchanged since the step that stored it, reading as little of it as can be.

An incremental save (see :mod:`..engine.incremental`) asks this of every chunk it stored
before. Three tests, cheapest first:

1. the source tensor's :class:`~..state.version_stamp.VersionStamp` equals the one recorded
   when the stored bytes were last known to be its bytes (same memory, no in-place op since).
   The same memory written in place since is taken as changed, and written (hashed as it
   streams out) without a separate check: what changes every step costs no check at all;
2. a *spot check*: the hash of :data:`SAMPLE_PIECES` pieces of :data:`SAMPLE_PIECE_BYTES` at
   fixed, evenly spread places of the chunk equals the one recorded with the stored bytes (the
   whole chunk when it is at most :data:`SAMPLE_WHOLE_BYTES`). It costs ~32 KiB of reading and
   catches the writes a version counter misses that touch the whole tensor (fused optimizers,
   custom kernels, ``.data.copy_``);
3. the full 128-bit content hash of the chunk, compared with the stored one.

A chunk passing 1 and 2, and not due a full check (the caller's schedule), is reused unread;
otherwise 3 decides. A chunk whose stamp was unchanged but whose hash was not is reported
(``behind_counter``): its tensor is written behind torch's version counter, and the caller
stops trusting that key's stamps.

Tests 1 and 2 are :func:`triage` and test 3 is :func:`settle`, so that a saver can triage
every chunk, start writing those already known changed, and hash the pending ones meanwhile.

Test 3 on a *box* stored as column bands (a row-major tensor cut into bands of columns) need
not copy each band out of the tensor to hash it: :func:`whole_box` finds the box's own
contiguous memory, and one hash of it (:func:`box_digest`) is compared with the one taken when
every band of the box was last known to hold its stored bytes (``Verdict.box_digest``: that
hash, and the band's digest then). Equal box hashes mean equal memory, so each band still
holds the bytes it held then; it is taken as unchanged only where its stored digest is still
the one recorded with the box hash, so a band written since cannot be vouched for by a stale
box hash. Here one hash of a 16 MiB box cost ~1 ms, against ~3.3 ms band by band.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..format.data_file import ContentHash, tensor_bytes
from ..state.version_stamp import VersionStamp
from .host_copy import side_by_side

SAMPLE_PIECES = 8
SAMPLE_PIECE_BYTES = 4096
SAMPLE_WHOLE_BYTES = 64 << 10  # chunks up to this size are spot-checked whole


@dataclass
class Verdict:
    """What the check found for one chunk.

    ``digest``: its content hash when it was hashed (or taken from the prior chunk when
    reused unread), else None; ``unread``: reused on its stamp and spot check alone;
    ``stamp``/``sample``: what to record for the next save; ``behind_counter``: its stamp
    said unchanged, its hash said otherwise; ``box_digest``: (the hash of its box's memory,
    this band's digest then), taken while every band of the box held the bytes their digests
    name (column bands only; see :func:`whole_box`).
    """

    digest: bytes | None
    stamp: VersionStamp | None
    sample: bytes | None
    unread: bool = False
    behind_counter: bool = False
    box_digest: tuple[bytes, bytes] | None = None


@dataclass
class UnchangedStats:
    """What one save's checks cost and found (bytes of this rank's chunks).

    ``unread_bytes``: chunks reused on their stamp and spot check, without reading them;
    ``hashed_bytes``: bytes hashed in full (by the checks, and while writing);
    ``sampled_bytes``: bytes the spot checks read; ``written_bytes``: chunk bytes written;
    ``behind_counter``: keys found changed under an unchanged stamp; ``whole_box_bytes``: the
    part of ``hashed_bytes`` checked by one hash of a box's memory instead of band by band.
    """

    unread_bytes: int = 0
    unread_chunks: int = 0
    hashed_bytes: int = 0
    sampled_bytes: int = 0
    written_bytes: int = 0
    behind_counter: set[str] = field(default_factory=set)
    whole_box_bytes: int = 0


def sample_digest(value: Any) -> tuple[bytes, int] | None:
    """The spot-check hash of a chunk's bytes and how many bytes it read, or None when the
    value cannot be sampled (not a tensor, or one slicing refuses)."""
    if not isinstance(value, torch.Tensor):
        return None
    t = value.detach()
    n, size = t.numel(), t.element_size()
    h = ContentHash()
    read = 0
    try:
        if n * size <= SAMPLE_WHOLE_BYTES or t.dim() == 0:
            views = [tensor_bytes(t)]
        elif t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            flat = tensor_bytes(t)  # no copy: pieces of the tensor's own memory
            piece = SAMPLE_PIECE_BYTES
            views = [flat[s:s + piece] for s in _spread(flat.nbytes - piece)]
        elif t.device.type == "cpu" and t.dim() >= 2 and t.stride(-1) == 1 and not (t.is_conj() or t.is_neg()):
            views = _row_pieces(t.view(torch.uint8).numpy())  # a column band: copies only the pieces
        else:
            m = max(1, SAMPLE_PIECE_BYTES // size)  # elements per piece
            if t.is_contiguous() or t.dim() == 1:  # pieces of the flat (or only) dimension
                flat = t.reshape(-1) if t.is_contiguous() else t
                pieces = [flat.narrow(0, s, m) for s in _spread(n - m)]
            else:  # a column band or a strided view: the head of evenly spread rows
                per_row = max(1, n // t.shape[0])
                k = max(1, min(t.shape[0], m // per_row))  # rows per piece
                pieces = [_head(t.narrow(0, r, k), m) for r in dict.fromkeys(_spread(t.shape[0] - k))]
            views = [tensor_bytes(torch.cat([p.reshape(-1) for p in pieces]))]  # one copy off a device
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    for data in views:
        h.feed(data)
        read += data.nbytes
    return h.digest(), read


def _spread(last: int) -> list[int]:
    """SAMPLE_PIECES evenly spread starts from 0 to ``last``."""
    return [i * last // (SAMPLE_PIECES - 1) for i in range(SAMPLE_PIECES)]


def _row_pieces(a: np.ndarray) -> list[memoryview]:
    """Pieces of the bytes of a strided host array (rows whose last dimension is contiguous):
    runs of whole rows at evenly spread places (gathered in one copy), or the head of a row
    larger than a piece."""
    row = a[0].nbytes
    if row >= SAMPLE_PIECE_BYTES:
        return [memoryview(np.ravel(a[r])[:SAMPLE_PIECE_BYTES]) for r in dict.fromkeys(_spread(a.shape[0] - 1))]
    k = min(a.shape[0], SAMPLE_PIECE_BYTES // max(1, row))
    return [memoryview(a[_sample_rows(a.shape[0], k)]).cast("B")]  # one gathering copy of the rows


@functools.lru_cache(maxsize=1024)
def _sample_rows(rows: int, k: int) -> np.ndarray:
    """The rows :func:`_row_pieces` reads of ``rows``: runs of ``k`` at evenly spread places (a
    step checks every chunk, and chunks of one shape share the index)."""
    idx = np.array([r + j for r in dict.fromkeys(_spread(rows - k)) for j in range(k)], dtype=np.intp)
    idx.flags.writeable = False
    return idx


def _head(t: torch.Tensor, m: int) -> torch.Tensor:
    """A leading part of ``t`` (a view) with at most ``m`` elements, or one element."""
    while t.dim() > 0 and t.numel() > m:
        inner = t.numel() // max(1, t.shape[0])
        if inner <= m:
            return t.narrow(0, 0, m // inner)
        t = t.select(0, 0)
    return t


def whole_box(bands: list[Any]) -> torch.Tensor | None:
    """The contiguous host memory that ``bands`` (every column band of one box, in order) cut
    up between them, as a 2-D tensor of whole rows; None where they are not that: not all
    equal 2-D CPU views of one storage side by side, or not spanning whole rows of it."""
    first = bands[0] if bands else None
    if not isinstance(first, torch.Tensor) or first.device.type != "cpu" or first.dim() != 2:
        return None
    rows, width = first.shape
    span = len(bands) * width
    if (not rows or first.stride() != (span, 1) or first.is_conj() or first.is_neg()
            or side_by_side(bands) != width):
        return None
    return first.detach().as_strided((rows, span), (span, 1))


def box_digest(box: torch.Tensor) -> bytes:
    """The 128-bit content hash of a box's memory (see :func:`whole_box`)."""
    h = ContentHash()
    h.feed(tensor_bytes(box))
    return h.digest()


@dataclass
class Pending:
    """A chunk :func:`triage` could not decide without the full hash of its bytes."""

    prior: Any
    stamp: VersionStamp | None
    sample: bytes | None
    same_stamp: bool
    nbytes: int


def known_changed(prior: Any, stamp: VersionStamp | None) -> bool:
    """Whether a chunk is written without reading it: nothing was stored for it (``prior``
    None), or its memory was written in place since (test 1 alone; :func:`triage` gives the
    verdict, which for a new chunk needs its spot check for the next save)."""
    return prior is None or (stamp is not None and stamp.written_since(prior.stamp))


def triage(prior: Any, stamp: VersionStamp | None, value: Any, nbytes: int,
           stats: UnchangedStats) -> Verdict | Pending:
    """Tests 1 and 2 for one chunk against ``prior``, what the last step stored for it (None:
    nothing, or another box): a :class:`Verdict` where they decide, else a :class:`Pending`
    that :func:`settle` finishes with the chunk's full hash. ``prior`` has ``digest``,
    ``stamp``, ``sample`` and ``trust`` (whether its stamp may stand for a full check at this
    save); ``value`` is the chunk's data."""
    if prior is None:  # written, and hashed as it is; its spot check recorded for the next save
        return Verdict(None, stamp, _sample(value, stats) if stamp is not None else None)
    if stamp is not None and stamp.written_since(prior.stamp):
        # the same memory, written in place since: written again without hashing it twice (a
        # tensor that changes every step never pays for a check); no spot check recorded, so
        # once it stops changing its first save hashes it in full before trusting its stamp
        return Verdict(None, stamp, None)
    same_stamp = stamp is not None and stamp.same_as(prior.stamp)
    sample = _sample(value, stats) if same_stamp else None
    if same_stamp and prior.trust and sample is not None and sample == prior.sample:
        stats.unread_bytes += nbytes
        stats.unread_chunks += 1
        return Verdict(prior.digest, stamp, sample, unread=True, box_digest=getattr(prior, "box_digest", None))
    # due a full check, or another tensor (a fresh copy of unchanged bytes is still reused)
    return Pending(prior, stamp, sample, same_stamp, nbytes)


def settle(pending: Pending, digest: bytes | None, stats: UnchangedStats, count: bool = True) -> Verdict:
    """Test 3: the verdict on a pending chunk given the full hash of its bytes (None: it could
    not be hashed, so it is written). ``count``: add its bytes to ``stats.hashed_bytes``
    (False when the hash was taken while writing it, which the caller counts)."""
    if digest is None:
        return Verdict(None, pending.stamp, pending.sample)
    if count:
        stats.hashed_bytes += pending.nbytes
    same = digest == pending.prior.digest  # its box's hash still vouches for it (see whole_box)
    return Verdict(digest, pending.stamp, pending.sample, behind_counter=pending.same_stamp and not same,
                   box_digest=getattr(pending.prior, "box_digest", None) if same else None)


def _sample(value: Any, stats: UnchangedStats) -> bytes | None:
    sampled = sample_digest(value)
    if sampled is None:
        return None
    stats.sampled_bytes += sampled[1]
    return sampled[0]
