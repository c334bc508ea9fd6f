"""The local-filesystem I/O engine: O_DIRECT where it works, buffered elsewhere, the same bytes either way."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from helpers import make_tensor
from safetensors import safe_open

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    FileSystemReader,
    FileSystemWriter,
    NotACheckpointError,
    load,
    save,
)
from hyper_parallel.core.distributed_checkpoint._src.backends import direct_io
from hyper_parallel.core.distributed_checkpoint._src.backends import filesystem as fss
from hyper_parallel.core.distributed_checkpoint._src.base.alignment import DIRECT_IO_ALIGN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
O_DIRECT = getattr(os, "O_DIRECT", 0)
SHM = "/dev/shm"

needs_direct_fs = pytest.mark.skipif(
    not O_DIRECT or not direct_io.direct_io_default("/tmp"),
    reason="/tmp is not on a filesystem where O_DIRECT is the automatic choice")
needs_tmpfs = pytest.mark.skipif(not os.path.isdir(SHM) or direct_io.filesystem_name(SHM) != "tmpfs",
                                 reason="no tmpfs at /dev/shm")


@pytest.fixture
def ext_dir(tmp_path):
    return str(tmp_path / "ckpt")


@pytest.fixture
def shm_dir(tmp_path):
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="hp-fs-test-", dir=SHM)
    yield os.path.join(d, "ckpt")
    shutil.rmtree(d, ignore_errors=True)


def _odd_state_dict() -> dict:
    """Sizes that are not multiples of anything, every dtype family, views and empties."""
    wide = make_tensor((300, 5000), seed=1)
    return {
        "f32": make_tensor((1000, 333)),  # 1.3 MB, unaligned length
        "bf16": make_tensor((3, 1 << 17), torch.bfloat16, seed=2),
        "f64": make_tensor((4097,), torch.float64, seed=3),
        "i8": make_tensor((65537,), torch.int8, seed=4),
        "bool": make_tensor((1001, 7), torch.bool, seed=5),
        "c64": make_tensor((129, 65), torch.complex64, seed=6),
        "i16": torch.arange(7, dtype=torch.int16),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "view": wide[:, 7:4000],  # non-contiguous: copied slab by slab
        "tail": make_tensor((1,), torch.float16, seed=7),
        "step": 12,
        "blob": b"x" * 4099,
    }


def _assert_loaded(path: str, sd: dict, **reader_kw) -> None:
    out = load(path=path, storage_reader=FileSystemReader(path, **reader_kw))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
            assert torch.equal(out[k], v), k
        else:
            assert out[k] == v, k


def _data_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def _spy_open(monkeypatch) -> list[int]:
    flags_seen: list[int] = []
    real = os.open

    def spy(path, flags, *a, **kw):
        if str(path).endswith(".safetensors"):
            flags_seen.append(flags)
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    return flags_seen


def _wrap_writes(monkeypatch, before):
    """Call ``before(fd, offset[, views])`` ahead of every data write (pwrite and pwritev)."""
    import inspect
    real, realv = os.pwrite, os.pwritev
    with_views = len(inspect.signature(before).parameters) == 3

    def pwrite(fd, data, offset):
        before(fd, offset, [data]) if with_views else before(fd, offset)
        return real(fd, data, offset)

    def pwritev(fd, views, offset):
        before(fd, offset, list(views)) if with_views else before(fd, offset)
        return realv(fd, views, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "pwritev", pwritev)


@needs_direct_fs
def test_automatic_mode_writes_with_o_direct_on_a_block_filesystem(ext_dir, monkeypatch):
    flags = _spy_open(monkeypatch)
    sd = _odd_state_dict()
    writer = FileSystemWriter(ext_dir)
    save(sd, storage_writer=writer, no_dist=True)
    assert writer.uses_direct_io is True
    assert flags and all(f & O_DIRECT for f in flags if f & os.O_WRONLY)
    _assert_loaded(ext_dir, sd)


@needs_tmpfs
def test_automatic_mode_writes_buffered_on_tmpfs(shm_dir, monkeypatch):
    flags = _spy_open(monkeypatch)
    sd = _odd_state_dict()
    writer = FileSystemWriter(shm_dir)
    save(sd, storage_writer=writer, no_dist=True)
    assert writer.uses_direct_io is False
    assert flags and not any(f & O_DIRECT for f in flags)
    _assert_loaded(shm_dir, sd)


@needs_direct_fs
def test_direct_io_false_forces_buffered_writes(ext_dir, monkeypatch):
    flags = _spy_open(monkeypatch)
    sd = _odd_state_dict()
    writer = FileSystemWriter(ext_dir, direct_io=False)
    save(sd, storage_writer=writer, no_dist=True)
    assert writer.uses_direct_io is False
    assert flags and not any(f & O_DIRECT for f in flags)
    _assert_loaded(ext_dir, sd)


@needs_tmpfs
def test_direct_io_true_forces_o_direct_where_the_kernel_allows_it(shm_dir, monkeypatch):
    if not O_DIRECT:
        pytest.skip("no O_DIRECT")
    try:
        fd = os.open(os.path.join(SHM, f"hp-odirect-probe-{os.getpid()}"), os.O_WRONLY | os.O_CREAT | O_DIRECT, 0o600)
    except OSError:
        pytest.skip("this kernel's tmpfs refuses O_DIRECT")
    os.close(fd)
    os.unlink(os.path.join(SHM, f"hp-odirect-probe-{os.getpid()}"))
    flags = _spy_open(monkeypatch)
    sd = _odd_state_dict()
    writer = FileSystemWriter(shm_dir, direct_io=True)
    save(sd, storage_writer=writer, no_dist=True)
    assert writer.uses_direct_io is True and all(f & O_DIRECT for f in flags if f & os.O_WRONLY)
    _assert_loaded(shm_dir, sd)


def _refuse_direct_open(monkeypatch):
    real = os.open

    def refusing(path, flags, *a, **kw):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refusing)


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT")
def test_a_filesystem_that_refuses_o_direct_falls_back_or_fails_clearly(ext_dir, monkeypatch):
    _refuse_direct_open(monkeypatch)
    monkeypatch.setattr(direct_io, "direct_io_default", lambda path: True)
    sd = _odd_state_dict()
    writer = FileSystemWriter(ext_dir)  # automatic: falls back to buffered writes
    save(sd, storage_writer=writer, no_dist=True)
    assert writer.uses_direct_io is False
    _assert_loaded(ext_dir, sd)  # automatic reads fall back to the page cache too
    # forced: an error naming the file, as for writes (it read through the page cache, silently)
    with pytest.raises(CheckpointError, match=r"direct_io=True.*data-r0"):
        _assert_loaded(ext_dir, sd, direct_io=True)
    with pytest.raises(CheckpointError, match="direct_io=True"):
        save(sd, storage_writer=FileSystemWriter(ext_dir + "-forced", direct_io=True), no_dist=True)
    assert not os.path.exists(os.path.join(ext_dir + "-forced", ".metadata"))


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT")
def test_einval_on_the_first_direct_write_falls_back_to_buffered(ext_dir, monkeypatch):
    refused = []

    def refuse(fd, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")

    _wrap_writes(monkeypatch, refuse)
    sd = _odd_state_dict()
    writer = FileSystemWriter(ext_dir, direct_io=None)
    writer._direct = True  # as on a filesystem that accepts the open but not the write
    save(sd, storage_writer=writer, no_dist=True)
    assert refused == [0] and writer.uses_direct_io is False
    _assert_loaded(ext_dir, sd)


@pytest.mark.parametrize("direct", [True, False])
def test_files_are_valid_safetensors_and_bit_exact_in_both_modes(tmp_path, direct):
    if direct and not O_DIRECT:
        pytest.skip("no O_DIRECT")
    path = str(tmp_path / "ckpt")
    sd = _odd_state_dict()
    save(sd, storage_writer=FileSystemWriter(path, direct_io=direct), no_dist=True)
    _assert_loaded(path, sd)
    _assert_loaded(path, sd, direct_io=True)
    for name in _data_files(path):
        size = os.path.getsize(name)
        with safe_open(name, "pt") as f:
            for entry in f.keys():
                key, _, at = entry.partition("@")
                if key in sd and isinstance(sd[key], torch.Tensor) and sd[key].numel():
                    got = f.get_tensor(entry)  # a chunk, or a column band of one
                    offsets = [int(x) for x in at.split(",")] if at else []
                    want = sd[key][tuple(slice(o, o + n) for o, n in zip(offsets, got.shape, strict=False))]
                    if got.dtype == sd[key].dtype:
                        assert torch.equal(got, want), entry
        if direct:
            assert size % DIRECT_IO_ALIGN == 0  # format v2: files with large payloads end on a block


def test_many_small_tensors_cost_few_system_calls(tmp_path):
    sd = {f"layer{i}.bias": make_tensor((i % 13 + 1, 3), seed=i) for i in range(400)}
    sd["big"] = make_tensor((1 << 20,))
    for direct in ([True, False] if O_DIRECT else [False]):
        path = str(tmp_path / f"ckpt-{direct}")
        writer = FileSystemWriter(path, direct_io=direct)
        save(sd, storage_writer=writer, no_dist=True)
        assert writer.write_calls <= 4, (direct, writer.write_calls)
        reader = FileSystemReader(path)
        out = load(path=path, storage_reader=reader)
        assert all(torch.equal(out[k], v) for k, v in sd.items())
        assert reader.read_calls <= 8, reader.read_calls  # indexes + a few runs, not one per tensor


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT")
def test_aligned_parts_are_written_from_their_own_memory(ext_dir, monkeypatch):
    os.makedirs(ext_dir)
    written: list[tuple[int, int, int]] = []

    def record(fd, offset, views):
        for v in views:
            written.append((direct_io.address(memoryview(v)), memoryview(v).nbytes, offset))
            offset += memoryview(v).nbytes

    _wrap_writes(monkeypatch, record)
    writer = FileSystemWriter(os.path.dirname(ext_dir), direct_io=True)
    writer.prepare()
    payload = direct_io.aligned_array(1 << 20)
    payload[:] = np.arange(1 << 20) % 251
    head = b"h" * 4096
    n = writer.write_file("f.bin", [memoryview(head), memoryview(payload), memoryview(b"tail")])
    assert n == 4096 + (1 << 20) + 4
    assert (direct_io.address(memoryview(payload)), 1 << 20, 4096) in written  # no copy
    with open(os.path.join(os.path.dirname(ext_dir), "f.bin"), "rb") as f:
        assert f.read() == head + payload.tobytes() + b"tail"  # padded write, then truncated


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT")
def test_direct_writes_ramp_up_and_keep_every_byte_in_place(ext_dir, monkeypatch):
    """The first O_DIRECT write of a file is small, so the disk starts early; later ones grow
    to WRITE_BYTES. Parts of every kind (tiny, unaligned and copied through bounce buffers
    that are queued a block at a time, aligned and written from their own memory) land in
    order, bit-exact."""
    os.makedirs(ext_dir)
    sizes: list[int] = []
    _wrap_writes(monkeypatch, lambda fd, offset, views: sizes.append(sum(memoryview(v).nbytes for v in views)))
    rng = np.random.default_rng(3)
    parts: list[memoryview] = []
    for i in range(120):
        kind = i % 3
        n = int(rng.integers(1, 5000)) if kind == 0 else int(rng.integers(100 << 10, 900 << 10))
        if kind == 2:
            a = direct_io.aligned_array(n - n % DIRECT_IO_ALIGN or DIRECT_IO_ALIGN)
            a[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
        else:
            a = rng.integers(0, 256, n + 1, dtype=np.uint8)[1:]  # off a block boundary
        parts.append(memoryview(a))
    writer = FileSystemWriter(os.path.dirname(ext_dir), direct_io=True)
    writer.prepare()
    total = writer.write_file("f.bin", parts)
    want = b"".join(bytes(p) for p in parts)
    assert total == len(want) > 3 * fss.WRITE_BYTES
    with open(os.path.join(os.path.dirname(ext_dir), "f.bin"), "rb") as f:
        assert f.read() == want
    assert sizes[0] <= 2 << 20 < fss.WRITE_BYTES, sizes[:4]  # ~FIRST_WRITE_BYTES, plus a part
    assert max(sizes) <= fss.WRITE_BYTES + (900 << 10) and max(sizes) >= fss.WRITE_BYTES, sizes
    assert all(s % DIRECT_IO_ALIGN == 0 for s in sizes), sizes


def test_an_error_while_streaming_leaves_no_thread_and_no_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    writer = FileSystemWriter(path)
    writer.prepare()

    def parts():
        yield memoryview(bytes(5 << 20))
        raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError, match="producer failed"):
        writer.write_file("data.safetensors", parts())
    time.sleep(0.05)
    import threading
    assert not [t for t in threading.enumerate() if t.name == "dcp-pwrite"]
    with pytest.raises(NotACheckpointError):
        load(path=path)


def test_a_write_error_is_raised_in_the_caller(tmp_path, monkeypatch):
    def failing(fd, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    _wrap_writes(monkeypatch, failing)
    with pytest.raises(OSError, match="No space"):
        save({"w": make_tensor((1000, 100))}, storage_writer=FileSystemWriter(str(tmp_path / "c")), no_dist=True)
    assert not os.path.exists(tmp_path / "c" / ".metadata")


_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {root!r})
    from hyper_parallel.core.distributed_checkpoint import save, FileSystemWriter
    real, realv = os.pwrite, os.pwritev
    def started():
        open({marker!r}, "w").close()  # tell the parent: writing has started
        time.sleep(0.5)
    os.pwrite = lambda fd, data, offset: (started(), real(fd, data, offset))[1]
    os.pwritev = lambda fd, views, offset: (started(), realv(fd, views, offset))[1]
    sd = {{"w%d" % i: torch.full((1 << 20,), float(i)) for i in range(8)}}
    save(sd, storage_writer=FileSystemWriter({path!r}), no_dist=True)
    print("finished")
""")


