"""The local tier of CheckpointManager: node-local saves, peer copies, recovery without the durable directory.

The protocol's pure parts (who keeps whose copy, which step recovery picks) are checked in
one process; everything that depends on ranks and nodes runs on real gloo ranks, with
several simulated nodes on this machine (``node_rank=`` and one ``local_dir`` per node),
real files, and SIGKILL for crashes.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import Counter, make_dtensor, make_tensor
from multiprocess import RankFailure, run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from hyper_parallel import fully_shard
from hyper_parallel.core.distributed_checkpoint import CheckpointManager, TrainState, list_steps
from hyper_parallel.core.distributed_checkpoint._src.manager import local_directory as tier_files
from hyper_parallel.core.distributed_checkpoint._src.manager import local_replication as replication
from hyper_parallel.core.distributed_checkpoint._src.manager.local_format import (
    parse_shard_file_name,
    rank_dir_name,
    read_manifest,
    shard_file_name,
)
from hyper_parallel.core.distributed_checkpoint._src.manager.local_recovery import decide
from hyper_parallel.core.distributed_checkpoint._src.manager.local_replication import Topology, node_identity
from hyper_parallel.core.distributed_checkpoint._src.manager.step_directory import LocalDirectory
from hyper_parallel.core.distributed_checkpoint._src.state.flatten import flatten

# ----------------------------------------------------------------------------- helpers


def tier_root(local_dir: str) -> str:
    """The one manager directory's subdirectory of a node's local directory."""
    subs = os.listdir(local_dir) if os.path.isdir(local_dir) else []
    assert len(subs) <= 1 and all(n.startswith("tier-") for n in subs), subs
    return os.path.join(local_dir, subs[0]) if subs else os.path.join(local_dir, "none")


def files(local_dir: str, rank: int) -> list[tuple[int, str]]:
    """``(step, timeline)`` of the committed shard files of ``rank`` in a node's directory."""
    sub = os.path.join(tier_root(local_dir), rank_dir_name(rank))
    names = os.listdir(sub) if os.path.isdir(sub) else []
    return sorted(p for p in map(parse_shard_file_name, names) if p is not None)


def temporaries(local_dir: str, rank: int) -> list[str]:
    sub = os.path.join(tier_root(local_dir), rank_dir_name(rank))
    return [n for n in os.listdir(sub) if n.startswith(".tmp-")] if os.path.isdir(sub) else []


def steps_of(local_dir: str, rank: int) -> list[int]:
    return [s for s, _ in files(local_dir, rank)]


