"""Corruption of data files and metadata is detected on load, or provably harmless.

Every injected fault ends in one of two outcomes: load raises a CheckpointError, or load
returns data bit-identical to what was saved. Never a silently wrong tensor.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil

import pytest
import torch
from helpers import assert_same, make_tensor

from hyper_parallel.core.distributed_checkpoint import CheckpointError, load, save

FLIPS = int(os.environ.get("HP_FLIPS", "150"))


def _state() -> dict:
    return {"w": make_tensor((128, 64)), "h": make_tensor((33, 7), torch.bfloat16, seed=1),
            "i": make_tensor((50,), torch.int64, seed=2), "step": 12, "blob": b"\x00" * 40}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "c")
    sd = _state()
    save(sd, path)
    return path, sd


def _outcome(path: str, expected: dict) -> str:
    try:
        out = load(path=path)
    except CheckpointError:
        return "detected"
    assert_same(expected, out)  # anything that loads must be exactly what was saved
    return "harmless"


def test_random_single_byte_flips_are_detected_or_harmless(saved, tmp_path):
    src, sd = saved
    rng = random.Random(1234)
    files = sorted(os.listdir(src))
    counts = {"detected": 0, "harmless": 0}
    for n in range(FLIPS):
        dst = str(tmp_path / f"c{n}")
        shutil.copytree(src, dst)
        name = rng.choice(files)
        size = os.path.getsize(os.path.join(dst, name))
        pos = rng.randrange(size)
        with open(os.path.join(dst, name), "r+b") as f:
            f.seek(pos)
            b = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([b ^ (1 << rng.randrange(8))]))
        counts[_outcome(dst, sd)] += 1
        shutil.rmtree(dst)
    print(f"\nbyte flips: {FLIPS} injected, {counts['detected']} detected, {counts['harmless']} harmless")
    # Only the safetensors header of a data file is not read by load; everything else is checked.
    assert counts["detected"] > 0.8 * FLIPS, counts


@pytest.mark.parametrize("fault", ["truncate_data", "delete_data", "empty_metadata", "truncate_metadata",
                                   "delete_metadata", "symlink_data", "pickle_metadata"])
def test_structural_faults_are_detected(saved, tmp_path, fault):
    src, sd = saved
    dst = str(tmp_path / "c")
    shutil.copytree(src, dst)
    data = next(f for f in os.listdir(dst) if f.endswith(".safetensors"))
    meta = os.path.join(dst, ".metadata")
    marker = tmp_path / "code-ran"
    if fault == "truncate_data":
        os.truncate(os.path.join(dst, data), os.path.getsize(os.path.join(dst, data)) // 2)
    elif fault == "delete_data":
        os.unlink(os.path.join(dst, data))
    elif fault == "empty_metadata":
        open(meta, "wb").close()
    elif fault == "truncate_metadata":
        os.truncate(meta, os.path.getsize(meta) - 3)
    elif fault == "delete_metadata":
        os.unlink(meta)
    elif fault == "symlink_data":
        outside = tmp_path / "outside.bin"
        shutil.copy(os.path.join(dst, data), outside)
        os.unlink(os.path.join(dst, data))
        os.symlink(outside, os.path.join(dst, data))
    elif fault == "pickle_metadata":
        class Payload:
            def __reduce__(self):
                return (open, (str(marker), "w"))
        with open(meta, "wb") as f:
            f.write(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError):
        load(path=dst)
    assert not marker.exists(), "loading must never execute code from the checkpoint"


def _forge_single_file(path: str, dst: str, how: str) -> None:
    import json
    import struct

    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack_from("<Q", raw)
    if how == "header length of 2**40":
        forged = struct.pack("<Q", 1 << 40) + raw[8:]
    else:  # a tensor of 2**58 bytes in a file of a few hundred
        header = json.loads(raw[8:8 + n])
        header["model.w"] = {"dtype": "F32", "shape": [1 << 28, 1 << 28], "data_offsets": [0, 1 << 58]}
        text = json.dumps(header).encode()
        forged = struct.pack("<Q", len(text)) + text + raw[8 + n:]
    with open(dst, "wb") as f:
        f.write(forged)


@pytest.mark.parametrize("how", ["header length of 2**40", "shape of 2**56 elements"])
def test_a_single_file_checkpoint_with_forged_sizes_is_refused_naming_the_file(tmp_path, how):
    """HyperParallel's single-file loader checks the safetensors header against the file's size
    first: safetensors' own error ("header too large") names neither the file nor the tensor."""
    from hyper_parallel.core.distributed_checkpoint import CorruptCheckpointError
    from hyper_parallel.core.distributed_checkpoint._src.interop.hyper_parallel.single_file import (
        load_checkpoint,
        save_checkpoint,
    )

    good, bad = str(tmp_path / "good.safetensors"), str(tmp_path / "bad.safetensors")
    save_checkpoint({"model": {"w": make_tensor((3, 4))}}, good)
    _forge_single_file(good, bad, how)
    with pytest.raises(CorruptCheckpointError, match="bad.safetensors"):
        load_checkpoint(bad)
