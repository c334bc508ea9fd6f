"""The same storage behaviours on every backend: local files, fsspec memory, S3 on loopback."""

from __future__ import annotations

import uuid

import pytest
import torch
from helpers import assert_same, make_tensor

from hyper_parallel.core.distributed_checkpoint import (
    CorruptCheckpointError,
    FileSystemReader,
    FileSystemWriter,
    NotACheckpointError,
    load,
    save,
)
from hyper_parallel.core.distributed_checkpoint._src.backends.fsspec import FsspecReader, FsspecWriter


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request, tmp_path):
    """(writer factory, reader factory, corrupt(name) helper) for one backend."""
    if request.param == "local":
        root = str(tmp_path / "ckpt")
        return (lambda: FileSystemWriter(root), lambda: FileSystemReader(root),
                lambda: (root, None))
    if request.param == "memory":
        url = f"memory://hp-tests/{uuid.uuid4().hex}"
        return (lambda: FsspecWriter(url), lambda: FsspecReader(url), lambda: (url, {}))
    endpoint = request.getfixturevalue("s3_endpoint")
    import boto3
    bucket = f"hp-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    opts = {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
    url = f"s3://{bucket}/ckpt"
    return (lambda: FsspecWriter(url, **opts), lambda: FsspecReader(url, **opts), lambda: (url, opts))


def _sd():
    return {"w": make_tensor((300, 1000)), "b": make_tensor((7,), torch.bfloat16), "step": 5, "blob": b"xyz"}


def test_round_trip_and_overwrite_on_every_backend(backend):
    new_writer, new_reader, _ = backend
    sd = _sd()
    save(sd, storage_writer=new_writer())
    assert_same(sd, load(storage_reader=new_reader()))
    sd["step"], sd["w"] = 6, sd["w"] + 1
    save(sd, storage_writer=new_writer())
    target = {"w": torch.zeros(300, 1000), "b": torch.zeros(7, dtype=torch.bfloat16), "step": 0, "blob": b""}
    load(target, storage_reader=new_reader())
    assert_same(sd, target)


def test_missing_checkpoint_and_missing_data_file_on_every_backend(backend):
    new_writer, new_reader, where = backend
    with pytest.raises(NotACheckpointError):
        load(storage_reader=new_reader())
    meta = save(_sd(), storage_writer=new_writer())
    writer = new_writer()
    writer.remove(meta.file_names())
    with pytest.raises(CorruptCheckpointError, match="missing"):
        load(storage_reader=new_reader())


def test_a_truncated_data_file_is_named_on_every_backend(backend):
    # on S3 a range past the end is a 416, which came out as a bare OSError naming no file; the
    # index range is now compared with the file's size (fstat, the object's size) before it is read
    import fsspec

    new_writer, new_reader, where = backend
    meta = save({"w": torch.arange(100000, dtype=torch.float32)}, storage_writer=new_writer())
    root, opts = where()
    fs, base = fsspec.core.url_to_fs(root, **(opts or {}))
    name = next(n for n in meta.file_names() if n.startswith("data-"))
    body = fs.cat_file(f"{base}/{name}")
    fs.pipe_file(f"{base}/{name}", body[:-5000])
    with pytest.raises(CorruptCheckpointError, match=f"{name}': its index .* lies beyond its end .* truncated"):
        load(storage_reader=new_reader())


class _FailingParts:
    """Data parts that fail after the first ``ok`` bytes, as a rank whose save breaks mid-file."""

    def __init__(self, ok: int):
        self.ok = ok

    def __iter__(self):
        yield bytes(self.ok)
        raise OSError("injected: the save failed mid-file")


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_a_failed_write_leaves_no_multipart_upload_behind(backend, monkeypatch):
    # the parts of an unfinished multipart upload stayed in the bucket: billed, listed by no one
    new_writer, _, where = backend
    url, opts = where()
    writer = new_writer()
    writer.set_up(0, True)
    with pytest.raises(OSError, match="injected"):  # past one 16 MiB part: an upload is under way
        writer.write_file("data-r00000-0-00ff.safetensors", _FailingParts(20 << 20))
    import boto3

    bucket = url.removeprefix("s3://").split("/", 1)[0]
    s3 = boto3.client("s3", endpoint_url=opts["client_kwargs"]["endpoint_url"])
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert not writer.fs.exists(f"{writer.root}/data-r00000-0-00ff.safetensors")
    # a failure while completing the upload (close) aborts it too
    import s3fs

    def refuse(self):
        raise OSError("injected: completing the upload failed")

    monkeypatch.setattr(s3fs.core.S3File, "commit", refuse)
    with pytest.raises(OSError, match="completing"):
        writer.write_file("data-r00000-0-00fe.safetensors", [bytes(20 << 20)])
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_the_offline_tools_read_the_urls_load_reads(tmp_path):
    # save/load took fsspec URLs; verify, reshard, offline_transform and export_torch_dcp
    # called every URL "not a checkpoint"
    from hyper_parallel.core.distributed_checkpoint import export_torch_dcp, offline_transform, verify_checkpoint
    from hyper_parallel.core.distributed_checkpoint._src.resharding.reshard import reshard

    sd = {"w": torch.arange(32, dtype=torch.float32).reshape(8, 4)}
    src = f"memory://offline-tools-{tmp_path.name}/ck"
    save(sd, src, no_dist=True)
    for url in (src, f"file://{tmp_path / 'local'}"):
        if url.startswith("file://"):
            save(sd, url, no_dist=True)
        name = url.rsplit("/", 1)[-1]
        assert verify_checkpoint(url).ok
        reshard(url, str(tmp_path / f"rs-{name}"), dst_mesh={"dp": 2})
        offline_transform(url, str(tmp_path / f"ot-{name}"), dst_layout={"dp": 2})
        export_torch_dcp(url, str(tmp_path / f"tdcp-{name}"))
        for out in (f"rs-{name}", f"ot-{name}"):
            assert torch.equal(load(path=str(tmp_path / out))["w"], sd["w"])



