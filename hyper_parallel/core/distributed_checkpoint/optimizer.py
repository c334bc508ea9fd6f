"""torch DCP's ``optimizer`` import path: an optimizer's state loaded sharded like the model.

A face over :mod:`._src.interop.torch.sharded_optimizer`.
"""

from ._src.interop.torch.sharded_optimizer import load_sharded_optimizer_state_dict

__all__ = ["load_sharded_optimizer_state_dict"]
