"""A tensor-like that follows a weight conversion symbolically: which checkpoint element lands where.

Run a conversion (stack the experts, interleave Q/K/V, transpose, add a constant) on
:class:`RegionTensor` inputs instead of real tensors and it computes no value: each result
knows, for every element, the checkpoint tensor and index it comes from and the elementwise
steps applied on the way (:mod:`.region_blocks`). :meth:`RegionTensor.remap_blocks` hands that
over as :class:`~hyper_parallel.core.distributed_checkpoint.remap_planner.RemapBlock` records, which
:class:`RemapLoadPlanner` loads region by region on each rank — never a whole checkpoint tensor,
never a whole result.

Followed (as methods and as the ``torch`` functions of the same name): ``cat``/``concat``/
``stack``, ``split``/``chunk``/``unbind``/``narrow``/``select``, indexing with integers, forward
slices, ``None`` and ``...``, ``reshape``/``view``/``flatten``/``unflatten``, ``transpose``/
``permute``/``t``/``swapaxes``, ``squeeze``/``unsqueeze``, ``contiguous``/``clone``/``detach``/
``to(dtype)``/``float()``..., and ``+ - * /`` and negation with Python numbers. Shapes and dtypes
are torch's own: each operation is first run on a meta tensor, so bad arguments fail as torch
fails them. Anything else — combining two tensors' values elementwise, reading a value
(``item``, comparisons, ``bool``), writing in place, a reversed slice, indexing with a tensor, any
other torch function — raises :class:`UnsupportedRegionOp`, and the caller runs the conversion
on real tensors instead.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from hyper_parallel.core.distributed_checkpoint.remap_planner import RemapBlock

from . import region_blocks as geo
from .region_blocks import RegionBlock, UnsupportedRegionOp

__all__ = ["RegionTensor", "UnsupportedRegionOp", "materialize"]


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype)


def _apply(function: Callable[[Any, Any], Any], scalar: Any, reflected: bool, tensor: torch.Tensor) -> torch.Tensor:
    return function(scalar, tensor) if reflected else function(tensor, scalar)


def _divide(scalar: Any, rounding_mode: str, tensor: torch.Tensor) -> torch.Tensor:
    return torch.div(tensor, scalar, rounding_mode=rounding_mode)


def _sizes(args: tuple) -> tuple:
    """A shape given as one sequence or as separate sizes."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def _scalar(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UnsupportedRegionOp(f"a region combines only with Python numbers, not {type(value).__name__}")
    return value


