"""Upgrading checkpoint metadata records written by older versions of HyperParallel's format.

HyperParallel's DCP stamps its pickled metadata record with a ``version`` string ("2.0" today);
records pickled before the stamp existed carry none, and count as "1.0". A reader hands what it
unpickled to :func:`migrate_metadata`, which applies one rule per step ("1.0" -> "2.0" -> ...)
until the record is current, so every later step reads one shape only. A version no rule knows
(older than the first rule, or newer than this code) fails at once with a ValueError naming the
version, because guessing at an unknown layout would load wrong data silently.

The records this accepts are the ones the package serves at HyperParallel's ``metadata.Metadata``
path: our format record (:class:`.metadata.Metadata`, whose ``version`` is the format's integer)
and torch DCP's ``Metadata`` (HyperParallel's record has torch's fields). Not here: our own
``.metadata`` JSON versions, which :mod:`.metadata` upgrades while it parses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata as TorchMetadata

from .metadata import Metadata
from .records import CURRENT_CHECKPOINT_VERSION

__all__ = ["CURRENT_CHECKPOINT_VERSION", "MIGRATION_RULES", "MigrationRule", "migrate_metadata",
           "effective_version", "metadata_record_types"]

# A record pickled before the version stamp existed has no ``version`` of its own.
UNSTAMPED_VERSION = "1.0"

MigrationRule = Callable[[Any], Any]


def metadata_record_types() -> tuple[type, ...]:
    """The classes a migration may take and must return (see the module docstring)."""
    return (Metadata, TorchMetadata)


def effective_version(metadata: Any) -> str:
    """The version of ``metadata`` as HyperParallel's DCP writes it ("1.0", "2.0", ...).

    Only the instance's own ``version`` counts: a record unpickled from before the field
    existed has none, and the class default must not hide that (it is "1.0"). ``None`` (torch's
    default) also means unstamped; our format's integer ``2`` reads as "2.0".
    """
    version = vars(metadata).get("version")
    if version is None:
        return UNSTAMPED_VERSION
    if isinstance(version, int) and not isinstance(version, bool):
        return f"{version}.0"
    return str(version)


def _stamp(metadata: Any, version: str) -> None:
    """Set the record's version in the form it keeps (our format record keeps an integer)."""
    current = vars(metadata).get("version")
    if isinstance(current, int) and not isinstance(current, bool):
        metadata.version = int(version.split(".")[0])
    else:
        metadata.version = version


def _migrate_1_0_to_2_0(metadata: Any) -> Any:
    """1.0 -> 2.0: the layouts are the same; 2.0 only stamps the version on the record."""
    _stamp(metadata, "2.0")
    return metadata


# version -> the rule taking a record of that version one step on. Each rule must return a
# metadata record whose version differs from the one it was given.
MIGRATION_RULES: dict[str, MigrationRule] = {UNSTAMPED_VERSION: _migrate_1_0_to_2_0}


def _version_key(version: str) -> tuple[int, ...] | None:
    """``"2.10"`` -> ``(2, 10)`` for ordering; None when the version is not dotted integers."""
    try:
        return tuple(int(part) for part in version.split("."))
    except ValueError:
        return None


def migrate_metadata(metadata: Any, rules: Mapping[str, MigrationRule] | None = None) -> Any:
    """Bring a metadata record up to :data:`CURRENT_CHECKPOINT_VERSION`, one rule at a time.

    Args:
        metadata: a record read from an older checkpoint (see :func:`metadata_record_types`).
        rules: ``{version: rule}``; :data:`MIGRATION_RULES` when None. Read once per call, so a
            caller may swap the table between calls.

    Returns:
        The record itself when it is already current, else what the last rule returned.

    Raises:
        TypeError: ``metadata`` is not a metadata record.
        ValueError: the version has no rule (unknown, or newer than this code); a rule left the
            version where it was, stepped past the current version, or returned something that
            is not a metadata record. Each message names the versions involved.

    Example::

        md = pickle.load(f)                 # a record from HyperParallel 1.x, no version stamp
        md = migrate_metadata(md)           # md.version == "2.0"
    """
    table = MIGRATION_RULES if rules is None else rules
    types = metadata_record_types()
    if not isinstance(metadata, types):
        raise TypeError(f"migrate_metadata takes a metadata record ({', '.join(t.__name__ for t in types)}), "
                        f"found {type(metadata).__name__}")
    if isinstance(metadata, Metadata) and type(vars(metadata).get("version")) is int:
        return metadata  # our format's record: its parser reads every version it knows as current
    current_key = _version_key(CURRENT_CHECKPOINT_VERSION)
    seen: set[str] = set()
    while True:
        version = effective_version(metadata)
        if version == CURRENT_CHECKPOINT_VERSION:
            return metadata
        rule = table.get(version)
        if rule is None:
            key = _version_key(version)
            newer = key is not None and current_key is not None and key > current_key
            raise ValueError(
                f"cannot migrate checkpoint metadata from version {version!r} to {CURRENT_CHECKPOINT_VERSION!r}: "
                + ("it was written by newer code than this; upgrade hyper_parallel to read it" if newer else
                   f"no migration rule is registered for it (known versions: {sorted(table)})"))
        if version in seen:
            raise ValueError(f"checkpoint metadata migration came back to version {version!r}; "
                             "the migration rules form a loop")
        seen.add(version)
        result = rule(metadata)
        if not isinstance(result, types):
            raise ValueError(f"the migration rule for version {version!r} returned {type(result).__name__}, "
                             f"not a metadata record ({', '.join(t.__name__ for t in types)})")
        new_version = effective_version(result)
        if new_version == version:
            raise ValueError(f"the migration rule for version {version!r} did not advance the version "
                             f"(still {new_version!r}); each rule must move a record one version on")
        new_key = _version_key(new_version)
        if new_key is not None and current_key is not None and new_key > current_key:
            raise ValueError(f"the migration rule for version {version!r} produced version {new_version!r}, "
                             f"newer than the current {CURRENT_CHECKPOINT_VERSION!r}")
        metadata = result
