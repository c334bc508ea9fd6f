"""``hyper_parallel.platform.torch.platform``: HyperParallel's path of :class:`TorchPlatform`.

The class is :class:`hyper_parallel.platform.TorchPlatform` itself (not a copy), so patching
``hyper_parallel.platform.torch.platform.TorchPlatform.load_checkpoint`` patches what
:func:`hyper_parallel.platform.get_platform` returns.
"""

from __future__ import annotations

from .. import EXISTING_COMM_GROUPS, PlatformType, TorchPlatform, get_platform

__all__ = ["TorchPlatform", "PlatformType", "EXISTING_COMM_GROUPS", "get_platform"]