def _refuse(name: str) -> Callable[..., Any]:
    def refuse(self: RegionTensor, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedRegionOp(f"{name} needs values, which {self!r} does not have")
    refuse.__name__ = name
    return refuse


class RegionTensor:
    """A symbolic tensor: shape, dtype, and the :class:`~.region_blocks.RegionBlock` records tiling it.

    Example::

        q = RegionTensor.leaf("q_proj.weight", (8, 16), torch.bfloat16)
        k = RegionTensor.leaf("k_proj.weight", (4, 16), torch.bfloat16)
        torch.cat([q, k]).remap_blocks()   # rows 0-7 from q_proj.weight, rows 8-11 from k_proj.weight
    """

    __slots__ = ("_shape", "_dtype", "_blocks")

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, blocks: Sequence[RegionBlock] = ()) -> None:
        self._shape = tuple(int(n) for n in shape)
        self._dtype = dtype
        self._blocks = tuple(blocks)
        geo.check_count(len(self._blocks))
        if any(len(b.offsets) != len(self._shape) for b in self._blocks):
            raise UnsupportedRegionOp(f"blocks of another rank than the shape {self._shape}")

    @classmethod
    def leaf(cls, source: str, shape: Sequence[int], dtype: torch.dtype) -> RegionTensor:
        """The whole checkpoint tensor ``source`` of ``shape`` and ``dtype``, as stored."""
        shape = tuple(int(n) for n in shape)
        if not math.prod(shape):
            return cls(shape, dtype)
        n = len(shape)
        columns = tuple(tuple(int(i == d) for i in range(n)) for d in range(n))
        return cls(shape, dtype, [RegionBlock((0,) * n, shape, source, (0,) * n, columns, dtype)])

    # ---------------------------------------------------------------- what it is

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def device(self) -> torch.device:
        return torch.device("meta")

    @property
    def requires_grad(self) -> bool:
        return False

    @property
    def blocks(self) -> tuple[RegionBlock, ...]:
        """The blocks tiling the tensor."""
        return self._blocks

    def sources(self) -> frozenset[str]:
        """The checkpoint tensors its elements come from."""
        return frozenset(b.source for b in self._blocks)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self._meta().size(dim)

    def dim(self) -> int:
        return len(self._shape)

    def numel(self) -> int:
        return math.prod(self._shape)

    nelement = numel

    def element_size(self) -> int:
        return self._dtype.itemsize

    def is_floating_point(self) -> bool:
        return self._dtype.is_floating_point

    def is_contiguous(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __iter__(self) -> Iterator[RegionTensor]:
        return iter(self.unbind(0))

    def __repr__(self) -> str:
        return f"RegionTensor(shape={self._shape}, dtype={self._dtype}, blocks={len(self._blocks)})"

    def remap_blocks(self) -> list[RemapBlock]:
        """The blocks as :class:`RemapBlock` records (``coeff`` rows per checkpoint dimension). A block
        still in another dtype than the tensor (a concatenation promoted it) gets the cast last."""
        out = []
        for b in self._blocks:
            post = b.post if b.dtype == self._dtype else b.post + (partial(_cast, dtype=self._dtype),)
            coeff = tuple(tuple(column[d] for column in b.columns) for d in range(len(b.base)))
            out.append(RemapBlock(b.offsets, b.lengths, b.source, b.base, coeff, post))
        return out

    # ---------------------------------------------------------------- torch's functions

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = _FUNCTIONS.get(func)
        if name is None or kwargs.pop("out", None) is not None:
            raise UnsupportedRegionOp(f"torch.{getattr(func, '__name__', func)} is not followed on regions")
        if name in _SEQUENCE_FUNCTIONS:
            return _SEQUENCE_FUNCTIONS[name](*args, **kwargs)
        args = list(args)
        first = kwargs.pop("input") if "input" in kwargs else args.pop(0)
        if isinstance(first, RegionTensor):
            return getattr(first, name)(*args, **kwargs)
        other = kwargs.pop("other") if "other" in kwargs else (args.pop(0) if args else None)
        if name in _REFLECTED and isinstance(other, RegionTensor) and not args and not kwargs:
            return getattr(other, _REFLECTED[name])(first)
        raise UnsupportedRegionOp(f"torch.{name} with a {type(first).__name__} first is not followed on regions")

    # ---------------------------------------------------------------- layout

    def _meta(self) -> torch.Tensor:
        return torch.empty(self._shape, dtype=self._dtype, device="meta")

    def _made(self, shape: Sequence[int], blocks: Sequence[RegionBlock]) -> RegionTensor:
        return RegionTensor(shape, self._dtype, blocks)

    def _reshaped(self, shape: tuple[int, ...]) -> RegionTensor:
        if shape == self._shape:
            return self
        return self._made(shape, geo.reshape(self._blocks, self._shape, shape))

    def reshape(self, *shape: Any) -> RegionTensor:
        return self._reshaped(tuple(self._meta().reshape(_sizes(shape)).shape))

    def view(self, *shape: Any) -> RegionTensor:
        if len(shape) == 1 and isinstance(shape[0], torch.dtype):
            raise UnsupportedRegionOp("viewing a region as another dtype reinterprets its bytes")
        return self.reshape(*shape)

    def reshape_as(self, other: Any) -> RegionTensor:
        return self.reshape(tuple(other.shape))

    view_as = reshape_as

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> RegionTensor:
        return self._reshaped(tuple(self._meta().flatten(start_dim, end_dim).shape))

    def unflatten(self, dim: int, sizes: Sequence[int]) -> RegionTensor:
        return self._reshaped(tuple(self._meta().unflatten(dim, sizes).shape))

    def permute(self, *dims: Any) -> RegionTensor:
        dims = _sizes(dims)
        shape = tuple(self._meta().permute(dims).shape)
        order = [d % len(self._shape) for d in dims] if self._shape else []
        return self._made(shape, [geo.permuted(b, order) for b in self._blocks])

    def transpose(self, dim0: int, dim1: int) -> RegionTensor:
        self._meta().transpose(dim0, dim1)
        if not self._shape:
            return self
        order = list(range(len(self._shape)))
        a, b = dim0 % len(order), dim1 % len(order)
        order[a], order[b] = order[b], order[a]
        return self.permute(order)

    swapaxes = swapdims = transpose

    def t(self) -> RegionTensor:
        self._meta().t()
        return self.transpose(0, 1) if len(self._shape) == 2 else self

    @property
    def T(self) -> RegionTensor:  # noqa: N802 (torch's name)
        return self.permute(list(reversed(range(len(self._shape)))))

    def squeeze(self, dim: Any = None) -> RegionTensor:
        shape = tuple((self._meta().squeeze() if dim is None else self._meta().squeeze(dim)).shape)
        if dim is None:
            axes = [a for a, n in enumerate(self._shape) if n == 1]
        else:
            dims = dim if isinstance(dim, (tuple, list)) else (dim,)
            axes = sorted({d % len(self._shape) for d in dims if self._shape[d % len(self._shape)] == 1})
        blocks = list(self._blocks)
        for axis in reversed(axes):
            blocks = [geo.drop_axis(b, axis) for b in blocks]
        return self._made(shape, blocks)

    def unsqueeze(self, dim: int) -> RegionTensor:
        shape = tuple(self._meta().unsqueeze(dim).shape)
        axis = dim % (len(self._shape) + 1)
        return self._made(shape, [geo.insert_axis(b, axis) for b in self._blocks])

    def narrow(self, dim: int, start: int, length: int) -> RegionTensor:
        shape = tuple(self._meta().narrow(dim, start, length).shape)
        axis = dim % len(self._shape)
        start = start + self._shape[axis] if start < 0 else start
        return self._made(shape, geo.sliced(self._blocks, axis, start, start + length))

    def select(self, dim: int, index: int) -> RegionTensor:
        shape = tuple(self._meta().select(dim, index).shape)
        axis = dim % len(self._shape)
        index = index + self._shape[axis] if index < 0 else index
        return self._made(shape, [geo.drop_axis(b, axis) for b in geo.sliced(self._blocks, axis, index, index + 1)])

    def _pieces(self, metas: Sequence[torch.Tensor], dim: int) -> tuple[RegionTensor, ...]:
        axis, start, out = dim % len(self._shape), 0, []
        for meta in metas:
            n = meta.shape[axis]
            out.append(self._made(tuple(meta.shape), geo.sliced(self._blocks, axis, start, start + n)))
            start += n
        return tuple(out)

    def split(self, split_size_or_sections: Any, dim: int = 0) -> tuple[RegionTensor, ...]:
        return self._pieces(self._meta().split(split_size_or_sections, dim), dim)

    def chunk(self, chunks: int, dim: int = 0) -> tuple[RegionTensor, ...]:
        return self._pieces(self._meta().chunk(chunks, dim), dim)

    def unbind(self, dim: int = 0) -> tuple[RegionTensor, ...]:
        return tuple(self.select(dim, i) for i in range(self._meta().size(dim)))

    def __getitem__(self, index: Any) -> RegionTensor:
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, bool) or not isinstance(i, (int, slice, type(None), type(Ellipsis))) for i in items):
            raise UnsupportedRegionOp(f"indexing a region with {index!r} (only integers, slices, None and ...)")
        shape = tuple(self._meta()[index].shape)
        used = sum(isinstance(i, (int, slice)) for i in items)
        expanded: list[Any] = []
        for item in items:
            expanded.extend([slice(None)] * (len(self._shape) - used) if item is Ellipsis else [item])
        sizes, blocks, axis = list(self._shape), list(self._blocks), 0
        for item in expanded:
            if item is None:
                blocks = [geo.insert_axis(b, axis) for b in blocks]
                sizes.insert(axis, 1)
                axis += 1
            elif isinstance(item, slice):
                start, stop, step = item.indices(sizes[axis])
                blocks = geo.sliced(blocks, axis, start, stop, step)
                sizes[axis] = len(range(start, stop, step))
                axis += 1
            else:
                at = item + sizes[axis] if item < 0 else item
                blocks = [geo.drop_axis(b, axis) for b in geo.sliced(blocks, axis, at, at + 1)]
                del sizes[axis]
        return self._made(shape, blocks)

    def contiguous(self, *args: Any, **kwargs: Any) -> RegionTensor:
        return self

    def clone(self, *args: Any, **kwargs: Any) -> RegionTensor:
        return self

    def detach(self) -> RegionTensor:
        return self

    def cpu(self) -> RegionTensor:
        return self

    # ---------------------------------------------------------------- values

    def _elementwise(self, step: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> RegionTensor:
        """Every element through ``step``, the result in ``dtype``. A block still in another dtype is
        first cast to the tensor's, as the values ``step`` sees are."""
        blocks = []
        for b in self._blocks:
            post = b.post if b.dtype == self._dtype else b.post + (partial(_cast, dtype=self._dtype),)
            blocks.append(replace(b, post=post + (step,), dtype=dtype))
        return RegionTensor(self._shape, dtype, blocks)

    def _with_number(self, function: Callable[[Any, Any], Any], other: Any, reflected: bool) -> RegionTensor:
        other = _scalar(other)
        meta = torch.empty((), dtype=self._dtype, device="meta")
        dtype = (function(other, meta) if reflected else function(meta, other)).dtype
        return self._elementwise(partial(_apply, function, other, reflected), dtype)

    def to(self, *args: Any, **kwargs: Any) -> RegionTensor:
        dtype = kwargs.get("dtype")
        for arg in args:
            if isinstance(arg, (RegionTensor, torch.Tensor)):
                raise UnsupportedRegionOp("to(another tensor) is not followed on regions; pass a dtype")
            if isinstance(arg, torch.dtype):
                dtype = arg
        if dtype is None or dtype == self._dtype:
            return self
        return self._elementwise(partial(_cast, dtype=dtype), dtype)

    def float(self) -> RegionTensor:
        return self.to(torch.float32)

    def double(self) -> RegionTensor:
        return self.to(torch.float64)

    def half(self) -> RegionTensor:
        return self.to(torch.float16)

    def bfloat16(self) -> RegionTensor:
        return self.to(torch.bfloat16)

    def add(self, other: Any, *, alpha: Any = None) -> RegionTensor:
        if alpha is not None:
            other = _scalar(other) * _scalar(alpha)
        return self._with_number(operator.add, other, False)

    def sub(self, other: Any, *, alpha: Any = None) -> RegionTensor:
        if alpha is not None:
            other = _scalar(other) * _scalar(alpha)
        return self._with_number(operator.sub, other, False)

    def mul(self, other: Any) -> RegionTensor:
        return self._with_number(operator.mul, other, False)

    def div(self, other: Any, *, rounding_mode: str | None = None) -> RegionTensor:
        if rounding_mode is None:
            return self._with_number(operator.truediv, other, False)
        other = _scalar(other)
        dtype = torch.div(torch.empty((), dtype=self._dtype, device="meta"), other, rounding_mode=rounding_mode).dtype
        return self._elementwise(partial(_divide, other, rounding_mode), dtype)

    def neg(self) -> RegionTensor:
        return self._elementwise(operator.neg, self._dtype)

    subtract, multiply, divide, true_divide, negative = sub, mul, div, div, neg
    __add__, __sub__, __mul__, __truediv__, __neg__ = add, sub, mul, div, neg

    def __radd__(self, other: Any) -> RegionTensor:
        return self._with_number(operator.add, other, True)

    def __rsub__(self, other: Any) -> RegionTensor:
        return self._with_number(operator.sub, other, True)

    def __rmul__(self, other: Any) -> RegionTensor:
        return self._with_number(operator.mul, other, True)

    def __rtruediv__(self, other: Any) -> RegionTensor:
        return self._with_number(operator.truediv, other, True)

    def __pos__(self) -> RegionTensor:
        return self

    __hash__ = object.__hash__
    __eq__ = _refuse("==")
    __ne__ = _refuse("!=")
    __lt__ = _refuse("<")
    __le__ = _refuse("<=")
    __gt__ = _refuse(">")
    __ge__ = _refuse(">=")
    __bool__ = _refuse("bool()")
    __index__ = _refuse("__index__")
    __setitem__ = _refuse("assignment")
    __iadd__ = _refuse("+=")
    __isub__ = _refuse("-=")
    __imul__ = _refuse("*=")
    __itruediv__ = _refuse("/=")
    __pow__ = _refuse("**")
    __matmul__ = _refuse("@")
    item = _refuse("item()")
    tolist = _refuse("tolist()")
    numpy = _refuse("numpy()")
    copy_ = _refuse("copy_()")
    add_ = _refuse("add_()")
    mul_ = _refuse("mul_()")


def _regions(tensors: Any, name: str) -> list[RegionTensor]:
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, RegionTensor) for t in tensors):
        raise UnsupportedRegionOp(f"torch.{name} of regions mixed with real tensors is not followed")
    return tensors


