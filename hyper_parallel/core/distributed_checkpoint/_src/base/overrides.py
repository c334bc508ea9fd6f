"""Which methods a user's subclass of a foreign (torch) class defines: the code that a mapping of
that class onto this library's would silently drop.

What it is not: the mappings themselves (``planning.torch_planners``, ``backends.torch_storage``,
``asynchronous.torch_stagers``).
"""

from __future__ import annotations

import inspect

__all__ = ["own_methods", "foreign_base"]


def foreign_base(cls: type, prefix: str = "torch.") -> type | None:
    """The first class of ``cls``'s hierarchy defined in a module under ``prefix`` (None if none)."""
    return next((c for c in cls.__mro__ if c.__module__.startswith(prefix)), None)


def own_methods(cls: type, prefix: str = "torch.") -> list[str]:
    """The methods the classes of ``cls``'s hierarchy below the first one from ``prefix`` define,
    dunders (``__init__``) aside: a subclass that only sets options in ``__init__`` has none."""
    own: list[str] = []
    for c in cls.__mro__:
        if c is object or c.__module__.startswith(prefix):
            break
        own.extend(n for n, v in vars(c).items()
                   if not (n.startswith("__") and n.endswith("__")) and n not in own
                   and (inspect.isfunction(v) or isinstance(v, (staticmethod, classmethod, property))))
    return own
