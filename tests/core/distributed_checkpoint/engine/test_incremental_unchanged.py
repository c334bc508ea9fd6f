"""The opt-in ``check="version_counter"``: incremental saves tell an unchanged tensor by torch's
version counter and its memory, without hashing it; the spot check, the rotating full re-hash and
our own loads keep that honest. (The default check hashes every chunk: tests/.../engine/test_incremental_exact.py.)"""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch
from helpers import bits, make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from hyper_parallel.core.distributed_checkpoint import CheckpointManager, load, save
from hyper_parallel.core.distributed_checkpoint._src.engine.incremental import IncrementalState
from hyper_parallel.core.distributed_checkpoint._src.format.metadata import step_dir_name
from hyper_parallel.core.distributed_checkpoint._src.state.version_stamp import stamp_of

BASE = (2048, 512)  # 4 MiB of fp32: stored as 4 column bands of 1 MiB
BASE_BYTES = 2048 * 512 * 4


def state() -> dict:
    return {"base": make_tensor(BASE, seed=1), "lora": make_tensor((64, 16), seed=2),
            "exp_avg": make_tensor((64, 16), seed=3)}


def snapshot(sd: dict) -> dict:
    return {k: v.clone() for k, v in sd.items()}


def assert_loads(path: str, want: dict) -> None:
    out = load(path=path)
    bad = [k for k, v in want.items() if not torch.equal(bits(out[k]), bits(v))]
    assert not bad, f"{path}: {bad} differ from what was saved"


class Steps:
    """save() with an IncrementalState into step directories, as the manager does."""

    def __init__(self, root, rehash_every: int = 8, check: str = "version_counter"):
        self.root, self.step = str(root), 0
        self.inc = IncrementalState(rehash_every=rehash_every, check=check)

    def save(self, sd: dict) -> str:
        self.step += 1
        self.inc.begin(step_dir_name(self.step))
        path = os.path.join(self.root, step_dir_name(self.step))
        save(sd, path, incremental=self.inc, no_dist=True)
        return path


def test_a_frozen_tensor_is_reused_unread_after_the_first_save(tmp_path):
    steps, sd = Steps(tmp_path), state()
    steps.save(sd)
    assert steps.inc.last.unread_bytes == 0 and steps.inc.last.written_bytes >= BASE_BYTES
    for _ in range(2):
        sd["lora"].add_(1.0)
        sd["exp_avg"].mul_(0.5)
        path = steps.save(sd)
        st = steps.inc.last
        # 1/8 of the frozen bytes are re-hashed in full at each save (one band here); the rest is not read
        assert st.unread_bytes == BASE_BYTES - BASE_BYTES // 4, st
        assert st.hashed_bytes == BASE_BYTES // 4 + st.written_bytes, st
        assert st.written_bytes == 2 * 64 * 16 * 4 and st.sampled_bytes <= 4 * (32 << 10), st  # ~32 KiB per band
        assert_loads(path, sd)


def test_rehash_every_1_hashes_every_chunk_at_every_save(tmp_path):
    steps, sd = Steps(tmp_path, rehash_every=1), state()
    steps.save(sd)
    sd["lora"].add_(1.0)
    path = steps.save(sd)
    assert steps.inc.last.unread_bytes == 0 and steps.inc.last.hashed_bytes >= BASE_BYTES
    assert_loads(path, sd)
    with pytest.raises(ValueError, match="rehash_every must be an int >= 1"):
        IncrementalState(rehash_every=0)


def test_an_in_place_update_through_a_view_is_written(tmp_path):
    steps, sd = Steps(tmp_path), state()
    first = steps.save(sd)
    sd["base"][1000:1001, 300:301].mul_(2.0)  # one element, through a view: the counter is shared
    path = steps.save(sd)
    st = steps.inc.last
    assert st.written_bytes == BASE_BYTES and st.unread_bytes == 2 * 64 * 16 * 4, st  # lora, exp_avg unread
    assert_loads(path, sd)
    assert not torch.equal(load(path=first)["base"], sd["base"])


