"""Conversion steps for :class:`WeightConverter` rules a model needs beyond transformers' own.

Each step is a :class:`~.weight_conversion.ConversionOps`: ``convert(input_dict, source_patterns,
target_patterns, **kwargs)`` takes the tensors collected per source pattern (one each here; a
list of one is accepted) and returns tensors per target pattern; ``reverse_op`` is the step that
undoes it. They are written with operations :class:`~.region_tensor.RegionTensor` follows
(concatenating, splitting, reshaping, slicing, adding a number), so :class:`HFLoadPlanner` turns
them into region reads instead of running them on whole tensors.

Grouped-query attention layouts, for ``kv`` key/value heads of ``groups`` query heads each, query
and key heads ``head_dim`` rows long, value heads ``value_dim`` rows long:

- separate: Q has ``kv*groups*head_dim`` rows, K ``kv*head_dim``, V ``kv*value_dim``; fused: the
  three stacked in that order;
- grouped (:class:`InterleaveQKV`): for each key/value head ``h`` in turn, the rows of its
  ``groups`` query heads, then its key rows, then its value rows — a tensor-parallel shard of
  whole groups then holds everything one attention group needs;
- gated (:class:`InterleaveGateQKV`): the checkpoint's query tensor holds, per query head, its
  query rows then its gate rows; grouped, each key/value head's block is its query rows, key
  rows, value rows, then the gate rows of its query heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .weight_conversion import ConversionOps

__all__ = ["AddScalar", "ConcatenateWithSections", "Split", "InterleaveQKV", "DeinterleaveQKV",
           "InterleaveGateQKV", "DeinterleaveGateQKV"]


def _one(input_dict: dict[str, Any], pattern: str, step: str) -> Any:
    """The single tensor collected under ``pattern``."""
    if pattern not in input_dict:
        raise ValueError(f"{step}: nothing was collected for source pattern {pattern!r} "
                         f"(collected: {sorted(input_dict)})")
    value = input_dict[pattern]
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"{step}: expected one tensor for {pattern!r}, got {len(value)}")
        return value[0]
    return value


def _need(step: str, sources: Sequence[str], n_sources: int, targets: Sequence[str], n_targets: int) -> None:
    if len(sources) != n_sources or len(targets) != n_targets:
        raise ValueError(f"{step} converts {n_sources} source pattern(s) into {n_targets} target pattern(s); "
                         f"the rule has {len(sources)} -> {len(targets)}: {list(sources)} -> {list(targets)}")


def _sections(sections: Sequence[int], step: str) -> tuple[int, ...]:
    sections = tuple(sections)
    if len(sections) < 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sections):
        raise ValueError(f"{step} needs two or more positive integer sections, got {sections!r}")
    return sections


class AddScalar(ConversionOps):
    """Add a number to every element (e.g. a norm stored as ``weight - 1``); undone by adding ``-value``."""

    def __init__(self, value: float) -> None:
        self.value = value

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, Any]:
        _need("AddScalar", source_patterns, 1, target_patterns, 1)
        return {target_patterns[0]: _one(input_dict, source_patterns[0], "AddScalar") + self.value}

    @property
    def reverse_op(self) -> ConversionOps:
        return AddScalar(-self.value)


class ConcatenateWithSections(ConversionOps):
    """Concatenate one tensor per source pattern along ``dim``, each exactly ``sections[i]`` long
    there (checked), so :class:`Split` can undo it."""

    def __init__(self, sections: Sequence[int], dim: int = 0) -> None:
        self.sections = _sections(sections, "ConcatenateWithSections")
        self.dim = dim

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, Any]:
        _need("ConcatenateWithSections", source_patterns, len(self.sections), target_patterns, 1)
        parts = [_one(input_dict, p, "ConcatenateWithSections") for p in source_patterns]
        found = tuple(int(t.shape[self.dim]) for t in parts)
        if found != self.sections:
            raise ValueError(f"ConcatenateWithSections expected sizes {self.sections} along dim {self.dim} for "
                             f"{list(source_patterns)}, found {found}")
        return {target_patterns[0]: torch.cat(parts, dim=self.dim)}

    @property
    def reverse_op(self) -> ConversionOps:
        return Split(self.sections, dim=self.dim)


class Split(ConversionOps):
    """Cut one tensor along ``dim`` into ``sections``, one per target pattern; undone by
    :class:`ConcatenateWithSections`."""

    def __init__(self, sections: Sequence[int], dim: int = 0) -> None:
        self.sections = _sections(sections, "Split")
        self.dim = dim

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, Any]:
        _need("Split", source_patterns, 1, target_patterns, len(self.sections))
        tensor = _one(input_dict, source_patterns[0], "Split")
        if int(tensor.shape[self.dim]) != sum(self.sections):
            raise ValueError(f"Split of {source_patterns[0]!r} into {self.sections} along dim {self.dim}: the "
                             f"tensor has {int(tensor.shape[self.dim])} there")
        return dict(zip(target_patterns, torch.split(tensor, list(self.sections), dim=self.dim), strict=True))

    @property
    def reverse_op(self) -> ConversionOps:
        return ConcatenateWithSections(self.sections, dim=self.dim)


class _GroupedAttention(ConversionOps):
    """The sizes every grouped-query layout step shares (see the module docstring)."""

    def __init__(self, num_key_value_heads: int, num_key_value_groups: int, query_head_dim: int,
                 value_head_dim: int) -> None:
        for name, value in (("num_key_value_heads", num_key_value_heads),
                            ("num_key_value_groups", num_key_value_groups),
                            ("query_head_dim", query_head_dim), ("value_head_dim", value_head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{type(self).__name__}: {name} must be a positive integer, got {value!r}")
        self.num_key_value_heads = num_key_value_heads
        self.num_key_value_groups = num_key_value_groups
        self.query_head_dim = query_head_dim
        self.value_head_dim = value_head_dim

    @property
    def _rows(self) -> tuple[int, int, int]:
        """Rows of Q, K and V in the separate layout."""
        kv, g, d, dv = self.num_key_value_heads, self.num_key_value_groups, self.query_head_dim, self.value_head_dim
        return kv * g * d, kv * d, kv * dv

    def _per_head(self, tensor: Any, rows: int) -> Any:
        """``tensor`` with its rows split into one block of ``rows`` per key/value head."""
        return tensor.reshape(self.num_key_value_heads, rows, *tensor.shape[1:])


class InterleaveQKV(_GroupedAttention):
    """Separate (three sources) or fused (one source) Q, K, V rows into the grouped layout."""

    def __init__(self, num_key_value_heads: int, num_key_value_groups: int, query_head_dim: int,
                 value_head_dim: int, source_is_fused: bool) -> None:
        super().__init__(num_key_value_heads, num_key_value_groups, query_head_dim, value_head_dim)
        self.source_is_fused = bool(source_is_fused)

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, Any]:
        if self.source_is_fused:
            _need("InterleaveQKV (fused source)", source_patterns, 1, target_patterns, 1)
            q, k, v = torch.split(_one(input_dict, source_patterns[0], "InterleaveQKV"), list(self._rows), dim=0)
        else:
            _need("InterleaveQKV", source_patterns, 3, target_patterns, 1)
            q, k, v = (_one(input_dict, p, "InterleaveQKV") for p in source_patterns)
        g, d, dv = self.num_key_value_groups, self.query_head_dim, self.value_head_dim
        grouped = torch.cat([self._per_head(q, g * d), self._per_head(k, d), self._per_head(v, dv)], dim=1)
        return {target_patterns[0]: grouped.flatten(0, 1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return DeinterleaveQKV(self.num_key_value_heads, self.num_key_value_groups, self.query_head_dim,
                               self.value_head_dim, target_is_fused=self.source_is_fused)


class DeinterleaveQKV(_GroupedAttention):
    """The grouped layout back to separate (three targets) or fused (one target) Q, K, V rows."""

    def __init__(self, num_key_value_heads: int, num_key_value_groups: int, query_head_dim: int,
                 value_head_dim: int, target_is_fused: bool) -> None:
        super().__init__(num_key_value_heads, num_key_value_groups, query_head_dim, value_head_dim)
        self.target_is_fused = bool(target_is_fused)

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, Any]:
        _need("DeinterleaveQKV", source_patterns, 1, target_patterns, 1 if self.target_is_fused else 3)
        g, d, dv = self.num_key_value_groups, self.query_head_dim, self.value_head_dim
        grouped = self._per_head(_one(input_dict, source_patterns[0], "DeinterleaveQKV"), g * d + d + dv)
        q, k, v = (part.flatten(0, 1) for part in torch.split(grouped, [g * d, d, dv], dim=1))
        if self.target_is_fused:
            return {target_patterns[0]: torch.cat([q, k, v], dim=0)}
        return dict(zip(target_patterns, (q, k, v), strict=True))

    @property
    def reverse_op(self) -> ConversionOps:
        return InterleaveQKV(self.num_key_value_heads, self.num_key_value_groups, self.query_head_dim,
                             self.value_head_dim, source_is_fused=self.target_is_fused)


class InterleaveGateQKV(_GroupedAttention):
    """Gated attention: per-query-head Q/gate rows, K and V (three sources) into one grouped tensor
    (per key/value head: query, key, value, then gate rows)."""

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, Any]:
        _need("InterleaveGateQKV", source_patterns, 3, target_patterns, 1)
        query_gate, k, v = (_one(input_dict, p, "InterleaveGateQKV") for p in source_patterns)
        kv, g, d, dv = self.num_key_value_heads, self.num_key_value_groups, self.query_head_dim, self.value_head_dim
        rest = tuple(query_gate.shape[1:])
        halves = query_gate.reshape(kv, g, 2, d, *rest)
        q = halves[:, :, 0].reshape(kv, g * d, *rest)
        gate = halves[:, :, 1].reshape(kv, g * d, *rest)
        grouped = torch.cat([q, self._per_head(k, d), self._per_head(v, dv), gate], dim=1)
        return {target_patterns[0]: grouped.flatten(0, 1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return DeinterleaveGateQKV(self.num_key_value_heads, self.num_key_value_groups, self.query_head_dim,
                                   self.value_head_dim)


class DeinterleaveGateQKV(_GroupedAttention):
    """The gated grouped layout back to per-query-head Q/gate rows, K and V (three targets)."""

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, Any]:
        _need("DeinterleaveGateQKV", source_patterns, 1, target_patterns, 3)
        kv, g, d, dv = self.num_key_value_heads, self.num_key_value_groups, self.query_head_dim, self.value_head_dim
        grouped = self._per_head(_one(input_dict, source_patterns[0], "DeinterleaveGateQKV"), 2 * g * d + d + dv)
        rest = tuple(grouped.shape[2:])
        q, k, v, gate = torch.split(grouped, [g * d, d, dv, g * d], dim=1)
        query_gate = torch.stack([q.reshape(kv, g, d, *rest), gate.reshape(kv, g, d, *rest)], dim=2)
        return {target_patterns[0]: query_gate.flatten(0, 3), target_patterns[1]: k.flatten(0, 1),
                target_patterns[2]: v.flatten(0, 1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return InterleaveGateQKV(self.num_key_value_heads, self.num_key_value_groups, self.query_head_dim,
                                 self.value_head_dim)
