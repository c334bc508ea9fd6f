"""A protocol class that torch DCP code and HyperParallel code both subclass, each with its own names.

torch's ``SavePlanner``/``LoadPlanner``/``StorageReader`` and HyperParallel's newer ABCs of the
same names describe the same steps under different method names (``set_up_planner`` /
``configure_planner``, ``read_data`` / ``execute_read``, ...). One import path serves both, so the
class there must let a subclass implement either set. :class:`EitherProtocol` is the metaclass
that does it: a subclass whose class defines every name of ``_HYPER_PARALLEL_NAMES`` is marked
``_hyper_parallel_form`` and is not held to torch's abstract methods (the HyperParallel adapter drives it by its own
names); any other subclass is checked as torch checks it.

What it is not: the adapters that run either form (``planning.hyper_parallel_protocol``).
"""

from __future__ import annotations

import abc
from typing import Any

__all__ = ["EitherProtocol", "hyper_parallel_form"]


class EitherProtocol(abc.ABCMeta):
    """Metaclass: a class defining all of its ``_HYPER_PARALLEL_NAMES`` is HyperParallel-form (no torch abstracts)."""

    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any) -> Any:
        cls = super().__new__(mcls, name, bases, namespace, **kwargs)
        names = getattr(cls, "_HYPER_PARALLEL_NAMES", ())
        cls._hyper_parallel_form = bool(names) and all(callable(getattr(cls, n, None)) for n in names)
        if cls._hyper_parallel_form:
            cls.__abstractmethods__ = frozenset()
        return cls


def hyper_parallel_form(obj: Any) -> bool:
    """Whether ``obj``'s class subclasses an :class:`EitherProtocol` class with HyperParallel's names."""
    return bool(getattr(type(obj), "_hyper_parallel_form", False))