def snapshot(state: dict) -> dict:
    """Every leaf of a state dict as this rank holds it (DTensors as their local shard), copied."""
    out = {}
    for key, leaf in flatten(state).leaves.items():
        v = leaf.value
        if isinstance(v, DTensor):
            v = v.to_local()
        out[key] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def same(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (bit for bit for tensors)."""
    bad = [k for k in set(a) ^ set(b)]
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))):
                bad.append(k)
        elif isinstance(x, np.ndarray):
            if not (isinstance(y, np.ndarray) and x.tobytes() == y.tobytes()):
                bad.append(k)
        elif x != y:
            bad.append(k)
    return sorted(bad)


class CountingDirectory(LocalDirectory):
    """A manager directory that counts every byte the manager reads from it, by file."""

    def __init__(self, path: str):
        super().__init__(path)
        self.reads: dict[str, int] = {}

    def _count(self, name: str, n: int) -> None:
        self.reads[name] = self.reads.get(name, 0) + n

    def step_metadata(self, name):
        data = super().step_metadata(name)
        self._count(f"{name}/.metadata", len(data))
        return data

    def read_owner(self):
        data = super().read_owner()
        self._count(".manager-owner.json", len(data or b""))
        return data

    def reader(self, name):
        reader = super().reader(name)
        read_into, read_metadata = reader.read_into, reader.read_metadata_bytes

        def counted_read_into(file, offset, buf):
            self._count(f"{name}/{file}", memoryview(buf).nbytes)
            return read_into(file, offset, buf)

        def counted_read_metadata():
            data = read_metadata()
            self._count(f"{name}/.metadata", len(data))
            return data

        reader.read_into, reader.read_metadata_bytes = counted_read_into, counted_read_metadata
        return reader


class CountingManager(CheckpointManager):
    def _root_for(self, directory, storage_options):
        return CountingDirectory(os.fspath(directory))


# ----------------------------------------------------------------------------- pure parts


def test_peers_sit_on_other_nodes_spread_over_them_and_sources_invert_peers():
    two = Topology.of([0, 0, 1, 1], replicas=2)  # 2 nodes x 2 ranks
    assert [two.peers(r) for r in range(4)] == [[2], [3], [0], [1]]
    assert [two.sources(r) for r in range(4)] == [[2], [3], [0], [1]]
    three = Topology.of(["c", "a", "b", "a", "b", "c"], replicas=3)  # nodes numbered by sorted identity
    assert three.nodes == (2, 0, 1, 0, 1, 2)
    for r in range(6):
        assert len(three.peers(r)) == 2 and len({three.nodes[p] for p in three.peers(r)} | {three.nodes[r]}) == 3
        assert sorted(three.sources(r)) == sorted(s for s in range(6) if r in three.peers(s))
    uneven = Topology.of([0, 0, 0, 1], replicas=2)  # 3 ranks on node 0, 1 on node 1
    assert [uneven.peers(r) for r in range(4)] == [[3], [3], [3], [0]]
    assert Topology.of([0, 0], replicas=2).peers(0) == []  # one node: nowhere to copy to
    assert Topology.of([0, 1, 2], replicas=9).peers(0) == [1, 2]  # capped at the other nodes


def test_node_identity_explicit_then_torchrun_then_local_world_size_then_host(monkeypatch):
    for var in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    assert node_identity(3) == ("node_rank", 3)
    assert node_identity(None)[0] == "hostname"
    monkeypatch.setenv("RANK", "13")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert node_identity(None) == ("RANK // LOCAL_WORLD_SIZE", 3)
    monkeypatch.setenv("GROUP_RANK", "5")
    assert node_identity(None) == ("GROUP_RANK", 5)
    assert node_identity(0) == ("node_rank", 0)
    with pytest.raises(ValueError, match="node_rank"):
        node_identity(-1)


DIRS4 = [0, 1, 2, 3]  # every rank its own directory


def held(owner, step, fp, tl="t1", size=100):
    return (owner, step, tl, size, fp)


def test_recovery_picks_the_newest_step_complete_somewhere_and_own_copies_first():
    fps = ["f0", "f1", "f2", "f3"]
    # node 0 (ranks 0, 1) lost its directory; node 1 (ranks 2, 3) has its own files and node 0's copies
    reports = [("f0", []), ("f1", []),
               ("f2", [held(2, 5, "f2"), held(0, 5, "f0"), held(2, 6, "f2"), held(0, 6, "f0")]),
               ("f3", [held(3, 5, "f3"), held(1, 5, "f1"), held(3, 6, "f3")])]  # rank 1's step 6 never arrived
    d = decide(reports, DIRS4, durable_latest=4, want=None, excluded=set(), keep=2)
    assert d["kind"] == "local" and d["step"] == 5  # step 6 lacks rank 1: partial, never chosen
    assert d["sources"] == {0: (2, 100), 1: (3, 100), 2: (2, 100), 3: (3, 100)}
    assert d["keep"] == [[5, "t1"]]
    # a newer durable step wins; so does "nothing complete"
    assert decide(reports, DIRS4, durable_latest=6, want=None, excluded=set(), keep=2)["kind"] == "durable"
    nothing = [(fp, []) for fp in fps]
    assert decide(nothing, DIRS4, durable_latest=None, want=None, excluded=set(), keep=2)["kind"] == "durable"
    # an explicit step: only that one
    assert decide(reports, DIRS4, durable_latest=9, want=5, excluded=set(), keep=2)["step"] == 5
    assert decide(reports, DIRS4, durable_latest=None, want=6, excluded=set(), keep=2)["kind"] == "durable"


def test_recovery_ignores_other_layouts_and_excluded_copies_and_balances_senders():
    reports = [("a0", [held(0, 3, "a0"), held(1, 3, "a1"), held(0, 4, "a0"), held(1, 4, "a1")]),
               ("a1", [held(1, 3, "a1"), held(0, 3, "a0"), held(1, 4, "OLD")])]  # rank 1's own step 4: other layout
    d = decide(reports, [0, 1], durable_latest=None, want=None, excluded=set(), keep=2)
    assert d["step"] == 4 and d["sources"][1] == (0, 100)  # rank 0 holds a good copy of rank 1's step 4
    d = decide(reports, [0, 1], durable_latest=None, want=None, excluded={(0, 1, 4, "t1")}, keep=2)
    assert d["step"] == 3 and d["sources"] == {0: (0, 100), 1: (1, 100)}
    # two ranks missing their copies are served by different holders
    reports = [("x", [held(0, 1, "x"), held(2, 1, "z"), held(3, 1, "w")]), ("y", [held(1, 1, "y"), held(2, 1, "z"),
               held(3, 1, "w")]), ("z", []), ("w", [])]
    d = decide(reports, DIRS4, durable_latest=None, want=None, excluded=set(), keep=2)
    assert {d["sources"][2][0], d["sources"][3][0]} == {0, 1}
    # node-mates share a directory: one of them lists it, and either may serve its files
    shared = [("x", [held(0, 1, "x"), held(1, 1, "y"), held(2, 1, "z"), held(3, 1, "w")]), ("y", []), ("z", []),
              ("w", [])]
    d = decide(shared, ["n0", "n0", "n1", "n1"], durable_latest=None, want=None, excluded=set(), keep=2)
    assert d["sources"][0] == (0, 100) and d["sources"][1] == (1, 100)  # their own directory
    assert {d["sources"][2][0], d["sources"][3][0]} == {0, 1}


def test_recovery_never_picks_a_step_of_a_timeline_a_later_run_abandoned():
    """The newest durable step (9, "tB") was committed by another run than the local steps'."""
    def report(tl, base, steps=(10,)):
        return [(fp, [(o, s, tl, 100, fp, base) for s in steps for o in (0, 1)]) for fp in ("f0", "f1")]

    def pick(reports, durable_latest, durable_timeline, want=None):
        d = decide(reports, [0, 0], durable_latest=durable_latest, durable_timeline=durable_timeline, want=want,
                   excluded=set(), keep=2)
        return d["step"] if d["kind"] == "local" else "durable"

    # run A (base: no durable step) saved local 10; run B, which never saw it, committed durable 9
    assert pick(report("tA", (None, None)), 9, "tB") == "durable"
    assert pick(report("tA", (None, None)), 9, "tB", want=10) == "durable"
    # ... while durable 8 (run A's own) or 8 (the base run A started from) leave it usable
    assert pick(report("tA", (None, None)), 8, "tA") == 10
    assert pick(report("tC", (8, "tA")), 8, "tA") == 10
    # a run that started from durable 8 and resumed a local step 10 is abandoned once another
    # run commits 9, whatever its local base was (step numbers alone would keep it)
    assert pick(report("tC", (8, "tA")), 9, "tB") == "durable"
    # no durable step at all, or one saved before timelines were recorded: step numbers decide
    assert pick(report("tA", (None, None)), None, None) == 10
    assert pick(report("tA", (None, None)), 9, None) == 10
    assert pick(report("tA", (None, None)), 11, None) == "durable"
    # files written before the durable base was recorded (5-tuples, or None) count unless a run
    # that records timelines committed the newest durable step after them
    old = [(fp, [(o, 10, "tA", 100, fp) for o in (0, 1)]) for fp in ("f0", "f1")]
    assert pick(old, 8, None) == 10 and pick(report("tA", None), 8, None) == 10
    assert pick(old, 9, "tB") == "durable" and pick(report("tA", None), 9, "tB") == "durable"
    # an abandoned timeline's newer step does not hide an older usable one of the current run
    mixed = [(fp, report("tA", (None, None))[i][1] + report("tB", (8, "tX"), (9,))[i][1])
             for i, fp in enumerate(("f0", "f1"))]
    assert pick(mixed, 9, "tB") == 9


# ----------------------------------------------------------------------------- one process


def counter_at(step: int) -> Counter:
    """A Stateful whose tensor keeps its shape from step to step."""
    c = Counter(3)
    c.n, c.hist = step, torch.arange(3.0) * step
    return c


def plain_state(step: int, counter: Counter) -> dict:
    return {"w": make_tensor((6, 5), seed=step), "i": torch.tensor(step), "arr": np.arange(4.0) * step,
            "blob": bytes([step]) * 3, "cfg": {"lr": 0.1 * step, "tags": ("a", step)}, "counter": counter,
            "nested": [make_tensor((3,), seed=100 + step), {"k": step}]}


def test_one_process_every_kind_of_value_round_trips_and_retention_keeps_local_keep(tmp_path):
    d, local = str(tmp_path / "run"), str(tmp_path / "shm")
    with CheckpointManager(d, save_interval_steps=100, local_dir=local, local_keep=2, replicas=1) as mgr:
        for s in range(1, 6):
            mgr.save(s, plain_state(s, counter_at(s)))
        mgr.wait()
        assert all(t.confirmed for t in mgr.local_tier.timings)
    assert steps_of(local, 0) == [4, 5] and mgr.all_steps() == []  # nothing durable
    path = os.path.join(tier_root(local), rank_dir_name(0), shard_file_name(*files(local, 0)[-1]))
    from safetensors import safe_open

    with safe_open(path, "pt") as f:  # a plain safetensors file
        assert torch.equal(f.get_tensor("w@0,0"), make_tensor((6, 5), seed=5))
    man = read_manifest(path)
    assert (man.step, man.rank, man.world_size, man.directory) == (5, 0, 1, os.path.abspath(d))
    counter = counter_at(0)
    target = plain_state(0, counter)
    w = target["w"]
    with CheckpointManager(d, local_dir=local, replicas=1) as mgr:
        assert mgr.load(target) == 5
        rec = mgr.local_tier.last_recovery
        assert rec.source == "local" and rec.step == 5 and rec.bytes_fetched == 0
    assert target["w"] is w  # filled in place
    assert same(snapshot(target), snapshot(plain_state(5, counter_at(5)))) == []
    assert counter.n == 5 and torch.equal(counter.hist, torch.arange(3.0) * 5)
    assert isinstance(target["cfg"]["tags"], tuple) and target["blob"] == b"\x05" * 3


def test_partial_and_damaged_local_steps_are_never_loaded_and_layout_changes_go_durable(tmp_path):
    d, local = str(tmp_path / "run"), str(tmp_path / "shm")
    with CheckpointManager(d, save_interval_steps=2, local_dir=local, local_keep=3, replicas=1) as mgr:
        for s in (1, 2, 3, 4, 5):
            mgr.save(s, plain_state(s, counter_at(s)))
    assert steps_of(local, 0) == [3, 4, 5] and [i.step for i in list_steps(d)] == [2, 4]
    sub = os.path.join(tier_root(local), rank_dir_name(0))
    (s5, tl), = [f for f in files(local, 0) if f[0] == 5]
    # a crashed save of step 6: only a temporary file; swept at the next start, never loaded
    with open(os.path.join(sub, f".tmp-{shard_file_name(6, tl)}.abc"), "wb") as f:
        f.write(b"partial")
    # step 5 damaged: one payload byte flipped
    p5 = os.path.join(sub, shard_file_name(5, tl))
    man = read_manifest(p5)
    with open(p5, "r+b") as f:
        f.seek(man.data_start + man.entries["w"]["start"] + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    target = plain_state(0, counter_at(0))
    with pytest.warns(UserWarning, match="damaged copies"), CheckpointManager(d, save_interval_steps=2,
                                                                              local_dir=local, replicas=1) as mgr:
        assert not any(n.startswith(".tmp-") for n in os.listdir(sub))
        assert mgr.load(target) == 4  # step 5 fails its checksum; step 4 is complete and not older than durable 4
        assert mgr.local_tier.last_recovery.source == "local" and mgr.local_tier.last_recovery.attempts == 2
    assert same(snapshot(target), snapshot(plain_state(4, counter_at(4)))) == []
    # a different layout (here: another shape of "w") never loads from the local tier
    changed = plain_state(0, counter_at(0))
    changed["w"] = torch.zeros(5, 6)
    with CheckpointManager(d, save_interval_steps=2, local_dir=local, replicas=1) as mgr:
        with pytest.raises(Exception, match="shape"):
            mgr.load(changed)  # the durable step 4 cannot fill it either: the durable tier's error
        assert mgr.local_tier.last_recovery.source == "durable"


def test_an_ndarray_shape_whose_int64_product_wraps_is_refused_before_allocating(tmp_path):
    """A manifest's ndarray shape is checked with exact arithmetic: [2**62, 4] elements make 0 in
    int64, which matched a recorded size of 0 bytes and reached ``np.empty`` (a raw ValueError)."""
    import json
    import struct

    from hyper_parallel.core.distributed_checkpoint import CorruptCheckpointError
    from hyper_parallel.core.distributed_checkpoint._src.manager import local_format as lf

    arr = np.arange(4.0)
    entry = lf.LocalEntry("arr", "ndarray", arr.dtype.str, arr.shape)
    manifest = {"format": lf.FORMAT_NAME, "version": lf.FORMAT_VERSION, "step": 1, "rank": 0, "world_size": 1,
                "timeline": "t", "directory": str(tmp_path), "node": "n", "fingerprint": "f"}
    shard = lf.build_shard_file(manifest, [entry], {"arr": 0}, lf.payload_bytes(arr), {})
    path = str(tmp_path / lf.shard_file_name(1, "t"))
    lf.write_shard_file(path, [memoryview(shard.header), shard.body])
    assert lf.read_into(read_manifest(path), [entry], [None])[0]["arr"].tolist() == arr.tolist()
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8:8 + n])
    man = json.loads(header["__metadata__"][lf.MANIFEST_KEY])
    man["entries"]["arr"].update(shape=[1 << 62, 4], nbytes=0)
    header["__metadata__"][lf.MANIFEST_KEY] = json.dumps(man)
    with open(path, "wb") as f:  # sealed with a valid header checksum: a forgery, not damage
        f.write(lf.seal_header(header) + raw[8 + n:])
    with pytest.raises(CorruptCheckpointError, match="ndarray entry 'arr' is malformed"):
        lf.read_into(read_manifest(path), [entry], [None])


