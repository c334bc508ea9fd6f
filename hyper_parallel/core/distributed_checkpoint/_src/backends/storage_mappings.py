"""torch storage classes whose counterparts live above this layer, mapped onto ours by registration.

:mod:`.torch_storage` maps torch's filesystem and fsspec storage objects onto this layer's
classes itself. torch's other storage classes with a counterpart here (its Hugging Face
reader and writers, whose counterparts live in ``interop``) cannot be named by this layer:
the layer that holds the counterpart registers a conversion (:func:`register`) when it is
imported, and :mod:`.torch_storage` asks :func:`convert` first. A subclass of a registered
class that overrides a method is not converted (its code would be dropped); it is left to the
caller (which runs torch's protocol, calling its hooks).

What it is not: the conversions themselves (``interop.huggingface.torch_storage``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..base.overrides import foreign_base, own_methods

__all__ = ["register", "convert"]

_CONVERSIONS: dict[tuple[type, str], Callable[[Any], Any]] = {}


def register(torch_class: type, role: str, conversion: Callable[[Any], Any]) -> None:
    """Convert instances of ``torch_class`` (a torch storage class; ``role``: ``"writer"`` or
    ``"reader"``) with ``conversion(obj) -> our storage object``."""
    if role not in ("writer", "reader"):
        raise ValueError(f"role must be 'writer' or 'reader', got {role!r}")
    _CONVERSIONS[(torch_class, role)] = conversion


def convert(obj: Any, role: str) -> Any | None:
    """Our storage object for torch's ``obj`` when its class (or a subclass of it that adds only
    ``__init__``) is registered for ``role``; None otherwise."""
    cls = type(obj)
    conversion = _CONVERSIONS.get((cls, role))
    if conversion is None:
        base = foreign_base(cls)
        conversion = _CONVERSIONS.get((base, role)) if base is not None and not own_methods(cls) else None
    return conversion(obj) if conversion is not None else None
