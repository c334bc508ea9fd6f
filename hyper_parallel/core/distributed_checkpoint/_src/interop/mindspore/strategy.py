"""MindSpore parallel strategy files: read them as our layouts, write our layouts as them.

MindSpore's compiler saves, per parameter, how it is sliced over the devices
(``set_auto_parallel_context(strategy_ckpt_config={"save_file": ...})``): a protobuf
``ParallelStrategyMap`` (``node_strategy.proto``), or the same in JSON when the file name ends
in ``...sharding.json``. Each ``parallel_layout_item`` holds a parameter name and its ``ParallelLayouts``:

- ``dev_matrix``: the device matrix (our mesh shape); rank = row-major position in it;
- ``tensor_map``: per tensor dim the device-matrix dim that splits it, counted from the
  right, ``-1`` when whole — exactly HyperParallel's ``tensor_map`` (see ``layout.py``). A
  dim split over several device dims has a list (outermost first); the protobuf then holds
  one ``TensorMap`` per tensor dim instead of one for all;
- ``opt_weight_shard_step/size`` (optimizer parallel), ``field`` and ``param_split_shape``
  (uneven embedding splits): other slicings, which we refuse by name rather than misread.

A name ``"<stage>-<name>"`` comes from ``merge_pipeline_strategys``: the parameter lives on
pipeline stage ``stage``, whose ranks are ``stage * prod(dev_matrix)`` onwards.

Mesh dims have no names in MindSpore; ours are ``dim0``, ``dim1``, ... (what
:meth:`TensorLayout.from_record` calls unnamed dims).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...base import protowire as pw
from ...base.atomic_file import write_atomically
from ...base.errors import MetadataError
from ...base.limits import MAX_MESH_NDIM, MAX_NDIM, MAX_WORLD
from ...sharding.layout import Layout, TensorLayout
from ...sharding.strategy import LayoutStrategy

__all__ = ["MindSporeLayout", "read_strategy", "parse_strategy", "strategy_to_layouts", "write_strategy"]

_STAGE_NAME = re.compile(r"^(\d+)-(.+)$")
_GLOB = re.compile(r"[*?\[]")


class NotAStrategyError(MetadataError):
    """The bytes are no MindSpore strategy file at all (neither protobuf nor its JSON form)."""


@dataclass(frozen=True)
class MindSporeLayout:
    """One ``parallel_layout_item`` of a strategy file, as MindSpore wrote it."""

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[tuple[int, ...], ...]  # the TensorMap messages, each a tuple of dims
    field: int = 0
    opt_shard_step: int = 0
    opt_shard_size: int = 0
    param_split_shape: tuple[int, ...] = ()
    stage: int = 0

    def resolved_map(self, ndim: int | None = None) -> list[int | tuple[int, ...]]:
        """Per tensor dim: -1, a device dim, or a tuple of them; ``ndim`` settles the 1-d case.

        One TensorMap lists every dim (the usual form); several list one dim each (the form
        for a dim split over several device dims). A 1-d tensor of the second form looks like
        a 2-d one of the first: ``ndim`` tells them apart.
        """
        raw = self.tensor_map
        if len(raw) == 1 and (ndim is None or len(raw[0]) == ndim):
            return list(raw[0])
        if ndim is not None and len(raw) != ndim:
            raise ValueError(f"tensor_map {[list(t) for t in raw]} does not describe a {ndim}-d tensor")
        return [t[0] if len(t) == 1 else tuple(t) for t in raw]

    def tensor_layout(self, ndim: int | None = None) -> TensorLayout:
        """Our layout for it, on a mesh ``dim0, dim1, ...`` of ``dev_matrix`` at this stage's ranks.

        Raises:
            ValueError: optimizer-parallel, field or uneven (param_split_shape) slicing, which
                this layout cannot express, or a malformed tensor_map.
        """
        if self.opt_shard_size or self.opt_shard_step:
            raise ValueError(
                f"it is sliced by MindSpore's optimizer parallel (opt_weight_shard_size "
                f"{self.opt_shard_size}, step {self.opt_shard_step}); convert it first with "
                "mindspore.transform_checkpoints to a strategy without optimizer parallel")
        if self.field:
            raise ValueError(f"it uses MindSpore's field slicing (field {self.field}), which is not supported")
        if self.param_split_shape:
            raise ValueError(f"it is split unevenly (param_split_shape {list(self.param_split_shape)}), "
                             "which is not supported")
        world = math.prod(self.dev_matrix)
        mesh = Layout(self.dev_matrix, tuple(f"dim{i}" for i in range(len(self.dev_matrix))),
                      range(self.stage * world, (self.stage + 1) * world))
        return TensorLayout.from_tensor_map(mesh, self.resolved_map(ndim))


def read_strategy(path: str | os.PathLike) -> dict[str, MindSporeLayout]:
    """Every parameter layout of a MindSpore strategy file (protobuf or JSON), by parameter name.

    Raises:
        MetadataError (a ValueError): the file is neither form (:class:`NotAStrategyError`),
            or a layout in it is malformed or larger than any job (names the file and the
            parameter).
    """
    where = os.fspath(path)
    with open(where, "rb") as f:
        raw = f.read()
    return parse_strategy(raw, where)


def parse_strategy(raw: bytes, where: str = "<bytes>") -> dict[str, MindSporeLayout]:
    """:func:`read_strategy` of a file's bytes (``where`` names it in errors)."""
    stripped = raw.lstrip()
    if stripped[:1] == b"{":
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than any strategy
            raise NotAStrategyError(f"{where}: not a MindSpore strategy: invalid JSON "
                                    f"({exc if isinstance(exc, ValueError) else 'nested too deep'})") from None
        layouts = _parse_json(doc, where)
    else:
        layouts = _parse_protobuf(raw, where)
    return {name: _check(layout, name, where) for name, layout in layouts.items()}


