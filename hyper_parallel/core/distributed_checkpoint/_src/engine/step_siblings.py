"""Which files of a step directory the committed steps beside it name.

A CheckpointManager's incremental step reads its unchanged chunks from an earlier step's
files (``../step_00000001/data-...``, a :class:`~..format.metadata.FileRecord` with ``dir``).
Whoever removes files from a step directory must keep those: the commit's reclaim of a
replaced checkpoint's files (a plain ``save`` over ``run/step_00000001``, :mod:`.commit`),
``hyper-dcp gc`` and the manager's retention (through
:func:`..manager.step_listing.files_other_steps_use`).

It lives here, below the manager, because a plain save knows nothing of managers: it sees
only that its directory has a step name (:func:`~..format.validation.step_of`), lists the
parent once and reads each sibling step's ``.metadata``. A directory whose name is not a
step name has no siblings (no listing at all).

When a sibling cannot be walked safely it raises :class:`SiblingsUnknownError` instead of
skipping it: a symbolic link (it may point at a moved copy of a step that still loads, whose
references resolve to this directory), a ``.metadata`` that cannot be read or parsed (it may
name files here). Callers then keep everything (the commit) or refuse (gc).

It is not the manager's listing of its steps (:mod:`..manager.step_listing`), and it removes
nothing.
"""

from __future__ import annotations

import os
from typing import Any

from ..backends.filesystem import FileSystemReader
from ..backends.fsspec import open_filesystem
from ..backends.locations import is_url, local_path
from ..base.errors import CheckpointError, NotACheckpointError
from ..format import metadata as md
from ..format.validation import step_of

__all__ = ["SiblingsUnknownError", "files_siblings_name"]


class SiblingsUnknownError(CheckpointError):
    """A sibling step could not be walked safely, so which files it names is unknown."""


def files_siblings_name(where: str | os.PathLike, storage_options: dict[str, Any] | None = None,
                        ) -> dict[str, list[str]]:
    """``{file name: [sibling step directories that name it]}`` for the files of the step
    directory ``where`` that committed sibling steps read (``../<name>/<file>``).

    Empty when ``where`` is not named as a step directory. A local ``where`` is looked at under
    the name given and under the name it resolves to (``run/step_1`` may be a link to another
    volume), so references through either name count. ``storage_options`` apply to URLs.

    Raises:
        SiblingsUnknownError: a sibling step is a symbolic link, or its ``.metadata`` cannot
            be read or parsed; the message names it and says what to do.
    """
    given = os.fspath(where)
    if is_url(given):
        return _siblings_of_url(given.rstrip("/"), dict(storage_options or {}))
    path = local_path(given).rstrip("/") or "/"
    out: dict[str, list[str]] = {}
    for name in sorted({os.path.abspath(path), os.path.realpath(path)}):
        for f, steps in _siblings_of_local(name).items():
            out.setdefault(f, [])
            out[f] = sorted({*out[f], *steps})
    return out


def _siblings_of_local(path: str) -> dict[str, list[str]]:
    name = os.path.basename(path)
    if step_of(name) is None:
        return {}
    parent = os.path.dirname(path)
    try:
        entries = sorted(os.scandir(parent), key=lambda e: e.name)
    except FileNotFoundError:
        return {}
    out: dict[str, list[str]] = {}
    for entry in entries:
        if entry.name == name or step_of(entry.name) is None:
            continue
        if entry.is_symlink():
            raise SiblingsUnknownError(
                f"{entry.path!r} is a symbolic link (to {os.readlink(entry.path)!r}): the step it stands for may "
                f"read files of {path!r} (incremental references resolve beside the link), and which ones cannot be "
                "told safely through a link. Nothing was removed. Put the step directory itself there (or remove "
                "the link), then try again")
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            raw = FileSystemReader(entry.path).read_metadata_bytes()
        except NotACheckpointError:  # no .metadata: uncommitted, names nothing
            continue
        except OSError as exc:
            raise _unreadable(entry.path, path, exc) from exc
        _collect(out, raw, entry.path, entry.name, name, path)
    return out


def _siblings_of_url(url: str, options: dict[str, Any]) -> dict[str, list[str]]:
    name = url.rsplit("/", 1)[-1]
    if step_of(name) is None:
        return {}
    parent = url[: len(url) - len(name)].rstrip("/")
    fs, root = open_filesystem(parent, options)
    fs.invalidate_cache(root)  # other processes write here; a cached listing may be stale
    try:
        found = fs.ls(root, detail=True)
    except FileNotFoundError:
        return {}
    out: dict[str, list[str]] = {}
    for info in sorted(found, key=lambda i: i["name"]):
        sibling = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if sibling == name or step_of(sibling) is None or info.get("type") != "directory":
            continue
        try:
            raw = fs.cat_file(f"{root}/{sibling}/{md.METADATA_FILE}")
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise _unreadable(f"{parent}/{sibling}", url, exc) from exc
        _collect(out, raw, f"{parent}/{sibling}", sibling, name, url)
    return out


def _collect(out: dict[str, list[str]], raw: bytes, where: str, sibling: str, name: str, path: str) -> None:
    try:
        meta = md.Metadata.from_json(raw, where=f"{where}/{md.METADATA_FILE}")
    except CheckpointError as exc:
        raise _unreadable(where, path, exc) from exc
    for f in meta.files:
        if f.dir == name:
            out.setdefault(f.name, []).append(sibling)


def _unreadable(sibling: str, path: str, exc: BaseException) -> SiblingsUnknownError:
    return SiblingsUnknownError(
        f"cannot tell which files of {path!r} other steps use: the {md.METADATA_FILE} of step {sibling!r} cannot "
        f"be read ({exc}). It may name files of {path!r}, so nothing was removed. Repair or remove that step, then "
        "try again")