def test_a_replaced_tensor_is_detected_and_an_equal_copy_is_still_reused(tmp_path):
    steps, sd = Steps(tmp_path), state()
    steps.save(sd)
    sd["base"] = sd["base"].clone()  # other memory, same bytes: hashed, found equal, not written
    path = steps.save(sd)
    assert steps.inc.last.written_bytes < BASE_BYTES and steps.inc.last.hashed_bytes >= BASE_BYTES
    assert_loads(path, sd)
    old = sd.pop("base")
    del old  # its memory is freed: a new tensor may get the same address, never the same stamp
    sd["base"] = make_tensor(BASE, seed=9)
    path = steps.save(sd)
    assert steps.inc.last.written_bytes >= BASE_BYTES
    assert_loads(path, sd)
    p = torch.nn.Parameter(sd["base"].clone())
    sd["base"] = p
    steps.save(sd)
    p.data = make_tensor(BASE, seed=10)  # the parameter now views other memory
    path = steps.save(sd)
    assert steps.inc.last.written_bytes >= BASE_BYTES
    assert_loads(path, sd)


def test_a_sparse_write_through_data_is_not_read_at_first_then_caught_within_rehash_every(tmp_path):
    k = 3
    steps, sd = Steps(tmp_path, rehash_every=k), state()
    steps.save(sd)
    before = snapshot(sd)
    version = sd["base"]._version
    sd["base"].data[100, 500] += 1.0  # .data has a counter of its own: the stamp does not move
    assert sd["base"]._version == version
    found = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2, 2 + k):
            path = steps.save(sd)
            if step == 2:  # the changed band was not read: this step still names the old bytes
                assert_loads(path, before)
            if "base" in steps.inc.last.behind_counter:
                found = step
                assert_loads(path, sd)
                break
    assert found is not None and found <= 1 + k, found  # hashed at save 1, so again by save 1 + k
    assert any("'base'" in str(w.message) and "version counter" in str(w.message) for w in caught)
    assert "base" in steps.inc.untracked  # hashed at every save from now on
    sd["base"].data[7, 7] += 1.0
    path = steps.save(sd)
    assert_loads(path, sd)


def test_fused_adamw_writes_behind_the_counter_and_every_step_still_loads_exactly(tmp_path):
    torch.manual_seed(0)
    frozen = torch.nn.Linear(512, 512)
    for p in frozen.parameters():
        p.requires_grad_(False)
    head = torch.nn.Linear(512, 64)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2, fused=True)
    x = torch.randn(8, 512)

    def train() -> None:
        head(frozen(x)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def sd() -> dict:
        return {"frozen": frozen.state_dict(), "head": head.state_dict(), "optim": opt.state_dict()}

    steps = Steps(tmp_path)
    train()
    saved = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # caught at once by the spot check: nothing stale was saved, no warning
        for _ in range(4):
            before = {k: v._version for k, v in head.state_dict().items()}
            train()
            assert {k: v._version for k, v in head.state_dict().items()} == before  # fused: no bump
            s = sd()
            saved.append((steps.save(s), {k: v.clone() for k, v in s["head"].items()}))
    assert {"head.weight", "head.bias"} <= steps.inc.untracked
    assert steps.inc.last.unread_bytes > 0  # the frozen layer is still reused unread
    for path, head_state in saved:
        out = load(path=path)
        assert all(torch.equal(bits(out["head"][k]), bits(v)) for k, v in head_state.items()), path


def aligned_vector(n: int, seed: int) -> torch.Tensor:
    """A 1-D tensor at a 4 KiB-aligned address, so a load reads straight into its memory."""
    raw = torch.empty(n + 1024)
    start = (-raw.data_ptr() % 4096) // 4
    out = raw[start:start + n]
    out.copy_(make_tensor((n,), seed=seed))
    return out


def test_a_load_into_the_tensors_is_not_taken_for_unchanged(tmp_path):
    d = str(tmp_path / "run")
    sd = {"vec": aligned_vector(1 << 19, seed=1), "base": make_tensor(BASE, seed=2)}
    a = snapshot(sd)
    with CheckpointManager(d, incremental=True, incremental_check="version_counter") as mgr:
        mgr.save(1, sd)
        for t in sd.values():
            t.view(-1)[3000] += 1.0  # one element each: a spot check alone would not see it
        b = snapshot(sd)
        mgr.save(2, sd)
        stamps = {k: stamp_of(v) for k, v in sd.items()}
        assert mgr.load(sd, step=1) == 1  # 'vec' is read straight into its memory, bypassing torch
        assert all(torch.equal(sd[k], a[k]) and not stamps[k].same_as(stamp_of(sd[k])) for k in sd)
        mgr.save(3, sd)
    assert_loads(os.path.join(d, step_dir_name(3)), a)
    assert_loads(os.path.join(d, step_dir_name(2)), b)


def test_async_saves_stamp_the_source_not_the_reused_staging_buffer(tmp_path):
    d = str(tmp_path / "run")
    sd = state()
    saved = []
    with CheckpointManager(d, incremental=True, incremental_check="version_counter", async_save=True) as mgr:
        for step in (1, 2, 3, 4, 5):
            mgr.save(step, sd)
            saved.append(snapshot(sd))  # staged: may change now
            sd["lora"].add_(1.0)
            if step == 2:
                sd["base"][5, 5] = 7.0  # in place, after the snapshot: step 3 must write it
            mgr.wait()
            st = mgr.incremental_stats
            if step in (2, 5):  # the staging buffer's counter moves at every copy; the source's did not
                assert st.unread_bytes >= BASE_BYTES // 2, (step, st)
            if step == 3:
                assert st.written_bytes >= BASE_BYTES, st
            if step == 4:  # unchanged again: hashed in full once (found equal, not written) before trusted
                assert st.hashed_bytes >= BASE_BYTES and st.written_bytes < BASE_BYTES, st
    for step, want in enumerate(saved, 1):
        assert_loads(os.path.join(d, step_dir_name(step)), want)


def rank_dtensor_steps(rank: int, ws: int, d: str) -> list[tuple[int, int, int]]:
    mesh = init_device_mesh("cpu", (ws,))
    frozen = make_dtensor(make_tensor((2048, 256), seed=1), mesh, [Shard(0)])
    train = make_dtensor(make_tensor((64, 32), seed=2), mesh, [Shard(0)])
    sd = {"model": {"frozen": frozen, "train": train}}
    out = []
    with CheckpointManager(d, incremental=True, incremental_check="version_counter") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, sd)
            st = mgr.incremental_stats
            out.append((st.unread_bytes, st.written_bytes, st.hashed_bytes))
            saved = train.to_local().clone()
            train.to_local().add_(1.0)
        target = {"model": {"frozen": make_dtensor(torch.zeros(2048, 256), mesh, [Shard(0)]),
                            "train": make_dtensor(torch.zeros(64, 32), mesh, [Shard(0)])}}
        assert mgr.load(target) == 3
        assert torch.equal(bits(target["model"]["frozen"].to_local()), bits(frozen.to_local()))
        assert torch.equal(bits(target["model"]["train"].to_local()), bits(saved))
    return out


