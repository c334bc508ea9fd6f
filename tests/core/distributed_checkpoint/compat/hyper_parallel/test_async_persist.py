"""HyperParallel's child-process async save (asynchronous/persist_process.py, base/file_exchange.py):
host staging, the exchange files, the join thread, and real persist children: alone, on 2 gloo
ranks coordinating through storage, and on 2 ranks over a fresh gloo group."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import socket
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hyper_parallel.core.distributed_checkpoint import api, async_persist, load
from hyper_parallel.core.distributed_checkpoint._src.base import file_exchange
from hyper_parallel.core.distributed_checkpoint._src.base.file_exchange import FileType
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan


def test_staging_copies_every_tensor_to_new_host_memory_and_keeps_the_structure():
    weight = torch.nn.Parameter(torch.ones(2, 3))
    state = {"model": {"w": weight}, "optim": [{"step": 1, "m": torch.zeros(2)}], "meta": bytearray(b"ab")}
    staged = async_persist.build_staged_state_dict(state)
    assert staged["model"]["w"] is not weight and not staged["model"]["w"].requires_grad
    weight.data.fill_(5.0)  # training goes on: the copy keeps what it had
    assert torch.equal(staged["model"]["w"], torch.ones(2, 3))
    assert staged["optim"][0]["step"] == 1 and staged["meta"] == b"ab" and isinstance(staged["meta"], bytes)


def test_the_most_derived_registered_type_wins_whatever_the_registration_order():
    class Base:
        pass

    class Derived(Base):
        pass

    class Leaf(Derived):
        pass

    saved = dict(async_persist.DataCopier._registry)
    try:
        async_persist.DataCopier.register(Derived)(lambda obj: "derived")
        async_persist.DataCopier.register(Base)(lambda obj: "base")
        assert async_persist.DataCopier.copy(Leaf()) == "derived"
        assert async_persist.DataCopier.dispatch(object()) is None
    finally:
        async_persist.DataCopier._registry.clear()
        async_persist.DataCopier._registry.update(saved)


def test_an_exchange_file_is_read_only_once_complete_and_storage_data_is_consumed():
    with tempfile.TemporaryDirectory() as d:
        plan = SavePlan(items=[], planner_data={"w": ("w",)})
        file_exchange.write_file(d, FileType.LOCAL_PLAN, 0, plan)
        path = file_exchange.assemble_file_path(d, FileType.LOCAL_PLAN, 0)
        whole = open(path, "rb").read()
        open(path, "wb").write(whole[:-3])  # a writer still at work
        assert file_exchange.load_file(d, FileType.LOCAL_PLAN, 0) is None
        open(path, "wb").write(whole)
        assert file_exchange.load_file(d, FileType.LOCAL_PLAN, 0) == plan and os.path.exists(path)
        file_exchange.write_file(d, FileType.STORAGE_DATA, 3, ["results"])
        assert file_exchange.load_file(d, FileType.STORAGE_DATA, 3) == ["results"]
        assert not os.path.exists(file_exchange.assemble_file_path(d, FileType.STORAGE_DATA, 3))


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_an_exchange_file_naming_code_is_refused():
    with tempfile.TemporaryDirectory() as d:
        file_exchange.write_file(d, FileType.LOCAL_PLAN, 0, _Boom())
        with pytest.raises(pickle.UnpicklingError, match="system"):
            file_exchange.load_file(d, FileType.LOCAL_PLAN, 0)


def test_the_readers_pick_up_a_file_the_round_after_it_lands():
    with tempfile.TemporaryDirectory() as d:
        file_exchange.write_file(d, FileType.LOCAL_PLAN, 0, "zero")

        def late() -> None:
            time.sleep(0.3)
            file_exchange.write_file(d, FileType.LOCAL_PLAN, 1, "one")

        writer = threading.Thread(target=late)
        writer.start()
        assert file_exchange.gather_all_results_from_storage(d, True, 2, "zero", FileType.LOCAL_PLAN, 0) == [
            "zero", "one"]
        writer.join()
        with pytest.raises(TimeoutError, match="ranks \\[5\\]"):
            file_exchange.batch_read_worker((5,), d, FileType.LOCAL_PLAN, timeout=0.2)
    assert file_exchange.construct_file_batches(tuple(range(5)), 2) == ([(0, 1, 2), (3, 4)], 2)
    with pytest.raises(ValueError):
        file_exchange.construct_file_batches((), 4)


def _persist_alone(directory: str) -> Any:
    staged = async_persist.build_staged_state_dict({"w": torch.arange(4.0), "step": 3})
    results: Any = multiprocessing.Queue()
    proc = api._create_persist_process(results, staged, directory, None, None, True, True, False)
    done: Future = Future()
    called = []
    proc.start()
    async_persist.resolve_async_persist_result(proc, results, done, lambda: called.append(1))
    return async_persist.AsyncSaveResponse(persist_completion=done).get_result(timeout=0), called


def test_a_persist_child_saves_the_staged_copy_and_the_join_thread_completes_the_future():
    with tempfile.TemporaryDirectory() as d:
        meta, called = _persist_alone(os.path.join(d, "ckpt"))
        assert "w" in meta.state_dict_metadata and called == [1]
        out = load({"w": torch.zeros(4), "step": 0}, checkpoint_id=os.path.join(d, "ckpt"), no_dist=True)
        assert torch.equal(out["w"], torch.arange(4.0)) and out["step"] == 3
        blocked = os.path.join(d, "file")
        open(blocked, "w").close()
        with pytest.raises(RuntimeError, match="not a directory|exists"):
            _persist_alone(blocked)  # the child's error, with its traceback


def test_a_child_that_dies_without_a_result_fails_the_future_with_its_exit_code():
    proc = multiprocessing.Process(target=os._exit, args=(3,))
    proc.start()
    done: Future = Future()
    async_persist.resolve_async_persist_result(proc, queue.Queue(), done, lambda: None)
    with pytest.raises(RuntimeError, match="code 3"):
        done.result(timeout=0)


def _persist_on_two_ranks(rank: int, world: int, directory: str, use_gloo: bool, port: int) -> dict[str, Any]:
    mesh = DeviceMesh("cpu", [0, 1])
    full = torch.arange(8.0).reshape(4, 2)
    state = {"w": DTensor.from_local(full[2 * rank:2 * rank + 2].clone(), mesh, [Shard(0)]), "step": 4}
    server = None
    if use_gloo:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        if rank == 0:
            server = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
        dist.barrier()
    staged = async_persist.build_staged_state_dict(state)
    assert tuple(staged["w"].shape) == (4, 2) and staged["w"].placements == (Shard(0),)
    multiprocessing.set_start_method("fork", force=True)  # the children inherit this rank's place, as in a job
    results: Any = multiprocessing.Queue()
    proc = api._create_persist_process(results, staged, directory, None, None, False, True, use_gloo)
    target = api.execute_async_persist_with_gloo if use_gloo else api.execute_async_persist
    assert proc._target is target
    done: Future = Future()
    proc.start()
    async_persist.resolve_async_persist_result(proc, results, done, lambda: None)
    meta = done.result(timeout=0)
    dist.barrier()
    out = load({"w": DTensor.from_local(torch.zeros(2, 2), mesh, [Shard(0)]), "step": 0}, checkpoint_id=directory)
    del server
    return {"keys": sorted(meta.state_dict_metadata), "w": out["w"].to_local().tolist(), "step": out["step"],
            "files": sorted(os.listdir(directory))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("use_gloo", [False, True], ids=["through-storage", "gloo"])
def test_persist_children_of_two_ranks_save_one_checkpoint_together(use_gloo):
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        out = run_ranks(_persist_on_two_ranks, 2, ckpt, use_gloo, _free_port(), timeout_s=180)
    assert out[0]["keys"] == ["step", "w"]
    assert out[0]["w"] == [[0.0, 1.0], [2.0, 3.0]] and out[1]["w"] == [[4.0, 5.0], [6.0, 7.0]]
    assert out[0]["step"] == out[1]["step"] == 4
    assert ".hp_exchange_store" not in out[0]["files"]  # the rendezvous file does not stay in the checkpoint


def test_create_persist_process_needs_the_rendezvous_to_use_gloo(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    with pytest.raises(AssertionError, match="MASTER_ADDR"):
        api._create_persist_process(None, {}, "ckpt", None, None, False, True, True)
    plain = api._create_persist_process(None, {}, "ckpt", None, None, False, True, False)
    assert plain._target is api.execute_async_persist and plain._args[-1] is True  # through storage
