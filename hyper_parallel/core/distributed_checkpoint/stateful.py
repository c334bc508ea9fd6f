"""torch DCP's ``stateful`` import path: the ``Stateful`` protocol (``state_dict()`` and
``load_state_dict()``), torch's own, which save and load expand and fill (see :mod:`._src.state.flatten`).

A face: re-exports torch's protocol and its type variable.
"""

from torch.distributed.checkpoint.stateful import Stateful, StatefulT

__all__ = ["Stateful", "StatefulT"]
