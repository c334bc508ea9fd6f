"""Metadata version migration (HyperParallel's path ``distributed_checkpoint.versioning``).

A face over :mod:`._src.format.versioning`. ``_MIGRATION_RULES`` is HyperParallel's table of rules, a
copy this module owns: ``migrate_metadata`` reads it at call time, so code that adds a rule
here (or swaps the table, as HyperParallel's tests do) changes what this path migrates without
touching the package's own table.
"""

from typing import Any

from ._src.format.versioning import CURRENT_CHECKPOINT_VERSION, MIGRATION_RULES, MigrationRule
from ._src.format.versioning import migrate_metadata as _migrate

__all__ = ["CURRENT_CHECKPOINT_VERSION", "migrate_metadata"]

_MIGRATION_RULES: dict[str, MigrationRule] = dict(MIGRATION_RULES)


def migrate_metadata(metadata: Any) -> Any:
    """Bring a metadata record up to ``CURRENT_CHECKPOINT_VERSION`` with this module's rules.

    See :func:`._src.format.versioning.migrate_metadata` for the arguments and the errors.
    """
    return _migrate(metadata, _MIGRATION_RULES)