def test_a_numpy_scalar_in_a_value_is_refused_naming_the_innermost_key(tmp_path):
    from hyper_parallel.core.distributed_checkpoint import UnsupportedValueError

    state = {"w": torch.ones(4), "extra": {"epoch": 1, "hist": [1.0, {"loss_ema": np.float64(0.25)}]}}
    with CheckpointManager(str(tmp_path / "run"), save_interval_steps=100, local_dir=str(tmp_path / "shm"),
                           replicas=1) as mgr:
        with pytest.raises(UnsupportedValueError, match=r"^'extra\.hist\.1\.loss_ema': a numpy\.float64 .*"
                                                         r"int\(x\) or float\(x\)"):
            mgr.save(1, state)
        state["extra"]["hist"][1]["loss_ema"] = 0.25  # float(x): saves
        mgr.save(2, state)
        mgr.wait()
    assert steps_of(str(tmp_path / "shm"), 0) == [2]


def test_local_tier_arguments_are_checked(tmp_path):
    d = str(tmp_path / "run")
    for kwargs in ({"local_interval_steps": 0}, {"local_keep": 0}, {"replicas": 0}, {"replication_timeout": 0}):
        with pytest.raises(ValueError):
            CheckpointManager(d, local_dir=str(tmp_path / "shm"), **kwargs)
    with pytest.raises(ValueError, match="pass local_dir too"):
        CheckpointManager(d, local_interval_steps=5)
    # every local tier setting off its default needs local_dir (they were silently ignored)
    for kwargs in ({"local_keep": 3}, {"replicas": 1}, {"node_rank": 0}, {"replication_timeout": 5}):
        with pytest.raises(ValueError, match=f"{next(iter(kwargs))} configures the local tier.*pass local_dir too"):
            CheckpointManager(d, **kwargs)
    CheckpointManager(d, local_keep=2, replicas=2, replication_timeout=60.0).close()  # the defaults: fine
    with CheckpointManager(d, local_dir=str(tmp_path / "shm"), local_interval_steps=2, replicas=1) as mgr:
        assert mgr.local_tier.save(1, {"x": 1}) is False and mgr.local_tier.save(2, {"x": 2}) is True
        with pytest.raises(ValueError, match="steps only go forward"):
            mgr.save(0, {"x": 0})
        with pytest.raises(Exception, match="pickle"):
            mgr.save(4, {"x": object()})


