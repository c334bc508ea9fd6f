"""Storage protocols: what a backend must do to hold checkpoints. Bytes and files only.

StorageWriter — the saver calls, in this order:

0. ``set_up(rank, is_coordinator)`` on every rank.
1. ``prepare()`` on every rank: make the destination exist (idempotent, race-safe).
2. ``write_file(name, parts)`` on every rank with data, once per data file: write the byte
   buffers ``parts`` (an iterable, consumed once, in order) as file ``name``. It may run in
   several threads at once for different files. The file need not be visible to readers
   until ``commit``.
3. ``read_committed()`` on the coordinator: the bytes of the ``.metadata`` being replaced,
   or None. (The saver uses it to know which old files become garbage after the commit.)
4. ``commit(metadata)`` on the coordinator, after every rank's writes succeeded: make
   ``.metadata`` hold these bytes atomically. Before this returns, readers see the old
   checkpoint (or none); after, the new one. It raises only if the new ``.metadata`` is
   not in place (see :mod:`.commit`: the commit is the point of no return).
5. ``remove(names)`` on every rank after a commit (its share of the replaced checkpoint's
   files, best effort), or on a rank whose save did not commit (its own new files). Missing
   files are not an error.

StorageReader — the loader calls:

0. ``set_up(rank, is_coordinator)`` on every rank.
1. ``read_metadata_bytes()`` on the coordinator: the ``.metadata`` document as stored;
   raises :class:`NotACheckpointError` when there is none. (``read_metadata()`` is torch's
   protocol: the same checkpoint described as torch's ``Metadata``, a
   :class:`~..format.torch_view.TorchView` built from those bytes; the loader never calls it.
   A reader written before this split, whose ``read_metadata()`` returns the bytes, still works:
   :func:`stored_metadata` takes either.)
2. ``file_index(record)`` on every rank, once per data file it reads (from any number of
   threads): the file's index, or None (the default) to have the loader read the file's
   ``__index__`` itself. Readers of foreign files (:mod:`.hf_storage`) build it from the
   file's own header.
3. ``file_size(name)`` and ``read_into(name, offset, buffer)`` on every rank, from any
   number of threads: fill the writable ``buffer`` with the bytes at ``offset``. Every
   range a file record names is checked against ``file_size`` before a buffer is allocated
   for it (:func:`check_range`).
4. ``close()`` on every rank.

``bytes_read`` counts the bytes returned by ``read_into`` (benchmarks and tests use it).
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

from ..base.errors import CorruptCheckpointError
from ..format.metadata import METADATA_FILE
from ..format.metadata import Metadata as Document
from ..format.torch_view import TorchView

if TYPE_CHECKING:  # storage backends need no torch at run time
    from ..format.data_file import FileIndex, UncheckedIndex
    from ..format.metadata import FileRecord

Buffer = memoryview


class StorageWriter(abc.ABC):
    """Writes one checkpoint's data files and commits its metadata.

    Call order (see the module docstring): ``set_up`` -> ``prepare`` -> ``write_file``... ->
    (``flush``) -> ``read_committed`` -> ``commit`` -> ``remove``. The commit protocol built on these
    methods is described in :mod:`.commit`.
    """

    save_id: str | None = None  # torch's StorageWriter.save_id: set by save() to the checkpoint's save id

    def set_up(self, rank: int, is_coordinator: bool) -> None:
        """Called first, on every rank."""
        self.rank = rank
        self.is_coordinator = is_coordinator

    def bound_calls(self, seconds: float) -> None:  # noqa: B027 - optional hook
        """Optional: fail (:class:`~.errors.StorageTimeoutError`) a call that gets no answer from
        the storage within ``seconds`` (the save's ``timeout``). Called after ``set_up``."""

    @abc.abstractmethod
    def prepare(self) -> None:
        """Make the destination exist; every rank calls it, so it must be idempotent and race-safe."""

    @abc.abstractmethod
    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        """Write ``parts`` in order as file ``name``; return the number of bytes written.

        Called on every rank with data, possibly from several threads at once for different
        names. The file need not be visible to readers before ``commit``. On error the file
        may be left partly written; the framework removes it. A backend may still be writing
        a part after it has asked for the next one (the filesystem writer does, on a thread
        of its own): a part's memory must stay unchanged until ``write_file`` returns.
        """

    def flush(self) -> None:
        """Make every file this writer wrote durable before the commit, for writers that
        defer syncing (one batch of many small files syncs faster than each on its own).
        Every rank that wrote calls it after its last ``write_file``; the default does nothing."""
        return None

    @abc.abstractmethod
    def read_committed(self, name: str = ".metadata") -> bytes | None:
        """The bytes of the ``.metadata`` the storage holds now, or None if it holds none.

        The coordinator calls it before ``commit`` (to know what the commit replaces) and
        after a failed ``commit`` (to learn whether the commit took effect after all).
        ``name`` is another metadata file (a rank-local fragment); a backend that does not
        support rank-local checkpoints may ignore it and raise for other names.
        """

    @abc.abstractmethod
    def commit(self, metadata: bytes, name: str = ".metadata") -> None:
        """Atomically make ``.metadata`` hold ``metadata`` (the coordinator, once per save).

        ``name``: commit another metadata file instead (each rank's fragment of a rank-local
        checkpoint, ``save(..., use_collectives=False)``).

        Before it returns, readers see the previous checkpoint (or none); after, the new one;
        never a mix. Raise only when the new ``.metadata`` is NOT in place: problems after
        it is in place (e.g. a directory fsync) are warnings, because the commit is the
        point of no return and data it names must never be deleted. (If an implementation
        raises anyway, the framework asks ``read_committed`` what happened.)
        """

    @abc.abstractmethod
    def remove(self, names: Iterable[str]) -> None:
        """Delete data files. Missing files are not an error; any other failure raises.

        Called on every rank after a commit (its share of the replaced checkpoint's files,
        best effort: those recorded under its rank) and on a rank whose save did not commit
        (its own new files).
        """

    def list_files(self) -> list[str]:
        """Names of the files in the checkpoint's directory, listed anew (optional). The
        coordinator lists once before the commit, to refuse a ``.metadata`` that names a data
        file no longer there (removed by ``hyper-dcp gc`` or by hand during the save). Raises
        NotImplementedError if unsupported: the check is then skipped."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its files")


class StorageReader(abc.ABC):
    """Reads a committed checkpoint's metadata and byte ranges of its data files."""

    bytes_read: int = 0

    def set_up(self, rank: int, is_coordinator: bool) -> None:
        self.rank = rank
        self.is_coordinator = is_coordinator

    def bound_calls(self, seconds: float) -> None:  # noqa: B027 - optional hook
        """Optional: fail (:class:`~.errors.StorageTimeoutError`) a call that gets no answer from
        the storage within ``seconds`` (the load's ``timeout``). Called after ``set_up``."""

    def read_metadata_bytes(self) -> bytes:
        """The checkpoint's ``.metadata`` document as stored (what the loader parses and the
        coordinator broadcasts). Raises :class:`NotACheckpointError` when there is none."""
        raise NotImplementedError(f"{type(self).__name__} implements neither read_metadata_bytes() nor "
                                  "a read_metadata() returning the .metadata bytes")

    def read_metadata(self) -> Any:
        """torch DCP's ``StorageReader.read_metadata``: the checkpoint as torch's ``Metadata``
        (``state_dict_metadata``, ``planner_data``, ``storage_data``, ``storage_meta``), a
        :class:`~..format.torch_view.TorchView` of our document, built per key on access, with
        the ``version`` torch's writer stamps (``CURRENT_DCP_VERSION``).

        A checkpoint saved rank-local (fragments, no ``.metadata``) is described by ``load``,
        which merges the fragments; this raises :class:`NotACheckpointError` for it.
        """
        if type(self).read_metadata_bytes is StorageReader.read_metadata_bytes:
            raise NotImplementedError(f"{type(self).__name__} must implement read_metadata_bytes()")
        where = getattr(self, "path", None) or getattr(self, "url", None)
        label = f"{where}/{METADATA_FILE}" if where else METADATA_FILE
        view = TorchView(Document.from_json(self.read_metadata_bytes(), where=label).attach(), checkpoint_id=where,
                         version=CURRENT_DCP_VERSION)
        view.storage_meta.load_id = self.load_id
        return view

    @property
    def load_id(self) -> str:
        """torch's ``StorageReader.load_id``: one id per reader (per load), in ``storage_meta``."""
        got = self.__dict__.get("_load_id")
        if got is None:
            got = self.__dict__["_load_id"] = uuid.uuid4().hex
        return got

    @abc.abstractmethod
    def file_size(self, name: str) -> int:
        """The size in bytes of data file ``name`` (a path relative to the checkpoint, as the
        metadata names it), as the storage holds it: ``fstat`` of the open file, an object's
        size. Raises :class:`~.errors.CorruptCheckpointError` when the file is missing.

        Every byte range a file record or header names is compared with it before a buffer
        is allocated for the range (the loader: :func:`check_range`; ``verify`` and the
        foreign-format readers: the sizes they record), so a forged offset or length fails
        with an error naming the file instead of allocating whatever size it says. Called
        from any number of threads.
        """

    @abc.abstractmethod
    def read_into(self, name: str, offset: int, buffer: Buffer) -> None:
        """Fill the writable ``buffer`` with the bytes of file ``name`` at ``offset``. Raises
        :class:`~.errors.CorruptCheckpointError` when the file ends before the buffer is full.
        Called from any number of threads."""

    def file_index(self, record: FileRecord) -> FileIndex | UncheckedIndex | None:
        """The index of data file ``record``, or None: the loader then reads and checks the
        file's ``__index__`` (format v2). Called on every rank, once per file it reads, from
        any number of threads.

        A reader of files this library did not write returns an
        :class:`~.data_file.UncheckedIndex` built from the file's own header; their chunks have
        no checksums, so nothing is verified for them.
        """
        return None

    def prefetch(self, ranges: Iterable[tuple[str, int, int]]) -> bool:
        """Hint that byte ranges ``(file, offset, length)`` will be read soon, so the storage
        fetches them in parallel (a load that touches thousands of small files). Returns
        whether it did: the loader then reads those ranges in one thread; otherwise it reads
        them from several. Optional; the default does nothing and returns False."""
        return False

    @property
    def memory_backed(self) -> bool:
        """Whether the files live in memory (tmpfs, ramfs, ``memory://``), where reading a
        byte again costs no more than receiving it from another rank: ``load`` then lets
        every rank read for itself instead of sharing replicated reads
        (``broadcast_replicated_tensors=None``). Default: False."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release open files; the reader may be set up again afterwards."""

    def list_files(self) -> list[str]:
        """Names of the files in the checkpoint's directory (optional; used by ``verify``
        and ``gc`` to find unreferenced files). Raises NotImplementedError if unsupported."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its files")

    def list_file_times(self) -> dict[str, float]:
        """``{file name: last modification time}`` (seconds since the epoch, the storage's
        clock) for the files of the checkpoint's directory (optional; ``gc`` leaves files no
        older than the committed ``.metadata``, which a save in progress may still commit).
        Raises NotImplementedError if unsupported."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its files' times")


