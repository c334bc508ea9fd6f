"""TopologyMapper: the checkpoint name of each target key, for moving between pipeline splits.

With pipeline parallelism each stage holds some of the model's layers. A model that numbers
its layers from 0 on every stage calls layer 4 of the whole model ``layers.0`` on stage 1; a
checkpoint saved with PP=2 and loaded with PP=1 (or the other way round) needs each target
key mapped to the name the checkpoint uses. HyperParallel gives its load planner a
``TopologyMapper`` for this; here it is accepted by ``StandardPlanner`` (on save and on load:
a target key is stored and looked up under its mapped name) and by ``reshard`` (when it can be
inverted).

Example — stage 1 of a PP=2 model whose stages hold 4 layers each::

    mapper = TopologyMapper(rules=[(r"^layers\\.(\\d+)\\.", lambda m: f"layers.{int(m[1]) + 4}.")])
    load(stage1_sd, ckpt, planner=StandardLoadPlanner(topology_mapper=mapper))
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["TopologyMapper"]

Replacement = str | Callable[[re.Match], str]


class TopologyMapper:
    """Maps target names (fully qualified keys) to checkpoint names.

    Args:
        target_to_checkpoint_fqn: exact names, ``{target: checkpoint}``, or a callable
            ``target -> checkpoint`` (return the name unchanged to keep it).
        rules: ``(regex, replacement)`` pairs tried in order after the exact names; the first
            regex that matches rewrites the name with :func:`re.sub` (the replacement may be a
            string with group references, or a function of the match).

    Names that nothing maps stay as they are.
    """

    def __init__(self, target_to_checkpoint_fqn: Mapping[str, str] | Callable[[str], str] | None = None, *,
                 rules: Sequence[tuple[str, Replacement]] = ()):
        self._fn = target_to_checkpoint_fqn if callable(target_to_checkpoint_fqn) else None
        self._map = dict(target_to_checkpoint_fqn) if isinstance(target_to_checkpoint_fqn, Mapping) else {}
        for k, v in self._map.items():
            if not isinstance(k, str) or not isinstance(v, str) or not k or not v:
                raise ValueError(f"TopologyMapper names must be non-empty strings, found {k!r} -> {v!r}")
        self._rules = [(re.compile(p), r) for p, r in rules]

    def map_fqn(self, fqn: str) -> str:
        """The checkpoint name of target name ``fqn``."""
        if not isinstance(fqn, str) or not fqn:
            raise ValueError(f"a name to map must be a non-empty string, found {fqn!r}")
        if fqn in self._map:
            return self._map[fqn]
        if self._fn is not None:
            out = self._fn(fqn)
            if not isinstance(out, str) or not out:
                raise ValueError(f"TopologyMapper function mapped {fqn!r} to {out!r}, not a name")
            return out
        for pattern, replacement in self._rules:
            if pattern.search(fqn):
                return pattern.sub(replacement, fqn, count=1)
        return fqn

    def __call__(self, fqn: str) -> str:
        return self.map_fqn(fqn)

    def inverse(self) -> dict[str, str]:
        """``{checkpoint: target}`` for a mapper of exact names (functions and rules cannot be
        inverted). Raises ValueError otherwise."""
        if self._fn is not None or self._rules:
            raise ValueError("only a TopologyMapper of exact names can be inverted; give the names as a dict")
        inv: dict[str, Any] = {}
        for t, c in self._map.items():
            if c in inv:
                raise ValueError(f"two target names map to checkpoint name {c!r}: {inv[c]!r} and {t!r}")
            inv[c] = t
        return inv
