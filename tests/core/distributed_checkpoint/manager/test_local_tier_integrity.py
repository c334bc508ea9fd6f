"""The local tier never loads a copy whose bytes changed since it was written, manifest included.

A local shard file's manifest (its header) holds every non-tensor value of the state: the
step counter, scheduler and RNG state, the payloads' checksums. One flipped bit there used
to load silently (``3005`` became ``3004``); now the whole header is checksummed, a copy that
fails its check is never loaded, and recovery falls back to another copy, then to the
durable step, with a warning naming the file and the step.

One process for the node's own copy and for damaged header bytes (length, JSON structure,
the safetensors entries, an older unverifiable version); 4 gloo ranks as 2 nodes for a
peer's replica after node 0's directory is wiped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import warnings

import pytest
import torch
from helpers import make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import CheckpointManager, list_steps
from hyper_parallel.core.distributed_checkpoint._src.manager.local_format import (
    MANIFEST_KEY,
    parse_shard_file_name,
    rank_dir_name,
)

COUNTER = 3000  # the state's counter at step s is COUNTER + s: 3005 at step 5


# ----------------------------------------------------------------------------- helpers


def shard_files(local_dir: str, owner: int) -> list[str]:
    """The committed shard files of ``owner`` in a node's local directory, by step."""
    out = []
    for tier in os.listdir(local_dir) if os.path.isdir(local_dir) else []:
        sub = os.path.join(local_dir, tier, rank_dir_name(owner))
        if os.path.isdir(sub):
            out += [(parse_shard_file_name(n), os.path.join(sub, n)) for n in os.listdir(sub)]
    return [p for parsed, p in sorted((x for x in out if x[0] is not None), key=lambda x: x[0])]


def header_of(path: str) -> tuple[int, bytes]:
    """The header length and the header bytes (JSON text, space-padded) of a shard file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, f.read(n)


def flip_bit(path: str, offset: int, mask: int) -> None:
    """XOR the byte at ``offset`` of ``path`` with ``mask`` (one bit for a single-bit mask)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def value_offset(path: str, key: str, text: str) -> int:
    """The file offset of the last character of ``key``'s object value ``text`` in the manifest
    (as the header stores it: JSON text inside a JSON string, its quotes escaped)."""
    _, head = header_of(path)
    pattern = (json.dumps(key) + ':{"kind":"object","value":' + text + "}").replace('"', '\\"').encode()
    at = head.find(pattern)
    assert at >= 0 and head.find(pattern, at + 1) < 0, f"{key}={text} not found once in {path}"
    return 8 + at + len(pattern) - 2  # "}" is last; the digit before it


def state_at(step: int) -> dict:
    """A training state whose every value is a function of ``step``."""
    return {"w": make_tensor((16, 8), seed=step), "counter": COUNTER + step,
            "sched": {"last_epoch": step, "lrs": [0.1 / step]}}


def empty_state() -> dict:
    return {"w": torch.full((16, 8), -1.0), "counter": -1, "sched": {"last_epoch": -1, "lrs": [0.0]}}


def save_steps(d: str, local: str, last: int) -> None:
    """Durable and local saves of steps 1..last (durable every ``last`` steps: only ``last``)."""
    with CheckpointManager(d, save_interval_steps=last, local_dir=local, local_keep=1, replicas=1) as mgr:
        for s in range(1, last + 1):
            mgr.save(s, state_at(s))
    assert [i.step for i in list_steps(d)] == [last]


def load_with_warnings(d: str, local: str) -> tuple[int | None, dict, str, list[str]]:
    """Load into an empty state: (step, state, the local tier's source, warning messages)."""
    target = empty_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(d, save_interval_steps=100, local_dir=local, local_keep=1, replicas=1) as mgr:
            step = mgr.load(target)
            source = mgr.local_tier.last_recovery.source
    return step, target, source, [str(w.message) for w in caught]


def assert_is_state_of(target: dict, step: int) -> None:
    expected = state_at(step)
    assert torch.equal(target["w"], expected["w"])
    assert target["counter"] == expected["counter"] and target["sched"] == expected["sched"], target


def assert_warned_of(messages: list[str], path: str, step: int) -> None:
    """One warning names the refused file and its step."""
    hits = [m for m in messages if path in m and re.search(rf"\bstep {step}\b", m)]
    assert hits, f"no warning names {path} and step {step}: {messages}"


# ----------------------------------------------------------------------------- one process


