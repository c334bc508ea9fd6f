"""HyperParallel's two checks on a single checkpoint file's path, before it is written.

:func:`has_valid_filename` says whether a path ends in a name a single-file saver accepts (a
stem and a suffix, each with a letter: ``model.safetensors``, not ``.safetensors`` or
``123.456``); :func:`check_path` makes the directories a path needs. Not here: where a
distributed checkpoint's files go (:mod:`..backends.locations`).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["has_valid_filename", "check_path"]


def has_valid_filename(path: str | os.PathLike) -> bool:
    """Whether ``path``'s last part is ``<stem>.<suffix>`` with a letter in the stem and one in
    the suffix (digits and underscores may follow).

    Example::

        has_valid_filename(Path("model.safetensors"))   # True
        has_valid_filename(Path(".safetensors"))        # False: no stem
    """
    p = Path(path)
    suffix = p.suffix
    return bool(p.name and len(suffix) > 1 and p.stem
                and any(c.isalpha() for c in p.stem) and any(c.isalpha() for c in suffix[1:]))


def check_path(path: str | os.PathLike) -> None:
    """Create what ``path`` needs to be written: its parent directories when it names a file
    (it has a suffix), else the directory itself. An existing path is left as it is."""
    p = Path(path)
    if p.exists():
        return
    (p.parent if p.suffix else p).mkdir(parents=True, exist_ok=True)