def test_dtensor_local_shards_are_stamped_on_two_ranks(tmp_path):
    results = run_ranks(rank_dtensor_steps, 2, str(tmp_path / "run"), timeout_s=120)
    local_frozen = 1024 * 256 * 4
    for per_rank in results:
        (u1, w1, _), (u2, w2, h2), (u3, w3, _) = per_rank
        assert u1 == 0 and w1 >= local_frozen
        # each rank re-hashes one of the two bands of its frozen shard (the oldest; 1/8 of the
        # bytes rounded up to a chunk) and reads none of the rest
        assert u2 == local_frozen // 2 and u3 == local_frozen // 2, per_rank
        assert w2 == w3 == 32 * 32 * 4 and h2 == local_frozen // 2 + w2, per_rank


def test_reusable_carries_every_field_of_a_known_chunk_and_sets_only_trust():
    """reusable() rebuilds each KnownChunk field by field (for speed): a field added to the
    class and not carried over would silently reset to its default at every save."""
    import dataclasses

    from hyper_parallel.core.distributed_checkpoint._src.base.box import Box
    from hyper_parallel.core.distributed_checkpoint._src.engine.incremental import KnownChunk, spec_of
    from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md

    entry = md.Entry("w", "tensor", ("w",), "float32", (4, 4), store=md.GridStore(tiles=1))
    t = torch.zeros(4, 4)
    chunk = KnownChunk(digest=b"d" * 16, file=md.FileRecord("f.data", "step_00000001", 3, 1, 2, 3, 4),
                       box=Box((0, 0), (4, 4)), spec=spec_of(entry), stamp=stamp_of(t), sample=b"s" * 16,
                       hashed_at=1, skipped=True, box_digest=(b"b" * 16, b"d" * 16))
    inc = IncrementalState(rehash_every=8, check="version_counter")
    inc.known = {("w", i): chunk for i in range(16)}  # the rotating re-hash takes the first 2
    inc.saves = 1
    out = inc.reusable({"w": entry})
    assert sorted(ks for ks, c in out.items() if not c.trust) == [("w", 0), ("w", 1)]
    for f in dataclasses.fields(KnownChunk):
        if f.name != "trust":
            assert all(getattr(c, f.name) is getattr(chunk, f.name) for c in out.values()), f.name