def test_two_jobs_sharing_a_local_directory_never_see_each_others_files(tmp_path):
    shm = str(tmp_path / "shm")
    a = CheckpointManager(str(tmp_path / "a"), save_interval_steps=100, local_dir=shm, replicas=1)
    b = CheckpointManager(str(tmp_path / "b"), save_interval_steps=100, local_dir=shm, replicas=1)
    for s in (1, 2, 3):
        a.save(s, plain_state(s, counter_at(s)))
        b.save(10 + s, plain_state(10 + s, counter_at(10 + s)))
    a.close()
    b.close()
    assert len(os.listdir(shm)) == 2  # one subdirectory per manager directory
    for d, step in (("a", 3), ("b", 13)):
        target = plain_state(0, counter_at(0))
        with CheckpointManager(str(tmp_path / d), local_dir=shm, replicas=1) as mgr:
            assert mgr.load(target) == step
        assert same(snapshot(target), snapshot(plain_state(step, counter_at(step)))) == []


# ----------------------------------------------------------------------------- real ranks

IN, HID, OUT = 24, 40, 12  # 40 hidden units on 4 ranks: 10 rows each; 12 outputs: 3 each


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(step * 100 + rank)
    x, y = torch.randn(8, IN, generator=g), torch.randn(8, OUT, generator=g)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def rank_train_then_lose_node_1(rank: int, ws: int, d: str, shm: str, ref: str, last: int) -> None:
    node = rank // 2
    model, opt = build(seed=0)
    state = {"app": TrainState(model, opt)}
    with CheckpointManager(d, save_interval_steps=10, local_dir=f"{shm}/node{node}", node_rank=node, timeout=30,
                           replication_timeout=20) as mgr:
        for step in range(1, last + 1):
            train_step(model, opt, step, rank)
            state["app"].step = step
            torch.save(snapshot(state), f"{ref}/r{rank}-s{step}.pt")
            mgr.save(step, state)
        if node == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # node 1 is lost, with a local save in flight
        train_step(model, opt, last + 1, rank)  # node 0 fails in the next collective
        time.sleep(30)