def check_range(reader: StorageReader, name: str, offset: int, length: int, what: str = "the range") -> int:
    """Check that bytes ``[offset, offset + length)`` lie inside file ``name`` before a buffer
    of ``length`` bytes is allocated for them; return the file's size.

    Raises CorruptCheckpointError naming the file (and ``what`` the range holds) when they do
    not: the file is truncated, or the metadata or header that points there is damaged.
    """
    size = reader.file_size(name)
    if offset < 0 or length < 0 or offset + length > size:
        root = getattr(reader, "path", None) or getattr(reader, "url", None)
        where = f"{root.rstrip('/')}/{name}" if isinstance(root, str) else name
        raise CorruptCheckpointError(
            f"data file {where!r}: {what} (bytes {offset}..{offset + length}) lies beyond its end ({size} bytes); "
            "the file is truncated, or the metadata that points there is damaged")
    return size


def stored_metadata(reader: StorageReader) -> bytes:
    """The ``.metadata`` bytes of ``reader``'s checkpoint: ``read_metadata_bytes()``, or, for a
    reader of ours written before that method existed, the bytes its ``read_metadata()`` returns.

    Raises:
        NotACheckpointError: the checkpoint has no ``.metadata``.
        TypeError: the reader gives neither (a torch-protocol reader: it has its own format).
    """
    if type(reader).read_metadata_bytes is not StorageReader.read_metadata_bytes:
        return reader.read_metadata_bytes()
    got = reader.read_metadata()
    if isinstance(got, (bytes, bytearray, memoryview)):
        return bytes(got)
    raise TypeError(f"{type(reader).__name__}.read_metadata() returned {type(got).__name__}, not the .metadata "
                    "bytes; implement read_metadata_bytes() on a reader of this library's StorageReader ABC")

