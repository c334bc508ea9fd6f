"""Hugging Face weights into a finalized, sharded model, each rank reading only the regions it needs.

:class:`HFLoadPlanner` loads what the legacy whole-tensor loader
(:func:`~.whole_tensor_loader.load_whole_tensors`, ``HuggingFaceCheckpointer(loader="legacy")``)
loads: the same keys grouped into the same conversions by the same rules
(:mod:`.load_groups`), and the same values, bit for bit. What differs is how the values get
there. While the load is planned, every conversion is run once on
:class:`~.region_tensor.RegionTensor` inputs, which turns it into
:class:`~hyper_parallel.core.distributed_checkpoint.remap_planner.RemapBlock` records: which
region of which checkpoint tensor fills which box of which model tensor, through which
elementwise steps. The planner is a :class:`RemapLoadPlanner`, so each rank then reads only the
regions its own shards need (a ``Shard(0)`` of stacked experts reads only its experts' tensors),
and replicated regions can be read once and broadcast.

A conversion that cannot be followed that way (it multiplies two tensors, reads a value, flips a
tensor, or :meth:`HFLoadPlanner.supports_symbolic` says no) is planned as a
:class:`~hyper_parallel.core.distributed_checkpoint.remap_planner.DeferredRead`: every rank that
loads it reads its checkpoint tensors whole and runs it on them, as the legacy loader runs every
conversion, then keeps its own part. The conversion is also run on meta tensors while planning,
which checks what tracing returns against torch's shapes and dtypes; on disagreement the
conversion is deferred too.

Rules, in the order they are tried: ``extra_weights_mapping``; then ``weights_mapping`` when
given (after the ``key_mapping`` renames), else the model's transformers conversion mapping
(:meth:`HFLoadPlanner.default_weights_mapping`, ``key_mapping`` renames first). Not covered: the
second conversion stage of models whose replacement modules convert normalized weights again.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from copy import copy
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.core.distributed_checkpoint import load
from hyper_parallel.core.distributed_checkpoint.hf_storage import HuggingFaceStorageReader
from hyper_parallel.core.distributed_checkpoint.remap_planner import DeferredRead, RemapBlock, RemapLoadPlanner

from .checkpoint_files import resolve_checkpoint_location
from .load_groups import (
    LoadGroup,
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
from .local_region_load import can_load_locally, open_local_safetensors, run_local_load
from .region_tensor import RegionTensor, materialize
from .target_shards import check_target, copy_into_target
from .weight_conversion import dot_natural_key, get_model_conversion_mapping

__all__ = ["HFLoadPlanner", "load_hf_checkpoint"]

logger = logging.getLogger(__name__)


def _same(value: Any) -> Any:
    """A loader handing a rule ``value`` (rules collect callables)."""
    return value


def _dtype(value: Any, key: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"checkpoint tensor {key!r} has dtype {value!r}, which is not a torch dtype")
    return found


def _emptied_copy(rule: Transform) -> Transform:
    """A copy of ``rule`` that collects anew, sharing its patterns and operations (which converting
    does not change): much cheaper than a deep copy, and run several times per conversion."""
    fresh = copy(rule)
    fresh.collected_tensors = defaultdict(list)
    if hasattr(rule, "layer_targets"):
        fresh.layer_targets = defaultdict(set)
    return fresh


@dataclass(eq=False)
class _Conversion:
    """One conversion of the load: its rule with nothing collected, the name it is known by, the
    model handed to its operations, and its inputs ``(source pattern, region)`` in collection order."""

    template: Transform
    name: str
    model: Any
    inputs: list[tuple[str, RegionTensor]]

    def sources(self) -> tuple[str, ...]:
        return tuple(sorted(set().union(*(v.sources() for _, v in self.inputs)), key=dot_natural_key))

    def run(self, values: Sequence[Any]) -> dict[str, Any]:
        """The rule run on ``values`` (one per input: regions, meta or real tensors), on a fresh copy."""
        rule = _emptied_copy(self.template)
        for (pattern, _), value in zip(self.inputs, values, strict=True):
            rule.add_tensor(self.name, self.name, pattern, partial(_same, value))
        return convert_group(LoadGroup(self.name, rule), self.model)


@dataclass(frozen=True, eq=False)
class _Deferred:
    """An output of a conversion that runs on real tensors: its shape (None if unknown until it
    runs), the conversion and the output's name."""

    shape: tuple[int, ...] | None
    conversion: _Conversion
    name: str


