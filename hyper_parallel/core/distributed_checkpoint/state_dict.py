"""torch DCP's ``state_dict`` import path: getting and setting model and optimizer state dicts.

A face. These are torch's own functions and options, re-exported: they turn a module and an
optimizer into FQN-keyed state dicts (DTensors kept as they are) and back, which is what our
``save``/``load`` take; they do not touch a checkpoint. The private
``_patch_model_state_dict``/``_patch_optimizer_state_dict`` (torch's tests and some user code
import them) are torch's too. :mod:`._src.state.train_state` builds on them.
"""

from torch.distributed.checkpoint.state_dict import (
    FQNS_T,
    DictValueType,
    ListDictValueType,
    OptimizerStateType,
    PrimitiveType,
    StateDictOptions,
    ValueType,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict import _patch_model_state_dict as _patch_model_state_dict
from torch.distributed.checkpoint.state_dict import _patch_optimizer_state_dict as _patch_optimizer_state_dict

__all__ = [
    "FQNS_T",
    "PrimitiveType",
    "ValueType",
    "DictValueType",
    "ListDictValueType",
    "OptimizerStateType",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]
