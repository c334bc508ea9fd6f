"""The saver's copies: what it copies itself (column bands, strided tensors, unaligned
tensors for an O_DIRECT writer) is checksummed as it is copied, and every checksum must
still match the bytes on disk."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import FileSystemWriter, load, save, saver, verify_checkpoint


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3001, 700, generator=g)
    return {
        "unaligned": big[1:],  # contiguous, 2800 bytes past its storage's start: not page-aligned
        "transposed": torch.randn(900, 1200, generator=g).t(),  # strided: copied by the saver
        "bands_bf16": torch.randn(640, 2048, generator=g).to(torch.bfloat16),  # column bands
        "complex": torch.randn(256, 512, generator=g, dtype=torch.complex64),  # numpy cannot view it
        "rows_over_a_slice": torch.randn(2, 3 << 20, generator=g)[:, 1:],  # rows of 12 MiB
        "vector": torch.randn(300_001, generator=g)[1:],
        "small": torch.randn(7, 3, generator=g),
    }


@pytest.mark.parametrize("direct_io", [None, False])
def test_what_the_saver_copies_is_checksummed_as_written(tmp_path, direct_io):
    sd = _state()
    writer = FileSystemWriter(tmp_path / "ck", direct_io=direct_io)
    save(sd, storage_writer=writer)
    report = verify_checkpoint(tmp_path / "ck")
    assert report.ok, report.problems
    assert report.chunks > len(sd)  # column bands were stored
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(target, str(tmp_path / "ck"))
    for k, v in sd.items():
        assert torch.equal(target[k], v), k


def test_which_tensors_the_saver_copies_first():
    t = torch.randn(3001, 700)
    assert saver._copy_first(t.t(), direct=False)  # strided: always copied
    assert saver._copy_first(t[1:], direct=True) and not saver._copy_first(t[1:], direct=False)
    aligned = torch.frombuffer(saver.direct_io.POOL.get(1 << 20), dtype=torch.float32)
    assert not saver._copy_first(aligned, direct=True)  # written from its own memory
    assert not saver._copy_first(torch.randn(100), direct=True)  # small: the writer gathers it
    assert not saver._copy_first(torch.tensor(1.0), direct=True)
