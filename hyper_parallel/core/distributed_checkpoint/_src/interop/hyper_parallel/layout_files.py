"""Layout files: a strategy stored as our JSON, or as a MindSpore strategy file.

:func:`save_layout` writes a strategy (meshes listed once, rules in match order) and
:func:`load_layout` reads one back, telling the kind by content: our JSON
(``"format": "hyper-parallel-layout"``) or MindSpore's dialect, whose bytes
``mindspore_strategy.py`` reads and writes. HyperParallel's plain layout maps
(``{rank: {name: info}}``, see :func:`...sharding.strategy.rank_layout_map`) are written and read back as
the JSON they are. Not here: what a layout is (``layout.py``) or how
a name finds its layout (``strategy.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import IO, Any

from ...base.atomic_file import write_atomically
from ...sharding.layout import Layout, TensorLayout
from ...sharding.strategy import LayoutStrategy
from ..mindspore.strategy import NotAStrategyError, parse_strategy, strategy_to_layouts, write_strategy

__all__ = ["save_layout", "load_layout", "LAYOUT_FORMAT", "LAYOUT_VERSION"]

LAYOUT_FORMAT = "hyper-parallel-layout"
LAYOUT_VERSION = 1


def save_layout(strategy: Mapping[str, TensorLayout], file: str | os.PathLike | IO[str], *,
                format: str = "hyper-parallel") -> None:
    """Write a strategy as JSON (meshes listed once, rules in match order).

    A mapping none of whose values is a :class:`TensorLayout` (HyperParallel's plain layout
    maps: dicts, lists, numbers, None) is written as that JSON itself, as HyperParallel does;
    :func:`load_layout` gives it back as the same dict.

    Args:
        strategy: ``{name or glob pattern: TensorLayout}``; order is match order. Or a plain map.
        file: a path (written atomically: temporary file, then rename; missing parent
            directories are made) or a text file object.
        format: ``"hyper-parallel"`` (this JSON), ``"mindspore"`` (a MindSpore strategy file,
            protobuf, as ``mindspore.transform_checkpoints`` reads) or ``"mindspore-json"``
            (its JSON form). MindSpore's forms need a path, exact parameter names (no globs)
            and meshes in rank order.

    Raises:
        TypeError: some values are :class:`TensorLayout` and some are not (names the first that is
            not), or a plain map holds a value JSON cannot.
        ValueError: an unknown format, or a strategy a MindSpore file cannot hold.

    Example::

        save_layout({"*.weight": Layout((4,), ("tp",))("tp", "None")}, "tp4.json")
        save_layout({"fc.weight": Layout((2,), ("tp",))("tp", "None")}, "strategy.ckpt", format="mindspore")
    """
    if format in ("mindspore", "mindspore-json"):
        if hasattr(file, "write"):
            raise ValueError("a MindSpore strategy is written to a path, not a file object")
        write_strategy(strategy, file, as_json=format == "mindspore-json")  # type: ignore[arg-type]
        return
    if format != "hyper-parallel":
        raise ValueError(f"format must be 'hyper-parallel', 'mindspore' or 'mindspore-json', found {format!r}")
    if strategy and not any(isinstance(v, TensorLayout) for v in strategy.values()):
        _write(file, json.dumps(dict(strategy), ensure_ascii=False))
        return
    meshes: list[Layout] = []
    rules = []
    for name, tl in strategy.items():
        if not isinstance(tl, TensorLayout):
            raise TypeError(f"strategy[{name!r}] is a {type(tl).__name__}, expected a TensorLayout")
        if tl.layout not in meshes:
            meshes.append(tl.layout)
        rule: dict[str, Any] = {"name": name, "mesh": meshes.index(tl.layout)}
        d = tl.to_dict()
        for k in ("tensor_map", "placements"):
            if k in d:
                rule[k] = d[k]
        rules.append(rule)
    doc = {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION,
           "meshes": [m.to_dict() for m in meshes], "layouts": rules}
    _write(file, json.dumps(doc, indent=1))


def _write(file: str | os.PathLike | IO[str], text: str) -> None:
    if hasattr(file, "write"):
        file.write(text)
        return
    parent = os.path.dirname(os.fspath(file))
    if parent:
        os.makedirs(parent, exist_ok=True)
    write_atomically(file, text)


def load_layout(file: str | os.PathLike | IO[str] | IO[bytes]) -> LayoutStrategy | dict[str, Any]:
    """Read a strategy written by :func:`save_layout`, or a MindSpore strategy file.

    The kind is told by content: our JSON (``"format": "hyper-parallel-layout"``), or the
    strategy file a MindSpore job saves (protobuf ``ParallelStrategyMap``, or its JSON form
    with ``parallel_layout_item``), whose parameters come back by exact name on meshes with
    dims ``dim0``, ``dim1``, ... (see ``mindspore_strategy.py``). Any other JSON object without a
    ``format`` field (HyperParallel's plain layout map, as :func:`save_layout` wrote it) comes
    back as that dict.

    Raises:
        FileNotFoundError: no such file (the message names it).
        ValueError: the file is none of those, of a newer version, or malformed (the
            message names the file and the rule).

    Example::

        strategy = load_layout("tp4.json")
        strategy.match("layers.3.wq.weight")
        load_layout("strategy.ckpt")          # a MindSpore job's strategy file
    """
    if hasattr(file, "read"):
        where, raw = str(getattr(file, "name", "<stream>")), file.read()
    else:
        where = os.fspath(file)
        with open(where, "rb") as f:
            raw = f.read()
    data = raw.encode() if isinstance(raw, str) else raw
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        doc = None
        json_error = exc if isinstance(exc, ValueError) else "nested too deep"
    if doc is None or (isinstance(doc, dict) and "parallel_layout_item" in doc):
        try:
            layouts = parse_strategy(data, where)
        except NotAStrategyError as ms_exc:  # a strategy with a bad layout says so itself
            if doc is None:
                why = str(ms_exc).removeprefix(f"{where}: ")
                raise ValueError(f"{where}: not a layout file: neither JSON ({json_error}) nor a MindSpore "
                                 f"strategy ({why})") from None
            raise
        return strategy_to_layouts(layouts, where)
    if isinstance(doc, dict) and "format" not in doc:
        return doc  # HyperParallel's plain layout map
    if not isinstance(doc, dict) or doc.get("format") != LAYOUT_FORMAT:
        raise ValueError(f"{where}: format is {doc.get('format') if isinstance(doc, dict) else None!r}, "
                         f"expected {LAYOUT_FORMAT!r}")
    version = doc.get("version")
    if type(version) is not int or not 1 <= version <= LAYOUT_VERSION:
        raise ValueError(f"{where}: layout file version {version!r} is not one this hyper-parallel reads "
                         f"(1..{LAYOUT_VERSION})")
    try:
        meshes = [Layout.from_dict(m) for m in doc.get("meshes", [])]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: bad mesh: {exc}") from None
    out = LayoutStrategy()
    for i, rule in enumerate(doc.get("layouts", [])):
        try:
            name, mesh = rule["name"], meshes[rule["mesh"]]
            if "tensor_map" in rule:
                out[name] = TensorLayout.from_tensor_map(mesh, rule["tensor_map"])
            else:
                out[name] = TensorLayout.from_placements(mesh, rule["placements"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: layout rule {i} ({rule!r:.120}) is malformed: {exc}") from None
    return out