def test_whole_box_is_the_memory_the_column_bands_cut_up_or_none():
    from hyper_parallel.core.distributed_checkpoint._src.transfer.unchanged import whole_box

    t = make_tensor((64, 32), seed=4)
    bands = [t[:, k * 8:(k + 1) * 8] for k in range(4)]
    whole = whole_box(bands)
    assert whole is not None and whole.is_contiguous() and whole.data_ptr() == t.data_ptr()
    assert torch.equal(whole, t)
    rows = t[8:24]  # a box of some rows: still whole rows of memory
    assert torch.equal(whole_box([rows[:, k * 8:(k + 1) * 8] for k in range(4)]), rows)
    assert whole_box(bands[:3]) is None  # three bands do not span whole rows
    assert whole_box([bands[1], bands[0], bands[2], bands[3]]) is None  # not side by side in order
    assert whole_box([b.clone() for b in bands]) is None  # copies: memory of their own
    wide = make_tensor((64, 40), seed=5)
    assert whole_box([wide[:, k * 8:(k + 1) * 8] for k in range(4)]) is None  # a part of each row only
    assert whole_box([bands[0]]) is None and whole_box([]) is None


def test_a_box_of_column_bands_all_due_is_hashed_once_in_its_own_memory(tmp_path):
    steps, sd = Steps(tmp_path, rehash_every=1), state()  # every chunk hashed in full at every save
    steps.save(sd)
    assert {c.box_digest is not None for ks, c in steps.inc.known.items() if ks[0] == "base"} == {True}
    for _ in range(2):
        sd["lora"].add_(1.0)
        path = steps.save(sd)
        st = steps.inc.last
        assert st.whole_box_bytes == BASE_BYTES and st.hashed_bytes >= BASE_BYTES and st.unread_bytes == 0, st
        assert st.written_bytes == 64 * 16 * 4, st  # lora alone
        assert_loads(path, sd)


def test_a_write_behind_the_counter_fails_the_box_hash_and_is_found_band_by_band(tmp_path):
    steps, sd = Steps(tmp_path, rehash_every=1), state()
    steps.save(sd)
    sd["base"].data[100, 500] += 1.0  # the version counter does not move
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = steps.save(sd)
    st = steps.inc.last
    assert st.whole_box_bytes == 0 and "base" in st.behind_counter, st
    assert st.written_bytes == BASE_BYTES, st  # the box's four bands, written together
    assert_loads(path, sd)
    path = steps.save(sd)  # written at the last save from the memory hashed then: that hash vouches
    assert steps.inc.last.whole_box_bytes == BASE_BYTES and steps.inc.last.written_bytes == 0
    assert_loads(path, sd)


def test_a_box_hash_never_vouches_for_a_band_written_since_it_was_taken(tmp_path):
    """Memory back to what it was when the box hash was taken does not make the band written
    since look unchanged: its stored bytes are the changed ones, and it is hashed again."""
    steps, sd = Steps(tmp_path, rehash_every=1), state()
    steps.save(sd)  # the box hash of the first bytes
    first = sd["base"][:, :128].clone()
    sd["base"][:, :128].add_(1.0)  # band 0 written in place: the box is written again
    steps.save(sd)
    sd["base"].data[:, :128] = first  # back to the first bytes, behind the counter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = steps.save(sd)
    st = steps.inc.last
    assert st.whole_box_bytes == 0 and st.written_bytes == BASE_BYTES, st
    assert_loads(path, sd)


def data_files(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.startswith("data-"))


