"""Ranks of one host hand bytes over in shared memory; ranks of several hosts use the network.

Real gloo ranks: the slots carry each rank's bytes to the others and leave nothing in
``/dev/shm``; ranks that report different hosts get no mailboxes (every rank alike); and a
``Shard(1)`` consolidated Hugging Face save, whose rows are regrouped through the mailboxes,
writes the same file as the same save over gloo, between ranks on "two hosts".
"""

from __future__ import annotations

import os
import socket

import torch
from helpers import make_dtensor, make_tensor
from multiprocess import run_ranks

from hyper_parallel.core.distributed_checkpoint import HuggingFaceStorageWriter, save
from hyper_parallel.core.distributed_checkpoint._src.coordination.coordinator import Coordinator
from hyper_parallel.core.distributed_checkpoint._src.transfer.host_mailboxes import SHM_DIR, HostMailboxes


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("hp-dcp-")} if os.path.isdir(SHM_DIR) else set()


def rank_hands_over(rank: int, ws: int) -> list:
    import torch.distributed as dist

    coord = Coordinator()
    dist.barrier(group=coord.group)
    before = _ours()
    mail = HostMailboxes.open(coord, 10_000 + rank, "test")
    assert mail is not None
    dist.barrier(group=coord.group)  # every rank has returned: every area's file is gone
    assert _ours() <= before
    got = []
    for round_no in range(3):
        out = mail.outbox(round_no)
        out[:] = (rank * 16 + round_no) % 251
        dist.barrier(group=coord.group)
        got.append([int(mail.inbox(src, round_no)[-1]) for src in range(ws)])
        dist.barrier(group=coord.group)
    mail.close()
    return got


def test_ranks_of_one_host_read_each_others_slots_and_leave_no_file():
    out = run_ranks(rank_hands_over, 2, timeout_s=90)
    want = [[(src * 16 + r) % 251 for src in range(2)] for r in range(3)]
    assert out == [want, want]


def rank_on_its_own_host(rank: int, ws: int) -> bool:
    real = socket.gethostname
    socket.gethostname = lambda: f"{real()}-{rank}"  # as if each rank ran on a host of its own
    try:
        return HostMailboxes.open(Coordinator(), 4096, "test") is None
    finally:
        socket.gethostname = real


def test_ranks_of_different_hosts_get_no_mailboxes():
    assert run_ranks(rank_on_its_own_host, 2, timeout_s=90) == [True, True]


def rank_without_shared_memory(rank: int, ws: int, missing: str) -> bool:
    import torch.distributed as dist

    from hyper_parallel.core.distributed_checkpoint._src.transfer import host_mailboxes

    coord = Coordinator()
    dist.barrier(group=coord.group)
    before = _ours()
    if rank == 1:  # this rank has no /dev/shm: no rank may use it
        host_mailboxes.SHM_DIR = missing
    none = HostMailboxes.open(coord, 4096, "test") is None
    dist.barrier(group=coord.group)
    return none and not _ours() - before  # rank 0's area was removed too


def test_a_rank_without_shared_memory_makes_every_rank_use_the_network(tmp_path):
    assert run_ranks(rank_without_shared_memory, 2, str(tmp_path / "none"), timeout_s=90) == [True, True]


def rank_saves_consolidated(rank: int, ws: int, d: str) -> bytes:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (ws,))
    sd = {"col": make_dtensor(make_tensor((300, 1031), seed=5), mesh, [Shard(1)]),
          "bf": make_dtensor(make_tensor((64, 48), torch.bfloat16, seed=7), mesh, [Shard(1)]),
          "row": make_dtensor(make_tensor((64, 48), seed=8), mesh, [Shard(0)])}
    save(sd, storage_writer=HuggingFaceStorageWriter(os.path.join(d, "shm"), enable_consolidation=True))
    real = socket.gethostname
    socket.gethostname = lambda: f"{real()}-{rank}"  # now over gloo
    try:
        save(sd, storage_writer=HuggingFaceStorageWriter(os.path.join(d, "gloo"), enable_consolidation=True))
    finally:
        socket.gethostname = real
    name = "model-00001-of-00001.safetensors"
    a, b = (open(os.path.join(d, w, name), "rb").read() for w in ("shm", "gloo"))
    assert a == b
    return a


def test_a_consolidated_save_regrouped_in_shared_memory_writes_what_gloo_writes(tmp_path):
    from safetensors.torch import load as load_bytes

    out = run_ranks(rank_saves_consolidated, 2, str(tmp_path), timeout_s=240)
    got = load_bytes(out[0])
    assert torch.equal(got["col"], make_tensor((300, 1031), seed=5))
    assert torch.equal(got["bf"], make_tensor((64, 48), torch.bfloat16, seed=7))
    assert torch.equal(got["row"], make_tensor((64, 48), seed=8))
