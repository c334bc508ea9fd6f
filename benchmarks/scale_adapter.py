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
NOTES = ("format v2 internals: StandardPlanner local plan + structure digest; the exchange carries a "
         "digest per rank and each distinct structure once; the global plan is computed from "
         "structures (O(tensors)) and a rank derives its own writes; saver.build_metadata from one "
         "file record per rank; Metadata.to_json/from_json")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def rank_save_plan(state_dict: dict[str, Any]) -> Any:
    """MEASURED: everything one rank computes from its own state dict before it talks to
    the others (flatten, per-tensor layout, chunk boxes, plan or digest of its shards).

    ``state_dict`` maps keys to this rank's DTensors. Returns an opaque plan that the other
    functions accept. v2: ``StandardPlanner.set_up_save`` + ``create_local_save_plan`` +
    ``structure_digest``.
    """
    from hyper_parallel.core.distributed_checkpoint import StandardPlanner

    planner = StandardPlanner()
    planner.set_up_save(state_dict, True)
    plan = planner.create_local_save_plan()
    return plan, planner.structure_digest(plan)


def all_rank_plans(rank_plan: Any, ranks: int, boxes_of: Callable[[int], Iterable[tuple[str, Box]]]) -> list[Any]:
    """SIMULATION (not timed): what the exchange delivers to every rank. v2: every rank of
    this job has the same structure, so each rank holds the one structure it received
    (entries only: boxes follow from the layouts; ``boxes_of`` is not needed)."""
    from hyper_parallel.core.distributed_checkpoint._src.planning.planner import SavePlan

    plan, digest = rank_plan
    shared = SavePlan(plan.entries, [], [])
    shared.digest, shared.structure = digest, pickle.dumps(plan.entries, protocol=pickle.HIGHEST_PROTOCOL)
    return [shared] * ranks


def encode_exchange(plans: list[Any]) -> list[bytes]:
    """SIMULATION (not timed): the bytes each rank puts into the exchange. v2: its digest, a
    save id and its cached-plan fingerprints (the structure travels once, in a broadcast:
    its bytes are counted in ``global_save_plan``'s input, and decoded there)."""
    return [pickle.dumps((p.digest, "0123456789abcdef", []), protocol=pickle.HIGHEST_PROTOCOL) for p in plans]


def decode_exchange(blobs: list[bytes]) -> Any:
    """MEASURED: what a rank does with the gathered exchange before it can plan globally
    (v2: unpickle every rank's digest tuple). The caller times it on a sample of ranks and
    scales to all ranks."""
    from hyper_parallel.core.distributed_checkpoint._src.base.gc_pause import paused_gc

    with paused_gc():
        return [pickle.loads(b) for b in blobs]


def global_save_plan(plans: list[Any]) -> list[Any]:
    """MEASURED: the global plan every rank derives from the exchanged plans: which rank
    writes which chunk (replicas deduplicated and balanced). v2: decode the one broadcast
    structure, ``StandardPlanner.create_global_save_plan`` over the structures, then this
    rank's own writes (``plans[rank]``)."""
    from hyper_parallel.core.distributed_checkpoint import StandardPlanner
    from hyper_parallel.core.distributed_checkpoint._src.planning.planner import SavePlan

    entries = pickle.loads(plans[0].structure)
    shared = SavePlan(entries, [], [])
    global_plans = StandardPlanner().create_global_save_plan([shared] * len(plans))
    global_plans[len(plans) // 2]  # this rank's own writes (computed on demand)
    return global_plans


def simulated_writes(global_plans: list[Any]) -> list[Any]:
    """SIMULATION (not timed): what each rank's writer reports to the coordinator after
    writing its share, without writing anything. v2: one file record per rank (where its
    index is, its checksum); the chunks' offsets and checksums stay in the data file."""
    from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md
    from hyper_parallel.core.distributed_checkpoint._src.transfer.saver import WriteResult

    results = []
    for r in range(len(global_plans)):
        wr = WriteResult()
        wr.files.append(md.FileRecord(f"data-r{r:05d}-0-0123456789abcdef.safetensors", "", r, 1 << 20, 24_000,
                                      0x1234ABCD, (1 << 20) + 24_000))
        results.append(wr)
    return results


def build_metadata(global_plans: list[Any], results: list[Any], ranks: int) -> Any:
    """MEASURED: the coordinator's merge of every rank's write report into the checkpoint's
    metadata object (v2: ``saver.build_metadata`` over the global plan's entries)."""
    from hyper_parallel.core.distributed_checkpoint._src.format.metadata_build import build_metadata as build

    return build(global_plans[0].entries, results, "0123456789abcdef", ranks, {})


def serialise_metadata(meta: Any) -> bytes:
    """MEASURED: encoding the metadata into the bytes of ``.metadata`` (v1:
    ``Metadata.to_json``). Returns exactly what would be written (its length is reported)."""
    return meta.to_json()


def parse_metadata(raw: bytes) -> Any:
    """MEASURED: what every loading rank does with the ``.metadata`` bytes before planning:
    decode and validate every field (v1: ``Metadata.from_json``)."""
    from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md

    return md.Metadata.from_json(raw)


def rank_load_plan(state_dict: dict[str, Any], meta: Any, rank: int) -> int:
    """MEASURED: one loading rank's planning: which saved bytes cover its DTensors' boxes
    (v1: ``StandardPlanner.set_up_load`` + ``create_local_load_plan``). Returns the number
    of reads planned (so a plan that reads nothing is noticed)."""
    from hyper_parallel.core.distributed_checkpoint import StandardPlanner

    planner = StandardPlanner()
    planner.set_up_load(state_dict, meta, False, rank=rank)
    return len(planner.create_local_load_plan().items)
