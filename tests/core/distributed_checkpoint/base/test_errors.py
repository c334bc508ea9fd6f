"""Every error of base/errors.py survives pickling whole: type, message and attributes.

Errors cross process boundaries (worker processes of ``multiprocessing`` and
``concurrent.futures``, async saves run elsewhere, a rank's failure sent to its peers); one that
cannot be rebuilt from its pickle turns into an unrelated TypeError, or a broken pool, on the
side that should have reported it.
"""

from __future__ import annotations

import concurrent.futures
import errno
import inspect
import multiprocessing
import pickle

import pytest

from hyper_parallel.core.distributed_checkpoint._src.base import errors


def samples() -> dict[type[BaseException], BaseException]:
    """One instance of every error class, with every attribute set to a non-default value."""
    failing = errors.CheckpointError("ranks 1 and 3 failed")
    failing.failures = {1: "OSError: disk full", 3: "KeyError: 'w'"}
    storage = errors.storage_error(OSError(errno.EIO, "Input/output error", "/ckpt/data-r0"), "checkpoint save")
    out: dict[type[BaseException], BaseException] = {
        errors.CheckpointError: failing,
        errors.NotACheckpointError: errors.NotACheckpointError("'/x' has no .metadata"),
        errors.MetadataError: errors.MetadataError("'/x/.metadata' is version 99"),
        errors.CorruptCheckpointError: errors.CorruptCheckpointError("crc32c mismatch in 'w' of data-r0"),
        errors.StateDictMismatchError: errors.StateDictMismatchError("'w' is missing from the checkpoint"),
        errors.StateDictLookupError: errors.StateDictLookupError("'w' has no chunk at offsets (4,) on rank 1"),
        errors.UnsupportedValueError: errors.UnsupportedValueError("'obj' needs pickle"),
        errors.LostContactError: errors.LostContactError("checkpoint save: lost contact on rank 2"),
        errors.StorageTimeoutError: errors.StorageTimeoutError("no answer from s3 within 30 s"),
        errors.CommitError: errors.CommitError("lost contact during the commit", None, "abc123"),
        errors.RankFailedError: errors.RankFailedError("save (writing data)", {3: "OSError: b", 1: "ValueError: a"}),
        errors.StorageError: storage,
    }
    for base, kind in errors._STORAGE_KINDS.items():
        out[kind] = errors.storage_error(base(errno.EACCES, "refused", "/ckpt/f", None, "/ckpt/g"),
                                         "checkpoint save to '/ckpt'")
    return out


def fields(e: BaseException) -> dict[str, object]:
    """What a caller may read of an error: its message, args and public attributes."""
    names = ["failures", "phase", "committed", "save_id", "errno", "strerror", "filename", "filename2", "context"]
    return {"str": str(e), "args": e.args, **{n: getattr(e, n) for n in names if hasattr(e, n)}}


def test_the_samples_cover_every_error_class_of_the_module():
    defined = {c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, BaseException) and c.__module__ == errors.__name__}
    assert defined == set(samples()), "add a sample of each new error class"


@pytest.mark.parametrize("cls", list(samples()), ids=lambda c: c.__name__)
def test_an_error_round_trips_through_pickle_with_its_message_and_fields(cls):
    e = samples()[cls]
    assert type(e) is cls
    for protocol in (2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(e, protocol=protocol))
        assert type(back) is cls
        assert fields(back) == fields(e)
        assert back.__dict__ == e.__dict__


def test_rank_failed_error_keeps_its_failures_and_every_rank_in_its_message():
    e = pickle.loads(pickle.dumps(errors.RankFailedError("load", {2: "CorruptCheckpointError: crc", 0: "x"})))
    assert e.phase == "load" and e.failures == {0: "x", 2: "CorruptCheckpointError: crc"}
    assert "[rank 2] CorruptCheckpointError: crc" in str(e) and "rank(s) [0, 2]" in str(e)


def _raise_sample(name: str) -> None:
    raise samples()[getattr(errors, name)]


def test_errors_raised_in_a_worker_process_arrive_whole():
    """A real process boundary: concurrent.futures pickles the worker's exception back."""
    want = samples()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        futures = {cls: pool.submit(_raise_sample, cls.__name__) for cls in want}
        for cls, fut in futures.items():
            got = fut.exception(timeout=120)
            assert type(got) is cls, (cls, got)
            assert fields(got) == fields(want[cls])