def rank_resume_after_node_loss(rank: int, ws: int, d: str, shm: str, ref: str) -> dict:
    node = rank // 2
    model, opt = build(seed=1)  # other initial weights: a load that did nothing would show
    state = {"app": TrainState(model, opt)}
    with CountingManager(d, save_interval_steps=10, local_dir=f"{shm}/node{node}", node_rank=node, timeout=30,
                         replication_timeout=20) as mgr:
        at_start = dict(mgr._root.reads)
        started = time.perf_counter()
        step = mgr.load(state)
        seconds = time.perf_counter() - started
        in_load = {k: v - at_start.get(k, 0) for k, v in mgr._root.reads.items() if v != at_start.get(k, 0)}
        expected = torch.load(f"{ref}/r{rank}-s{step}.pt", weights_only=False)
        differ = same(snapshot(state), expected)
        rec = mgr.local_tier.last_recovery
        for s in (step + 1, step + 2):  # training goes on, and so do local saves
            train_step(model, opt, s, rank)
            state["app"].step = s
            mgr.save(s, state)
        mgr.wait()
        return {"step": step, "differ": differ, "reads_at_start": at_start, "reads_in_load": in_load,
                "source": rec.source, "holder": rec.holders[rank], "fetched": rec.bytes_fetched, "seconds": seconds,
                "durable": mgr.all_steps(), "confirmed": [t.confirmed for t in mgr.local_tier.timings]}


