"""Checkpoint keys grouped into conversions, as both pretrained loaders group them.

Each checkpoint key is renamed by the rules (every ``WeightRenaming`` in turn, then the first
``WeightConverter`` that matches, then the base-model prefix dropped or added where that names a
model tensor: transformers' ``rename_source_key``). Keys renamed to the same model tensor form one
:class:`LoadGroup`: a fresh copy of the converter they matched (or a plain renaming), which
collects a loader per key, in :func:`~.weight_conversion.dot_natural_key` order, so experts are
stacked 0, 1, 2, ..., 10. Keys renamed to no model tensor are reported as unexpected.

What a loader returns is the caller's business: :class:`HuggingFaceCheckpointer`'s legacy loader
reads the whole tensor; :class:`HFLoadPlanner` hands out a
:class:`~.region_tensor.RegionTensor`. The groups, and so the names and the order of what each
conversion sees, are the same for both, which is why their results are equal bit for bit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .weight_conversion import WeightConverter, WeightRenaming, get_model_conversion_mapping, rename_source_key

__all__ = ["Transform", "LoadGroup", "ConverterSelector", "build_load_targets", "names_by_target", "resolve_mapping",
           "select_unique_converter", "build_load_groups", "convert_group", "first_tensor"]

Transform = Any  # a WeightRenaming or a WeightConverter (transformers' classes or the fallback's)

ConverterSelector = Callable[[str, str, Sequence[Any]], Any]
"""``(source pattern, model tensor name, candidate converters) -> the converter, or None``."""


@dataclass
class LoadGroup:
    """The checkpoint tensors converted together into one model tensor (and maybe others):
    ``first_target_name`` is the name the first key was renamed to, ``transform`` the collecting rule."""

    first_target_name: str
    transform: Transform
    origin: Any = None
    """The rule ``transform`` is a fresh copy of (None for a plain renaming made for one key)."""


def build_load_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``model`` under every name it is registered under
    (a tied weight appears under each of its names, as the same object)."""
    targets: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                targets[dot + name] = param
        skipped = module._non_persistent_buffers_set
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in skipped:
                targets[dot + name] = buffer
    return targets


def names_by_target(targets: Mapping[str, torch.Tensor]) -> dict[int, list[str]]:
    """Every name of each model tensor, by the tensor's identity, in registration order."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, tensor in targets.items():
        names[id(tensor)].append(name)
    return names


def resolve_mapping(model: nn.Module, weights_mapping: Sequence[Transform] | None,
                    extra_weights_mapping: Sequence[Transform] = (),
                    key_mapping: Mapping[str, str] | None = None) -> list[Transform]:
    """The rules in the order they are tried: ``extra_weights_mapping``, then ``key_mapping`` renames
    and ``weights_mapping`` (default: the model's transformers mapping, with ``key_mapping`` renames
    first); a rule listed twice is used once."""
    if weights_mapping is None:
        base = list(get_model_conversion_mapping(model, key_mapping=dict(key_mapping) if key_mapping else None,
                                                 hf_quantizer=None))
    else:
        base = [WeightRenaming(source_patterns=s, target_patterns=t) for s, t in (key_mapping or {}).items()]
        base += list(weights_mapping)
    seen, rules = set(), []
    for rule in (*extra_weights_mapping, *base):
        if id(rule) not in seen:
            seen.add(id(rule))
            rules.append(rule)
    for rule in rules:
        if not isinstance(rule, (WeightRenaming, WeightConverter)):
            raise ValueError(f"weights mapping rules must be WeightRenaming or WeightConverter, found "
                             f"{type(rule).__name__}: {rule!r}")
    return rules


def select_unique_converter(source_pattern: str, target_name: str, candidates: Sequence[Any]) -> Any:
    """The converter a key matched by ``source_pattern`` belongs to: the only one scoped to a module
    holding ``target_name``, else the only unscoped one; None when neither is unique."""
    del source_pattern
    scoped = [c for c in candidates if c.scope_prefix is not None
              and (target_name == c.scope_prefix or target_name.startswith(f"{c.scope_prefix}."))]
    if len(scoped) == 1:
        return scoped[0]
    unscoped = [c for c in candidates if c.scope_prefix is None]
    return unscoped[0] if len(unscoped) == 1 else None


def build_load_groups(model: Any, source_keys: Iterable[str], targets: Mapping[str, Any], rules: Sequence[Transform],
                      make_loader: Callable[[str], Any],
                      select_converter: ConverterSelector = select_unique_converter,
                      ) -> tuple[list[LoadGroup], list[str]]:
    """Group ``source_keys`` (collected in the order given) by the model tensor they are renamed to.

    Returns the groups in order of their first key, and the keys renamed to no model tensor.

    Raises:
        ValueError: a key matched a converter pattern that no single converter claims for its target.
    """
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    by_pattern: dict[str, list[Any]] = defaultdict(list)
    for converter in converters:
        for pattern in converter.source_patterns:
            by_pattern[pattern].append(converter)
    prefix = getattr(model, "base_model_prefix", None)
    groups: dict[str, LoadGroup] = {}
    unexpected: list[str] = []
    for key in source_keys:
        name, pattern = rename_source_key(key, renamings, converters, base_model_prefix=prefix,
                                          meta_state_dict=targets)
        if name not in targets and key in targets:
            name, pattern = key, None  # the rules renamed a key the model has as it is
        if name not in targets:
            unexpected.append(key)
            continue
        if pattern is None:
            pattern, rule = key, None
        else:
            rule = select_converter(pattern, name, by_pattern.get(pattern, []))
            if rule is None:
                raise ValueError(f"checkpoint key {key!r} matched source pattern {pattern!r} (-> model tensor "
                                 f"{name!r}), which no single WeightConverter claims; candidates: "
                                 f"{by_pattern.get(pattern, [])}")
        group = groups.get(name)
        if group is None:  # each group collects into a fresh copy of its rule
            fresh = WeightRenaming(source_patterns=key, target_patterns=name) if rule is None else deepcopy(rule)
            group = groups[name] = LoadGroup(name, fresh, rule)
        group.transform.add_tensor(name, key, pattern, make_loader(key))
    return list(groups.values()), unexpected


def convert_group(group: LoadGroup, model: Any) -> dict[str, Any]:
    """Run the group's rule on what it collected: ``{model tensor name: tensor or [tensor]}``.

    Raises:
        RuntimeError: the conversion failed; the message names the group.
    """
    try:
        return group.transform.convert(group.first_target_name, model=model, config=getattr(model, "config", None),
                                       hf_quantizer=None, loading_info=None)
    except Exception as exc:
        raise RuntimeError(f"converting the checkpoint tensors of {group.first_target_name!r} failed: "
                           f"{type(exc).__name__}: {exc}") from exc


def first_tensor(value: Any) -> Any:
    """The tensor of a conversion result (a renaming returns it in a list)."""
    return value[0] if isinstance(value, list) else value
