"""TopologyMapper: renaming keys between pipeline splits (and any other renaming).

With pipeline parallelism each stage holds some of the model's layers. A model that numbers
its layers from 0 on every stage calls layer 4 of the whole model ``layers.0`` on stage 1; a
checkpoint saved with PP=2 and loaded with PP=1 (or the other way round) needs each key
mapped to the name the other side uses. A mapper is one function on names, given as a
:class:`TopologyMapper`, a ``{name: name}`` mapping, a callable, or ``(regex, replacement)``
rules (:func:`as_topology_mapper` turns each into a :class:`TopologyMapper`). Where it is
accepted, and which way it maps:

- ``StandardPlanner(topology_mapper=...)`` on load: the target's name -> the checkpoint's
  name (the model asks for ``layers.0.weight``; read ``layers.4.weight``).
- ``StandardPlanner(topology_mapper=...)`` on save: the state dict's name -> the name
  stored (save stage-local names under whole-model names).
- ``reshard(..., topology_mapper=...)`` and ``offline_transform(..., topology_mapper=...)``:
  the source checkpoint's name -> the new checkpoint's name. An offline rewrite walks the
  keys it has, so it maps them forward; a load mapper of exact names turns around with
  :meth:`TopologyMapper.inverse`.

Names nothing maps stay as they are; two names mapped to one is an error naming both.

HyperParallel's form, ``TopologyMapper(target_to_checkpoint_fqn={...})``, is the same class; its
:meth:`TopologyMapper.compute_required_shards` plans one tensor's reads in torch DCP's
``ReadItem`` terms (which are HyperParallel's): for each chunk a rank holds, the overlap with every
saved chunk of the mapped name.

Example — stage 1 of a PP=2 model whose stages hold 4 layers each::

    mapper = TopologyMapper(rules=[(r"^layers\\.(\\d+)\\.", lambda m: f"layers.{int(m[1]) + 4}.")])
    load(stage1_sd, ckpt, planner=StandardLoadPlanner(topology_mapper=mapper))
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ..base.box import Box, uncovered

__all__ = ["TopologyMapper", "MapperLike", "as_topology_mapper", "rename_keys"]

Replacement = str | Callable[[re.Match], str]


class TopologyMapper:
    """Maps names (fully qualified keys) to names: on load, target names to checkpoint names.

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

    def compute_required_shards(self, target_fqn: str, checkpoint_md: Any,
                                local_chunks: Sequence[Any]) -> list[ReadItem]:
        """The reads that fill this rank's chunks of ``target_fqn`` from the checkpoint.

        Args:
            target_fqn: the name on the load side; the reads come from :meth:`map_fqn` of it.
            checkpoint_md: the saved tensor's record (``TensorStorageMetadata``): its ``chunks``,
                each with global ``offsets`` and ``sizes``.
            local_chunks: the chunks this rank holds (``offsets``/``sizes`` in the global tensor).

        Returns:
            One torch ``ReadItem`` (type TENSOR) per overlap of a local chunk ``i`` with a saved
            chunk ``j``, local chunks in order, then saved chunks in order: ``dest_index`` is
            ``MetadataIndex(target_fqn, local offsets, i)`` and ``dest_offsets`` the overlap's
            start inside the local chunk; ``storage_index`` is ``MetadataIndex(checkpoint name,
            saved offsets, j)`` and ``storage_offsets`` its start inside the saved chunk;
            ``lengths`` its sizes. Empty when there are no local or no saved chunks.

        Raises:
            ValueError: ``target_fqn`` is not a non-empty string; a local chunk meets no saved
                chunk ("no intersection"), or the saved chunks leave part of it unread ("not
                fully covered": loading would leave that part as it was). Messages name the
                tensor, the chunk and what is missing.

        Example — a checkpoint saved with TP=4, rank 0 of TP=2 needing rows ``[0, 4)``::

            items = TopologyMapper().compute_required_shards("w", md, [ChunkStorageMetadata((0,), (4,))])
            # two items: rows [0, 2) from saved chunk 0 and [2, 4) from saved chunk 1
        """
        if not isinstance(target_fqn, str) or not target_fqn:
            raise ValueError(f"compute_required_shards needs the target name as a non-empty string, "
                             f"found {target_fqn!r}")
        saved = list(getattr(checkpoint_md, "chunks", None) or [])
        if not local_chunks or not saved:
            return []
        checkpoint_fqn = self.map_fqn(target_fqn)
        saved_boxes = [Box(tuple(c.offsets), tuple(c.sizes)) for c in saved]
        items: list[ReadItem] = []
        for i, chunk in enumerate(local_chunks):
            local = Box(tuple(chunk.offsets), tuple(chunk.sizes))
            overlaps: list[Box] = []
            for j, box in enumerate(saved_boxes):
                if box.ndim != local.ndim:
                    raise ValueError(f"{target_fqn!r}: local chunk {i} {local} has {local.ndim} dims, saved chunk "
                                     f"{j} {box} of {checkpoint_fqn!r} has {box.ndim}; the checkpoint holds a "
                                     "tensor of another shape under that name")
                cut = local.intersect(box)
                if cut is None:
                    continue
                overlaps.append(cut)
                items.append(ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(target_fqn, local.offsets, i),
                    dest_offsets=_relative(cut, local),
                    storage_index=MetadataIndex(checkpoint_fqn, box.offsets, j),
                    storage_offsets=_relative(cut, box),
                    lengths=cut.sizes,
                ))
            if not overlaps and local.numel:
                raise ValueError(f"{target_fqn!r}: local chunk {i} {local} has no intersection with any saved chunk "
                                 f"of {checkpoint_fqn!r} ({len(saved_boxes)} saved); check the mapping and the "
                                 "tensor's global shape")
            left = uncovered(local, overlaps)
            if left:
                missing = sum(math.prod(b.sizes) for b in left)
                raise ValueError(f"{target_fqn!r}: local chunk {i} {local} is not fully covered by the saved chunks "
                                 f"of {checkpoint_fqn!r}: {missing} elements in {', '.join(map(str, left[:4]))}"
                                 f"{' ...' if len(left) > 4 else ''} were not saved")
        return items

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