@pytest.fixture(params=["memory", "s3"])
def url_root(request, monkeypatch):
    """A fresh fsspec URL root; for s3, a bucket on the loopback server, reached through the
    environment as a plain ``s3://`` URL carries no options."""
    if request.param == "memory":
        return f"memory://offline-dst-{uuid.uuid4().hex[:8]}"
    endpoint = request.getfixturevalue("s3_endpoint")
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    bucket = f"hp-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}"


def test_the_offline_tools_write_to_urls(tmp_path, url_root, monkeypatch):
    # destinations were local paths only: an s3:// URL became a local directory named "s3:"
    from hyper_parallel.core.distributed_checkpoint import (
        CheckpointError,
        full_state_dict_to_dcp_format,
        offline_transform,
        verify_checkpoint,
    )
    from hyper_parallel.core.distributed_checkpoint._src.resharding.reshard import reshard

    monkeypatch.chdir(tmp_path)  # a URL taken for a relative path lands here
    sd = {"w": torch.arange(96, dtype=torch.float32).reshape(8, 12), "step": 3}
    src = str(tmp_path / "src")
    save(sd, src, no_dist=True)
    reshard(src, f"{url_root}/rs", dst_mesh={"dp": 2})
    offline_transform(f"{url_root}/rs", f"{url_root}/ot", dst_layout={"tp": 4})
    full_state_dict_to_dcp_format(sd, f"{url_root}/full")
    for name in ("rs", "ot", "full"):
        assert verify_checkpoint(f"{url_root}/{name}").ok, name
        assert_same(sd, load(path=f"{url_root}/{name}", no_dist=True))
    assert not (tmp_path / "s3:").exists() and not (tmp_path / "memory:").exists()
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        offline_transform(src, f"{url_root}/ot", dst_layout={"tp": 2})
    with pytest.raises(ValueError, match="differ"):
        offline_transform(f"{url_root}/ot", f"{url_root}/ot/", dst_layout={"tp": 2})
    offline_transform(src, f"{url_root}/ot", dst_layout={"tp": 2}, overwrite=True)
    assert_same(sd, load(path=f"{url_root}/ot", no_dist=True))


@pytest.fixture()
def silent_endpoint():
    """An HTTP endpoint that accepts connections and never answers (a stuck object store)."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held, stop = [], threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])  # kept open, never read from or answered
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


def test_a_stuck_object_store_fails_a_save_and_a_load_within_their_timeout(silent_endpoint):
    # timeout= bounded only the waits between ranks: against an endpoint that never answers a
    # save was still blocked after 150 s (s3fs retries on top of botocore's 60 s read timeouts)
    import time

    from hyper_parallel.core.distributed_checkpoint import StorageTimeoutError

    opts = {"client_kwargs": {"endpoint_url": silent_endpoint}, "skip_instance_cache": True,
            "key": "k", "secret": "s"}
    from hyper_parallel.core.distributed_checkpoint import CheckpointManager, RankFailedError

    for call in (lambda: save(_sd(), storage_writer=FsspecWriter("s3://bucket/ck", **opts), no_dist=True, timeout=2),
                 lambda: load(_sd(), storage_reader=FsspecReader("s3://bucket/ck", **opts), no_dist=True, timeout=2)):
        t0 = time.monotonic()
        with pytest.raises(StorageTimeoutError, match=r"s3://bucket/ck\): the storage gave no answer within 2s"):
            call()
        assert time.monotonic() - t0 < 10
    # the manager's own calls (listing the steps, its owner file) too
    t0 = time.monotonic()
    with pytest.raises((StorageTimeoutError, RankFailedError), match=r"s3://bucket/run\): the storage gave no answer"):
        CheckpointManager("s3://bucket/run", storage_options=opts, timeout=2)
    assert time.monotonic() - t0 < 10


def test_a_metadata_write_slower_than_the_timeout_leaves_a_whole_checkpoint(monkeypatch):
    # a bounded .metadata PUT that timed out was taken for "not committed": every rank removed
    # its new files, then the PUT landed and named them (the previous checkpoint was gone too)
    import time

    from fsspec.implementations.memory import MemoryFileSystem

    from hyper_parallel.core.distributed_checkpoint import CommitError

    url = f"memory://slow-{uuid.uuid4().hex[:8]}/ck"
    save({"w": torch.ones(4)}, url, no_dist=True)
    real = MemoryFileSystem.pipe_file
    landed = []

    def slow(self, path, value, **kw):
        if path.endswith(".metadata"):
            time.sleep(1.0)  # a slow endpoint, not a dead one: the write lands after the timeout
        real(self, path, value, **kw)
        landed.append(path)

    monkeypatch.setattr(MemoryFileSystem, "pipe_file", slow)
    with pytest.raises(CommitError, match="either this save .* or the previous one") as info:
        save({"w": torch.full((4,), 2.0)}, url, no_dist=True, timeout=0.3)
    assert info.value.committed is None
    deadline = time.monotonic() + 10
    while not landed and time.monotonic() < deadline:
        time.sleep(0.05)
    monkeypatch.setattr(MemoryFileSystem, "pipe_file", real)
    assert torch.equal(load(path=url, no_dist=True)["w"], torch.full((4,), 2.0))  # whole: its files were kept