@dataclass
class _Plan:
    table: dict[str, list[Any]] = field(default_factory=dict)
    deferred: dict[int, tuple[_Conversion, list[tuple[str, str]]]] = field(default_factory=dict)
    loaded_ids: set[int] = field(default_factory=set)
    loaded_keys: set[str] = field(default_factory=set)
    unexpected: list[str] = field(default_factory=list)


def _real(value: RegionTensor, fetched: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The values of an input region out of the whole checkpoint tensors read for it."""
    blocks = value.blocks
    if len(blocks) == 1 and not blocks[0].post and blocks[0].dtype == value.dtype:
        source = fetched[blocks[0].source]
        if tuple(source.shape) == tuple(value.shape) and blocks[0].base == (0,) * source.dim() \
                and blocks[0].columns == tuple(tuple(int(i == d) for i in range(source.dim()))
                                               for d in range(source.dim())):
            return source  # the whole checkpoint tensor as it is
    return materialize(value, fetched)


def _same_outputs(traced: Mapping[str, Any], expected: Mapping[str, Any]) -> bool:
    return traced.keys() == expected.keys() and all(
        isinstance(v, RegionTensor) and tuple(v.shape) == tuple(expected[n].shape) and v.dtype == expected[n].dtype
        for n, v in traced.items())


_NUMBER = re.compile(r"\d+")


class _Leaf:
    """The loader of checkpoint tensor ``key`` while planning: its :class:`RegionTensor`, made on
    first call (a layer that converts as an earlier one did never needs it)."""

    __slots__ = ("key", "shape", "dtype", "_value")

    def __init__(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.key, self.shape, self.dtype, self._value = key, shape, dtype, None

    def __call__(self) -> RegionTensor:
        if self._value is None:
            self._value = RegionTensor.leaf(self.key, self.shape, self.dtype)
        return self._value


@dataclass(frozen=True)
class _Reusable:
    """A traced conversion as a pattern for others of its signature: per output, its name split
    around the numbers of the conversion's name, its shape, and its blocks with the input each reads."""

    outputs_: tuple[tuple[tuple[str, ...], tuple[int, ...], tuple[tuple[RemapBlock, int], ...]], ...]

    @staticmethod
    def of(first_target_name: str, sources: list[str], outputs: Mapping[str, tuple[Any, Any]]) -> _Reusable | None:
        """The pattern of a conversion named ``first_target_name`` reading ``sources`` (its inputs, in
        order) with these outputs; None when it cannot serve as one (an output not traced, an output
        whose numbers are not the conversion's, a block reading something else than an input)."""
        numbers = _NUMBER.findall(first_target_name)
        where = {source: i for i, source in enumerate(sources)}
        if len(where) != len(sources):
            return None
        out = []
        for name, (value, blocks) in outputs.items():
            if blocks is None or _NUMBER.findall(name) != numbers or any(b.source not in where for b in blocks):
                return None
            out.append((tuple(_NUMBER.split(name)), tuple(value.shape),
                        tuple((b, where[b.source]) for b in blocks)))
        return _Reusable(tuple(out))

    def outputs(self, first_target_name: str, sources: list[str]) -> list[tuple[str, tuple[int, ...], list[Any]]]:
        """``(name, shape, blocks)`` of each output for a conversion of the same signature."""
        numbers = _NUMBER.findall(first_target_name)
        out = []
        for parts, shape, blocks in self.outputs_:
            name = parts[0] + "".join(n + p for n, p in zip(numbers, parts[1:], strict=True))
            out.append((name, shape, [b.with_source(sources[i]) for b, i in blocks]))
        return out


class HFLoadPlanner(RemapLoadPlanner):
    """Load planner for a Hugging Face checkpoint read into a finalized (materialized, maybe sharded) model.

    Every rank plans its load; a failure to plan on one rank fails the load on every rank (the
    driver, ``load``, exchanges the outcome). Use it through :func:`load_hf_checkpoint`, or::

        planner = HFLoadPlanner(model)
        load(planner.state_dict_for_load(), storage_reader=HuggingFaceStorageReader(path), planner=planner)
        report = planner.finish(path)

    Args:
        model: the model, its tensors materialized (plain tensors or DTensors, any placements but
            ``Partial``).
        weights_mapping: rules replacing the model's default ones. Default None (the default).
        extra_weights_mapping: rules tried before all others. Default ().
        key_mapping: ``{regex: replacement}`` renames applied to checkpoint keys before the other
            rules. Default None.
        strict: fail the load (before reading anything) when a model tensor would be left
            unloaded; :class:`~.load_report.MissingWeightsError` names them. Default True.
        broadcast_replicated_tensors: see :class:`RemapLoadPlanner`. Default False.

    After planning, ``table`` holds the region reads by state-dict key, ``deferred`` the
    conversions run on whole tensors, and ``report`` the :class:`LoadReport`.

    Hooks a subclass may override: :meth:`default_weights_mapping`, :meth:`map_checkpoint_key`,
    :meth:`select_converter`, :meth:`supports_symbolic`, :attr:`reuse_traced_layers`.
    """

    reuse_traced_layers: bool = True
    """Trace one conversion per signature (the rule it copies, its input patterns, shapes and dtypes,
    and its names with the numbers left out: the same conversion of every layer) and give the others
    its blocks, renamed, instead of tracing each. Assumes a conversion does not look at the numbers in
    its names, as transformers' operations do not; a subclass whose rules do sets it False."""

    def __init__(self, model: nn.Module, *, weights_mapping: Sequence[Transform] | None = None,
                 extra_weights_mapping: Sequence[Transform] = (), key_mapping: Mapping[str, str] | None = None,
                 strict: bool = True, broadcast_replicated_tensors: bool = False) -> None:
        super().__init__(broadcast_replicated_tensors=broadcast_replicated_tensors)
        self.model = model
        self.weights_mapping = None if weights_mapping is None else list(weights_mapping)
        self.extra_weights_mapping = list(extra_weights_mapping)
        self.key_mapping = dict(key_mapping or {})
        self.strict = strict
        self.report: LoadReport | None = None
        self._targets = build_load_targets(model)
        self._names = names_by_target(self._targets)
        self._state_keys = {tid: names[0] for tid, names in self._names.items()}
        self._loaded_ids: set[int] = set()
        self._used: list[Transform] = []

    # ---------------------------------------------------------------- hooks

    def default_weights_mapping(self, model: nn.Module) -> list[Transform]:
        """The rules used when no ``weights_mapping`` is given: the model's transformers conversion
        mapping, ``key_mapping`` renames first."""
        return list(get_model_conversion_mapping(model, key_mapping=self.key_mapping or None, hf_quantizer=None))

    def map_checkpoint_key(self, key: str) -> str | None:
        """The name the rules see checkpoint key ``key`` under (default: itself); None skips it
        (neither loaded nor reported)."""
        return key

    def select_converter(self, source_pattern: str, target_name: str, candidates: Sequence[Any]) -> Any:
        """The converter a key matched by ``source_pattern`` (renamed to ``target_name``) belongs to,
        out of every converter with that pattern; None fails the load. Default: as the legacy loader."""
        return select_unique_converter(source_pattern, target_name, candidates)

    def supports_symbolic(self, transform: Transform) -> bool:
        """Whether ``transform`` may be traced into region reads (default True); False always runs
        it on whole tensors."""
        return True

    # ---------------------------------------------------------------- driving

    def state_dict_for_load(self) -> dict[str, torch.Tensor]:
        """What to pass to ``load`` with this planner: every model tensor once, under its first name."""
        return {key: self._targets[key] for key in self._state_keys.values()}

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False,
                       **kwargs: Any) -> None:
        """torch DCP's step 0 (and, through ``configure_planner``, HyperParallel's): take the state dict,
        then plan every model tensor's load from the checkpoint's metadata.

        Raises:
            MissingWeightsError: ``strict`` and some model tensor would be left unloaded.
            ValueError: a converted shape differs from the model tensor's, a model tensor is on the
                meta device or ``Partial``, two checkpoint keys map to one name, or a key matched no
                single converter. Messages name the keys.
        """
        super().set_up_planner(state_dict, metadata, is_coordinator, **kwargs)
        plan = self._compile(metadata)
        self._adopt(plan)

    def finish(self, pretrained_path: str | Path = "") -> LoadReport:
        """After ``load`` ran with this planner: mark the loaded tensors initialized
        (``_is_hf_initialized``), record the rules used on the model (``model._weight_conversions``,
        where saving in the original format finds them) and return the :class:`LoadReport`."""
        if self.report is None:
            raise RuntimeError("HFLoadPlanner.finish() before a load was planned with this planner")
        for tensor in self._targets.values():
            if id(tensor) in self._loaded_ids:
                tensor._is_hf_initialized = True
        self.model._weight_conversions = list(self._used)
        log_unexpected(self.report.unexpected_keys)
        logger.info("loaded %d model tensors from %s", len(self.report.loaded_keys), pretrained_path)
        return self.report

    # ---------------------------------------------------------------- planning

    def _checkpoint_keys(self, metadata: Any) -> dict[str, str]:
        """``{name the rules see: checkpoint key}`` for every checkpoint tensor."""
        keys: dict[str, str] = {}
        for key, md in metadata.state_dict_metadata.items():
            if getattr(md, "chunks", None) is None or getattr(md, "size", None) is None:
                continue
            mapped = self.map_checkpoint_key(key)
            if mapped is None:
                continue
            if mapped in keys:
                raise ValueError(f"checkpoint keys {keys[mapped]!r} and {key!r} both map to {mapped!r}")
            keys[mapped] = key
        return keys

    def _rules(self) -> list[Transform]:
        if self.weights_mapping is None:
            return resolve_mapping(self.model, self.default_weights_mapping(self.model), self.extra_weights_mapping)
        return resolve_mapping(self.model, self.weights_mapping, self.extra_weights_mapping, self.key_mapping)

    def _compile(self, metadata: Any) -> _Plan:
        keys = self._checkpoint_keys(metadata)

        def leaf(mapped: str) -> _Leaf:
            key = keys[mapped]
            md = metadata.state_dict_metadata[key]
            return _Leaf(key, tuple(int(n) for n in md.size), _dtype(md.properties.dtype, key))

        rules = self._rules()
        groups, unexpected = build_load_groups(self.model, sorted(keys, key=dot_natural_key), self._targets, rules,
                                               leaf, self.select_converter)
        plan = _Plan(unexpected=[keys[k] for k in unexpected])
        reusable: dict[tuple, _Reusable | None] = {}
        for group in groups:
            loaders = [(pattern, loader) for pattern, loaders in group.transform.collected_tensors.items()
                       for loader in loaders]
            group.transform.collected_tensors.clear()
            signature = self._signature(group, loaders)
            earlier = reusable.get(signature) if signature is not None else None
            if earlier is not None:  # converts as an earlier layer did: its blocks, renamed
                sources = [loader.key for _, loader in loaders]
                for name, shape, blocks in earlier.outputs(group.first_target_name, sources):
                    self._claim(plan, name, shape, blocks=blocks)
                continue
            inputs = [(pattern, loader()) for pattern, loader in loaders]
            conversion = _Conversion(group.transform, group.first_target_name, self.model, inputs)
            outputs = {}
            for name, value in self._plan_conversion(conversion).items():
                if isinstance(value, RegionTensor):
                    blocks = value.remap_blocks()
                    self._claim(plan, name, value.shape, blocks=blocks)
                else:
                    blocks = None
                    self._claim(plan, name, value.shape, deferred=value)
                outputs[name] = (value, blocks)
            if signature is not None and signature not in reusable:
                reusable[signature] = _Reusable.of(group.first_target_name, [ld.key for _, ld in loaders], outputs)
        self._used = [rule for rule in rules if rule.was_used()]
        return plan

    def _signature(self, group: LoadGroup, loaders: list[tuple[str, Any]]) -> tuple | None:
        """What a conversion's outcome depends on, its numbers (layer, expert) left out: the rule it
        copies, its input patterns, shapes and dtypes, and its names with every number as ``#``.
        Conversions of one signature trace alike (see :attr:`reuse_traced_layers`); None: not reused."""
        if not self.reuse_traced_layers or not all(isinstance(loader, _Leaf) for _, loader in loaders):
            return None
        origin = id(group.origin) if group.origin is not None else None
        inputs = tuple((_NUMBER.sub("#", pattern), _NUMBER.sub("#", loader.key), loader.shape, loader.dtype)
                       for pattern, loader in loaders)
        return (origin, type(group.transform), _NUMBER.sub("#", group.first_target_name), inputs,
                self.supports_symbolic(group.transform))

    def _plan_conversion(self, conversion: _Conversion) -> dict[str, Any]:
        """Every output of ``conversion``: a :class:`RegionTensor` when it traces, else a :class:`_Deferred`."""
        values = [v for _, v in conversion.inputs]
        traced = None
        if self.supports_symbolic(conversion.template):
            try:
                traced = {n: first_tensor(v) for n, v in conversion.run(values).items()}
            except Exception as exc:  # whatever the conversion raises on regions, it runs for real
                logger.debug("%s does not trace into region reads (%s); it runs on whole tensors", conversion.name,
                             exc)
        try:
            metas = [torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for v in values]
            expected = {n: first_tensor(v) for n, v in conversion.run(metas).items()}
        except Exception:
            expected = None
        if traced is not None and all(isinstance(v, RegionTensor) for v in traced.values()) and (
                expected is None or _same_outputs(traced, expected)):
            return traced
        if expected is None:
            return self._unknown_outputs(conversion, traced)
        return {n: _Deferred(tuple(v.shape), conversion, n) for n, v in expected.items()}

    @staticmethod
    def _unknown_outputs(conversion: _Conversion, traced: Any) -> dict[str, Any]:
        """Outputs of a conversion that neither traces nor runs on meta tensors: named as tracing named
        them, else as the conversion is known; shapes are checked once it has run."""
        names = list(traced) if traced else [conversion.name]
        return {n: _Deferred(None, conversion, n) for n in names}

    def _claim(self, plan: _Plan, name: str, shape: Any, blocks: list[RemapBlock] | None = None,
               deferred: _Deferred | None = None) -> None:
        """Load model tensor ``name`` of ``shape`` (None: known once a deferred conversion ran) from
        ``blocks``, or else from the ``deferred`` output, unless something planned earlier already does."""
        target = self._targets.get(name)
        if target is None:
            plan.unexpected.append(name)
            return
        tid = id(target)
        if tid not in plan.loaded_ids:
            if shape is not None:
                check_target(name, target, tuple(shape))
            key = self._state_keys[tid]
            if blocks is not None:
                plan.table[key] = blocks
            else:
                plan.deferred.setdefault(id(deferred.conversion), (deferred.conversion, []))[1].append(
                    (deferred.name, name))
            plan.loaded_ids.add(tid)
        plan.loaded_keys.update(self._names[tid])

    def _adopt(self, plan: _Plan) -> None:
        """Make ``plan`` this load's table and deferred reads, and its report."""
        missing = sorted_names(set(self._targets) - plan.loaded_keys)
        check_missing(missing, self.strict)
        deferred = []
        for conversion, claims in plan.deferred.values():
            complete = partial(self._complete, conversion, tuple(claims))
            sources = conversion.sources()
            if sources:
                deferred.append(DeferredRead(sources, complete,
                                             targets=tuple(self._state_keys[id(self._targets[t])] for _, t in claims)))
            else:
                complete({})  # a conversion of empty tensors reads nothing
        self.table = {key: tuple(blocks) for key, blocks in plan.table.items()}  # traced blocks tile their tensor
        self.deferred = tuple(deferred)
        self._loaded_ids = set(plan.loaded_ids)
        self.report = LoadReport(loaded_keys=sorted_names(plan.loaded_keys), missing_keys=missing,
                                 unexpected_keys=sorted_names(plan.unexpected))
        logger.info("planned %d model tensors as region reads and %d through %d conversion(s) on whole tensors",
                    len(self.table), sum(len(c) for _, c in plan.deferred.values()), len(plan.deferred))

    def _complete(self, conversion: _Conversion, claims: tuple[tuple[str, str], ...],
                  fetched: Mapping[str, torch.Tensor]) -> None:
        """A deferred conversion's checkpoint tensors have been read whole: run it, keep this rank's parts."""
        outputs = conversion.run([_real(v, fetched) for _, v in conversion.inputs])
        for output, name in claims:
            if output not in outputs:
                raise RuntimeError(f"the conversion of {conversion.name!r} returned {sorted(outputs)}, not {output!r}")
            copy_into_target(name, first_tensor(outputs[output]), self._targets[name])


