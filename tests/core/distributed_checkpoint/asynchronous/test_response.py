"""async_save returns what torch's returns: a concurrent.futures.Future, or (with an async
stager that stages in the background) torch's AsyncSaveResponse; either carries our extras.
Each shape is checked against stock torch 2.13 called the same way. One process, real files."""

from __future__ import annotations

import concurrent.futures
import os
import warnings
from concurrent.futures import Future

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.metadata import Metadata as TorchMetadata
from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse as TorchAsyncSaveResponse

from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer, AsyncSaveFuture, async_save, load
from hyper_parallel.core.distributed_checkpoint import state_dict_saver as saver_face


def _stager(kind: str):
    if kind == "none":
        return None
    if kind == "blocking":
        return BlockingAsyncStager()
    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                        use_async_staging=kind == "background", use_non_blocking_copy=False))


def _shape(result) -> tuple[bool, bool]:
    return isinstance(result, Future), isinstance(result, TorchAsyncSaveResponse)


def _wait(result) -> None:
    (result.upload_completion if isinstance(result, TorchAsyncSaveResponse) else result).result(timeout=120)


@pytest.mark.parametrize("kind", ["none", "blocking", "eager", "background"])
def test_the_return_has_the_shape_stock_torch_gives(tmp_path, kind):
    sd = {"w": torch.arange(12.0).reshape(3, 4)}
    theirs_stager, ours_stager = _stager(kind), _stager(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = tdcp.async_save(sd, checkpoint_id=str(tmp_path / "torch"), async_stager=theirs_stager, no_dist=True)
    _wait(theirs)
    ours = async_save(sd, checkpoint_id=str(tmp_path / "ours"), async_stager=ours_stager, no_dist=True)
    _wait(ours)
    for stager in (theirs_stager, ours_stager):
        if stager is not None and hasattr(stager, "close"):
            stager.close()
    assert _shape(ours) == _shape(theirs)
    assert _shape(ours) == ((False, True) if kind == "background" else (True, False))
    out = {"w": torch.zeros(3, 4)}
    load(out, checkpoint_id=str(tmp_path / "ours"), no_dist=True)
    assert torch.equal(out["w"], sd["w"])


def test_without_a_stager_it_is_a_future_with_our_extras(tmp_path):
    ckpt = AsyncCheckpointer()
    try:
        seen = []
        fut = async_save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path), no_dist=True, checkpointer=ckpt)
        fut.add_done_callback(lambda f: seen.append(f))
        done, _ = concurrent.futures.wait([fut], timeout=120)  # the stdlib's own waiting works on it
        assert done == {fut}
        meta = fut.result()
        assert isinstance(fut, AsyncSaveFuture) and isinstance(meta, TorchMetadata) and "w" in meta.entries
        assert fut.done() and not fut.running() and not fut.cancelled() and fut.exception() is None
        assert seen == [fut]
        # the extras: torch's AsyncSaveResponse names, HyperParallel's, and ours
        assert fut.upload_completion is fut and fut.staging_completion.result(timeout=0) is None
        assert fut.persist_completion.result(timeout=0) is meta and fut.get_result() is meta
        assert fut.staged() and fut.staging == "eager" and fut.blocking_s >= 0 and fut.total_s >= fut.blocking_s
        fut.wait_staged(timeout=0)
    finally:
        ckpt.close()


def test_with_a_background_stager_it_is_torchs_response_whose_upload_is_our_future(tmp_path):
    stager = _stager("background")
    try:
        resp = async_save({"w": torch.ones(64, 64)}, checkpoint_id=str(tmp_path), async_stager=stager, no_dist=True)
        assert isinstance(resp, saver_face.AsyncSaveResponse)  # the name code importing our face checks
        assert not isinstance(resp, Future)
        assert resp.staging_completion.result(timeout=60) is None
        assert isinstance(resp.upload_completion, AsyncSaveFuture)
        meta = resp.upload_completion.result(timeout=120)
        # the Future's extras answer on the response too
        assert resp.result() is meta and resp.done() and resp.staging == "lazy" and resp.staged()
        assert "upload_completion" in repr(resp)
    finally:
        stager.close()


def test_a_failed_save_fails_its_future_after_a_snapshot_that_was_taken(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ckpt = AsyncCheckpointer()
    try:
        fut = async_save({"w": torch.ones(2)}, checkpoint_id=str(blocker / "ckpt"), no_dist=True, checkpointer=ckpt)
        assert fut.exception(timeout=120) is not None
        with pytest.raises(Exception):  # noqa: B017 - the storage error, whatever its class
            fut.result()
        assert fut.staging_completion.result(timeout=0) is None  # the snapshot itself was taken
    finally:
        with pytest.raises(Exception):  # noqa: B017 - close() reports the failed save again
            ckpt.close()
    assert not os.path.exists(blocker / "ckpt")


def test_a_snapshot_that_fails_fails_the_staging_future_as_torchs_does(tmp_path):
    def generator():
        yield 1

    ckpt = AsyncCheckpointer()
    try:
        fut = async_save({"w": torch.ones(2), "g": generator()}, checkpoint_id=str(tmp_path), no_dist=True,
                         checkpointer=ckpt)
        assert isinstance(fut.staging_completion.exception(timeout=60), TypeError)  # a generator cannot be copied
        assert "taking the snapshot failed" in str(fut.exception(timeout=60))
    finally:
        with pytest.raises(Exception):  # noqa: B017 - close() reports the failed save again
            ckpt.close()