def _cat(tensors: Sequence[Any], dim: int = 0) -> RegionTensor:
    tensors = _regions(tensors, "cat")
    meta = torch.cat([t._meta() for t in tensors], dim)
    axis, at, blocks = dim % meta.dim(), 0, []
    for t in tensors:
        if t.ndim != meta.dim():  # torch.cat skips 1-D empty tensors of any other rank
            continue
        blocks.extend(geo.shifted(b, axis, at) for b in t.blocks)
        at += t.shape[axis]
    return RegionTensor(meta.shape, meta.dtype, blocks)


def _stack(tensors: Sequence[Any], dim: int = 0) -> RegionTensor:
    tensors = _regions(tensors, "stack")
    meta = torch.stack([t._meta() for t in tensors], dim)
    axis = dim % meta.dim()
    blocks = [geo.shifted(geo.insert_axis(b, axis), axis, i) for i, t in enumerate(tensors) for b in t.blocks]
    return RegionTensor(meta.shape, meta.dtype, blocks)


_SEQUENCE_FUNCTIONS: dict[str, Callable[..., RegionTensor]] = {"cat": _cat, "concat": _cat, "concatenate": _cat,
                                                               "stack": _stack}
_METHOD_FUNCTIONS = ("reshape", "flatten", "unflatten", "transpose", "swapaxes", "swapdims", "t", "permute", "squeeze",
                     "unsqueeze", "split", "chunk", "unbind", "narrow", "select", "clone", "detach", "add", "sub",
                     "subtract", "mul", "multiply", "div", "divide", "true_divide", "neg", "negative")