def test_must_show_lose_a_node_resume_from_the_newest_local_step_bit_exact_reading_nothing_from_directory(tmp_path):
    """4 ranks as 2 nodes: local saves every step, durable every 10. Both ranks of node 1 die
    with a local save in flight and node 1's local directory is wiped; 4 fresh ranks resume
    from the newest complete local step (not the durable step 20), bit-exact, and read no
    byte of any step in ``directory`` (its data files are even moved away meanwhile)."""
    d, shm, ref = str(tmp_path / "run"), str(tmp_path / "shm"), str(tmp_path / "ref")
    os.makedirs(ref)
    with pytest.raises(RankFailure):
        run_ranks(rank_train_then_lose_node_1, 4, d, shm, ref, 23, grace_s=3)
    assert [i.step for i in list_steps(d) if i.state == "committed"] == [10, 20]
    assert steps_of(f"{shm}/node0", 2)[-1] >= 22  # node 0 holds copies of node 1's ranks
    shutil.rmtree(f"{shm}/node1")  # the node is gone, and its /dev/shm with it
    hidden = str(tmp_path / "hidden")
    os.makedirs(hidden)
    for step_dir in ("step_00000010", "step_00000020"):  # recovery must not need the durable data
        for name in os.listdir(os.path.join(d, step_dir)):
            if name != ".metadata":
                os.rename(os.path.join(d, step_dir, name), os.path.join(hidden, f"{step_dir}-{name}"))
    results = run_ranks(rank_resume_after_node_loss, 4, d, shm, ref)
    step = results[0]["step"]
    assert step in (22, 23) and all(r["step"] == step for r in results), [r["step"] for r in results]
    for rank, r in enumerate(results):
        assert r["differ"] == [], (rank, r["differ"])  # bit-exact: model, Adam, step, RNG states
        assert r["source"] == "local" and r["reads_in_load"] == {}, r["reads_in_load"]
        assert all(name.endswith((".metadata", ".manager-owner.json")) for name in r["reads_at_start"])
        assert r["durable"] == [10, 20] and r["confirmed"] == [True, True]
    assert [r["holder"] for r in results][2:] == [0, 1] and results[2]["fetched"] > 0  # node 1 fetched from node 0
    assert results[0]["holder"] == 0 and results[0]["fetched"] == 0
    assert steps_of(f"{shm}/node1", 2)[-1] == step + 2  # node 1's directory is alive again


def rank_elastic_run(rank: int, ws: int, d: str, shm: str, base: int, last: int, force_last: bool) -> dict:
    """One run of a job on nodes of 2 ranks: load, then save steps up to ``last`` (local every
    step, durable every 4) with values ``base + step``; returns what the load found."""
    node = rank // 2
    mesh = init_device_mesh("cpu", (ws,))

    def state_at(value: int) -> dict:
        return {"w": make_dtensor(torch.full((8, 4), float(value)), mesh, [Shard(0)]), "value": value}

    target = state_at(-1)
    with CheckpointManager(d, save_interval_steps=4, local_dir=f"{shm}/node{node}", node_rank=node, timeout=30,
                           replication_timeout=10) as mgr:
        start = mgr.load(target)
        found = {"step": start, "source": mgr.local_tier.last_recovery.source, "value": target["value"],
                 "w": target["w"].to_local().unique().tolist()}
        for step in range((start or 0) + 1, last + 1):
            mgr.save(step, state_at(base + step), force=force_last and step == last)
        mgr.wait()
    return found


def test_after_an_elastic_scale_down_the_next_run_never_resumes_the_abandoned_runs_local_steps(tmp_path):
    """A: 4 ranks on 2 nodes, local steps 1-6, durable 4. B: node 1 down, 2 ranks: another world
    size, so durable 4 loads; B commits durable 5 (and prunes A's files on node 0 only). C: 4
    ranks, node 1 back with A's step 6 complete in its directory: C must resume B's durable 5,
    not A's local 6. D: C's own later local steps (after durable 5, which C started from) load."""
    d, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    a = run_ranks(rank_elastic_run, 4, d, shm, 1000, 6, False)
    assert a[0]["step"] is None
    b = run_ranks(rank_elastic_run, 2, d, shm, 2000, 5, True)
    assert [(r["step"], r["source"], r["value"]) for r in b] == [(4, "durable", 1004)] * 2, b
    assert [i.step for i in list_steps(d) if i.state == "committed"] == [4, 5]
    assert all(6 in steps_of(f"{shm}/node1", r) for r in range(4))  # the abandoned run A's step, complete
    c = run_ranks(rank_elastic_run, 4, d, shm, 3000, 7, False)
    assert [(r["step"], r["source"], r["value"], r["w"]) for r in c] == [(5, "durable", 2005, [2005.0])] * 4, c
    dd = run_ranks(rank_elastic_run, 4, d, shm, 4000, 0, False)
    assert [(r["step"], r["source"], r["value"], r["w"]) for r in dd] == [(7, "local", 3007, [3007.0])] * 4, dd


