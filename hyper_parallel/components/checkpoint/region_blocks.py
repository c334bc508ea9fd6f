"""The geometry of a symbolic tensor: boxes of it, each an affine window into one checkpoint tensor.

A :class:`RegionBlock` says: the elements ``x`` of the box ``offsets <= x < offsets + lengths``
are the checkpoint tensor ``source`` at index ``base + sum_d columns[d] * (x[d] - offsets[d])``,
passed through the elementwise ``post`` operations (which leave them in ``dtype``). The blocks of
a tensor tile it. Every function here maps the blocks of a tensor to the blocks of the tensor an
operation makes of it — a slice, a new or dropped axis, a permutation, a reshape — without
looking at a value. Columns stay non-negative: only forward slices are described, so every block
reads a box of its checkpoint tensor from its first element on.

A reshape is the one operation that may cut blocks: a block stays whole only where the elements
it covers stay affine in the new shape (see :func:`reshape`). :data:`MAX_BLOCKS` bounds how far a
tensor may be cut before describing it block by block stops being worthwhile; past it,
:class:`UnsupportedRegionOp` is raised and the conversion runs on real tensors instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = ["RegionBlock", "UnsupportedRegionOp", "MAX_BLOCKS", "sliced", "drop_axis", "insert_axis", "shifted",
           "permuted", "reshape"]

MAX_BLOCKS = 1 << 16


class UnsupportedRegionOp(TypeError):
    """An operation whose result is not a set of affine windows into checkpoint tensors (it mixes two
    tensors' values, reads a value, writes in place, or would cut the result into too many blocks)."""


@dataclass(frozen=True)
class RegionBlock:
    """A box of a symbolic tensor and where each of its elements is read from (module docstring).

    ``columns`` has one entry per dimension of the symbolic tensor, each a step in the checkpoint
    tensor's coordinates (as many as ``base``).
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    source: str
    base: tuple[int, ...]
    columns: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    post: tuple[Callable[[Any], Any], ...] = ()

    def moved(self, axis: int, delta: int) -> tuple[int, ...]:
        """``base`` after moving ``delta`` elements along ``axis``."""
        return tuple(b + c * delta for b, c in zip(self.base, self.columns[axis], strict=True))


def check_count(count: int) -> None:
    """Refuse to describe a tensor cut into more than :data:`MAX_BLOCKS` blocks."""
    if count > MAX_BLOCKS:
        raise UnsupportedRegionOp(f"the result would be cut into more than {MAX_BLOCKS} blocks")


def _put(values: tuple, axis: int, value: Any) -> tuple:
    return values[:axis] + (value,) + values[axis + 1:]


def _strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a shape."""
    out, stride = [], 1
    for size in reversed(sizes):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))


def _scaled(column: tuple[int, ...], factor: int) -> tuple[int, ...]:
    return tuple(c * factor for c in column)


