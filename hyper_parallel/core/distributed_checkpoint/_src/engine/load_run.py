"""A load, as its phases.

1. :func:`open_checkpoint` (exchange "load (reading metadata)"): the reader set up, the target
   flattened once (:func:`~.targets.prepare_target`), the metadata's bytes read where they are
   read (the coordinator; a rank-local load: each rank its own fragment).
2. :func:`share_metadata`: the coordinator's bytes (and whether replicated parts are read once
   and broadcast) reach every rank.
3. A checkpoint in torch's format, or a planner on torch's protocol: torch's procedure
   (:mod:`.protocol_run`). Else :func:`plan_and_read` (exchange "load"): each rank plans; it
   reads alone (:func:`read_alone`), or, when replicated parts are shared, the ranks read
   together once everyone's needs are known (:func:`read_together`).
4. :func:`finish_load`: ``strict="all"`` across ranks, then the values go back into the target
   (exchange "load (applying)"), or, with no target, the state nested as saved.

Each phase returns what it made; what stays on a rank travels beside what the exchange
carries (:class:`~.phase_result.PhaseResult`). Everything that can fail on one rank happens
inside an exchange, so the others learn of it at once instead of waiting out the timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

from ..backends.protocol import StorageReader
from ..backends.resolve import reader_for
from ..backends.torch_format import TorchFormatReader, is_pickle
from ..base.gc_pause import paused_gc
from ..base.options import BroadcastOptions, Coordination, ReadOptions
from ..coordination.coordinator import Coordinator
from ..format import metadata as md
from ..format.torch_view import TorchView
from ..planning.hyper_parallel_protocol import is_hyper_parallel_planner
from ..planning.load_planner import BoxLoadPlanner
from ..planning.per_call import planner_for_call
from ..planning.torch_planners import leave_set_up
from ..planning.torch_protocol import is_torch_planner, torch_load_planner
from ..state.flatten import unflatten
from ..transfer.loader import read_plan
from ..transfer.shared_reads import DEFAULT_BATCH_BYTES, Needs, needs_of, read_shared, sharing_wanted, worth_sharing
from ..transfer.torch_reads import OwnFormatReader
from .flattened import Flattened, flatten_once
from .metadata_reader import metadata_bytes, own_metadata_bytes
from .phase_result import PhaseResult
from .protocol_run import run_load
from .scope import bound_calls, distributed, mesh_group
from .targets import Target, apply_loaded, asked_for, assign_back, check_all_asked_for, check_keys, prepare_target

__all__ = ["LoadCall", "Opened", "Read", "resolve_load", "load_with", "open_checkpoint", "share_metadata",
           "plan_and_read", "read_alone", "read_together", "finish_load", "load_on_torch_protocol"]


@dataclass(frozen=True)
class LoadCall:
    """One load, as the public call resolved it.

    ``reader``: the one given, or None (one for ``where`` is made in the first phase);
    ``planner``: this call's own copy, or the one given when it is on torch's protocol
    (``foreign_planner``); ``given``: the planner as the caller gave it (torch's procedure
    takes that one); ``rank``: this rank in the process group (a rank-local load's
    coordinator is this process alone); ``read.strict`` and ``broadcast.replicated_tensors``
    as resolved from the call's keywords; ``flattened``: the target flattened once (None: no
    target).
    """

    state_dict: Any
    flattened: Flattened | None
    where: str | None
    reader: StorageReader | None
    planner: Any
    given: Any
    foreign_planner: bool
    coord: Coordinator
    rank: int
    rank_local: bool
    read: ReadOptions
    broadcast: BroadcastOptions

    @property
    def label(self) -> str:
        return f"{self.where or 'checkpoint'}/{md.METADATA_FILE}"


@dataclass(frozen=True)
class Opened:
    """What the first phase leaves on this rank: its reader (set up), the target flattened
    (None: no target, load everything), the metadata's bytes where this rank read them, and
    the coordinator's choice to share replicated reads (None: not decided here)."""

    reader: StorageReader
    target: Target | None
    raw: bytes | None
    auto_share: bool | None


@dataclass(frozen=True)
class Read:
    """What planning and reading leave on this rank: the checkpoint's Metadata, this rank's
    plan, and the values read (None until the ranks that share reads have read)."""

    meta: md.Metadata
    plan: Any
    values: dict[str, Any] | None


