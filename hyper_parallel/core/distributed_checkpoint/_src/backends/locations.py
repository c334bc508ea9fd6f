"""Where a checkpoint is: local paths and fsspec URLs, named the same way everywhere.

A location is a local path (``str`` or ``os.PathLike``; a ``file://`` URL is one too) or an
fsspec URL (``s3://bucket/run``, ``memory://x``). These functions only look at the name:
which backend serves a location is :mod:`.resolve`'s decision, made from :func:`is_url`.
"""

from __future__ import annotations

import os


def checkpoint_path(path: str | os.PathLike) -> str:
    """Normalise a ``path``/``checkpoint_id`` argument to a string."""
    return os.fspath(path)


def is_url(path: str | os.PathLike) -> bool:
    """Whether a checkpoint location is an fsspec URL (``s3://``, ``memory://``, ...); a
    ``file://`` URL is a local path."""
    path = os.fspath(path)
    return "://" in path and not path.startswith("file://")


def local_path(path: str | os.PathLike) -> str:
    """A local location as a plain path (``file:///x`` -> ``/x``)."""
    return os.fspath(path).removeprefix("file://")


def location(path: str | os.PathLike) -> str:
    """A checkpoint location in a form two names of one place share: an absolute local path
    with symlinks resolved, or a URL without a trailing slash."""
    path = os.fspath(path)
    if is_url(path):
        return path.rstrip("/")
    return os.path.realpath(local_path(path))