def _split_stage(name: str) -> tuple[str, int]:
    m = _STAGE_NAME.match(name)
    if not m:
        return name, 0
    digits = m.group(1)  # more digits than any stage number: kept huge, for _check to refuse
    return m.group(2), int(digits) if len(digits) <= 18 else 1 << 64


def _check(layout: MindSporeLayout, name: str, where: str) -> MindSporeLayout:
    """Refuse a layout the rest cannot hold: bounded as our ``...sharding.metadata`` bounds layouts
    (at most MAX_MESH_NDIM mesh dims and MAX_WORLD ranks), so nothing walks a mesh of
    16.7M ranks or allocates one of 2**40."""
    at = f"{where}: parameter {name!r}"
    dev = layout.dev_matrix
    if not dev or any(d < 1 for d in dev):
        raise MetadataError(f"{at} has dev_matrix {list(dev)!r:.100}; expected positive sizes")
    if len(dev) > MAX_MESH_NDIM:
        raise MetadataError(f"{at} has a dev_matrix of {len(dev)} dims; a mesh has at most {MAX_MESH_NDIM}")
    world = math.prod(dev)
    if (layout.stage + 1) * world > MAX_WORLD:
        ranks = f"{world} devices" + (f" on pipeline stage {layout.stage}, ranks up to "
                                      f"{(layout.stage + 1) * world - 1}" if layout.stage else "")
        raise MetadataError(f"{at} has dev_matrix {list(dev)}: {ranks}, more than any job (at most {MAX_WORLD} "
                            "ranks, as in a checkpoint's .metadata); the file is damaged or not a job's strategy")
    if not layout.tensor_map:
        raise MetadataError(f"{at} has no tensor_map")
    if len(layout.tensor_map) > MAX_NDIM or any(len(t) > MAX_NDIM for t in layout.tensor_map):
        raise MetadataError(f"{at} has a tensor_map of more than {MAX_NDIM} dims")
    if len(layout.param_split_shape) > MAX_WORLD:
        raise MetadataError(f"{at} has a param_split_shape of {len(layout.param_split_shape)} entries")
    return layout


def _parse_json(doc: Any, where: str) -> dict[str, MindSporeLayout]:
    items = doc.get("parallel_layout_item") if isinstance(doc, dict) else None
    if not isinstance(items, dict):
        raise NotAStrategyError(f"{where}: not a MindSpore strategy: a JSON strategy has a 'parallel_layout_item' "
                                "object")
    out: dict[str, MindSporeLayout] = {}
    for full_name, item in items.items():
        try:
            tmap = item["tensor_map"]
            per_dim = any(isinstance(t, list) for t in tmap)
            tensor_map = tuple(tuple(t) if isinstance(t, list) else (t,) for t in tmap) if per_dim \
                else (tuple(tmap),)
            name, stage = _split_stage(full_name)
            layout = MindSporeLayout(
                dev_matrix=tuple(_json_int(d) for d in item["dev_matrix"]),
                tensor_map=tuple(tuple(_json_int(x) for x in t) for t in tensor_map),
                field=_json_int(item.get("field") or 0),
                opt_shard_step=_json_int(item.get("opt_weight_shard_step") or 0),
                opt_shard_size=_json_int(item.get("opt_weight_shard_size") or 0),
                param_split_shape=tuple(_json_int(x) for x in item.get("param_split_shape") or ()),
                stage=stage)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MetadataError(f"{where}: parallel_layout_item {full_name!r} is malformed ({exc!r:.200})") from None
        out[name] = layout
    return out