def test_a_flipped_bit_in_a_value_of_the_nodes_own_copy_loads_the_durable_value_with_a_warning(tmp_path):
    """3005 -> 3004 in the local copy's manifest: the copy fails its check, is never loaded,
    and the durable step 5 (the same step, the true value) loads instead, with a warning."""
    d, local = str(tmp_path / "run"), str(tmp_path / "shm")
    save_steps(d, local, 5)
    (path,) = shard_files(local, 0)
    flip_bit(path, value_offset(path, "counter", "3005"), 0x01)  # '5' -> '4'
    assert value_offset(path, "counter", "3004")  # the file now says 3004
    step, target, source, messages = load_with_warnings(d, local)
    assert (step, source) == (5, "durable")
    assert target["counter"] == 3005  # never the flipped 3004
    assert_is_state_of(target, 5)
    assert_warned_of(messages, path, 5)


def _flip_length_low(path: str) -> None:
    flip_bit(path, 0, 0x01)  # one byte more or less of header: still within the file


def _flip_length_high(path: str) -> None:
    flip_bit(path, 5, 0x01)  # a header of about a terabyte


def _flip_json_open(path: str) -> None:
    flip_bit(path, 8, 0x01)  # the header's opening "{"


def _flip_json_colon(path: str) -> None:
    _, head = header_of(path)
    at = head.find(b'"' + MANIFEST_KEY.encode() + b'":')
    assert at >= 0
    flip_bit(path, 8 + at + len(MANIFEST_KEY) + 2, 0x01)  # the ":" after the manifest's key


def _flip_entry_offset(path: str) -> None:
    """A digit of the safetensors entry of "w" (its data_offsets): a header byte this library
    never reads, but ``safetensors.safe_open`` does; the file's check covers it too."""
    _, head = header_of(path)
    m = re.search(rb'"w@0,0":\{"dtype":"F32","shape":\[16,8\],"data_offsets":\[\d+,(\d)', head)
    assert m is not None, head[:300]
    flip_bit(path, 8 + m.start(1), 0x01)


@pytest.mark.parametrize("damage", [_flip_length_low, _flip_length_high, _flip_json_open, _flip_json_colon,
                                    _flip_entry_offset], ids=lambda f: f.__name__.removeprefix("_flip_"))
def test_damaged_header_bytes_fall_back_to_the_durable_step_cleanly_with_a_warning(tmp_path, damage):
    """A flipped bit in the header length, the JSON structure or the safetensors entries: no
    crash, no read of the damaged copy, the durable step loads, and a warning names the file."""
    d, local = str(tmp_path / "run"), str(tmp_path / "shm")
    save_steps(d, local, 5)
    (path,) = shard_files(local, 0)
    damage(path)
    step, target, source, messages = load_with_warnings(d, local)
    assert (step, source) == (5, "durable")
    assert_is_state_of(target, 5)
    assert_warned_of(messages, path, 5)


def test_a_local_file_of_the_unverifiable_older_version_is_refused_and_the_durable_step_loads(tmp_path):
    """Version 1 files carry no checksum of their manifest: the local tier is a cache, so such a
    copy is refused (with a warning) and the durable step loads."""
    d, local = str(tmp_path / "run"), str(tmp_path / "shm")
    save_steps(d, local, 5)
    (path,) = shard_files(local, 0)
    n, head = header_of(path)
    header = json.loads(head)
    meta = header["__metadata__"]
    man = json.loads(meta[MANIFEST_KEY])
    man["version"] = 1
    header["__metadata__"] = {MANIFEST_KEY: json.dumps(man, separators=(",", ":"))}  # as version 1 wrote it
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(text + b" " * (n - len(text)))  # same length: the payloads stay where they are
    step, target, source, messages = load_with_warnings(d, local)
    assert (step, source) == (5, "durable")
    assert_is_state_of(target, 5)
    assert_warned_of(messages, path, 5)
    assert any("version 1" in m for m in messages), messages


def test_an_intact_local_copy_still_loads_from_the_local_tier_without_a_warning(tmp_path):
    d, local = str(tmp_path / "run"), str(tmp_path / "shm")
    save_steps(d, local, 5)
    step, target, source, messages = load_with_warnings(d, local)
    assert (step, source) == (5, "local")
    assert_is_state_of(target, 5)
    assert not [m for m in messages if "local" in m], messages


# ----------------------------------------------------------------------------- 4 ranks as 2 nodes

ROWS, COLS = 64, 8


def rank_state(step: int, mesh) -> dict:
    return {"w": make_dtensor(make_tensor((ROWS, COLS), seed=step), mesh, [Shard(0)]), "counter": COUNTER + step}


