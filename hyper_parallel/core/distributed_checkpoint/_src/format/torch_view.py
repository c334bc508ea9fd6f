"""Our checkpoint document seen as torch DCP's ``Metadata``, built lazily, one key at a time.

torch DCP code (and HyperParallel's) reads a checkpoint's description as a ``Metadata``:
``reader.read_metadata().state_dict_metadata[key].size``, a planner walking every chunk of the
keys it loads, ``planner_data`` for nesting. Our document (:mod:`.metadata`) stores chunk
geometry in columns (a grid derived from the layout, or a table), so that a checkpoint of
thousands of ranks is parsed in milliseconds; listing every chunk of every key as torch records
would bring back the per-chunk cost the columns removed. :class:`TorchView` is a ``Metadata``
(a subclass of torch's, via :mod:`.records`) whose three maps build an entry the first time it
is asked for, and keep it:

- ``state_dict_metadata``: key -> torch's ``TensorStorageMetadata`` (size, dtype, the saved
  chunks' offsets and sizes) or ``BytesStorageMetadata``;
- ``planner_data``: key -> the key's path in the nested state dict (torch's flatten mapping);
- ``storage_data``: ``MetadataIndex(key, chunk offsets)`` -> a :class:`~.chunks.ChunkRef`
  (the chunk's box and the data files that may hold it; byte ranges come from the files'
  indexes at read time).

Asking for one key costs that key's chunks; iterating a map costs them all. Every other
attribute (``entries``, ``save_id``, ``world_size``, ``files``, ...) is the document's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

from . import chunks as chunk_store
from . import metadata as md
from .records import CURRENT_CHECKPOINT_VERSION, Metadata, MetadataIndex

__all__ = ["TorchView", "object_leaves", "leaf_value"]


def _terminal(value: Any) -> bool:
    """torch's rule for where flattening stops: a mapping is always entered; a list or tuple is
    a leaf unless it holds a mapping or a non-leaf list somewhere."""
    if isinstance(value, Mapping):
        return False
    if isinstance(value, (list, tuple)):
        return all(_terminal(v) for v in value)
    return True


def _walk(path: tuple[Any, ...], value: Any, out: dict[str, tuple[Any, ...]], key: str) -> None:
    if _terminal(value):
        out[".".join(str(p) for p in path)] = (key, path)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _walk(path + (str(k),), v, out, key)
    else:
        for i, v in enumerate(value):
            _walk(path + (i,), v, out, key)


def object_leaves(document: md.Metadata) -> dict[str, tuple[str, tuple[Any, ...]]]:
    """Where torch's flattening would put the parts of our whole-value entries: a plain value
    saved as one JSON entry (``"cfg": {"lr": 0.5}``) is, to torch, keys ``"cfg.lr"``...

    Returns flattened key -> (our entry's key, the path from the state dict's root), for the
    entries whose value torch flattens further (dicts, lists holding dicts); computed once.
    """
    got = document.__dict__.get("_torch_leaves")
    if got is None:
        got = {}
        for key, entry in document.entries.items():
            if entry.kind == "object" and not _terminal(entry.value):
                _walk(tuple(entry.path), entry.value, got, key)
        document.__dict__["_torch_leaves"] = got
    return got


def leaf_value(document: md.Metadata, fqn: str) -> tuple[md.Entry, Any] | None:
    """(our entry, the value) of a key torch's flattening made inside one of our whole-value
    entries, or None when ``fqn`` is not such a key."""
    found = object_leaves(document).get(fqn)
    if found is None:
        return None
    key, path = found
    entry = document.entries[key]
    value = entry.value
    for part in path[len(entry.path):]:
        value = value[part]
    return entry, value


class _TorchKeys(Mapping):
    """The keys torch sees: ours, with whole-value entries flattened as torch would."""

    def __init__(self, document: md.Metadata) -> None:
        self._doc = document

    def __contains__(self, key: object) -> bool:
        leaves = object_leaves(self._doc)
        return key in leaves or (key in self._doc.entries and not self._split(key))

    def _split(self, key: Any) -> bool:
        entry = self._doc.entries.get(key)
        return entry is not None and entry.kind == "object" and not _terminal(entry.value)

    def __iter__(self) -> Iterator[str]:
        for key in self._doc.entries:
            if not self._split(key):
                yield key
        yield from object_leaves(self._doc)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return key


class _LazyMap(MutableMapping):
    """key -> value, computed by ``build(key)`` the first time it is asked for; assignments and
    deletions (torch code sometimes edits a loaded ``Metadata``) are kept."""

    def __init__(self, keys: Any, build: Any) -> None:
        self._keys = keys  # the document's entries (live: no copy of a large key list)
        self._build = build
        self._cache: dict[Any, Any] = {}
        self._removed: set[Any] = set()
        self._added: dict[Any, Any] = {}

    def __getitem__(self, key: Any) -> Any:
        if key in self._added:
            return self._added[key]
        if key in self._removed or key not in self._keys:
            raise KeyError(key)
        if key not in self._cache:
            self._cache[key] = self._build(key)
        return self._cache[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._removed.discard(key)
        self._added[key] = value

    def __delitem__(self, key: Any) -> None:
        if key in self._added:
            del self._added[key]
        elif key in self._keys and key not in self._removed:
            self._removed.add(key)
        else:
            raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return key in self._added or (key in self._keys and key not in self._removed)

    def __iter__(self) -> Iterator[Any]:
        yield from (k for k in self._keys if k not in self._removed and k not in self._added)
        yield from self._added

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"<{len(self)} keys, built on access>"


class _ChunkLocations(MutableMapping):
    """``MetadataIndex(key, chunk offsets)`` -> the chunk's :class:`~.chunks.ChunkRef`, one key's
    chunks listed the first time an index of that key is asked for."""

    def __init__(self, meta: md.Metadata) -> None:
        self._meta = meta
        self._by_key: dict[str, dict[MetadataIndex, Any]] = {}
        self._added: dict[Any, Any] = {}

    def _of(self, key: str) -> dict[MetadataIndex, Any]:
        got = self._by_key.get(key)
        if got is None:
            entry = self._meta.entries.get(key)
            got = {}
            if entry is not None and entry.kind in ("tensor", "ndarray"):
                for ref in chunk_store.all_chunks(self._meta, entry):
                    got.setdefault(MetadataIndex(key, ref.box.offsets), ref)
            self._by_key[key] = got
        return got

    def __getitem__(self, index: Any) -> Any:
        if index in self._added:
            return self._added[index]
        return self._of(index.fqn)[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        self._added[index] = value

    def __delitem__(self, index: Any) -> None:
        if index in self._added:
            del self._added[index]
        else:
            self._of(index.fqn).pop(index)

    def __iter__(self) -> Iterator[Any]:
        for key in self._meta.entries:
            yield from self._of(key)
        yield from self._added

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return "<chunk locations, listed per key on access>"


class TorchView(Metadata):
    """A committed checkpoint's description as torch DCP's ``Metadata`` (see the module docstring).

    ``document`` is our own record (:class:`.metadata.Metadata`); its attributes are reachable
    on the view too (``view.entries``, ``view.save_id``, ``view.world_size``). ``version`` is the
    record version of the ecosystem asking: HyperParallel's ("2.0", the default) or torch DCP's
    (``"1.0.0"``, what torch's writer stamps; torch's readers of ours pass it); our document's
    format version is ``document.version``.
    """

    def __init__(self, document: md.Metadata, checkpoint_id: Any = None,
                 version: str = CURRENT_CHECKPOINT_VERSION) -> None:
        self.__dict__["document"] = document
        keys = _TorchKeys(document)
        super().__init__(
            state_dict_metadata=_LazyMap(keys, lambda k: md.storage_metadata_of(document.entries[k])
                                         if k in document.entries else BytesStorageMetadata()),
            planner_data=_LazyMap(keys, lambda k: tuple(document.entries[k].path) if k in document.entries
                                  else object_leaves(document)[k][1]),
            storage_data=_ChunkLocations(document),
            storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=document.save_id),
            version=version,
        )

    def __getattr__(self, name: str) -> Any:
        # only called for what the view itself lacks: the document's own fields
        if name.startswith("__") or "document" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["document"], name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.document, self.storage_meta.checkpoint_id if self.storage_meta else None,
                             self.version))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TorchView):
            return self.document is other.document
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a mutable record, like torch's

    def __repr__(self) -> str:
        d = self.document
        return (f"TorchView({len(d.entries)} keys, save_id={d.save_id!r}, world_size={d.world_size}, "
                f"format version {d.version})")