def resolve_load(state_dict: Any, where: str | None, reader: StorageReader | None, planner: Any,
               foreign_planner: bool, coordination: Coordination, read: ReadOptions,
               broadcast: BroadcastOptions) -> LoadCall:
    """The target flattened once, the load's group (a mesh over some ranks may choose it), its
    coordinator, this rank, and this call's own planner (a planner on torch's protocol is used as given)."""
    c = coordination
    flattened = flatten_once(state_dict) if state_dict is not None else None
    rank_local = not c.use_collectives and not c.no_dist and distributed()
    if rank_local:
        rank = dist.get_rank(c.process_group) if c.process_group is not None else dist.get_rank()
        coord = Coordinator(None, True, 0, c.timeout)
    else:
        group = (c.process_group if c.process_group is not None or c.no_dist
                 else mesh_group(state_dict, flattened.flat if flattened is not None else None))
        coord = Coordinator(group, c.no_dist or not c.use_collectives, c.coordinator_rank, c.timeout)
        rank = coord.rank
    given = planner  # a checkpoint in torch's format, or a torch-protocol planner: torch's procedure
    if not foreign_planner:
        planner = planner_for_call(planner if planner is not None else BoxLoadPlanner(), read.allow_pickle)
        if getattr(planner, "allow_partial_load", False) and read.strict is True:
            # StandardLoadPlanner(allow_partial_load=True): HyperParallel's strict=False
            read = replace(read, strict=False)
    return LoadCall(state_dict, flattened, where, reader, planner, given, foreign_planner, coord, rank, rank_local,
                    read, broadcast)


def load_with(call: LoadCall) -> Any:
    """``load`` of our procedure: the phases above, the reader closed whatever happens."""
    opening: PhaseResult[Opened, None] = PhaseResult(lambda: open_checkpoint(call))
    # Planning and reading make thousands of small acyclic objects (boxes, chunk references,
    # read items); the full collections they trigger over a trained model's heap measured
    # 50-200 ms on the critical path, so the cyclic GC waits until the data is in place.
    with paused_gc():
        try:
            call.coord.exchange("load (reading metadata)", opening.shared)
            opened = opening.kept
            meta_bytes, enabled = share_metadata(call, opened)
            if is_pickle(meta_bytes) or call.foreign_planner:  # torch's format, or a planner on torch's protocol
                return _load_via_protocol(call, opened.reader, meta_bytes)
            share = sharing_wanted(call.coord, enabled, call.rank_local)
            reading: PhaseResult[Read, tuple[Needs | None, bytes]] = PhaseResult(
                lambda: plan_and_read(call, opened, meta_bytes, share))
            outcomes = call.coord.exchange("load", reading.shared)
            read = reading.kept
            if share:
                read = read_together(call, opened.reader, read, [needs for needs, _ in outcomes])
        finally:
            if opening.kept_or_none is not None:
                opening.kept_or_none.reader.close()
    return finish_load(call, opened.target, read, [asked for _, asked in outcomes])


def open_checkpoint(call: LoadCall) -> tuple[Opened, None]:
    """Phase 1, on each rank: set the reader up, flatten the target once, read the metadata's
    bytes where they are read. A checkpoint in torch's format is checked here (its files too),
    before any rank plans from it. The reader is closed if this rank fails here."""
    coord = call.coord
    reader = call.reader if call.reader is not None else reader_for(call.where)
    try:
        reader.set_up(coord.rank, coord.is_coordinator)
        bound_calls(reader, coord)
        target = prepare_target(call.flattened.leaves()) if call.flattened is not None else None
        raw, auto_share = _metadata_here(call, reader)
        if raw is not None and is_pickle(raw):
            TorchFormatReader(reader, raw, call.read.allow_pickle).read_metadata()
    except BaseException:
        reader.close()
        raise
    return Opened(reader, target, raw, auto_share), None


def _metadata_here(call: LoadCall, reader: StorageReader) -> tuple[bytes | None, bool | None]:
    """The metadata's bytes, where this rank reads them: a rank-local load its own fragment, the
    coordinator the whole checkpoint's (and, unless the call said, whether sharing replicated
    reads pays: not where the files live in memory); other ranks nothing."""
    where = call.where or "checkpoint"
    if call.rank_local:
        return own_metadata_bytes(reader, call.rank, where), None
    if not call.coord.is_coordinator:
        return None, None
    auto = None
    if call.broadcast.replicated_tensors is None:  # decided once, for every rank
        auto = not getattr(reader, "memory_backed", False)
    return metadata_bytes(reader, where), auto


def share_metadata(call: LoadCall, opened: Opened) -> tuple[bytes, bool]:
    """Phase 2: the metadata's bytes on every rank, and whether replicated parts are shared
    (the call's choice, else the coordinator's)."""
    if call.rank_local:
        meta_bytes, enabled = opened.raw, False
    else:
        mine = None if opened.raw is None else (opened.raw, bool(opened.auto_share))
        meta_bytes, enabled = call.coord.broadcast(mine, "load (metadata broadcast)")
    if call.broadcast.replicated_tensors is not None:
        enabled = call.broadcast.replicated_tensors
    return meta_bytes, enabled


