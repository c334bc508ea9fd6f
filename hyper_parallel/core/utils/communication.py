"""``hyper_parallel.core.utils.communication``: HyperParallel's newer home of the group registry.

``EXISTING_COMM_GROUPS`` is the very dict of :mod:`hyper_parallel.platform.platform` (one
registry under two import paths), so clearing either clears both.
"""

from ...platform.platform import EXISTING_COMM_GROUPS

__all__ = ["EXISTING_COMM_GROUPS"]