@pytest.mark.parametrize("threads", [1, 2])
def test_chunks_found_changed_only_by_hashing_are_written_after_the_others_into_files_of_their_own(tmp_path, threads):
    """The saver writes what the cheap checks find changed while it hashes the undecided
    chunks; those the hashes find changed go into a second round of files."""
    steps, sd = Steps(tmp_path), state()
    sd["fresh"] = make_tensor((256, 64), seed=4)
    sd["copy"] = make_tensor((256, 64), seed=5)

    def step() -> str:
        steps.step += 1
        steps.inc.begin(step_dir_name(steps.step))
        path = os.path.join(steps.root, step_dir_name(steps.step))
        save(sd, path, incremental=steps.inc, no_dist=True, thread_count=threads)
        return path

    first = step()
    assert len(data_files(first)) <= threads
    for seed in (6, 7):
        sd["lora"].add_(1.0)  # in place: written at once, unhashed
        sd["fresh"] = make_tensor((256, 64), seed=seed)  # new memory, new bytes: hashed, then written
        sd["copy"] = sd["copy"].clone()  # new memory, the same bytes: hashed, reused
        path = step()
        st = steps.inc.last
        assert st.written_bytes == (64 * 16 + 256 * 64) * 4, st
        assert st.hashed_bytes >= 2 * 256 * 64 * 4 + 64 * 16 * 4, st  # fresh, copy, and lora as written
        # one file of what the checks found changed (lora), then one of what the hashes did (fresh)
        assert [f.split("-")[2] for f in data_files(path)] == ["0", "1"], data_files(path)
        assert_loads(path, sd)
    assert not steps.inc.untracked
    sd["exp_avg"].mul_(0.5)  # nothing left to hash: one round again
    path = step()
    assert len(data_files(path)) <= threads
    assert_loads(path, sd)


def test_a_failed_save_removes_the_second_round_of_data_files_too(tmp_path):
    from hyper_parallel.core.distributed_checkpoint import FileSystemWriter

    class FailingCommit(FileSystemWriter):
        def commit(self, metadata, name=".metadata"):  # after both rounds of data files are written
            assert sorted(f.split("-")[2] for f in data_files(self.path)) == ["0", "1"]
            raise OSError(28, "No space left on device (injected)")

    inc, sd = IncrementalState(check="version_counter"), state()
    inc.begin(step_dir_name(1))
    save(sd, os.path.join(tmp_path, step_dir_name(1)), incremental=inc, no_dist=True)
    sd["lora"].add_(1.0)
    sd["exp_avg"] = make_tensor((64, 16), seed=8)
    inc.begin(step_dir_name(2))
    path = os.path.join(tmp_path, step_dir_name(2))
    with pytest.raises(Exception, match="injected"):
        save(sd, storage_writer=FailingCommit(path), incremental=inc, no_dist=True)
    assert data_files(path) == [], "a failed save left data files behind"
    assert not os.path.exists(os.path.join(path, ".metadata"))


def test_the_first_files_are_decided_by_stamps_alone_and_spot_checks_run_beside_them_at_background_priority(
        tmp_path, monkeypatch):
    """Pass 1 reads no tensor: what its stamp says was written in place goes into the first
    files at once. The spot checks run while those are written, on a thread at background
    niceness, and what they find changed (a write behind torch's version counter) goes into
    a second round of files."""
    from hyper_parallel.core.distributed_checkpoint._src.base.priority import BACKGROUND_NICE
    from hyper_parallel.core.distributed_checkpoint._src.transfer import chunk_checks, unchanged

    steps, sd = Steps(tmp_path), state()
    steps.save(sd)
    sampled: list[int] = []
    real_sample = unchanged.sample_digest
    monkeypatch.setattr(unchanged, "sample_digest", lambda v: sampled.append(v.numel()) or real_sample(v))
    niceness: list[int] = []
    real_pending = chunk_checks.ChunkChecks.hash_pending

    def spy(self, digest):
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_pending(self, digest)

    monkeypatch.setattr(chunk_checks.ChunkChecks, "hash_pending", spy)
    real_triage = chunk_checks.ChunkChecks.triage

    def first_pass(self, planner, fence):
        out = real_triage(self, planner, fence)
        assert not sampled, "pass 1 read a tensor"
        return out

    monkeypatch.setattr(chunk_checks.ChunkChecks, "triage", first_pass)
    sd["lora"].add_(1.0)  # in place, through torch: known from its stamp
    sd["exp_avg"].data.mul_(0.5)  # behind the counter, every element: the spot check sees it
    path = steps.save(sd)
    assert sampled, "the spot checks did not run"
    if hasattr(os, "getpriority"):
        assert niceness and niceness[0] >= min(BACKGROUND_NICE, 19), niceness
    assert [f.split("-")[2] for f in data_files(path)] == ["0", "1"], data_files(path)
    assert steps.inc.last.written_bytes == 2 * 64 * 16 * 4
    assert_loads(path, sd)
