"""``save`` / ``load``: the checkpoint's two calls (seed path ``distributed_checkpoint.api``).

A face: the procedures live in :mod:`.engine.checkpoint`; this module only re-exports them.
"""

from .engine.checkpoint import load, save

__all__ = ["save", "load"]