def _json_int(v: Any) -> int:
    """An integer of a JSON strategy: MindSpore writes ints; a whole float or a numeric string
    (protobuf's JSON form of 64-bit ints) is taken as one, as before; inf, nan, 1.5 are not."""
    if type(v) is int:
        return v
    if type(v) is float and v.is_integer():  # not inf or nan: int() of those raises OverflowError
        return int(v)
    if type(v) is str and len(v) <= 20:
        return int(v)
    raise TypeError(f"{v!r:.40} is not an integer")


def _ints(buf: bytes, a: int, b: int, signed: bool = False) -> tuple[int, ...]:
    """The values of field 1 (repeated int) of the small message ``buf[a:b]``."""
    out: list[int] = []
    for num, wire, x, y in pw.fields(buf, a, b):
        if num == 1:
            out.extend(pw.as_signed(v, 32) if signed else v for v in pw.repeated_varints(buf, wire, x, y))
    return tuple(out)


def _parse_protobuf(raw: bytes, where: str) -> dict[str, MindSporeLayout]:
    out: dict[str, MindSporeLayout] = {}
    try:
        for num, wire, a, b in pw.fields(raw, 0, len(raw)):
            if num != 3:  # 1: current_stage, 2: operator strategies
                continue
            if wire != pw.LEN:
                raise pw.WireError(f"parallel_layout_item has wire type {wire}", a)
            name, layouts = None, None
            for n2, w2, x, y in pw.fields(raw, a, b):
                if n2 == 1 and w2 == pw.LEN:
                    name = pw.text(raw, x, y)
                elif n2 == 2 and w2 == pw.LEN:
                    layouts = (x, y)
            if name is None or layouts is None:
                raise pw.WireError("a parallel_layout_item lacks param_name or parallel_layouts", a)
            dev_matrix: tuple[int, ...] = ()
            tensor_map: list[tuple[int, ...]] = []
            split: list[int] = []
            scalars = {5: 0, 6: 0, 7: 0}
            for n3, w3, x, y in pw.fields(raw, *layouts):
                if n3 == 1 and w3 == pw.LEN and not dev_matrix:
                    dev_matrix = _ints(raw, x, y)
                elif n3 == 2 and w3 == pw.LEN:
                    tensor_map.append(_ints(raw, x, y, signed=True))
                elif n3 == 3 and w3 == pw.LEN:
                    split.extend(_ints(raw, x, y))
                elif n3 in scalars and w3 == pw.VARINT:
                    scalars[n3] = pw.as_signed(x, 32)
            short, stage = _split_stage(name)
            out[short] = MindSporeLayout(dev_matrix, tuple(tensor_map), scalars[5], scalars[6], scalars[7],
                                         tuple(split), stage)
    except ValueError as exc:  # pw.WireError, or an int32 field out of range
        raise NotAStrategyError(f"{where}: not a MindSpore strategy file (protobuf ParallelStrategyMap or JSON): "
                                f"{exc}") from None
    if not out:
        raise NotAStrategyError(f"{where}: not a MindSpore strategy file: it holds no parameter layout "
                                "(parallel_layout_item)")
    return out


def strategy_to_layouts(layouts: Mapping[str, MindSporeLayout], where: str = "strategy") -> LayoutStrategy:
    """A :class:`LayoutStrategy` of exact parameter names (what :func:`load_layout` returns).

    Raises:
        MetadataError (a ValueError): a parameter uses a slicing our layouts cannot express, or
            its tensor_map does not fit its dev_matrix (names it and why).
    """
    out = LayoutStrategy()
    for name, ms_layout in layouts.items():
        try:
            out[name] = ms_layout.tensor_layout()
        except ValueError as exc:
            raise MetadataError(f"{where}: parameter {name!r}: {exc}") from None
    return out


# ---------------------------------------------------------------------------- writing