def rank_killed_mid_local_save_or_copy(rank: int, ws: int, d: str, shm: str, where: str) -> None:
    """2 ranks as 2 nodes; at step 3 a process dies inside the local save (``where``:
    "write": rank 1 while writing its own file; "copy": rank 0 while writing the copy of
    rank 1's file it received)."""
    real = tier_files.write_shard_file
    victim = {"write": (1, rank_dir_name(1)), "copy": (0, rank_dir_name(1))}[where]

    def die_midway(final, pieces, sync=False, spare=None):
        if rank == victim[0] and "step_00000003" in final and f"/{victim[1]}/" in final:
            with open(os.path.join(os.path.dirname(final), ".tmp-" + os.path.basename(final) + ".x"), "wb") as f:
                f.write(pieces[0])  # the header, then death
            os.kill(os.getpid(), signal.SIGKILL)
        return real(final, pieces, sync, spare)

    tier_files.write_shard_file = die_midway
    mesh = init_device_mesh("cpu", (ws,))
    with CheckpointManager(d, save_interval_steps=100, local_dir=f"{shm}/node{rank}", node_rank=rank, timeout=20,
                           replication_timeout=10) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": make_dtensor(make_tensor((8, 4), seed=step), mesh, [Shard(0)]), "step": step})
        mgr.wait()
        time.sleep(30)  # the test kills the survivor