def sliced(blocks: Sequence[RegionBlock], axis: int, start: int, stop: int, step: int = 1) -> list[RegionBlock]:
    """The blocks of ``t[..., start:stop:step, ...]`` (``start``/``stop`` clamped, ``step`` > 0)."""
    out = []
    for block in blocks:
        first_in = max(block.offsets[axis], start)
        last_out = min(block.offsets[axis] + block.lengths[axis], stop)
        if first_in >= last_out:
            continue
        first = -((start - first_in) // step)  # index in the slice of the first kept element at or after first_in
        last = (last_out - 1 - start) // step
        if first > last:
            continue
        delta = start + first * step - block.offsets[axis]
        out.append(replace(block, offsets=_put(block.offsets, axis, first),
                           lengths=_put(block.lengths, axis, last - first + 1), base=block.moved(axis, delta),
                           columns=_put(block.columns, axis, _scaled(block.columns[axis], step))))
    return out


def drop_axis(block: RegionBlock, axis: int) -> RegionBlock:
    """``block`` without ``axis``, along which it is one element long."""
    return replace(block, offsets=block.offsets[:axis] + block.offsets[axis + 1:],
                   lengths=block.lengths[:axis] + block.lengths[axis + 1:],
                   columns=block.columns[:axis] + block.columns[axis + 1:])


def insert_axis(block: RegionBlock, axis: int) -> RegionBlock:
    """``block`` with a new axis of size one at ``axis``."""
    return replace(block, offsets=block.offsets[:axis] + (0,) + block.offsets[axis:],
                   lengths=block.lengths[:axis] + (1,) + block.lengths[axis:],
                   columns=block.columns[:axis] + ((0,) * len(block.base),) + block.columns[axis:])


def shifted(block: RegionBlock, axis: int, distance: int) -> RegionBlock:
    """``block`` moved ``distance`` elements along ``axis`` of the tensor (what it reads unchanged)."""
    return replace(block, offsets=_put(block.offsets, axis, block.offsets[axis] + distance))


def permuted(block: RegionBlock, order: Sequence[int]) -> RegionBlock:
    """``block`` with its axes in ``order``."""
    return replace(block, offsets=tuple(block.offsets[a] for a in order),
                   lengths=tuple(block.lengths[a] for a in order),
                   columns=tuple(block.columns[a] for a in order))


def _merge(blocks: Sequence[RegionBlock], start: int, sizes: Sequence[int]) -> list[RegionBlock]:
    """Blocks of the tensor whose axes ``start .. start+len(sizes)-1`` (all longer than one) become one.

    A block stays one block when its elements are consecutive in the merged axis and one step
    along it is one fixed step in the checkpoint: every axis after the first it spans is covered
    whole, and each spanned axis steps the checkpoint by the last axis' step times its stride.
    Otherwise it is cut into one-element-long slices along its first spanned axis, which are
    merged in turn.
    """
    stop, strides = start + len(sizes), _strides(sizes)
    out, pending = [], list(blocks)
    while pending:
        block = pending.pop()
        spanned = [i for i in range(len(sizes)) if block.lengths[start + i] > 1]
        if spanned:
            first = spanned[0]
            step = block.columns[stop - 1]
            whole = all(block.offsets[start + i] == 0 and block.lengths[start + i] == sizes[i]
                        for i in range(first + 1, len(sizes)))
            affine = all(block.columns[start + i] == _scaled(step, strides[i]) for i in range(first, len(sizes)))
            if not (whole and affine):
                pending.extend(_cut_rows(block, start + first))
                check_count(len(out) + len(pending))
                continue
            length = block.lengths[start + first] * strides[first]
        else:
            step, length = (0,) * len(block.base), 1
        offset = sum(o * s for o, s in zip(block.offsets[start:stop], strides, strict=True))
        out.append(replace(block, offsets=block.offsets[:start] + (offset,) + block.offsets[stop:],
                           lengths=block.lengths[:start] + (length,) + block.lengths[stop:],
                           columns=block.columns[:start] + (step,) + block.columns[stop:]))
    return out


def _cut_rows(block: RegionBlock, axis: int) -> list[RegionBlock]:
    """``block`` cut into one-element-long slices along ``axis``, each at its own index."""
    at = block.offsets[axis]
    return [replace(block, offsets=_put(block.offsets, axis, at + n), lengths=_put(block.lengths, axis, 1),
                    base=block.moved(axis, n)) for n in range(block.lengths[axis])]


def _runs_of_flat(start: int, length: int, sizes: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Consecutive flat indices ``start .. start+length-1`` of a shape ``sizes``, as boxes
    ``(offsets, lengths)``: a partial first row, whole rows, a partial last row (recursively)."""
    if len(sizes) == 1:
        return [((start,), (length,))]
    inner_sizes = tuple(sizes[1:])
    inner = math.prod(inner_sizes)
    boxes = []
    row, column = divmod(start, inner)
    if column:
        head = min(inner - column, length)
        boxes += [((row,) + o, (1,) + n) for o, n in _runs_of_flat(column, head, inner_sizes)]
        row, length = row + 1, length - head
    rows, tail = divmod(length, inner)
    if rows:
        boxes.append(((row,) + (0,) * len(inner_sizes), (rows,) + inner_sizes))
    if tail:
        boxes += [((row + rows,) + o, (1,) + n) for o, n in _runs_of_flat(0, tail, inner_sizes)]
    return boxes


def _split(blocks: Sequence[RegionBlock], axis: int, sizes: Sequence[int]) -> list[RegionBlock]:
    """Blocks of the tensor whose axis ``axis`` becomes the axes ``sizes`` (all longer than one)."""
    strides = _strides(sizes)
    out = []
    for block in blocks:
        step = block.columns[axis]
        columns = tuple(_scaled(step, s) for s in strides)
        for offsets, lengths in _runs_of_flat(block.offsets[axis], block.lengths[axis], sizes):
            flat = sum(o * s for o, s in zip(offsets, strides, strict=True))
            out.append(replace(block, offsets=block.offsets[:axis] + offsets + block.offsets[axis + 1:],
                               lengths=block.lengths[:axis] + lengths + block.lengths[axis + 1:],
                               base=block.moved(axis, flat - block.offsets[axis]),
                               columns=block.columns[:axis] + columns + block.columns[axis + 1:]))
    return out


def _runs(old: Sequence[int], new: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Axes of two shapes (no size one, as many elements) matched into runs of equal element counts:
    ``(old start, old stop, new start, new stop)``."""
    runs, i, j = [], 0, 0
    while i < len(old):
        i0, j0 = i, j
        a, b = old[i], new[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                a, i = a * old[i], i + 1
            else:
                b, j = b * new[j], j + 1
        runs.append((i0, i, j0, j))
    return runs


def reshape(blocks: Sequence[RegionBlock], old_shape: Sequence[int], new_shape: Sequence[int]) -> list[RegionBlock]:
    """The blocks of a tensor of ``old_shape`` reshaped (row-major) to ``new_shape``.

    Axes of size one are dropped, the rest matched into runs of equal element counts; each run
    is merged into one axis and split into its new axes; the new shape's axes of size one are put
    back.
    """
    if math.prod(old_shape) == 0:
        return []
    blocks = list(blocks)
    for axis in reversed([a for a, n in enumerate(old_shape) if n == 1]):
        blocks = [drop_axis(b, axis) for b in blocks]
    old = [n for n in old_shape if n != 1]
    new = [n for n in new_shape if n != 1]
    for i0, i1, j0, j1 in reversed(_runs(old, new)):
        if i1 - i0 > 1:
            blocks = _merge(blocks, i0, old[i0:i1])
        if j1 - j0 > 1:
            blocks = _split(blocks, i0, new[j0:j1])
        check_count(len(blocks))
    for axis, n in enumerate(new_shape):
        if n == 1:
            blocks = [insert_axis(b, axis) for b in blocks]
    return blocks
