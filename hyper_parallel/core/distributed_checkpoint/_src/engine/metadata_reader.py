"""The one reader of a checkpoint's metadata, whichever way it was committed.

A collective save commits ``.metadata``; a rank-local save commits one fragment per rank
(:mod:`.fragments`), which readers merge into one document. :func:`metadata_bytes` returns
that document (what a coordinator broadcasts); :func:`read_checkpoint_metadata` parses and
checks it. A rank-local load reads :func:`own_metadata_bytes` instead: ``.metadata`` where
there is one, else the rank's own fragment alone. ``StorageReader.read_metadata_bytes()`` is the
storage's own ``.metadata`` bytes only.
"""

from __future__ import annotations

from ..backends.protocol import StorageReader, stored_metadata
from ..base.errors import NotACheckpointError
from ..format import metadata as md
from .fragments import check_not_mixed, check_own_fragment, failed_ranks, fragment_ranks, merge_fragments, read_fragment


def metadata_bytes(reader: StorageReader, where: str = "checkpoint") -> bytes:
    """The checkpoint's metadata: ``.metadata``, or all fragments merged into one document.

    Raises:
        NotACheckpointError: neither ``.metadata`` nor any fragment exists.
        MetadataError: fragments are missing or disagree (names the ranks).
    """
    try:
        return stored_metadata(reader)
    except NotACheckpointError as missing:
        try:
            names = reader.list_files()
        except (NotImplementedError, OSError):
            raise missing from None
        ranks = fragment_ranks(names)
        if not ranks:
            raise
    fragments = [read_fragment(reader, r, where) for r in ranks]
    merged = merge_fragments(fragments, where)
    check_not_mixed(failed_ranks(names), merged.world_size, where, reader, fragments)
    return merged.to_json()


def own_metadata_bytes(reader: StorageReader, rank: int, where: str = "checkpoint") -> bytes:
    """What ``load(..., use_collectives=False)`` on ``rank`` reads: the whole checkpoint's
    metadata where there is one (``.metadata``, or a foreign reader's such as Hugging Face
    files: no fragment needed), else this rank's own fragment, checked to be loadable alone.
    """
    try:
        return stored_metadata(reader)
    except NotACheckpointError:
        frag = read_fragment(reader, rank, where)
        check_own_fragment(reader, frag, where)
        return frag.to_json()


def read_checkpoint_metadata(reader: StorageReader, where: str | None = None) -> md.Metadata:
    """Read and validate a checkpoint's metadata through ``reader`` (``.metadata`` or merged fragments).

    Raises:
        NotACheckpointError: neither ``.metadata`` nor any fragment exists.
        MetadataError: the metadata is damaged, of an unknown version, or fragments disagree.
    """
    return md.Metadata.from_json(metadata_bytes(reader, where or "checkpoint"),
                                 where=where or md.METADATA_FILE).attach()
