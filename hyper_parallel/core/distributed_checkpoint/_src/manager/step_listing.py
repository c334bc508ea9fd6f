"""What a CheckpointManager directory holds: its steps, committed or not, and what each records.

:func:`scan` lists a manager directory once (one recursive listing on object stores) and reads
every step's ``.metadata`` (in parallel): a step is *committed* once its ``.metadata`` is in
place and parses, *uncommitted* without one, *unreadable* with one that does not parse
(:class:`StepInfo`). :func:`list_steps` is its read-only public face (``hyper-dcp ls``), and
:func:`files_other_steps_use` says which files of a step later incremental steps name.

A committed step's own facts (its step, metrics and the timeline that saved it) live in its
``Metadata.user`` under :data:`USER_KEY`; :func:`encode_metrics`, :func:`metrics_of`,
:func:`timeline_of` and :func:`step_of_name` write and read them.

Nothing here writes or removes anything (:mod:`.step_directory`, :mod:`.step_deletion`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..base.errors import CheckpointError, NotACheckpointError
from ..engine.step_siblings import files_siblings_name
from ..format import metadata as md
from ..format.metadata import step_dir_name, step_of
from .step_directory import Directory, PathLike, open_directory

__all__ = ["StepInfo", "USER_KEY", "encode_metrics", "files_other_steps_use", "list_steps", "metrics_of",
           "references_of", "scan", "step_of_name", "timeline_of"]

USER_KEY = "checkpoint_manager"  # where a step's own facts live in Metadata.user
_READ_THREADS = 8  # parallel .metadata reads at start (object stores have latency)


@dataclass(frozen=True)
class StepInfo:
    """One step directory as found on storage (see :func:`list_steps`).

    ``state`` is ``"committed"`` (its ``.metadata`` parses: it loads), ``"uncommitted"`` (no
    ``.metadata``: a save in flight, or debris of a crashed save or deletion, which the next
    manager start sweeps), or ``"unreadable"`` (a ``.metadata`` that does not parse: corrupt
    or written by a newer version; never counted, never deleted; ``error`` says why).
    ``references`` are the other steps whose files this step uses (always empty until
    incremental checkpoints exist).
    """

    step: int
    path: str
    state: str
    files: int
    bytes: int
    metrics: dict[str, Any] | None = None
    references: tuple[int, ...] = ()
    error: str | None = None


def encode_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as they are stored in ``Metadata.user``: plain JSON where it can be (``nan``
    and other non-JSON values carry the type tags of :func:`metadata.encode_value`)."""
    return {k: md.encode_value(v) for k, v in metrics.items()}


def _own(meta: md.Metadata, field: str) -> Any:
    """One of the facts the manager recorded in a committed step's user data (None: absent)."""
    own = meta.user.get(USER_KEY) if isinstance(meta.user, dict) else None
    return own.get(field) if isinstance(own, dict) else None


def metrics_of(meta: md.Metadata) -> dict[str, Any] | None:
    """The metrics saved with a committed step (None: none, or not decodable)."""
    stored = _own(meta, "metrics")
    if not isinstance(stored, dict):
        return None
    try:
        return {k: md.decode_value(v) for k, v in stored.items()}
    except ValueError:
        return None


def timeline_of(meta: md.Metadata) -> str | None:
    """The timeline (run) that saved a committed step, from its user data (None: not recorded)."""
    timeline = _own(meta, "timeline")
    return timeline if isinstance(timeline, str) else None


def step_of_name(meta: md.Metadata) -> str | None:
    """The step directory name a committed step's metadata was saved under (from its user data)."""
    step = _own(meta, "step")
    return step_dir_name(step) if isinstance(step, int) else None


def references_of(meta: md.Metadata) -> tuple[int, ...]:
    """The steps (other than its own) whose directories hold data ``meta`` names: an
    incremental checkpoint's unchanged chunks live in earlier steps' files."""
    return tuple(sorted(s for d in meta.referenced_dirs() if (s := step_of(d)) is not None))


def scan(root: Directory) -> tuple[list[StepInfo], dict[str, dict[str, int]], dict[int, md.Metadata]]:
    """List ``root`` once and read every step's ``.metadata``: (infos by step, the listing,
    parsed metadata of committed steps, without their entries: see ``Metadata.from_json``)."""
    listing = root.listing()
    with_meta = [name for name, files in listing.items() if md.METADATA_FILE in files]

    def read(name: str) -> tuple[str, md.Metadata | None, str | None]:
        try:
            # entries are not needed to list, retain or sweep a step: only its files and user data
            return name, md.Metadata.from_json(root.step_metadata(name), where=f"{root.step_path(name)}/"
                                               f"{md.METADATA_FILE}", entries=False), None
        except NotACheckpointError:  # removed between the listing and the read: uncommitted
            return name, None, None
        except CheckpointError as exc:
            return name, None, str(exc)

    if len(with_meta) > 1:
        with ThreadPoolExecutor(min(_READ_THREADS, len(with_meta))) as pool:
            results = list(pool.map(read, with_meta))
    else:
        results = [read(n) for n in with_meta]
    parsed: dict[int, md.Metadata] = {}
    errors: dict[str, str] = {}
    for name, meta, error in results:
        if meta is not None:
            parsed[step_of(name)] = meta  # type: ignore[index]
        elif error is not None:
            errors[name] = error
    infos = []
    for name, files in listing.items():
        step = step_of(name)
        meta = parsed.get(step)  # type: ignore[arg-type]
        state = "committed" if meta is not None else ("unreadable" if name in errors else "uncommitted")
        infos.append(StepInfo(step, root.step_path(name), state, len(files), sum(files.values()),  # type: ignore[arg-type]
                              metrics_of(meta) if meta else None, references_of(meta) if meta else (),
                              errors.get(name)))
    return sorted(infos, key=lambda i: i.step), listing, parsed


def list_steps(directory: PathLike, *, storage_options: dict[str, Any] | None = None) -> list[StepInfo]:
    """Every step directory under ``directory``, committed or not, oldest first (read-only).

    Needs no process group and changes nothing (no sweep, no owner file); ``hyper-dcp ls``
    prints it.

    Example::

        committed = [s.step for s in list_steps("/ckpt/run1") if s.state == "committed"]
    """
    return scan(open_directory(directory, storage_options))[0]


def files_other_steps_use(path: PathLike, *, storage_options: dict[str, Any] | None = None) -> set[str]:
    """Files of the step directory ``path`` that committed sibling steps name: an incremental
    step reads its unchanged chunks from an earlier step's files (``../<step>/<file>``), and
    the manager keeps those files when it retires that step. Empty when ``path`` is not a
    step directory. A local ``path`` counts under the name given and the one it resolves to.

    The walk is :func:`..engine.step_siblings.files_siblings_name` (the same one a plain save
    over a step directory uses to spare those files).

    Raises:
        CheckpointError: a sibling cannot be walked safely: it is a symbolic link (the step
            behind it may read files here), or its ``.metadata`` does not parse (it might name
            some). That is an error, never a guess; the message names the sibling.
    """
    return set(files_siblings_name(path, storage_options))
