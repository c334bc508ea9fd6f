"""``hyper_parallel.platform.platform``: the current platform object and the group registry.

HyperParallel runs the same code on MindSpore and on torch by asking one *platform* object
for process facts (rank, world size, groups, a module's parameters). That object lives in this
module's global ``platform``: ``None`` until :func:`get_platform` first builds it, and tests (or
a program switching frameworks) may set it back to ``None`` to have it built again. The
environment variable ``HYPER_PARALLEL_PLATFORM`` names the framework; here only ``torch`` exists,
so an unset variable also means torch, and ``mindspore`` raises an ImportError that says so.

``EXISTING_COMM_GROUPS`` is the registry of process groups made through the platform
(:meth:`TorchPlatform.create_group`), keyed by the tuple of member ranks. It is a plain dict
that tests ``.clear()`` between cases; ``hyper_parallel.core.utils.communication`` exposes the
same object under HyperParallel's newer path. Clearing it forgets the registry only: the
groups themselves stay cached by :func:`hyper_parallel.platform.member_group`, so asking again
returns the same group without a new rendezvous.
"""

from __future__ import annotations

import os
from typing import Any

from . import PlatformType, TorchPlatform

__all__ = ["HYPER_PARALLEL_PLATFORM", "HYPER_PARALLEL_PLATFORM_TORCH", "HYPER_PARALLEL_PLATFORM_MINDSPORE",
           "EXISTING_COMM_GROUPS", "PlatformType", "TorchPlatform", "platform", "get_platform",
           "get_torch_platform", "set_platform"]

HYPER_PARALLEL_PLATFORM = "HYPER_PARALLEL_PLATFORM"
"""The environment variable that names the framework (``torch`` or ``mindspore``)."""
HYPER_PARALLEL_PLATFORM_TORCH = "torch"
HYPER_PARALLEL_PLATFORM_MINDSPORE = "mindspore"

EXISTING_COMM_GROUPS: dict[Any, Any] = {}

platform: TorchPlatform | None = None
"""The platform object :func:`get_platform` returns; set to ``None`` to have it rebuilt."""


def get_torch_platform() -> TorchPlatform:
    """Build the torch platform, make it the current one and return it."""
    global platform
    platform = TorchPlatform()
    return platform


def get_platform() -> TorchPlatform:
    """The current platform object, built on first use.

    Reads ``HYPER_PARALLEL_PLATFORM`` only when no platform is set: ``torch`` (any case) or
    unset gives the torch platform.

    Raises:
        ImportError: ``HYPER_PARALLEL_PLATFORM=mindspore``; this package runs on torch only.
        ValueError: the variable names a framework HyperParallel does not know.

    Example::

        from hyper_parallel.platform.platform import get_platform
        if get_platform().get_rank() == 0:
            ...
    """
    if platform is not None:
        return platform
    choice = os.environ.get(HYPER_PARALLEL_PLATFORM)
    choice = choice.strip().lower() if choice else HYPER_PARALLEL_PLATFORM_TORCH
    if choice == HYPER_PARALLEL_PLATFORM_TORCH:
        return get_torch_platform()
    if choice == HYPER_PARALLEL_PLATFORM_MINDSPORE:
        raise ImportError(f"{HYPER_PARALLEL_PLATFORM}=mindspore: this hyper_parallel runs on torch only; "
                          f"unset the variable or set it to 'torch'")
    raise ValueError(f"{HYPER_PARALLEL_PLATFORM}={choice!r} is not a known framework; use 'torch'")


def set_platform(new: TorchPlatform | None) -> None:
    """Make ``new`` the current platform (``None``: rebuild it on the next :func:`get_platform`)."""
    global platform
    platform = new
