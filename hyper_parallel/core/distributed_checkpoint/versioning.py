"""Metadata version migration (seed path ``distributed_checkpoint.versioning``).

A face over :mod:`.format.versioning`. ``_MIGRATION_RULES`` is the seed's table of rules, a
copy this module owns: ``migrate_metadata`` reads it at call time, so code that adds a rule
here (or swaps the table, as the seed's tests do) changes what this path migrates without
touching the package's own table.
"""

from typing import Any

from .format.versioning import CURRENT_CHECKPOINT_VERSION, MIGRATION_RULES, MigrationRule
from .format.versioning import migrate_metadata as _migrate

__all__ = ["CURRENT_CHECKPOINT_VERSION", "migrate_metadata"]

_MIGRATION_RULES: dict[str, MigrationRule] = dict(MIGRATION_RULES)


def migrate_metadata(metadata: Any) -> Any:
    """Bring a metadata record up to ``CURRENT_CHECKPOINT_VERSION`` with this module's rules.

    See :func:`.format.versioning.migrate_metadata` for the arguments and the errors.
    """
    return _migrate(metadata, _MIGRATION_RULES)
