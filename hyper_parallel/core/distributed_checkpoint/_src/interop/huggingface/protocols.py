"""The safetensors-directory readers on the two other reader protocols: HyperParallel's and torch DCP's.

Our loader drives :class:`~.reader.HuggingFaceStorageReader` (and its subclasses) through our
own protocol: the directory presented as our document (``read_metadata_bytes``), byte ranges
read by the loader. Code written for HyperParallel's newer DCP, and torch's own loader, drive a
reader themselves, with their own calls. :class:`ProtocolReads` gives the readers those calls:

==================================================  =================================================
HyperParallel                                       torch DCP
==================================================  =================================================
``load_metadata(**kw)``: HyperParallel's            ``read_metadata()``: torch's ``Metadata``, a view
``Metadata`` (:func:`seed_metadata`)                of our document (:class:`~...format.torch_view.TorchView`)
``configure_reader(md, is_coordinator=, rank=)``    ``set_up_storage_reader(md, is_coordinator, rank=)``
``optimize_local_plan`` / ``optimize_global_plan``  ``prepare_local_plan`` / ``prepare_global_plan``
``execute_read(plan, planner)``                     ``read_data(plan, planner)`` -> a completed ``Future``
``initialize_reader(checkpoint_id)``                ``reset(checkpoint_id)``
==================================================  =================================================

Both reads carry out the plan's ``ReadItem``\\ s (torch's form, or HyperParallel's, which is the same
record class here) with :func:`~...transfer.torch_reads.read_torch_items`: each item is the
region ``storage_index.offset + storage_offsets``, ``lengths`` long, of the saved tensor, read
with the loader's checked, parallel reads from whichever files hold it, converted to the dtype
of the tensor the planner gives. A planner is called by HyperParallel's hook names where it has
them (``acquire_tensor`` / ``apply_tensor`` / ``apply_bytes``), else by torch's
(``resolve_tensor`` / ``commit_tensor`` / ``load_bytes``; ``apply_bytes`` gets the bytes of the
``torch.save`` stream ``load_bytes`` would, as :class:`~...planning.hyper_parallel_protocol.HyperParallelLoadPlanner`
hands them; safetensors files hold no byte items). A plan of this library's own planner
(:class:`~...planning.standard_planner.StandardPlanner`) is read by the loader and finished
(``finish_load``), so the same calls also run our planner.

Every rank reads every item of its own plan: a replicated region is read by each rank that needs
it (``load`` shares such reads; these protocols leave that to the caller).

What it is not: the readers themselves (:mod:`.reader`), nor the call order of a load on
these protocols (:mod:`...engine.protocol_run`, torch's ``load``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ...base.dtypes import torch_dtype
from ...format import metadata as md
from ...format.chunks import all_chunks
from ...format.records import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from ...format.storage_info import StorageInfo
from ...planning.hyper_parallel_protocol import HyperParallelLoadPlanner
from ...planning.planner import LoadPlan as BoxPlan
from ...transfer.loader import read_plan
from ...transfer.torch_reads import read_torch_items

__all__ = ["ProtocolReads", "seed_metadata"]


def seed_metadata(document: md.Metadata) -> Metadata:
    """HyperParallel's ``Metadata`` of a safetensors directory described by our ``document``.

    Every tensor as HyperParallel's readers describe it: its size, its dtype spelled
    ``str(torch dtype)`` ("torch.bfloat16"), its chunks (one at the origin for a Hugging Face
    file, one per shard for torch's shards), and ``storage_data[MetadataIndex(key, chunk
    offsets)] = StorageInfo(relative_path=file, offset=0, length=-1, tensor_key=key)``. An empty
    tensor has one empty chunk at the origin and no ``storage_data`` entry (no file holds bytes of
    it). The document stays reachable as ``..document``, as on the torch view.
    """
    state: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    for key, entry in document.entries.items():
        if entry.kind != "tensor":
            continue
        shape = tuple(int(n) for n in entry.shape)
        chunks = []
        for ref in all_chunks(document, entry):
            offsets = tuple(int(o) for o in ref.box.offsets)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(ref.box.sizes)))
            storage[MetadataIndex(key, offsets)] = StorageInfo(relative_path=ref.files[0].path, offset=0, length=-1,
                                                               tensor_key=key)
        if not chunks:
            chunks.append(ChunkStorageMetadata(offsets=torch.Size((0,) * len(shape)), sizes=torch.Size(shape)))
        state[key] = TensorStorageMetadata(properties=TensorProperties(dtype=str(torch_dtype(entry.dtype))),
                                           size=torch.Size(shape), chunks=chunks)
    meta = Metadata(state_dict_metadata=state, storage_data=storage)
    meta.document = document
    return meta


def _torch_named(planner: Any) -> Any:
    """``planner`` as read_torch_items calls it (torch's names): one with HyperParallel's names
    (``acquire_tensor``, ...) is called by those, through seed_protocol's adapter."""
    if isinstance(planner, HyperParallelLoadPlanner) or not callable(getattr(planner, "acquire_tensor", None)):
        return planner
    return HyperParallelLoadPlanner(planner)


class ProtocolReads:
    """HyperParallel's and torch's reader calls on a reader of ours that presents its files as our
    document (``read_metadata_bytes``; see the module docstring). Mixed into
    :class:`~.reader.HuggingFaceStorageReader`.

    The document the reads resolve items through is the one the last ``load_metadata`` /
    ``read_metadata`` built (or the one the metadata given to ``configure_reader`` /
    ``set_up_storage_reader`` carries), else it is built when the first read needs it.
    """

    path: str
    _document: md.Metadata | None = None

    # ------------------------------------------------------------------ HyperParallel's calls

    def load_metadata(self, **kwargs: Any) -> Metadata:
        """HyperParallel's ``Metadata`` of the directory (:func:`seed_metadata`), from the files'
        headers alone. ``kwargs`` (``rank=``, which HyperParallel's load passes when a first call
        fails) are ignored: the directory has no rank-local metadata.

        Raises what ``read_metadata_bytes`` raises: FileNotFoundError (no checkpoint, a file the
        index names is missing), ValueError (a malformed header or index, a directory of the
        other kind); each also a :class:`~...base.errors.CheckpointError`.
        """
        return seed_metadata(self._describe())

    def configure_reader(self, metadata: Any, is_coordinator: bool = False, rank: int | None = None,
                         **kwargs: Any) -> None:
        """HyperParallel's set-up call: this rank (default: the process group's rank, else 0)."""
        self._take_document(metadata)
        self.set_up(_rank(rank), is_coordinator)

    def optimize_local_plan(self, plan: Any) -> Any:
        return plan

    def optimize_global_plan(self, plan: Any) -> Any:
        return plan

    def initialize_reader(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """HyperParallel's ``initialize_reader``: read another directory from now on (None: same)."""
        self.reset(checkpoint_id)

    def execute_read(self, plan: Any, planner: Any, *args: Any, **kwargs: Any) -> None:
        """Read every item of ``plan`` into what ``planner`` gives for it (see the module docstring).
        HyperParallel's further arguments (``broadcast_groups``, ``broadcast_batch_bytes``) are
        accepted and not needed: this rank reads its items itself.

        Raises:
            CheckpointError: an item names a tensor the files do not hold or a region outside it,
                or the planner's tensor has another shape than the item's ``lengths``.
            CorruptCheckpointError: a file changed or is shorter than its header says.
        """
        try:
            if isinstance(plan, BoxPlan):  # our own planner's plan (StandardPlanner): the loader's reads
                read_plan(plan, planner, self)  # type: ignore[arg-type]
                planner.finish_load()
                return
            document = self._document if self._document is not None else self._describe()
            read_torch_items(document, self, plan.items, _torch_named(planner),  # type: ignore[arg-type]
                             where=self.path)
        finally:
            self.close()  # type: ignore[attr-defined]  # no file stays open past the load

    # ------------------------------------------------------------------ torch's calls

    def read_metadata(self) -> Any:
        """torch's ``Metadata`` of the directory: a view of our document (built per key on access)."""
        self.close()  # type: ignore[attr-defined]  # a new load: files reopened, as they are now
        view = super().read_metadata()  # type: ignore[misc]
        self._document = view.document
        return view

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """torch's set-up call (``rank=`` as torch 2.13 passes it; default as ``configure_reader``)."""
        self._take_document(metadata)
        self.set_up(_rank(kwargs.get("rank")), is_coordinator)

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        """torch's read call: :meth:`execute_read`, done when it returns (the future is complete)."""
        self.execute_read(plan, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    # ------------------------------------------------------------------ the document

    def _describe(self) -> md.Metadata:
        """Our document of the files as they are now, kept for the reads that follow."""
        self.close()  # type: ignore[attr-defined]  # a new load: files reopened, as they are now
        raw = self.read_metadata_bytes()  # type: ignore[attr-defined]
        self._document = md.Metadata.from_json(raw, where=f"{self.path.rstrip('/')}/.metadata").attach()
        return self._document

    def _take_document(self, metadata: Any) -> None:
        document = getattr(metadata, "document", None)  # what seed_metadata and the torch view carry
        if isinstance(document, md.Metadata):
            self._document = document


def _rank(rank: int | None) -> int:
    if rank is not None:
        return int(rank)
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
