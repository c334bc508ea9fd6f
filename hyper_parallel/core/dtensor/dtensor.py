"""``hyper_parallel.core.dtensor.dtensor``: torch's ``DTensor`` and its constructors.

``DTensor.from_local(local, mesh, placements)``, ``.to_local()``, ``.full_tensor()`` and
``.redistribute()`` are torch's. HyperParallel's ``DTensor.layout`` attribute does not exist
here (use ``.device_mesh`` and ``.placements``).

Added for HyperParallel code (torch's ``DTensor`` class stays the same object):
``DTensor.from_local_with_layout(local, layout)`` (installed on torch's class as a static
method, since torch has no such name) and :class:`SkipDTensorDispatch`. The seed's
``DTensor.from_local(local, mesh, placements, shape=global_shape)`` without ``stride`` (torch
raises "Please pass both shape and stride") gets the contiguous stride of ``shape``: torch's
``from_local`` is wrapped for that one case and otherwise called as it is.

``dtensor.backward(gradient)`` with a plain tensor ``gradient`` (HyperParallel's DTensor runs
autograd on the local shards, so its tests seed a DTensor loss with this rank's local gradient,
e.g. ``loss.backward(torch.tensor(1.0 / tp_size))``) reads ``gradient`` as this rank's shard of
the gradient; torch would otherwise pass the plain tensor into the backward of DTensor
operators, which refuse it ("got mixed torch.Tensor and DTensor"). See :func:`_backward`.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

__all__ = ["DTensor", "distribute_tensor", "distribute_module", "SkipDTensorDispatch", "from_local_with_layout"]


def _op_names(op: Any) -> set[str]:
    """The names an operator answers to in ``no_skip``: ``aten.add.Tensor``, ``add.Tensor``, ``add``."""
    if isinstance(op, str):
        return {op}
    names = {str(getattr(op, "__name__", op))}
    full = getattr(op, "_name", None)  # "aten::add" on an OpOverload
    if full:
        names |= {full, full.replace("::", "."), full.split("::")[-1]}
    schema = getattr(op, "_schema", None)
    if schema is not None:
        names.add(f"{schema.name.split('::')[-1]}.{schema.overload_name}" if schema.overload_name
                  else schema.name.split("::")[-1])
    return names


class _LocalTensorMode(TorchDispatchMode):
    """Runs each aten op on the local shards of its DTensor arguments (results are plain tensors)."""

    def __init__(self, no_skip: frozenset[str]):
        super().__init__()
        self._no_skip = no_skip

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._no_skip and (_op_names(func) | _op_names(func.overloadpacket)) & self._no_skip:
            return func(*args, **kwargs)
        args, kwargs = tree_map_only(DTensor, lambda t: t._local_tensor, (args, kwargs))
        return func(*args, **kwargs)


class SkipDTensorDispatch:
    """Within the block, operators on DTensors run on their local shards, without DTensor's dispatch.

    HyperParallel wraps optimizer steps and hand-written parameter updates in it: each rank
    updates its own shard (``p.add_(g)`` writes into ``p``'s local tensor) with no sharding
    propagation and no collectives. Operators return plain tensors (local results), so code in
    the block must not expect DTensors back. ``no_skip`` lists operators that still go through
    DTensor dispatch: callables (``torch.zeros_like``, ``torch.ops.aten.add.Tensor``) or names
    (``"aten.add.Tensor"``, ``"add"``).

    Implemented as a torch ``TorchDispatchMode``: it sees every aten op below autograd, unwraps
    DTensor arguments to ``_local_tensor`` and calls the op. Torch's FSDP2 works inside it
    (its unsharded parameters are plain tensors already).

    Example::

        with SkipDTensorDispatch():
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)     # each rank updates its shard in place
    """

    def __init__(self, no_skip: Iterable[Any] | None = None):
        names: set[str] = set()
        for op in no_skip or ():
            names |= _op_names(op)
        self._no_skip = frozenset(names)
        self._mode: _LocalTensorMode | None = None

    def __enter__(self) -> SkipDTensorDispatch:
        self._mode = _LocalTensorMode(self._no_skip)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(exc_type, exc, tb)


def from_local_with_layout(local_tensor: torch.Tensor, layout: Any, *, run_check: bool = False) -> DTensor:
    """HyperParallel's ``DTensor.from_local_with_layout``: a DTensor from this rank's shard and a layout.

    ``layout`` is a :class:`hyper_parallel.core.dtensor.layout.Layout` with placements set; its
    tensor meta (``set_tensor_meta``), when set, gives the global shape and stride, which torch
    otherwise infers from the local shard (wrong for uneven or empty shards).

    Raises:
        ValueError: the layout has no placements.
    """
    placements = getattr(layout, "placements", None)
    if not placements:
        raise ValueError("from_local_with_layout needs a layout with placements: call layout.set_placements")
    meta = getattr(layout, "tensor_meta", None)
    shape, stride = (meta[0], meta[1]) if meta is not None else (None, None)
    return DTensor.from_local(local_tensor, layout.mesh, placements, run_check=run_check, shape=shape,
                              stride=stride)


def _contiguous_stride(shape: Iterable[int]) -> tuple[int, ...]:
    out: list[int] = []
    step = 1
    for n in reversed(tuple(shape)):
        out.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(out))


def _wrap_from_local(original: Any) -> Any:
    """Torch's ``from_local``, with ``stride`` defaulting to the contiguous stride of a given ``shape``."""

    def from_local(local_tensor: torch.Tensor, device_mesh: Any = None, placements: Any = None, *,
                   run_check: bool = False, shape: Any = None, stride: Any = None, **kwargs: Any) -> DTensor:
        if shape is not None and stride is None:
            stride = _contiguous_stride(shape)
        return original(local_tensor, device_mesh, placements, run_check=run_check, shape=shape, stride=stride,
                        **kwargs)

    from_local.__doc__ = original.__doc__
    from_local.__wrapped__ = original  # type: ignore[attr-defined]
    from_local._hyper_parallel_shape_only = True  # type: ignore[attr-defined]
    return from_local


