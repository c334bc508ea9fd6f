"""HyperParallel's ``distributed_checkpoint.util`` import path, for the one name its system
tests import from it: ``_MAX_BROADCASTS_IN_FLIGHT``, the number of broadcasts its load pipeline
keeps going at once, which they use to size their state dicts ("several times as many shared
tensors as the pipeline allows in flight").

Nothing here reads it. Our shared reads (:mod:`.shared_reads`) send each replicated slab with
point-to-point messages in rounds bounded by bytes (``batch_bytes`` per rank), not by a count
of messages, so a state dict of any size exercises the same code.
"""

from __future__ import annotations

__all__: list[str] = []

_MAX_BROADCASTS_IN_FLIGHT = 8  # HyperParallel's value; only sizes its tests here