def rank_recover_small(rank: int, ws: int, d: str, shm: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    target = {"w": make_dtensor(torch.zeros(8, 4), mesh, [Shard(0)]), "step": -1}
    with CheckpointManager(d, save_interval_steps=100, local_dir=f"{shm}/node{rank}", node_rank=rank,
                           timeout=20) as mgr:
        step = mgr.load(target)
        rec = mgr.local_tier.last_recovery
        return {"step": step, "value": target["step"], "source": rec.source, "holder": rec.holders.get(rank),
                "ok": torch.equal(target["w"].to_local(), make_tensor((8, 4), seed=step)[rank * 4:(rank + 1) * 4]),
                "files": steps_of(f"{shm}/node{rank}", rank)}


@pytest.mark.parametrize("where", ["write", "copy"])
def test_a_kill_during_a_local_save_or_its_replication_never_makes_recovery_pick_the_partial_step(tmp_path, where):
    d, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    with pytest.raises(RankFailure):
        run_ranks(rank_killed_mid_local_save_or_copy, 2, d, shm, where, grace_s=2)
    if where == "write":  # rank 1's file of step 3 is a temporary file; rank 0's is whole
        assert 3 not in steps_of(f"{shm}/node1", 1) and 3 in steps_of(f"{shm}/node0", 0)
        assert temporaries(f"{shm}/node1", 1)
    else:  # node 1's own step 3 is whole, its copy on node 0 is not; node 1 is then lost
        assert temporaries(f"{shm}/node0", 1)
        assert 3 in steps_of(f"{shm}/node1", 1) and 3 not in steps_of(f"{shm}/node0", 1)
        shutil.rmtree(f"{shm}/node1")
    results = run_ranks(rank_recover_small, 2, d, shm)
    for rank, r in enumerate(results):
        assert r["step"] == 2 and r["value"] == 2 and r["ok"] and r["source"] == "local", r
        assert r["files"][-1] == 2  # the partial step's leftovers are gone
        assert not temporaries(f"{shm}/node{rank}", rank)
    if where == "copy":
        assert results[1]["holder"] == 0  # rank 1's step 2 came from its copy on node 0


def rank_slow_peer(rank: int, ws: int, d: str, shm: str) -> dict:
    """Rank 1's replication of step 3 stalls for 6 s; replication_timeout is 1 s."""
    if rank == 1:
        real = replication.Replicator.replicate

        def stall(self, step, timeline, path):
            if step == 3:
                time.sleep(6)
            return real(self, step, timeline, path)

        replication.Replicator.replicate = stall
    mesh = init_device_mesh("cpu", (ws,))
    blocked = []
    with CheckpointManager(d, save_interval_steps=100, local_dir=f"{shm}/node{rank}", node_rank=rank, timeout=20,
                           replication_timeout=1, local_keep=2) as mgr:
        for step in range(1, 8):
            state = {"w": make_dtensor(make_tensor((8, 4), seed=step), mesh, [Shard(0)]), "step": step}
            started = time.perf_counter()
            mgr.save(step, state)
            blocked.append(time.perf_counter() - started)
        mgr.wait()
        timings = [(t.step, t.confirmed) for t in mgr.local_tier.timings]
        target = {"w": make_dtensor(torch.zeros(8, 4), mesh, [Shard(0)]), "step": -1}
        step = mgr.load(target)
        ok = torch.equal(target["w"].to_local(), make_tensor((8, 4), seed=step)[rank * 4:(rank + 1) * 4])
        return {"blocked": blocked, "timings": timings, "step": step, "ok": ok,
                "files": steps_of(f"{shm}/node{rank}", rank), "error": mgr.local_tier.replication_error}


def test_a_slow_peer_blocks_training_only_for_a_bounded_wait_and_corrupts_nothing(tmp_path):
    results = run_ranks(rank_slow_peer, 2, str(tmp_path / "run"), str(tmp_path / "shm"))
    healthy = results[0]["blocked"]
    # one wait of about replication_timeout (bounded by 2x), never the peer's 6 s
    assert max(healthy) < 2 * 1 + 1 and sorted(healthy)[-2] < 1.0, healthy
    for r in results:
        assert r["error"] is not None  # replication stopped on both ranks ...
        assert dict(r["timings"])[2] is True and not any(c for s, c in r["timings"] if s >= 3)  # ... unconfirmed after
        assert r["step"] == 7 and r["ok"], r  # every rank still has its own file of step 7: complete
        assert r["files"] == [6, 7]  # unconfirmed steps are kept too, but never more than local_keep


def rank_reshard_falls_back_to_durable(rank: int, ws: int, d: str, shm: str) -> dict:
    mesh = init_device_mesh("cpu", (ws,))
    with CheckpointManager(d, save_interval_steps=2, local_dir=f"{shm}/node{rank}", node_rank=rank,
                           timeout=20) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": make_dtensor(make_tensor((8, 6), seed=step), mesh, [Shard(0)]), "step": step})
        mgr.wait()
        target = {"w": make_dtensor(torch.zeros(8, 6), mesh, [Shard(1)]), "step": -1}  # another layout
        step = mgr.load(target)
        source = mgr.local_tier.last_recovery.source
        ok = torch.equal(target["w"].to_local(), make_tensor((8, 6), seed=2)[:, rank * 3:(rank + 1) * 3])
    return {"step": step, "source": source, "ok": ok, "value": target["step"]}


def test_a_changed_layout_loads_the_durable_step(tmp_path):
    results = run_ranks(rank_reshard_falls_back_to_durable, 2, str(tmp_path / "run"), str(tmp_path / "shm"))
    for r in results:
        assert r == {"step": 2, "source": "durable", "ok": True, "value": 2}, r


def fresh_start_with_a_local_tier(rank: int, ws: int, root: str) -> list:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(f"{root}/durable", save_interval_steps=100, local_dir=f"{root}/local{rank}",
                           node_rank=rank) as mgr:
        start = mgr.load({"app": TrainState(model, opt)})
    return [start, dict(opt.state)]


def test_a_fresh_start_with_a_local_tier_leaves_the_optimizer_untouched(tmp_path):
    # recovery flattened the target to learn its layout, and torch's get_state_dict gives an
    # empty AdamW a state with step 1: the job then trained differently from one without a tier
    out = run_ranks(fresh_start_with_a_local_tier, 2, str(tmp_path), timeout_s=120)
    assert out == [[None, {}], [None, {}]], out


def local_tier_phase(rank: int, ws: int, root: str, phase: int) -> list:
    from hyper_parallel.core.distributed_checkpoint import CorruptCheckpointError

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"app": TrainState(model, opt)}
    with CheckpointManager(f"{root}/durable", save_interval_steps=1000, local_dir=f"{root}/local{rank}",
                           node_rank=rank) as mgr:
        try:
            got = mgr.load(state)
        except CorruptCheckpointError as exc:
            return ["refused", str(exc)]
        if phase == 1:
            model(torch.ones(2, 8)).sum().backward()
            opt.step()
            mgr.save(1, state)  # local only: the durable tier saves every 1000 steps
            mgr.wait()
        return [got, dict(opt.state) == {}]


def test_local_copies_that_cannot_be_used_never_leave_a_fresh_start_changed(tmp_path):
    root = str(tmp_path / "gone")
    run_ranks(local_tier_phase, 2, root, 1)
    # every copy of rank 1's shard gone: no complete step, and the optimizer must not be given a state
    for f in files_of(root, "*", "r00001"):
        os.remove(f)
    assert run_ranks(local_tier_phase, 2, root, 2) == [[None, True], [None, True]]
    # every copy damaged after it was read into the target: an error, not a "fresh start" holding part of it
    root = str(tmp_path / "damaged")
    run_ranks(local_tier_phase, 2, root, 1)
    for f in files_of(root, "*", "r0000*"):
        data = bytearray(open(f, "rb").read())
        for at in range(len(data) - 200, len(data) - 100):  # the last tensor's bytes, not the file's manifest
            data[at] ^= 0xFF
        with open(f, "wb") as out:
            out.write(data)
    out = run_ranks(local_tier_phase, 2, root, 2)
    assert all(o[0] == "refused" and "damaged" in o[1] for o in out), out


def files_of(root: str, node: str, owner: str) -> list[str]:
    import glob

    return [f for f in glob.glob(os.path.join(root, f"local{node}", "*", owner, "*")) if os.path.isfile(f)]
