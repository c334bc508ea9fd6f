"""HyperParallel's newer planner and storage-reader names, run on torch DCP's protocol.

HyperParallel's newer DCP renamed torch's protocol methods and changed one step: its
``build_global_plan(all_plans)`` runs on every rank and returns only this rank's plan (load), or
this rank's plan and the checkpoint's ``Metadata`` (save), where torch's ``create_global_plan``
runs on the coordinator and returns every rank's. The adapters here present a HyperParallel-protocol
object as a torch-protocol one, so :mod:`..engine.protocol_run` runs both alike:

==============================================  ==============================================
HyperParallel                                   torch
==============================================  ==============================================
``configure_planner(state_dict, [metadata], **kw)``  ``set_up_planner``
``build_local_plan()``                          ``create_local_plan()``
``build_global_plan(all_plans)``                ``own_global_plan(all_plans)`` (see below)
``finalize_plan(plan)``                         ``finish_plan(plan)``
``get_data(item)``                              ``resolve_data(item)`` (bytes -> ``BytesIO``)
``acquire_tensor(item)``                        ``resolve_tensor(item)``
``apply_tensor(item, tensor)``                  ``commit_tensor(item, tensor)``
``apply_bytes(item, value: bytes)``             ``load_bytes(item, value: BytesIO)``
reader ``load_metadata(**kw)``                  ``read_metadata(*args, **kw)``
reader ``configure_reader(md, is_coordinator=, rank=)``  ``set_up_storage_reader``
reader ``optimize_local_plan(plan)``            ``prepare_local_plan(plan)``
reader ``optimize_global_plan(plan)``           ``prepare_own_plan(plan)`` (see below)
reader ``execute_read(plan, planner)``          ``read_data(plan, planner)``
==============================================  ==============================================

Two names extend torch's protocol for HyperParallel's per-rank step, and the procedure uses them
where present: a planner's ``own_global_plan(all_plans)`` (every rank runs it over every rank's
local plan: this rank's plan; save: ``(plan, Metadata)``), and a reader's
``prepare_own_plan(plan)`` (every rank, on its own plan after the scatter). A HyperParallel reader's
``execute_read`` calls HyperParallel's names on the planner, so a torch-protocol planner is handed
to it through :class:`HyperParallelView`.

What it is not: torch's protocol itself (:mod:`.torch_protocol`), our own planners
(:mod:`.standard_planner`).
"""

from __future__ import annotations

import io
import os
from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint import planner as _torch_planner
from torch.distributed.checkpoint import storage as _torch_storage

from ..base.either_protocol import hyper_parallel_form
from .planner import LoadPlanner, SavePlanner

__all__ = ["is_hyper_parallel_planner", "is_hyper_parallel_reader", "HyperParallelSavePlanner",
           "HyperParallelLoadPlanner", "HyperParallelReader", "HyperParallelView", "as_torch_planner",
           "as_torch_reader"]

_PLANNER = ("configure_planner", "build_local_plan", "build_global_plan", "finalize_plan")
_READER = ("load_metadata", "configure_reader", "execute_read")


def _has(obj: Any, names: tuple[str, ...]) -> bool:
    return obj is not None and all(callable(getattr(obj, n, None)) for n in names)


def is_hyper_parallel_planner(planner: Any) -> bool:
    """Whether ``planner`` speaks HyperParallel's newer planner names (and not torch's, nor ours:
    our planners answer those names too, and plan as ours)."""
    if not _has(planner, _PLANNER) or isinstance(planner, (SavePlanner, LoadPlanner)):
        return False
    # a subclass of the planner face's ABC written with HyperParallel's names is HyperParallel's
    return hyper_parallel_form(planner) or not isinstance(planner,
                                                          (_torch_planner.SavePlanner, _torch_planner.LoadPlanner))


def is_hyper_parallel_reader(reader: Any) -> bool:
    """Whether ``reader`` speaks HyperParallel's newer storage-reader names (and not torch's)."""
    return _has(reader, _READER) and (hyper_parallel_form(reader)
                                      or not isinstance(reader, _torch_storage.StorageReader))


class HyperParallelSavePlanner(_torch_planner.SavePlanner):
    """A HyperParallel-protocol save planner on torch's protocol (see the module docstring).

    Args:
        inner: the planner (``configure_planner``, ``build_local_plan``, ``build_global_plan``,
            ``finalize_plan``, ``get_data``).
        rank: this rank, passed to ``configure_planner(rank=)``.
        use_collectives: passed to ``configure_planner(use_collectives=)``.
    """

    def __init__(self, inner: Any, rank: int = 0, use_collectives: bool = True) -> None:
        self.inner, self.rank, self.use_collectives = inner, rank, use_collectives

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.inner.configure_planner(state_dict=state_dict, is_coordinator=is_coordinator, rank=self.rank,
                                    use_collectives=self.use_collectives)

    def create_local_plan(self) -> Any:
        return self.inner.build_local_plan()

    def own_global_plan(self, all_plans: list[Any]) -> tuple[Any, Any]:
        """HyperParallel's every-rank step: ``(this rank's plan, Metadata)``."""
        return self.inner.build_global_plan(all_plans)

    def create_global_plan(self, all_plans: list[Any]) -> tuple[list[Any], Any]:
        """torch's coordinator step, which HyperParallel's per-rank step can serve for one rank only."""
        if len(all_plans) != 1:
            raise RuntimeError("a HyperParallel-protocol planner plans each rank on its own rank (own_global_plan); "
                               "create_global_plan serves a single rank")
        plan, metadata = self.inner.build_global_plan(all_plans)
        return [plan], metadata

    def finish_plan(self, new_plan: Any) -> Any:
        return self.inner.finalize_plan(new_plan)

    def resolve_data(self, write_item: Any) -> Any:
        data = self.inner.get_data(write_item)
        return io.BytesIO(bytes(data)) if isinstance(data, (bytes, bytearray, memoryview)) else data


