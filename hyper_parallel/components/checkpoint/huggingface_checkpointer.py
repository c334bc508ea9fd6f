"""Hugging Face pretrained weights as a :class:`CheckpointerBase`: load only, into a live model.

The payload is ``{"model": <nn.Module>}``: a module, not a state dict, because loading writes
into its (possibly sharded) tensors in place. :meth:`HuggingFaceCheckpointer.load` adds
``"load_report"``, the :class:`LoadReport` naming what was loaded, what is missing and what the
checkpoint holds beyond the model.

Two loaders reach the same values under the same names:

- ``"legacy"``: :func:`~.whole_tensor_loader.load_whole_tensors`, every rank reads whole tensors;
- ``"dcp"``: :func:`~.huggingface_load_planner.load_hf_checkpoint`, each rank reads only the
  regions its shards need.

The choice is the ``loader`` argument, else the ``HYPER_PARALLEL_HF_LOADER`` environment
variable, else ``"legacy"``. Saving in the Transformers format stays with the model's own
``save_pretrained``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from .base import CheckpointerBase
from .huggingface_load_planner import HFLoadPlanner, load_hf_checkpoint
from .load_groups import Transform
from .whole_tensor_loader import load_whole_tensors

__all__ = ["HF_LOADER_ENV", "resolve_hf_loader", "HuggingFaceCheckpointer"]

HF_LOADER_ENV = "HYPER_PARALLEL_HF_LOADER"
_LOADERS = ("legacy", "dcp")


def resolve_hf_loader(loader: str | None = None) -> str:
    """``"legacy"`` or ``"dcp"``: ``loader``, else ``$HYPER_PARALLEL_HF_LOADER``, else ``"legacy"``.

    Raises:
        ValueError: any other name (the message says where it came from).
    """
    chosen = (loader or os.environ.get(HF_LOADER_ENV) or "legacy").strip().lower()
    if chosen not in _LOADERS:
        where = "the loader argument" if loader else f"${HF_LOADER_ENV}"
        raise ValueError(f"unknown pretrained loader {chosen!r} (from {where}); expected one of {', '.join(_LOADERS)}")
    return chosen


class HuggingFaceCheckpointer(CheckpointerBase):
    """Loads complete Hugging Face weights into one finalized model.

    Args:
        loader: ``"legacy"`` or ``"dcp"`` (see the module docstring); resolved here, so a bad
            name fails before any file is opened.
        weights_mapping: rules replacing the model's transformers conversion mapping. Default None.
        extra_weights_mapping: rules tried before all others. Default ().
        key_mapping: regex renames of checkpoint keys applied first. Default None.

    Example::

        state = HuggingFaceCheckpointer(loader="dcp").load("/models/qwen3-moe", {"model": model})
        state["load_report"].missing_keys   # ()
    """

    def __init__(self, *, loader: str | None = None, weights_mapping: Sequence[Transform] | None = None,
                 extra_weights_mapping: Sequence[Transform] = (),
                 key_mapping: Mapping[str, str] | None = None) -> None:
        self.loader = resolve_hf_loader(loader)
        self.weights_mapping = None if weights_mapping is None else list(weights_mapping)
        self.extra_weights_mapping = list(extra_weights_mapping)
        self.key_mapping = dict(key_mapping or {})

    def save(self, path: str, state: dict[str, Any], *, global_step: int, save_async: bool = False) -> None:
        """Not supported: write a training checkpoint with the distributed checkpoint's ``save``,
        or Transformers' format with the model's own ``save_pretrained``."""
        raise NotImplementedError("HuggingFaceCheckpointer only loads pretrained weights; save a training checkpoint "
                                  "with hyper_parallel.core.distributed_checkpoint.save, or the Transformers format "
                                  "with the model's save_pretrained()")

    def load(self, path: str, state: dict[str, Any], *, strict_model: bool = True,
             extra_state_skeleton: dict[str, Any] | None = None) -> dict[str, Any]:
        """Load the weights at ``path`` into ``state["model"]``; sets ``state["load_report"]``.

        Raises:
            ValueError: ``path`` is empty, or ``extra_state_skeleton`` is given (pretrained weights
                carry no training state).
            TypeError: ``state["model"]`` is not an ``nn.Module``.
            MissingWeightsError: ``strict_model`` and some model tensor was left unloaded.
        """
        if extra_state_skeleton is not None:
            raise ValueError("a pretrained Hugging Face checkpoint carries no training state; restore extra_state "
                             "from a training checkpoint instead")
        if not path:
            raise ValueError("HuggingFaceCheckpointer.load needs the path (or Hub id) of the pretrained weights")
        model = state.get("model")
        if not isinstance(model, nn.Module):
            raise TypeError(f"HuggingFaceCheckpointer.load fills state['model'], which must be the nn.Module to load "
                            f"into; got {type(model).__name__}")
        if self.loader == "dcp":
            planner = HFLoadPlanner(model, weights_mapping=self.weights_mapping,
                                    extra_weights_mapping=self.extra_weights_mapping, key_mapping=self.key_mapping,
                                    strict=strict_model)
            state["load_report"] = load_hf_checkpoint(model, path, planner=planner)
        else:
            state["load_report"] = load_whole_tensors(model, path, weights_mapping=self.weights_mapping,
                                                      extra_weights_mapping=self.extra_weights_mapping,
                                                      key_mapping=self.key_mapping, strict=strict_model)
        return state