class _SingleFileReader(HuggingFaceStorageReader):
    """A checkpoint that is one ``.safetensors`` file, whatever its name."""

    def __init__(self, file: Path) -> None:
        super().__init__(file.parent)
        self._file = file.name

    def weight_files(self) -> tuple[list[str], dict[str, str] | None]:
        return [self._file], None


def load_hf_checkpoint(model: nn.Module, pretrained_path: str | Path, *,
                       weights_mapping: Sequence[Transform] | None = None, strict: bool = True,
                       planner: HFLoadPlanner | None = None, storage_reader: Any = None,
                       **load_kwargs: Any) -> LoadReport:
    """Load a Hugging Face checkpoint into a finalized model through region reads.

    Every rank of the default process group calls it together; without a process group it runs
    in this process alone.

    Args:
        model: the model, materialized; DTensor parameters are filled shard by shard.
        pretrained_path: a ``.safetensors`` file, a checkpoint directory, or a Hub repository id.
        weights_mapping: rules replacing the model's default ones (ignored with ``planner``).
        strict: fail when a model tensor would be left unloaded (ignored with ``planner``).
        planner: an :class:`HFLoadPlanner` (or subclass) for rules beyond ``weights_mapping``.
        storage_reader: what reads the files, through ``load``. Default: the plan is carried out
            straight from the files (the index's, or ``model.safetensors``, or the one file given;
            :mod:`.local_region_load`) when the model's tensors are on the CPU, no ``load_kwargs``
            are given and the planner does not broadcast replicated shards; otherwise ``load`` with
            this library's ``HuggingFaceStorageReader``.
        **load_kwargs: passed to ``load`` (``use_collectives``, ``thread_count``, ...).

    Returns:
        The :class:`LoadReport`: loaded, missing and unexpected names.

    Raises:
        MissingWeightsError: ``strict`` and a model tensor would stay unloaded (names them).

    Example::

        report = load_hf_checkpoint(model, "/models/qwen3-moe")
        assert not report.missing_keys
    """
    if planner is None:
        planner = HFLoadPlanner(model, weights_mapping=weights_mapping, strict=strict)
    state_dict = planner.state_dict_for_load()
    if storage_reader is None:
        location = resolve_checkpoint_location(pretrained_path)
        if not load_kwargs and not planner.broadcast_replicated_tensors and can_load_locally(state_dict):
            checkpoint = open_local_safetensors(location)
            try:
                run_local_load(planner, state_dict, checkpoint)
            finally:
                checkpoint.close()
            return planner.finish(pretrained_path)
        storage_reader = _SingleFileReader(location) if location.is_file() else HuggingFaceStorageReader(location)
    if not (dist.is_available() and dist.is_initialized()):
        load_kwargs.setdefault("no_dist", True)
    load(state_dict, storage_reader=storage_reader, planner=planner, **load_kwargs)
    return planner.finish(pretrained_path)
