"""HyperParallel's ``distributed_checkpoint.util`` import path, for the one name its system
tests import from it: ``_MAX_BROADCASTS_IN_FLIGHT``, the number of broadcasts its load pipeline
keeps going at once, which they use to size their state dicts ("several times as many shared
tensors as the pipeline allows in flight").

It is the limit of :mod:`.transfer.broadcasts` (the seed's read-and-broadcast pipeline, face
``distributed_checkpoint.broadcast``). Our own ``load`` shares replicated data through
:mod:`.transfer.shared_reads` instead, with point-to-point messages in rounds bounded by bytes
(``batch_bytes`` per rank), not by a count of messages.
"""

from __future__ import annotations

from .transfer.broadcasts import MAX_BROADCASTS_IN_FLIGHT as _MAX_BROADCASTS_IN_FLIGHT

__all__ = ["_MAX_BROADCASTS_IN_FLIGHT"]
