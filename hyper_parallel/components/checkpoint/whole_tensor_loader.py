"""The legacy pretrained loader: every rank reads whole checkpoint tensors, converts them, keeps its part.

This is the reference :class:`HFLoadPlanner` must equal bit for bit, and the obvious way to load
a Hugging Face checkpoint into a sharded model: the rules of :mod:`.load_groups` group the keys,
each group's tensors are read whole (:class:`~.checkpoint_files.CheckpointIndex`) and converted in
host memory, and each result is cut to this rank's part of its model tensor
(:func:`~.target_shards.copy_into_target`). It needs no process group and no collective; every
rank reads everything its model tensors are made from, which is what makes it slow and
memory-hungry for a sharded mixture-of-experts model.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path

from torch import nn

from .checkpoint_files import resolve_checkpoint_index
from .load_groups import (
    ConverterSelector,
    Transform,
    build_load_groups,
    build_load_targets,
    convert_group,
    first_tensor,
    names_by_target,
    resolve_mapping,
    select_unique_converter,
)
from .load_report import LoadReport, check_missing, log_unexpected, sorted_names
from .target_shards import copy_into_target

__all__ = ["load_whole_tensors"]

logger = logging.getLogger(__name__)


def load_whole_tensors(model: nn.Module, pretrained_path: str | Path, *,
                       weights_mapping: Sequence[Transform] | None = None,
                       extra_weights_mapping: Sequence[Transform] = (), key_mapping: Mapping[str, str] | None = None,
                       strict: bool = True, select_converter: ConverterSelector = select_unique_converter,
                       ) -> LoadReport:
    """Load ``pretrained_path`` into ``model`` by whole-tensor reads (see the module docstring).

    Arguments as for :class:`HFLoadPlanner`. Returns the :class:`LoadReport`.

    Raises:
        MissingWeightsError: ``strict`` and some model tensor was left unloaded (raised after
            loading the rest, which stays loaded).
        ValueError / RuntimeError: a converted shape differs from the model tensor's, or a
            conversion failed; the message names the tensor.
    """
    index = resolve_checkpoint_index(pretrained_path)
    targets = build_load_targets(model)
    names = names_by_target(targets)
    rules = resolve_mapping(model, weights_mapping, extra_weights_mapping, key_mapping)
    groups, unexpected = build_load_groups(model, index.keys(), targets, rules,
                                           lambda key: partial(index.load_tensor, key), select_converter)
    loaded_ids: set[int] = set()
    loaded_keys: set[str] = set()
    try:
        for group in groups:
            for name, value in convert_group(group, model).items():
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                if id(target) not in loaded_ids:
                    copy_into_target(name, first_tensor(value), target)
                    target._is_hf_initialized = True
                    loaded_ids.add(id(target))
                loaded_keys.update(names[id(target)])
    finally:
        index.close()
    missing = sorted_names(set(targets) - loaded_keys)
    check_missing(missing, strict)
    report = LoadReport(loaded_keys=sorted_names(loaded_keys), missing_keys=missing,
                        unexpected_keys=sorted_names(unexpected))
    model._weight_conversions = [rule for rule in rules if rule.was_used()]
    log_unexpected(report.unexpected_keys)
    logger.info("loaded %d model tensors from %s", len(report.loaded_keys), pretrained_path)
    return report