def _load_via_protocol(call: LoadCall, reader: StorageReader, meta_bytes: bytes) -> Any:
    """A checkpoint in torch's format, or a planner on torch's protocol: torch's procedure,
    with a reader of torch's protocol over ours."""
    opts = call.read
    if is_pickle(meta_bytes):
        on_protocol: Any = TorchFormatReader(reader, meta_bytes, opts.allow_pickle, files_checked=True)
    else:
        on_protocol = OwnFormatReader(reader, md.Metadata.from_json(meta_bytes, where=call.label).attach(),
                                      where=call.where or "checkpoint", allow_pickle=opts.allow_pickle,
                                      thread_count=opts.thread_count, verify=opts.verify)
    out = load_on_torch_protocol(call.state_dict, on_protocol, call.given, call.coord, call.rank, opts.strict,
                                 opts.allow_pickle)
    leave_set_up(call.given, out, on_protocol.read_metadata, call.coord.is_coordinator)
    return out


def load_on_torch_protocol(state_dict: Any, reader: Any, planner: Any, coord: Coordinator, rank: int,
                           strict: bool | str, allow_pickle: bool, checkpoint_id: Any = None) -> dict[str, Any]:
    """load() through torch's procedure (:mod:`.protocol_run`): ``planner`` as given when it is on
    torch's protocol (or HyperParallel's newer one), else torch's default planner with this
    library's ``strict`` (no target: everything, nested as saved)."""
    whole = state_dict is None
    if not (is_torch_planner(planner, "load") or is_hyper_parallel_planner(planner)):
        planner = torch_load_planner(planner, whole=whole, strict=strict)
    target = {} if whole else state_dict
    return run_load(target, reader, planner, coord, checkpoint_id=checkpoint_id, rank=rank,
                    allow_pickle=allow_pickle)


def plan_and_read(call: LoadCall, opened: Opened, meta_bytes: bytes,
                  share: bool) -> tuple[Read, tuple[Needs | None, bytes]]:
    """Phase 3, on each rank: plan against the target and check its keys; read alone, or, when
    replicated parts are shared, tell the others what this rank needs. Every rank learns the
    others' needs and (``strict="all"``) which checkpoint keys each asked for."""
    planner, strict = call.planner, call.read.strict
    meta = md.Metadata.from_json(meta_bytes, where=call.label)
    planner.set_up_load(opened.target.view if opened.target is not None else None, meta,
                        call.coord.is_coordinator, rank=call.rank)
    plan = planner.create_local_load_plan()
    check_keys(planner, strict)
    asked = asked_for(meta, planner) if strict == "all" else b""
    if share:  # read after learning what the other ranks need
        return Read(meta, plan, None), (needs_of(plan, meta), asked)
    return read_alone(call, opened.reader, meta, plan), (None, asked)


def read_alone(call: LoadCall, reader: StorageReader, meta: md.Metadata, plan: Any) -> Read:
    """This rank reads everything its plan needs from storage itself."""
    read_plan(plan, call.planner, reader, call.read.thread_count, verify=call.read.verify)
    return Read(meta, plan, call.planner.finish_load())


def read_together(call: LoadCall, reader: StorageReader, read: Read, everyone: list[Needs | None]) -> Read:
    """The ranks read together: parts several ranks need are read once and broadcast (when that
    pays, :func:`~..transfer.shared_reads.worth_sharing`), else each reads alone; then each
    finishes its load (exchange "load (finishing)")."""
    coord, planner, opts = call.coord, call.planner, call.read
    if worth_sharing(everyone):
        read_shared(coord, read.plan, planner, reader, read.meta, everyone, thread_count=opts.thread_count,
                    verify=opts.verify, batch_bytes=call.broadcast.batch_bytes or DEFAULT_BATCH_BYTES)
    else:
        coord.exchange("load (reading)", lambda: read_plan(read.plan, planner, reader, opts.thread_count,
                                                           verify=opts.verify))
    finishing: PhaseResult[dict[str, Any], None] = PhaseResult(lambda: (planner.finish_load(), None))
    coord.exchange("load (finishing)", finishing.shared)
    return Read(read.meta, read.plan, finishing.kept)


def finish_load(call: LoadCall, target: Target | None, read: Read, asked: list[bytes]) -> Any:
    """Phase 4: ``strict="all"`` (every checkpoint key asked for by some rank); then the values
    go back into the target, or, with no target, the state nested as saved."""
    values, meta = read.values, read.meta
    if call.read.strict == "all":
        check_all_asked_for(meta, asked)
    if target is None:
        order = {k: i for i, k in enumerate(meta.entries)}  # as saved
        return unflatten({meta.entries[k].path: values[k] for k in sorted(values, key=order.__getitem__)})

    # Putting values back can raise too (a Stateful's load_state_dict): in an exchange of its
    # own, after every rank has read, so no rank is left waiting and none applies half-read data.
    def apply() -> None:
        apply_loaded(target, values, call.planner)
        assign_back(call.state_dict)

    call.coord.exchange("load (applying)", apply)
    leave_set_up(call.planner, call.state_dict, lambda: TorchView(meta, call.where, version=CURRENT_DCP_VERSION),
                 call.coord.is_coordinator)
    return call.state_dict
