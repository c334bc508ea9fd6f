"""The one place the scale benchmarks call the library's internals (retarget me for format v2).

``benchmarks/dcp_planning.py`` times each function below for one simulated rank of a job of
R ranks x T tensors. Everything else those benchmarks run goes through the public API
(``save``, ``load``, ``offline_transform``, the ``StandardPlanner`` protocol). When the
internals change, rewrite the bodies here and keep each function's contract: its docstring
says what it must cover to be an honest measurement of that step. A step the new design no
longer has returns quickly (and says so in ``NOTES``); a step it adds goes inside the
function whose stage it belongs to.

Why not the public ``save()`` under torch's fake process group? It cannot run there: the
coordinator makes a gloo subgroup (``new_group(backend="gloo")``), which the fake backend
refuses, and even if it could, the fake all-gather hands each rank N copies of its own plan
(no honest global plan). So the per-rank planning of a save is timed step by step here, on
the real DTensors of one fake-PG rank, and the other ranks' plans are derived from boxes.
The load side IS timed through the public ``load(..., no_dist=True)`` in bench_scale.py.

Steps timed (``MEASURED``) and helpers that only build inputs (``SIMULATION``):

====================== ============ ========================================================
function               kind         stage of one save / load
====================== ============ ========================================================
rank_save_plan         MEASURED     a rank plans its own shards (before any exchange)
all_rank_plans         SIMULATION   what the plan exchange hands every rank
encode_exchange        SIMULATION   the bytes each rank sends in that exchange
decode_exchange        MEASURED     every rank decodes what the exchange gathered
global_save_plan       MEASURED     every rank derives the global plan (dedup, balance)
simulated_writes       SIMULATION   what each rank's writer reports after writing
build_metadata         MEASURED     the coordinator merges the reports into metadata
serialise_metadata     MEASURED     ... and encodes ``.metadata`` (bytes written to disk)
parse_metadata         MEASURED     every loading rank decodes + validates ``.metadata``
rank_load_plan         MEASURED     a loading rank plans its reads from the metadata
====================== ============ ========================================================
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from typing import Any

# Shown in the report next to the numbers: what the current bodies call.
NOTES = ("v1 internals: StandardPlanner local/global plans, pickled SavePlan exchange, "
         "saver.build_metadata, Metadata.to_json/from_json")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def rank_save_plan(state_dict: dict[str, Any]) -> Any:
    """MEASURED: everything one rank computes from its own state dict before it talks to
    the others (flatten, per-tensor layout, chunk boxes, plan or digest of its shards).

    ``state_dict`` maps keys to this rank's DTensors. Returns an opaque plan that the other
    functions accept. v1: ``StandardPlanner.set_up_save`` + ``create_local_save_plan``.
    """
    from hyper_parallel.core.distributed_checkpoint import StandardPlanner

    planner = StandardPlanner()
    planner.set_up_save(state_dict, True)
    return planner.create_local_save_plan()


def all_rank_plans(rank_plan: Any, ranks: int, boxes_of: Callable[[int], Iterable[tuple[str, Box]]]) -> list[Any]:
    """SIMULATION (not timed): the local plans of all ``ranks`` ranks, as the plan exchange
    delivers them to every rank, made from ``rank_plan`` (this rank's) by giving rank ``r``
    the boxes ``boxes_of(r)`` yields as ``(key, (offsets, sizes))``.

    v1: one ``SavePlan`` per rank; the plans share one ``entries`` dict (a real exchange
    gives every plan its own copy; the work done on them is the same). v2 can return
    whatever its exchange carries (digests, per-tensor summaries).
    """
    from hyper_parallel.core.distributed_checkpoint.box import Box as LibBox
    from hyper_parallel.core.distributed_checkpoint.metadata import itemsize as dtype_size
    from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, WriteItem

    entries = rank_plan.entries
    itemsize = {k: dtype_size(e.dtype) for k, e in entries.items() if e.dtype}
    plans = []
    for r in range(ranks):
        items = []
        for key, (offsets, sizes) in boxes_of(r):
            n = 1
            for s in sizes:
                n *= s
            if n:
                items.append(WriteItem(key, LibBox(offsets, sizes), n * itemsize[key]))
        plans.append(SavePlan(entries, items, list(rank_plan.objects)))
    return plans


def encode_exchange(plans: list[Any]) -> list[bytes]:
    """SIMULATION (not timed): the bytes each rank in ``plans`` puts into the plan
    exchange (v1: its pickled ``SavePlan``, sent through ``all_gather_object``)."""
    return [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in plans]


def decode_exchange(blobs: list[bytes]) -> Any:
    """MEASURED: what a rank does with the gathered exchange before it can plan globally
    (v1: unpickle every rank's ``SavePlan``, with the garbage collector paused as ``save``
    does). The caller times it on a sample of ranks and scales to all ranks."""
    from hyper_parallel.core.distributed_checkpoint import metadata as md

    with md.paused_gc():
        return [pickle.loads(b) for b in blobs]


def global_save_plan(plans: list[Any]) -> list[Any]:
    """MEASURED: the global plan every rank derives from the exchanged plans: which rank
    writes which chunk (replicas deduplicated and balanced). v1:
    ``StandardPlanner.create_global_save_plan``."""
    from hyper_parallel.core.distributed_checkpoint import StandardPlanner

    return StandardPlanner().create_global_save_plan(plans)


def simulated_writes(global_plans: list[Any]) -> list[Any]:
    """SIMULATION (not timed): what each rank's writer reports to the coordinator after
    writing its share (file names, offsets, checksums), without writing anything.
    v1: one ``WriteResult`` per rank with a ``ChunkRecord`` per chunk and its crc list."""
    from hyper_parallel.core.distributed_checkpoint import metadata as md
    from hyper_parallel.core.distributed_checkpoint.saver import WriteResult, block_rows

    results = []
    for r, plan in enumerate(global_plans):
        wr = WriteResult()
        name = f"data-r{r:05d}-0-0123456789abcdef.safetensors"
        pos = 4096
        for item in plan.items:
            br = block_rows(item.box.sizes, item.nbytes)
            crcs = (0x1234ABCD,) * -(-item.box.sizes[0] // br)
            wr.chunks.setdefault(item.key, []).append(
                md.ChunkRecord(item.box.offsets, item.box.sizes, name, pos, item.nbytes, br, crcs))
            pos += item.nbytes
        wr.files.append(name)
        wr.nbytes = pos
        results.append(wr)
    return results


def build_metadata(global_plans: list[Any], results: list[Any], ranks: int) -> Any:
    """MEASURED: the coordinator's merge of every rank's write report into the checkpoint's
    metadata object (v1: ``saver.build_metadata``)."""
    from hyper_parallel.core.distributed_checkpoint.saver import build_metadata as build

    return build(global_plans[0], results, "0123456789abcdef", ranks, {})


def serialise_metadata(meta: Any) -> bytes:
    """MEASURED: encoding the metadata into the bytes of ``.metadata`` (v1:
    ``Metadata.to_json``). Returns exactly what would be written (its length is reported)."""
    return meta.to_json()


def parse_metadata(raw: bytes) -> Any:
    """MEASURED: what every loading rank does with the ``.metadata`` bytes before planning:
    decode and validate every field (v1: ``Metadata.from_json``)."""
    from hyper_parallel.core.distributed_checkpoint import metadata as md

    return md.Metadata.from_json(raw)


def rank_load_plan(state_dict: dict[str, Any], meta: Any, rank: int) -> int:
    """MEASURED: one loading rank's planning: which saved bytes cover its DTensors' boxes
    (v1: ``StandardPlanner.set_up_load`` + ``create_local_load_plan``). Returns the number
    of reads planned (so a plan that reads nothing is noticed)."""
    from hyper_parallel.core.distributed_checkpoint import StandardPlanner

    planner = StandardPlanner()
    planner.set_up_load(state_dict, meta, False, rank=rank)
    return len(planner.create_local_load_plan().items)