def _local_gradient_as_dtensor(output: DTensor, gradient: torch.Tensor) -> DTensor:
    """``gradient``, this rank's local gradient of ``output``, as the DTensor gradient torch expects.

    The gradient of a DTensor is laid out like the DTensor itself, except that a pending sum
    (``Partial``) becomes ``Replicate``: the gradient of a sum is the same for each of its terms
    (torch's own default seed, ``torch.ones_like(loss)``, is laid out so). Each rank's plain
    ``gradient`` is then what HyperParallel's local autograd would see on that rank: the same
    parameter gradients come out.

    Raises:
        ValueError: ``gradient``'s shape is not ``output``'s local shape.
    """
    local_shape = tuple(output.to_local().shape)
    if tuple(gradient.shape) != local_shape:
        raise ValueError(
            f"DTensor.backward: a plain-tensor gradient is this rank's local gradient and must have the "
            f"DTensor's local shape {local_shape} (global shape {tuple(output.shape)}, placements "
            f"{tuple(output.placements)}), got shape {tuple(gradient.shape)}; pass a DTensor gradient otherwise")
    placements = tuple(Replicate() if p.is_partial() else p for p in output.placements)
    return DTensor.from_local(gradient, output.device_mesh, placements, run_check=False, shape=output.shape,
                              stride=output.stride())


def _backward(self: DTensor, gradient: torch.Tensor | None = None, retain_graph: bool | None = None,
              create_graph: bool = False, inputs: Any = None) -> None:
    """``DTensor.backward``: torch's ``Tensor.backward``, taking a plain ``gradient`` as this rank's local gradient.

    HyperParallel's DTensor hands ``backward`` to its local tensor, so a plain-tensor gradient
    there is the local shard's gradient. Here it is turned into a DTensor first (see
    :func:`_local_gradient_as_dtensor`); a DTensor gradient or ``None`` goes to torch unchanged.

    Example::

        loss = model(x)                          # a DTensor, e.g. Partial(sum) over the tp mesh
        loss.backward(torch.tensor(1.0))         # the same as loss.backward() for a scalar loss
    """
    if isinstance(gradient, torch.Tensor) and not isinstance(gradient, DTensor):
        gradient = _local_gradient_as_dtensor(self, gradient)
    torch.Tensor.backward(self, gradient, retain_graph, create_graph, inputs=inputs)


_backward._hyper_parallel_local_gradient = True  # type: ignore[attr-defined]


if not getattr(DTensor.from_local, "_hyper_parallel_shape_only", False):
    DTensor.from_local = staticmethod(_wrap_from_local(DTensor.from_local))  # type: ignore[method-assign]

if not hasattr(DTensor, "from_local_with_layout"):
    DTensor.from_local_with_layout = staticmethod(from_local_with_layout)  # type: ignore[attr-defined]

if not getattr(DTensor.backward, "_hyper_parallel_local_gradient", False):
    DTensor.backward = _backward  # type: ignore[method-assign]