class HyperParallelLoadPlanner(_torch_planner.LoadPlanner):
    """A HyperParallel-protocol load planner on torch's protocol (see the module docstring).

    Args:
        inner: the planner (``configure_planner``, ``build_local_plan``, ``build_global_plan``,
            ``finalize_plan``, ``acquire_tensor``, ``apply_tensor``, ``apply_bytes``).
        rank: this rank, passed to ``configure_planner(rank=)``.
    """

    def __init__(self, inner: Any, rank: int = 0) -> None:
        self.inner, self.rank = inner, rank

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        self.inner.configure_planner(state_dict=state_dict, metadata=metadata, is_coordinator=is_coordinator,
                                    rank=self.rank)

    def create_local_plan(self) -> Any:
        return self.inner.build_local_plan()

    def own_global_plan(self, all_plans: list[Any]) -> Any:
        """HyperParallel's every-rank step: this rank's plan."""
        return self.inner.build_global_plan(all_plans)

    def create_global_plan(self, global_plan: list[Any]) -> list[Any]:
        """torch's coordinator step, which HyperParallel's per-rank step can serve for one rank only."""
        if len(global_plan) != 1:
            raise RuntimeError("a HyperParallel-protocol planner plans each rank on its own rank (own_global_plan); "
                               "create_global_plan serves a single rank")
        return [self.inner.build_global_plan(global_plan)]

    def finish_plan(self, central_plan: Any) -> Any:
        return self.inner.finalize_plan(central_plan)

    def resolve_tensor(self, read_item: Any) -> Any:
        return self.inner.acquire_tensor(read_item)

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        self.inner.apply_tensor(read_item, tensor)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.inner.apply_bytes(read_item, value.getvalue())


class HyperParallelView:
    """A torch-protocol load planner seen through HyperParallel's names (what a HyperParallel reader's
    ``execute_read`` calls); every other attribute is the planner's."""

    def __init__(self, planner: Any) -> None:
        self.planner = planner

    def acquire_tensor(self, read_item: Any) -> Any:
        return self.planner.resolve_tensor(read_item)

    def apply_tensor(self, read_item: Any, tensor: Any) -> None:
        self.planner.commit_tensor(read_item, tensor)

    def apply_bytes(self, read_item: Any, value: bytes) -> None:
        self.planner.load_bytes(read_item, io.BytesIO(value))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.planner, name)


class HyperParallelReader(_torch_storage.StorageReader):
    """A HyperParallel-protocol storage reader on torch's protocol (see the module docstring)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        hook = getattr(self.inner, "initialize_reader", None)
        if checkpoint_id and hook is not None:
            hook(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.load_metadata(**kwargs)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.inner.configure_reader(metadata, is_coordinator=is_coordinator, rank=kwargs.get("rank"))

    def prepare_local_plan(self, plan: Any) -> Any:
        hook = getattr(self.inner, "optimize_local_plan", None)
        return hook(plan) if hook is not None else plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans  # HyperParallel's DCP optimizes each rank's plan on that rank: prepare_own_plan

    def prepare_own_plan(self, plan: Any) -> Any:
        """HyperParallel's ``optimize_global_plan``, on this rank's plan after the scatter."""
        hook = getattr(self.inner, "optimize_global_plan", None)
        return hook(plan) if hook is not None else plan

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        inner_planner = planner.inner if isinstance(planner, HyperParallelLoadPlanner) else HyperParallelView(planner)
        self.inner.execute_read(plan, inner_planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def close(self) -> None:
        hook = getattr(self.inner, "close", None)
        if hook is not None:
            hook()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


def as_torch_planner(planner: Any, what: str, rank: int = 0, use_collectives: bool = True) -> Any:
    """``planner`` on torch's protocol: a HyperParallel-protocol planner wrapped in its adapter, anything
    else as it is (``what``: "save" or "load")."""
    if not is_hyper_parallel_planner(planner):
        return planner
    if what == "save":
        return HyperParallelSavePlanner(planner, rank, use_collectives)
    return HyperParallelLoadPlanner(planner, rank)


def as_torch_reader(reader: Any) -> Any:
    """``reader`` on torch's protocol: a HyperParallel-protocol reader wrapped in :class:`HyperParallelReader`,
    anything else as it is."""
    return HyperParallelReader(reader) if is_hyper_parallel_reader(reader) else reader