_FUNCTIONS = {getattr(torch, n): n for n in (*_SEQUENCE_FUNCTIONS, *_METHOD_FUNCTIONS) if hasattr(torch, n)}
_FUNCTIONS.update({getattr(torch.Tensor, n): n for n in _METHOD_FUNCTIONS if hasattr(torch.Tensor, n)})
_REFLECTED = {"add": "__radd__", "sub": "__rsub__", "subtract": "__rsub__", "mul": "__rmul__",
              "multiply": "__rmul__", "div": "__rtruediv__", "divide": "__rtruediv__", "true_divide": "__rtruediv__"}


def materialize(region: RegionTensor, sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The values of ``region``, computed from the whole checkpoint tensors it reads (``{name: tensor}``)."""
    device = next((sources[name].device for name in region.sources()), None)
    out = torch.empty(tuple(region.shape), dtype=region.dtype, device=device)
    for block in region.remap_blocks():
        source = sources[block.source]
        strides = tuple(sum(row[axis] * s for row, s in zip(block.coeff, source.stride(), strict=True))
                        for axis in range(len(block.lengths)))
        start = source.storage_offset() + sum(b * s for b, s in zip(block.base, source.stride(), strict=True))
        values = source.as_strided(block.lengths, strides, start)
        for step in block.post:
            values = step(values)
        out[tuple(slice(o, o + n) for o, n in zip(block.offsets, block.lengths, strict=True))].copy_(values)
    return out