def rank_save(rank: int, ws: int, d: str, shm: str) -> None:
    """Durable step 4, local steps 1..5 (each rank's copy kept on the other node)."""
    node = rank // 2
    mesh = init_device_mesh("cpu", (ws,))
    with CheckpointManager(d, save_interval_steps=4, local_dir=f"{shm}/node{node}", local_interval_steps=1,
                           local_keep=1, replicas=2, node_rank=node, timeout=30, replication_timeout=20) as mgr:
        for s in range(1, 6):
            mgr.save(s, rank_state(s, mesh))
        mgr.wait()
        assert all(t.confirmed for t in mgr.local_tier.timings), list(mgr.local_tier.timings)


def rank_load(rank: int, ws: int, d: str, shm: str) -> dict:
    node = rank // 2
    mesh = init_device_mesh("cpu", (ws,))
    target = {"w": make_dtensor(torch.full((ROWS, COLS), -1.0), mesh, [Shard(0)]), "counter": -1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(d, save_interval_steps=4, local_dir=f"{shm}/node{node}", local_interval_steps=1,
                               local_keep=1, replicas=2, node_rank=node, timeout=30, replication_timeout=20) as mgr:
            step = mgr.load(target)
            source = mgr.local_tier.last_recovery.source
    expected = rank_state(step, mesh) if step is not None else None
    exact = expected is not None and torch.equal(target["w"].to_local(), expected["w"].to_local())
    return {"step": step, "source": source, "counter": target["counter"], "exact": exact,
            "warnings": [str(w.message) for w in caught]}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> tuple[str, str, str]:
    """One run of 4 ranks as 2 nodes (saved once for the module): the durable directory, the
    local directories' parent, and a pristine copy of them that each test restores."""
    root = tmp_path_factory.mktemp("two_nodes")
    d, shm, pristine = str(root / "run"), str(root / "shm"), str(root / "pristine")
    run_ranks(rank_save, 4, d, shm)
    shutil.copytree(shm, pristine)
    return d, shm, pristine


def wiped_node0(two_nodes: tuple[str, str, str]) -> tuple[str, str, str, str]:
    """The saved run with node 0 replaced (its local directory empty): the only copies of ranks 0
    and 1 are node 1's replicas of step 5. Returns (durable dir, shm, replica of 0, of 1)."""
    d, shm, pristine = two_nodes
    shutil.rmtree(shm)
    shutil.copytree(pristine, shm)
    shutil.rmtree(f"{shm}/node0")
    replica0, = shard_files(f"{shm}/node1", 0)
    replica1, = shard_files(f"{shm}/node1", 1)
    assert parse_shard_file_name(os.path.basename(replica0))[0] == 5
    return d, shm, replica0, replica1


def test_a_peers_replica_intact_loads_local_step_5(two_nodes):
    """The baseline of the two below: with node 0 wiped, node 1's replicas serve step 5."""
    d, shm, _, _ = wiped_node0(two_nodes)
    for rank, r in enumerate(run_ranks(rank_load, 4, d, shm)):
        assert (r["step"], r["source"], r["counter"], r["exact"]) == (5, "local", 3005, True), (rank, r)


def test_a_peers_replica_with_a_flipped_value_is_never_loaded_the_durable_step_is(two_nodes):
    """Node 0 wiped; node 1's replica of rank 0 has its counter flipped 3005 -> 3007 in the
    manifest. That copy fails its check: every rank loads the durable step 4 (not local step 5
    with rank 0's counter 3007), and a warning names the file and step 5."""
    d, shm, replica0, _ = wiped_node0(two_nodes)
    flip_bit(replica0, value_offset(replica0, "counter", "3005"), 0x02)  # '5' -> '7'
    results = run_ranks(rank_load, 4, d, shm)
    for rank, r in enumerate(results):
        assert (r["step"], r["source"], r["counter"], r["exact"]) == (4, "durable", 3004, True), (rank, r)
    assert_warned_of([m for r in results for m in r["warnings"]], replica0, 5)


def test_a_peers_replica_with_a_flipped_header_length_falls_back_cleanly(two_nodes):
    """Node 0 wiped; node 1's replica of rank 1 has a bit of its header length flipped: no
    crash, no hang, every rank loads the durable step 4, and a warning names the file."""
    d, shm, _, replica1 = wiped_node0(two_nodes)
    flip_bit(replica1, 0, 0x01)
    results = run_ranks(rank_load, 4, d, shm, timeout_s=90)
    for rank, r in enumerate(results):
        assert (r["step"], r["source"], r["counter"], r["exact"]) == (4, "durable", 3004, True), (rank, r)
    assert_warned_of([m for r in results for m in r["warnings"]], replica1, 5)
