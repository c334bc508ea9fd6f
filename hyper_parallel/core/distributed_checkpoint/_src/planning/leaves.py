"""Leaves of a state dict as the standard planner stores and fills them.

Save: a leaf (tensor, numpy array, bytes) becomes the tensor a checkpoint stores
(:func:`numpy_tensor`, :func:`bytes_tensor`, with ``allow_pickle`` :func:`pickled_tensor`),
refused by name when the format cannot hold it (:func:`check_saveable`, :func:`refuse_value`:
the key, the value's type, and whether pickle would take it). Load: a target leaf is checked for being writable in place
(:func:`check_writable`, :func:`numpy_tensor_view`), its kind named (:func:`kind_of`,
:func:`describe`, :func:`number_kind`), and a plain (JSON) value filled from the saved one
(:func:`fill_plain`, :func:`shaped_like` for values saved split into keys of their own).

What it is not: which rank writes or reads which box (:mod:`.standard_planner`,
:mod:`.global_plan`), nor how bytes lie in files (:mod:`..format`).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ..base.dtypes import dtype_name
from ..base.errors import StateDictMismatchError, UnsupportedValueError
from ..format import metadata as md
from ..format.values import is_json_value, json_culprit

__all__ = ["bytes_tensor", "numpy_tensor", "pickled_tensor", "refuse_value", "check_saveable", "check_writable",
           "numpy_tensor_view", "number_kind", "kind_of", "describe", "part_name", "shaped_like", "fill_plain"]


# ---------------------------------------------------------------------- save: values as tensors

def bytes_tensor(value: bytes | bytearray) -> torch.Tensor:
    """``bytes`` as the uint8 tensor a checkpoint stores them as (a copy)."""
    buf = bytearray(value)
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


def numpy_tensor(arr: np.ndarray, key: str) -> torch.Tensor:
    """A numpy array as the tensor a checkpoint stores it as (native byte order, its shape)."""
    if not arr.dtype.isnative:  # a big-endian array: its values, in this machine's byte order
        arr = arr.astype(arr.dtype.newbyteorder("="))
    try:
        # np.ascontiguousarray makes a 0-d array 1-d; keep the shape
        return torch.from_numpy(np.ascontiguousarray(arr).reshape(arr.shape))
    except TypeError:
        raise UnsupportedValueError(
            f"{key!r}: numpy dtype {arr.dtype} cannot be stored as a tensor"
        ) from None


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _pickle_error(value: Any) -> Exception | None:
    """Why pickle refuses ``value`` (None if it takes it)."""
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # PicklingError, TypeError, AttributeError... whatever the object raises
        return exc
    return None


def _pickle_culprit(key: str, value: Any) -> tuple[str, Any, Exception]:
    """The innermost item of ``value`` (through dicts, lists, tuples, sets) that pickle
    refuses, where it sits, and pickle's error; ``value`` itself when no item is to blame."""
    error = _pickle_error(value)
    while error is not None:
        if isinstance(value, dict):
            items = [(f"{key}.{k}", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = [(f"{key}.{i}", v) for i, v in enumerate(value)]
        else:
            break
        for where, item in items:
            inner = _pickle_error(item)
            if inner is not None:
                key, value, error = where, item, inner
                break
        else:
            break
    return key, value, error


def pickled_tensor(key: str, value: Any) -> torch.Tensor:
    """``value`` pickled, as the uint8 tensor a ``pickle`` entry stores (``allow_pickle=True``).

    Raises:
        UnsupportedValueError: pickle refuses it (a lambda, a generator, a lock, an open file...);
            the message names the innermost item at fault, its type and pickle's reason.
    """
    try:
        return bytes_tensor(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        where, bad, exc = _pickle_culprit(key, value)
        raise UnsupportedValueError(
            f"{where!r}: a {_type_name(bad)} cannot be saved, not even with allow_pickle=True: pickle refuses it "
            f"({type(exc).__name__}: {exc}); leave it out of the state dict, or save what it is made of "
            "(tensors and plain values) instead") from None


def refuse_value(key: str, value: Any) -> UnsupportedValueError:
    """The error for a value that is no tensor, array, bytes or plain (JSON) value, saved
    without ``allow_pickle``: it names the innermost item at fault and its type, and offers
    ``allow_pickle=True`` only when pickle would take that item."""
    where, bad = json_culprit(value, key) or (key, value)
    exc = _pickle_error(bad)
    if exc is not None:
        return UnsupportedValueError(
            f"{where!r}: a {_type_name(bad)} cannot be saved: it is no tensor, array, bytes or plain value, and "
            f"pickle refuses it too ({type(exc).__name__}: {exc}); leave it out of the state dict, or save what it "
            "is made of (tensors and plain values) instead")
    return UnsupportedValueError(
        f"{where!r}: a {_type_name(bad)} can only be saved with pickle; convert it to tensors/plain values (e.g. "
        "int(x) for a numpy scalar), or pass allow_pickle=True to save (and again to load) if you trust the "
        "checkpoint")


def check_saveable(key: str, t: torch.Tensor) -> None:
    """Refuse, naming the key, a tensor the format cannot hold (torch's own errors would not)."""
    try:
        facts = t.is_nested, t.layout, t.device.type
    except Exception as exc:  # a tensor subclass that answers no plain tensor question
        raise UnsupportedValueError(
            f"{key!r}: a {_type_name(t)} (a torch.Tensor subclass) cannot be saved: it does not answer what a "
            f"tensor's layout and device are ({type(exc).__name__}: {str(exc)[:200]}); save a plain tensor or "
            "DTensor holding its values") from None
    if facts[0] or facts[1] != torch.strided:
        kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        hint = "its components (t.unbind())" if t.is_nested else "it dense (t.to_dense())"
        raise UnsupportedValueError(f"{key!r}: a {kind} tensor cannot be saved; save {hint}")
    if facts[2] == "meta":
        raise UnsupportedValueError(f"{key!r}: the tensor is on the meta device and holds no data; "
                                    "materialize it (e.g. model.to_empty(device=...) and initialize it) first")
    try:
        dtype_name(t.dtype)
    except md.MetadataError as exc:
        raise UnsupportedValueError(f"{key!r}: {exc}") from None


# ---------------------------------------------------------------------- load: targets

def number_kind(dtype: torch.dtype) -> int:
    """0 bool, 1 integer, 2 floating point (float8 included), 3 complex: a lesser kind loses values."""
    if dtype.is_complex:
        return 3
    if dtype.is_floating_point:
        return 2
    return 0 if dtype == torch.bool else 1


def check_writable(key: str, t: torch.Tensor) -> None:
    """Refuse, naming the key, a load target torch could not write in place."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise StateDictMismatchError(f"{key!r}: the target was made under torch.inference_mode() and cannot be "
                                     "written outside it; load into a tensor made outside inference mode")
    if t.layout != torch.strided or t.is_nested:
        raise StateDictMismatchError(f"{key!r}: the target is a {t.layout} tensor; load into a dense tensor")
    if t.numel() and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True)):
        raise StateDictMismatchError(f"{key!r}: several elements of the target share memory (an expand()ed "
                                     "or broadcast view); load into a tensor of its own (t.clone())")


def numpy_tensor_view(arr: np.ndarray, key: str) -> torch.Tensor:
    """A tensor over a numpy target's own memory, so the load fills the array in place."""
    if not arr.dtype.isnative:
        raise StateDictMismatchError(f"{key!r}: the target numpy array is {arr.dtype.str} (not this machine's byte "
                                     "order) and cannot be filled in place; load into a native-order array")
    try:
        return torch.from_numpy(arr)
    except TypeError:
        raise UnsupportedValueError(f"{key!r}: numpy dtype {arr.dtype} is not supported") from None


def kind_of(v: Any) -> str:
    """The entry kind a value would be saved as: tensor, ndarray, bytes, object or pickle."""
    if isinstance(v, torch.Tensor):
        return "tensor"
    if isinstance(v, np.ndarray):
        return "ndarray"
    if isinstance(v, (bytes, bytearray)):
        return "bytes"
    return "object" if is_json_value(v) else "pickle"


def describe(v: Any) -> str:
    """A target value in words, for mismatch errors."""
    if isinstance(v, (torch.Tensor, np.ndarray)):
        kind = "DTensor" if isinstance(v, DTensor) else type(v).__name__
        return f"{kind} {str(v.dtype).replace('torch.', '')} shape {list(v.shape)}"
    return type(v).__name__


# ---------------------------------------------------------------------- load: plain values

def part_name(part: Any) -> str:
    """A path part as text: dict keys as they are, list/tuple indices and int keys as digits."""
    return str(part[1]) if isinstance(part, tuple) else str(part)


def shaped_like(built: Any, target: Any) -> Any:
    """A value put together from split keys ({name: ...} at every level), given the target's
    containers: digit names become list (or tuple) items where the target has a sequence
    there (or nothing, and the names are 0..n-1), and a target dict's int keys stay ints."""
    if not isinstance(built, dict):
        return built
    digits = built and all(k.isdigit() for k in built) and sorted(map(int, built)) == list(range(len(built)))
    if isinstance(target, (list, tuple)) or (target is None and digits):
        if digits:
            seq = [shaped_like(built[str(i)], target[i] if target is not None and i < len(target) else None)
                   for i in range(len(built))]
            return tuple(seq) if isinstance(target, tuple) else seq
        return {k: shaped_like(v, None) for k, v in built.items()}
    if isinstance(target, dict):
        names = {str(k): k for k in target}
        return {names.get(k, k): shaped_like(v, target.get(names[k]) if k in names else None)
                for k, v in built.items()}
    return {k: shaped_like(v, None) for k, v in built.items()}


def fill_plain(key: str, saved: Any, target: Any, missing: list[str]) -> Any:
    """The value a plain (JSON) entry loads as: the saved value, except that a target dict's
    keys the saved dict lacks are missing keys (``key.sub``, nested alike), as flattened keys
    would be, and keep the target's values (what ``strict=False`` loads). Keys only the saved
    dict has load with it (``strict="all"`` does not look inside a plain value)."""
    if not isinstance(saved, dict) or not isinstance(target, dict):
        return saved
    out = dict(saved)
    for k, v in target.items():
        name = f"{key}.{k}"
        if k in saved:
            out[k] = fill_plain(name, saved[k], v, missing)
        else:
            missing.append(name)
            out[k] = v
    return out
