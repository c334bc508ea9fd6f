"""Plain values in ``.metadata``: which Python values are plain data, and their typed JSON.

A non-tensor value of a state dict (a step, a config, ``user_metadata``) is kept in
``.metadata`` as JSON with type tags, so that it comes back exactly as saved: an int stays
an int, a tuple a tuple, a dict with int keys such a dict, ``nan`` a float. This module says
which values qualify (:func:`plain_value_problem`, :func:`is_json_value`, with bounded cost
for any value, hostile or not), names the culprit when one does not (:func:`json_culprit`,
:func:`check_user_metadata`), and encodes and decodes them (:func:`encode_value`,
:func:`decode_value`), as well as the parts of an entry's path in the nested state dict
(:func:`encode_path_part`, :func:`decode_path_part`). It knows nothing of entries, files or
tensors: the schema is :mod:`.metadata`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from ..base.limits import MAX_VALUE_DEPTH, MAX_VALUE_ITEMS

_LEAVES = (bool, int, float, str)


class ValueFault(NamedTuple):
    """Why a value is not plain data: ``kind`` is ``"type"`` (``culprit`` is a value of a type
    JSON cannot hold), ``"key"`` (``culprit`` is a dict key other than str or int) or ``"shape"``
    (``culprit`` is a container that holds itself, nests too deep or holds too many items);
    ``path`` holds the keys/indices leading to it."""

    kind: str
    path: tuple[Any, ...]
    culprit: Any
    why: str


class _Fault(Exception):
    def __init__(self, kind: str, culprit: Any, why: str):
        super().__init__(why)
        self.fault = ValueFault(kind, (), culprit, why)
        self.path: list[Any] = []  # keys from the culprit up, added as the walk unwinds


def plain_value_problem(v: Any) -> ValueFault | None:
    """None when ``v`` round-trips exactly through :func:`encode_value`; else its first fault.

    The walk stops at the first fault (a reference cycle, nesting deeper than MAX_VALUE_DEPTH,
    more than MAX_VALUE_ITEMS items, a type or key JSON cannot hold), so any value, hostile or
    not, costs at most MAX_VALUE_ITEMS steps and MAX_VALUE_DEPTH frames.
    """
    items = 1
    on_path: set[int] = set()  # ids of the containers being walked: one met again is a cycle

    def walk(x: Any, depth: int) -> None:
        nonlocal items
        t = type(x)
        if t is dict:
            for k in x:
                if type(k) is not str and type(k) is not int:
                    raise _Fault("key", k, f"its dict key {k!r:.80} is a {type(k).__name__}, not a str or int")
            members: Any = x.items()
        elif t is list or t is tuple:
            members = enumerate(x)
        elif x is None or t in _LEAVES:
            return
        else:
            raise _Fault("type", x, f"a {t.__module__}.{t.__qualname__} is not plain data")
        if id(x) in on_path:
            raise _Fault("shape", x, "it contains itself (a reference cycle)")
        if depth >= MAX_VALUE_DEPTH:
            raise _Fault("shape", x, f"it nests lists, tuples or dicts more than {MAX_VALUE_DEPTH} deep")
        items += len(x)
        if items > MAX_VALUE_ITEMS:
            raise _Fault("shape", x, f"it holds more than {MAX_VALUE_ITEMS} items as JSON writes them (a list or "
                                     "dict used in several places counts at each use)")
        on_path.add(id(x))
        for k, m in members:
            if m is not None and type(m) not in _LEAVES:
                try:
                    walk(m, depth + 1)
                except _Fault as fault:
                    fault.path.append(k)
                    raise
        on_path.discard(id(x))

    try:
        walk(v, 0)
    except _Fault as fault:
        return fault.fault._replace(path=tuple(reversed(fault.path)))
    return None


def is_json_value(v: Any) -> bool:
    """True when ``v`` round-trips exactly through :func:`encode_value` (within the bounds of
    :func:`plain_value_problem`: no cycles, nesting and size bounded)."""
    if v is None or type(v) in _LEAVES:
        return True
    return plain_value_problem(v) is None


def json_culprit(value: Any, where: str, item: Callable[[str, Any], str] | None = None) -> tuple[str, Any] | None:
    """The first value inside ``value`` that :func:`is_json_value` refuses, and where it sits
    (``item(where, key)`` names a member; default ``where.key``), so that an error names it
    rather than its container; a dict key of another type than str or int counts. None when
    everything is plain."""
    item = item or (lambda w, k: f"{w}.{k}")
    found = plain_value_problem(value)
    if found is None:
        return None
    for k in found.path:
        where = item(where, k)
    if found.kind == "key":
        return f"{where} (its key {found.culprit!r})", found.culprit
    if found.kind == "type":  # the culprit's type says what is wrong
        return where, found.culprit
    return f"{where} ({found.why})", found.culprit


def check_user_metadata(value: Any) -> None:
    """Raise ValueError naming the first value of ``user_metadata`` that is not plain JSON-able
    data (:func:`is_json_value`), e.g. ``user_metadata['loss'] is a numpy.float32``."""
    found = (json_culprit(value, "user_metadata", lambda w, k: f"{w}[{k!r}]") if type(value) is dict
             else ("user_metadata", value))
    if found is not None:
        where, bad = found
        raise ValueError(f"{where} is a {type(bad).__module__}.{type(bad).__qualname__}: user_metadata must be a dict "
                         "of plain JSON-able values (None, bool, int, float, str, lists, tuples, dicts with str or "
                         "int keys); convert it first (e.g. float(x) for a numpy scalar)")


def encode_value(v: Any) -> Any:
    """Python value -> JSON with type tags; only call when :func:`is_json_value` holds."""
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return v if math.isfinite(v) else {"$float": repr(v)}
    if t is list:
        return [encode_value(x) for x in v]
    if t is tuple:
        return {"$tuple": [encode_value(x) for x in v]}
    if t is dict:
        return {"$dict": [[k, encode_value(x)] for k, x in v.items()]}
    raise TypeError(f"cannot encode {t.__name__}")


def decode_value(v: Any) -> Any:
    """JSON with type tags -> the Python value :func:`encode_value` took; raises ValueError."""
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is list:
        return [decode_value(x) for x in v]
    if type(v) is dict and len(v) == 1:
        (tag, inner), = v.items()
        if tag == "$tuple" and type(inner) is list:
            return tuple(decode_value(x) for x in inner)
        if tag == "$dict" and type(inner) is list:
            out = {}
            for pair in inner:
                if type(pair) is not list or len(pair) != 2 or type(pair[0]) not in (str, int):
                    raise ValueError(f"bad dict item {pair!r:.80}")
                out[pair[0]] = decode_value(pair[1])
            return out
        if tag == "$float" and inner in ("nan", "inf", "-inf"):
            return float(inner)
    raise ValueError(f"unrecognised value {v!r:.80}")


def encode_path_part(p: Any) -> Any:
    """A path component as ``.metadata`` writes it: a dict key as itself, ``(tag, n)`` (``"i"``
    a list index, ``"t"`` a tuple index, ``"k"`` an int dict key) as ``{tag: n}``."""
    if isinstance(p, str):
        return p
    tag, n = p
    return {tag: n}


def decode_path_part(p: Any) -> Any:
    """The inverse of :func:`encode_path_part`; raises ValueError for anything else."""
    if isinstance(p, str):
        return p
    if isinstance(p, dict) and len(p) == 1:
        (tag, n), = p.items()
        if tag in ("i", "t", "k") and type(n) is int:
            return (tag, n)
    raise ValueError(f"bad path component {p!r}")