def _relative(inner: Box, outer: Box) -> tuple[int, ...]:
    """Where ``inner`` starts inside ``outer``."""
    return tuple(a - b for a, b in zip(inner.offsets, outer.offsets, strict=True))


# What ``topology_mapper=`` accepts (see as_topology_mapper).
MapperLike = TopologyMapper | Mapping[str, str] | Callable[[str], str] | Sequence[tuple[str, Replacement]]


def as_topology_mapper(value: Any) -> Any:
    """A mapper (anything with ``map_fqn``) from what users pass as ``topology_mapper=``.

    A :class:`TopologyMapper` or any object with ``map_fqn`` passes through; a
    ``{name: name}`` mapping or a callable becomes ``TopologyMapper(value)``; a list of
    ``(regex, replacement)`` pairs becomes ``TopologyMapper(rules=value)``; None stays None.

    Raises:
        TypeError: anything else.
    """
    if value is None or callable(getattr(value, "map_fqn", None)):
        return value
    if isinstance(value, Mapping) or callable(value):
        return TopologyMapper(value)
    if isinstance(value, (list, tuple)) and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in value):
        return TopologyMapper(rules=[tuple(r) for r in value])
    raise TypeError(f"topology_mapper must be a TopologyMapper, a {{name: name}} mapping, a callable or a list of "
                    f"(regex, replacement) rules, found {type(value).__name__}")


def rename_keys(keys: Iterable[str], mapper: Any, what: str = "topology_mapper") -> dict[str, str]:
    """``{key: mapped key}`` for every key, in order.

    Raises:
        ValueError: two keys map to one name (the message names both and the name).
    """
    out: dict[str, str] = {}
    taken: dict[str, str] = {}
    for key in keys:
        new = mapper.map_fqn(key)
        if not isinstance(new, str) or not new:
            raise ValueError(f"{what} mapped {key!r} to {new!r}, not a name")
        first = taken.setdefault(new, key)
        if first != key:
            raise ValueError(f"{what} maps two keys to {new!r}: {first!r} and {key!r}; "
                             "each key needs a name of its own")
        out[key] = new
    return out