def _kill_mid_write(tmp_path, path: str) -> None:
    """Start a save of a large state to ``path`` in a child and SIGKILL it while it writes."""
    marker = str(tmp_path / "writing")
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(root=ROOT, marker=marker, path=path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.path.exists(marker), child.communicate()[1][-2000:]
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(30)
    assert child.returncode == -signal.SIGKILL


def test_a_crash_mid_write_leaves_the_previous_checkpoint_committed(tmp_path):
    path = str(tmp_path / "ckpt")
    old = {"w0": torch.zeros(4)}
    save(old, path, no_dist=True)
    _kill_mid_write(tmp_path, path)
    out = load(path=path)  # still the old checkpoint
    assert set(out) == {"w0"} and torch.equal(out["w0"], old["w0"])


def test_a_crash_mid_first_save_leaves_no_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    _kill_mid_write(tmp_path, path)
    assert _data_files(path)  # a data file was being written
    with pytest.raises(NotACheckpointError):
        load(path=path)


@pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT")
def test_reader_direct_io_reads_aligned_requests_with_o_direct(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    sd = _odd_state_dict()
    save(sd, path, no_dist=True)
    reader = FileSystemReader(path, direct_io=True)
    assert reader.read_alignment == DIRECT_IO_ALIGN
    _assert_loaded(path, sd, direct_io=True)
    reader = FileSystemReader(path, direct_io=True)
    name = os.path.basename(_data_files(path)[0])
    buf = direct_io.aligned_array(8192)
    reader.read_into(name, 4096, memoryview(buf))
    with reader._files.held(name, direct=True) as fd:  # opened with O_DIRECT, kept for the next read
        assert fd is not None and os.get_blocking(fd) and os.O_DIRECT & fcntl.fcntl(fd, fcntl.F_GETFL)
    with open(os.path.join(path, name), "rb") as f:
        f.seek(4096)
        assert f.read(8192) == buf.tobytes()
    unaligned = bytearray(100)
    reader.read_into(name, 3, memoryview(unaligned))  # unaligned: through the page cache
    with open(os.path.join(path, name), "rb") as f:
        f.seek(3)
        assert f.read(100) == bytes(unaligned)
    reader.close()


def test_direct_io_argument_is_checked(tmp_path):
    with pytest.raises(ValueError, match="direct_io"):
        FileSystemWriter(str(tmp_path), direct_io="yes")
    with pytest.raises(ValueError, match="direct_io"):
        FileSystemReader(str(tmp_path), direct_io=1.0)


def test_aligned_pool_reuses_memory_once_released():
    pool = direct_io.AlignedPool(size=1 << 16, keep=1 << 20, min_size=1 << 12)
    a = pool.get(1000)
    addr = direct_io.address(a)
    assert addr % DIRECT_IO_ALIGN == 0 and a.nbytes == 1000
    view = a[10:20]
    del a
    assert pool.idle_bytes() == 0  # a slice still holds it
    del view
    assert pool.idle_bytes() == 1 << 12  # the smallest size class that fits
    b = pool.get(500)
    assert direct_io.address(b) == addr
    c = pool.get(5000)  # the next class up: fresh memory
    assert c.nbytes == 5000 and direct_io.address(c) != addr
    big = pool.get(1 << 17)
    assert big.nbytes == 1 << 17 and direct_io.address(big) % DIRECT_IO_ALIGN == 0
    del b, c, big
    assert pool.idle_bytes() == (1 << 12) + (1 << 13)  # dedicated memory is not kept


def test_aligned_pool_evicts_the_oldest_idle_buffers_to_keep_a_returned_one():
    # Idle small buffers must not keep a large one out: every large read would fault in
    # fresh memory (the kernel zeroing pages was a quarter of a cold load's CPU).
    pool = direct_io.AlignedPool(size=1 << 16, keep=1 << 16, min_size=1 << 12)
    small = [pool.get(1 << 12) for _ in range(16)]
    del small
    assert pool.idle_bytes() == 1 << 16  # full of small buffers
    big = pool.get(1 << 16)
    addr = direct_io.address(big)
    del big
    assert pool.idle_bytes() == 1 << 16  # the large one evicted every small one
    again = pool.get(1 << 16)
    assert direct_io.address(again) == addr
    del again


def test_aligned_pool_holds_a_working_set_while_held_and_trims_after():
    pool = direct_io.AlignedPool(size=1 << 16, keep=1 << 16, min_size=1 << 16)
    with pool.held(3 << 16):
        bufs = [pool.get(1 << 16) for _ in range(4)]
        addrs = {direct_io.address(b) for b in bufs}
        del bufs
        assert pool.idle_bytes() == 4 << 16  # keep + held: all four stay
        with pool.held(1 << 16):  # nested holders add up
            pass
        assert pool.idle_bytes() == 4 << 16
        reused = [pool.get(1 << 16) for _ in range(4)]
        assert {direct_io.address(b) for b in reused} == addrs  # no fresh memory
        del reused
    assert pool.idle_bytes() == 1 << 16  # back to keep once the last holder left


def test_filesystem_names():
    assert direct_io.filesystem_name("/proc") not in ("", None)
    if os.path.isdir(SHM):
        assert direct_io.direct_io_default(SHM) is (direct_io.filesystem_name(SHM) in
                                                  direct_io.DIRECT_FILESYSTEMS.values())
    _ = fss  # the module under test


def test_deferred_sync_makes_every_data_file_durable_before_the_commit(tmp_path, monkeypatch):
    """defer_sync batches the fsyncs, but all of them happen before .metadata is in place."""
    synced: list[str] = []
    synced_at_commit: list[set[str]] = []
    real_fsync, real_commit = os.fsync, FileSystemWriter.commit

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def commit(self, *args, **kwargs):
        synced_at_commit.append(set(synced))
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(FileSystemWriter, "commit", commit)
    path = str(tmp_path / "c")
    writer = FileSystemWriter(path, defer_sync=True, direct_io=False)
    sd = {"w": make_tensor((64, 8)), "b": make_tensor((8,))}
    save(sd, storage_writer=writer, no_dist=True)
    data = {os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")}
    assert data and synced_at_commit and data <= synced_at_commit[0]
    assert not writer._unsynced
    out = load(path=path)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