def _ms_tensor_map(tl: TensorLayout, name: str) -> list[int | list[int]]:
    if tl.ndim is None:
        raise ValueError(f"{name!r}: its layout was built from placements without ndim; "
                         "build it with ndim= so that the tensor_map is known")
    return [list(v) if isinstance(v, tuple) else v for v in tl.tensor_map]


def _check_writable(strategy: Mapping[str, TensorLayout]) -> None:
    for name, tl in strategy.items():
        if not isinstance(tl, TensorLayout):
            raise TypeError(f"strategy[{name!r}] is a {type(tl).__name__}, expected a TensorLayout")
        if _GLOB.search(name):
            raise ValueError(f"{name!r} is a glob pattern; a MindSpore strategy names each parameter exactly")
        if list(tl.layout.rank_list) != list(range(tl.layout.world_size)):
            raise ValueError(f"{name!r}: its mesh has rank_list {list(tl.layout.rank_list)}; a MindSpore "
                             "strategy numbers ranks row-major from 0")


def _check_json_writable(maps: Mapping[str, list[int | list[int]]], target: str) -> None:
    """Refuse a multi-axis tensor_map in the JSON form: MindSpore cannot read it back.

    MindSpore's JSON reader (``_build_json_strategy``) copies ``tensor_map`` into a single
    ``TensorMap`` of ints, so ``[[1, 0], -1]`` fails there (``TypeError: [1, 0] has type
    list``); only the protobuf form holds one ``TensorMap`` per tensor dim.
    """
    multi = [f"{name!r} (tensor_map {tmap})" for name, tmap in maps.items() if any(isinstance(t, list) for t in tmap)]
    if multi:
        raise ValueError(
            f"{target}: cannot write {', '.join(multi)} in MindSpore's JSON strategy form: a tensor dim split over "
            "several mesh dims has no JSON form MindSpore reads (mindspore.build_searched_strategy expects one list "
            "of ints per parameter); write the protobuf form instead: save_layout(..., format=\"mindspore\")")


def write_strategy(strategy: Mapping[str, TensorLayout], path: str | os.PathLike, *, as_json: bool = False) -> None:
    """Write a strategy as a MindSpore strategy file (protobuf, or JSON with ``as_json``).

    ``mindspore.build_searched_strategy`` and ``mindspore.transform_checkpoints`` read it.
    The file is written atomically (temporary file, then rename).

    Raises:
        ValueError: a name is a glob pattern, a mesh has its own rank order, a layout has
            no ndim, or (JSON only) a tensor dim is split over several mesh dims.
    """
    _check_writable(strategy)
    maps = {name: _ms_tensor_map(tl, name) for name, tl in strategy.items()}
    if as_json:
        _check_json_writable(maps, os.fspath(path))
        doc = {"current_stage": 0,
               "parallel_strategy_item": {"hyper_parallel_layout": {"stage": 0, "parallel_strategy": []}},
               "parallel_layout_item": {
                   name: {"dev_matrix": list(tl.layout.mesh_shape), "tensor_map": maps[name],
                          "param_split_shape": [], "indices_offset": [], "field": 0,
                          "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}
                   for name, tl in strategy.items()}}
        data = json.dumps(doc, indent=1).encode()
    else:
        # ParallelStrategyMap: 1 current_stage, 2 an operator item (MindSpore's tools read the
        # stage from the first), 3 one parallel_layout_item per parameter
        op_item = pw.str_field(1, "hyper_parallel_layout") + pw.len_field(2, pw.int_field(1, 0))
        parts = [pw.int_field(1, 0), pw.len_field(2, op_item)]
        for name, tl in strategy.items():
            tmap = maps[name]
            if any(isinstance(t, list) for t in tmap):
                tensor_maps = [pw.repeated_ints(1, t if isinstance(t, list) else [t]) for t in tmap]
            else:
                tensor_maps = [pw.repeated_ints(1, tmap)]  # type: ignore[arg-type]
            layouts = (pw.len_field(1, pw.repeated_ints(1, list(tl.layout.mesh_shape)))
                       + b"".join(pw.len_field(2, t) for t in tensor_maps)
                       + pw.len_field(3, b"") + pw.len_field(4, b"")
                       + pw.int_field(5, 0) + pw.int_field(6, 0) + pw.int_field(7, 0))
            parts.append(pw.len_field(3, pw.str_field(1, name) + pw.len_field(2, layouts)))
        data = b"".join(parts)
    write_atomically(path, data)
