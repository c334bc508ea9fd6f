"""The Transformers 5 weight-transform contract, for an environment whose ``transformers`` lacks it.

Transformers 5 renames and converts checkpoint tensors on load with ``WeightRenaming`` and
``WeightConverter`` rules (``transformers.core_model_loading``). Where that module is present
with scoped rules, :mod:`.weight_conversion` uses transformers' own classes, so the rules a model
ships load exactly as transformers loads them. This module is what it uses otherwise (no
transformers, or a 4.x release): the same contract, written for the patterns this package's
users pass by hand.

The contract, as the loaders here rely on it:

- a rule has ``source_patterns`` and ``target_patterns`` (a string is one pattern). A pattern is a
  regular expression searched in the key, where ``*.`` stands for one path component
  (``experts.*.w1.weight``), and a pattern ending in a letter or digit ends on a name boundary
  (``weight`` does not match ``weight_scale``). The longest source pattern is tried first;
- ``rename_source_key(key) -> (new key, matched source pattern or None)`` replaces the matched
  text by the first target pattern, and marks the rule used (:meth:`WeightTransform.was_used`);
- ``add_tensor(target_key, source_key, source_pattern, loader)`` collects a loader (a callable
  returning the tensor) under its source pattern; ``convert(layer_name, model=, config=, ...)``
  calls the loaders and returns ``{model tensor name: tensor or [tensor]}``;
- ``scope_prefix`` (None: every key) restricts a rule to the keys under a module, optionally
  behind ``base_model_prefix``.

What is not here: transformers' quantization hooks, tensor-parallel hooks, and the reverse
conversion used when saving in the original format.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ConversionOps", "WeightTransform", "WeightRenaming", "WeightConverter", "dot_natural_key",
           "rename_source_key", "get_model_conversion_mapping"]


class ConversionOps(ABC):
    """One step of a :class:`WeightConverter`: tensors collected by source pattern in, tensors by
    target pattern out."""

    @abstractmethod
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, Any]:
        """Convert ``input_dict`` (``{pattern: tensor or [tensors]}``); keywords carry
        ``full_layer_name``, ``model``, ``config`` and ``missing_keys``."""

    @property
    def reverse_op(self) -> ConversionOps:
        """The step that undoes this one (for saving back in the checkpoint's layout)."""
        raise NotImplementedError(f"{type(self).__name__} has no reverse operation")


def _as_list(patterns: str | Sequence[str]) -> list[str]:
    return [patterns] if isinstance(patterns, str) else list(patterns)


def _branch(pattern: str) -> str:
    """The regular expression one source pattern is searched with."""
    expression = pattern.replace("*.", r".*\.")
    if re.search(r"[A-Za-z0-9]$", expression):
        expression += r"(?!\w)"
    return expression


class WeightTransform:
    """A rule renaming checkpoint keys that match its source patterns (see the module docstring)."""

    def __init__(self, source_patterns: str | Sequence[str], target_patterns: str | Sequence[str]) -> None:
        self.source_patterns = _as_list(source_patterns)
        self.target_patterns = _as_list(target_patterns)
        if not self.source_patterns or not self.target_patterns:
            raise ValueError(f"{type(self).__name__} needs source and target patterns, got "
                             f"{self.source_patterns!r} -> {self.target_patterns!r}")
        order = sorted(range(len(self.source_patterns)), key=lambda i: -len(self.source_patterns[i]))
        self.compiled_sources = re.compile("|".join(f"(?P<g{i}>{_branch(self.source_patterns[i])})" for i in order))
        self.collected_tensors: dict[str, list[Any]] = defaultdict(list)
        self.scope_prefix: str | None = None
        self.base_model_prefix: str | None = None
        self._was_used = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(source_patterns={self.source_patterns}, target_patterns={self.target_patterns})"

    def _scoped(self, key: str) -> tuple[str, str] | None:
        """``(prefix kept aside, rest matched)``, or None when the key is outside the scope."""
        if self.scope_prefix is None:
            return "", key
        scope = f"{self.scope_prefix}." if self.scope_prefix else ""
        base = f"{self.base_model_prefix}." if self.base_model_prefix else ""
        for prefix in (base + scope, scope):
            if key.startswith(prefix):
                return prefix, key[len(prefix):]
        return None

    def rename_source_key(self, source_key: str) -> tuple[str, str | None]:
        """The key renamed by the first target pattern, and the source pattern that matched (None: unchanged)."""
        scoped = self._scoped(source_key)
        if scoped is None:
            return source_key, None
        prefix, rest = scoped
        match = self.compiled_sources.search(rest)
        if match is None:
            return source_key, None
        self._was_used = True
        group = next(name for name, value in match.groupdict().items() if value is not None)
        return prefix + rest.replace(match.group(0), self.target_patterns[0], 1), \
            self.source_patterns[int(group[1:])]

    def add_tensor(self, target_key: str, source_key: str, source_pattern: str, loader: Any) -> None:
        """Collect ``loader`` (a callable returning the tensor, or the tensor) under ``source_pattern``."""
        del target_key, source_key
        self.collected_tensors[source_pattern].append(loader)

    def materialize_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The collected tensors by pattern (loaders called), emptying the collection."""
        collected = {pattern: [value() if callable(value) else value for value in values]
                     for pattern, values in self.collected_tensors.items()}
        self.collected_tensors.clear()
        return collected

    def was_used(self) -> bool:
        """Whether the rule renamed a key."""
        return self._was_used


class WeightRenaming(WeightTransform):
    """A rule that renames and leaves the tensor as it is."""

    def convert(self, layer_name: str, model: Any = None, config: Any = None, hf_quantizer: Any = None,
                loading_info: Any = None) -> dict[str, Any]:
        """``{layer_name: [tensor]}`` for the one collected tensor."""
        del model, config, hf_quantizer, loading_info
        collected = self.materialize_tensors()
        return {layer_name: next(iter(collected.values()))}


class WeightConverter(WeightTransform):
    """A rule that renames and runs ``operations`` on the tensors collected for one model tensor."""

    def __init__(self, source_patterns: str | Sequence[str], target_patterns: str | Sequence[str],
                 operations: Sequence[ConversionOps]) -> None:
        super().__init__(source_patterns, target_patterns)
        self.operations = list(operations)
        if not self.operations:
            raise ValueError(f"WeightConverter {self.source_patterns} -> {self.target_patterns} needs an operation")

    def convert(self, layer_name: str, model: Any = None, config: Any = None, hf_quantizer: Any = None,
                loading_info: Any = None) -> dict[str, Any]:
        """Run the operations, then name each result as ``layer_name`` names its first target."""
        del hf_quantizer
        values: dict[str, Any] = self.materialize_tensors()
        for operation in self.operations:
            values = operation.convert(values, source_patterns=self.source_patterns,
                                       target_patterns=self.target_patterns, full_layer_name=layer_name, model=model,
                                       config=config,
                                       missing_keys=getattr(loading_info, "missing_keys", None))
        full = layer_name.replace("*.", "0.")
        for pattern in values:
            if pattern in full:
                prefix, _, suffix = full.partition(pattern)
                return {prefix + name + suffix: value for name, value in values.items()}
        return values


def dot_natural_key(key: str) -> list[tuple]:
    """Sort key for dotted tensor names: numeric components by value (``experts.2`` before ``experts.10``)."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in key.split(".")]


def rename_source_key(source_key: str, weight_renamings: Sequence[WeightRenaming],
                      weight_converters: Sequence[WeightConverter], base_model_prefix: str | None = None,
                      meta_state_dict: dict[str, Any] | None = None) -> tuple[str, str | None]:
    """Every renaming in turn, then the first converter that matches; then the base-model prefix is
    dropped or added where that names a model tensor. Returns the key and the converter's matched
    source pattern (None when no converter matched)."""
    key = source_key
    for renaming in weight_renamings:
        key, _ = renaming.rename_source_key(key)
    pattern = None
    for converter in weight_converters:
        key, pattern = converter.rename_source_key(key)
        if pattern is not None:
            break
    if base_model_prefix and meta_state_dict is not None:
        prefix = f"{base_model_prefix}."
        if key.startswith(prefix) and key[len(prefix):] in meta_state_dict:
            key = key[len(prefix):]
        elif prefix + key in meta_state_dict:
            key = prefix + key
    return key, pattern


def get_model_conversion_mapping(model: Any, key_mapping: dict[str, str] | None = None, hf_quantizer: Any = None,
                                 add_legacy: bool = True) -> list[WeightTransform]:
    """Without transformers' mapping table, a model's rules are only the ``key_mapping`` renames."""
    del model, hf_quantizer, add_legacy
    return [WeightRenaming(source, target) for source, target in (key_mapping or {}).items()]

