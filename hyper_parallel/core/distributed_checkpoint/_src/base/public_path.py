"""Record classes named by their public import path.

Pickles name a class by its ``__module__``. Records that end up pickled in files (HyperParallel's
per-rank ``.metadata``, exchange files) are defined in the internals, whose paths may move
between releases; :func:`publish` names them by the public face that exports them, which
stays, so a file one release writes loads in the next. It runs after the classes are built: a
dataclass resolves its annotations in its own module first.
"""

from __future__ import annotations

__all__ = ["publish"]


def publish(module: str, *classes: type) -> None:
    """Give each class ``module`` (a face that exports it under the same name) as its path."""
    for cls in classes:
        cls.__module__ = module
