"""The options of a save, a load, an async save and a checkpoint manager, as small records.

``save``, ``load``, ``async_save``, ``AsyncCheckpointer.save`` and ``CheckpointManager`` take
the keywords torch DCP and HyperParallel users pass (``process_group=``, ``thread_count=``,
...). Each builds these records once, at its top, and hands them down; the code below the
public call then passes one record where it passed a list of loose values, so a new option
is added in one place and cannot be dropped on the way.

They are frozen (a record is a value: the same options give the same record, and nothing
below the call can change what the caller asked for) and plain data, so they sit in the
bottom layer and every layer can take them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any


@dataclass(frozen=True)
class Coordination:
    """Who takes part in a call and how the ranks agree.

    ``process_group``: the ranks that save or load together (None: the world, or a mesh's ranks);
    ``no_dist``: this process acts alone; ``use_collectives``: False makes a rank-local checkpoint;
    ``coordinator_rank``: the rank that plans globally and commits; ``timeout``: the bound on every
    cross-rank exchange and every call to an object store (seconds or a timedelta; None: 30 min).
    """

    process_group: Any = None
    no_dist: bool = False
    use_collectives: bool = True
    coordinator_rank: int = 0
    timeout: timedelta | float | None = None


@dataclass(frozen=True)
class WriteOptions:
    """How a save writes: data files (and threads) per rank, fsync before the commit, pickle
    permitted for values only pickle can store, and the JSON-able ``user_metadata`` recorded."""

    thread_count: int = 1
    sync_files: bool = True
    allow_pickle: bool = False
    user_metadata: dict[str, Any] | None = None


@dataclass(frozen=True)
class ReadOptions:
    """How a load reads: reader threads per rank, checksum verification, pickle permitted,
    and ``strict`` (True, False, or a policy name) for keys the checkpoint lacks."""

    thread_count: int = 4
    verify: bool = True
    allow_pickle: bool = False
    strict: bool | str = True


@dataclass(frozen=True)
class BroadcastOptions:
    """HyperParallel's read-once-and-broadcast load of replicated tensors (None: the default)."""

    replicated_tensors: bool | None = None
    groups: dict[tuple[int, ...], Any] | None = None
    batch_bytes: int | None = None
    from_minimum_rank: bool | None = None


@dataclass(frozen=True)
class AsyncOptions:
    """How an async save stages: ``staging`` ("eager" or "streamed"), the ``callback`` run on
    completion, the gloo side group for its exchanges, and pinned staging memory (None: when
    an accelerator is present)."""

    staging: str = "eager"
    callback: Callable[..., Any] | None = None
    use_gloo: bool = True
    pin_memory: bool | None = None


@dataclass(frozen=True)
class RetentionOptions:
    """Which steps a checkpoint manager saves and keeps."""

    save_interval_steps: int = 1
    keep_latest: int | None = None
    keep_every_steps: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"


@dataclass(frozen=True)
class IncrementalOptions:
    """Incremental steps: ``enabled``, how an unchanged chunk is told (``check``) and how often
    every chunk is hashed again regardless (``rehash_every``)."""

    enabled: bool = False
    check: str = "content"
    rehash_every: int | None = None


@dataclass(frozen=True)
class LocalTierOptions:
    """A checkpoint manager's node-local tier: its directory, interval and depth, its
    replication to peer nodes, and whether its shard files are fsynced (off: the tier survives
    process restarts, and checksums catch what a machine crash lost)."""

    local_dir: Any = None
    interval_steps: int | None = None
    keep: int = 2
    replicas: int = 2
    node_rank: int | None = None
    replication_timeout: float = 60.0
    sync_files: bool = False


def pick(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """``cls`` built from the keywords of ``values`` named like its fields (after ``prefix``).

    The public calls collect their keywords once (``locals()``) and build each record with this,
    so the list of fields is written once, in the record.
    """
    return cls(**{f.name: values[prefix + f.name] for f in fields(cls) if prefix + f.name in values})


def as_keywords(*records: Any) -> dict[str, Any]:
    """The fields of ``records`` as keywords, for a call that takes them loose (the engine's
    ``save``/``load``): a field added to a record reaches the call without another edit, and
    one the call does not take fails loudly instead of being dropped.

    The values themselves, not copies (unlike :func:`dataclasses.asdict`): a process group
    must stay the same object.
    """
    out: dict[str, Any] = {}
    for record in records:
        for f in fields(record):
            if f.name in out:
                raise ValueError(f"as_keywords: {f.name!r} is a field of more than one record")
            out[f.name] = getattr(record, f.name)
    return out
