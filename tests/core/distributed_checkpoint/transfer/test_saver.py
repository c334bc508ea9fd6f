"""The saver's copies: what it copies itself (column bands, strided tensors, unaligned
tensors for an O_DIRECT writer) is checksummed as it is copied, and every checksum must
still match the bytes on disk."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import FileSystemWriter, load, save, verify_checkpoint
from hyper_parallel.core.distributed_checkpoint._src.backends.direct_io import direct_io_default
from hyper_parallel.core.distributed_checkpoint._src.transfer import saver


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
        "conj": torch.randn(50_001, generator=g, dtype=torch.complex64)[1:].conj(),  # lazy views: values saved
        "neg": torch.randn(300, 301, generator=g)._neg_view(),
    }


def _direct_writer(path, direct_io):
    writer = FileSystemWriter(path, direct_io=direct_io)
    if direct_io and not direct_io_default(str(path.parent)):
        pytest.skip(f"{path.parent} is on a filesystem without O_DIRECT")
    return writer


@pytest.mark.parametrize("direct_io", [None, False, True])
def test_what_the_saver_copies_is_checksummed_as_written(tmp_path, direct_io, monkeypatch):
    sd = _state()
    writer = _direct_writer(tmp_path / "ck", direct_io)
    fed: list[int] = []
    real = saver.copy_fed
    monkeypatch.setattr(saver, "copy_fed", lambda dest, src, feed: fed.append(dest.nbytes) or real(dest, src, feed))
    real_gather = saver.gather_fed  # a box's column bands: one copy, each band fed as copied
    monkeypatch.setattr(saver, "gather_fed", lambda dest, pitch, src, feed: (
        fed.append(src.numel() * src.element_size()) or real_gather(dest, pitch, src, feed)))
    save(sd, storage_writer=writer)
    report = verify_checkpoint(tmp_path / "ck")
    assert report.ok, report.problems
    assert report.chunks > len(sd)  # column bands were stored
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(target, str(tmp_path / "ck"))
    for k, v in sd.items():
        assert torch.equal(target[k], v.resolve_conj().resolve_neg()), k
    copied = sd["transposed"].numel() * 4 + sd["rows_over_a_slice"].numel() * 4
    if writer.uses_direct_io:  # the unaligned contiguous tensors too, not only bands and strided views
        copied += sd["unaligned"].numel() * 4 + sd["vector"].numel() * 4
    assert sum(fed) >= copied


@pytest.mark.parametrize("shape", [(4096, 700), (2, 3 << 20), (1, 5 << 20)])
def test_copied_slabs_stay_small_and_whole_blocks(shape):
    # rows of 2800 bytes, of 12 MiB and one row of 20 MiB: slabs of at most a slice (a
    # contiguous tensor is cut anywhere) and a multiple of 4 KiB but for the last
    t = torch.randn(*shape)[:, 1:]
    for tensor in (t.contiguous()[:, :], t):
        sizes = [b.nbytes for b in saver._copied_slices(tensor, None)]
        assert sum(sizes) == tensor.numel() * 4
        if tensor.is_contiguous() or tensor[0].numel() * 4 <= saver.SLICE_BYTES:
            assert max(sizes) <= saver.SLICE_BYTES
        assert all(n % 4096 == 0 for n in sizes[:-1]) or not tensor.is_contiguous() and len(sizes) == shape[0]


def test_which_tensors_the_saver_copies_first():
    t = torch.randn(3001, 700)
    assert saver._copy_first(t.t(), direct=False)  # strided: always copied
    assert saver._copy_first(t[1:], direct=True) and not saver._copy_first(t[1:], direct=False)
    aligned = torch.frombuffer(saver.direct_io.POOL.get(1 << 20), dtype=torch.float32)
    assert not saver._copy_first(aligned, direct=True)  # written from its own memory
    assert not saver._copy_first(torch.randn(100), direct=True)  # small: the writer gathers it
    assert not saver._copy_first(torch.tensor(1.0), direct=True)


def _strided_copy(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` in memory that is not contiguous (every other element)."""
    if t.dim() == 0:
        return t.clone()
    room = torch.empty(t.numel() * 2, dtype=t.dtype)[::2]
    room.copy_(t.reshape(-1))
    return room.view(t.shape) if t.dim() == 1 else room.as_strided(t.shape, [2 * s for s in t.stride()])


@pytest.mark.parametrize("direct_io", [False, True])
def test_small_chunks_written_whole_are_the_bytes_of_the_copied_path(tmp_path, direct_io, monkeypatch):
    # small contiguous chunks go out as one view with one checksum; strided twins of the same
    # values go through the saver's copies: the data files must be the same bytes
    from hyper_parallel.core.distributed_checkpoint._src.engine import save_run as checkpoint

    g = torch.Generator().manual_seed(5)
    sd = {"scalar": torch.tensor(2.5), "bias": torch.randn(4096, generator=g),
          "norm_bf16": torch.randn(8, 384, generator=g).to(torch.bfloat16),
          "rows": torch.randn(100, 1024, generator=g)[:99],  # 396 KiB: an aligned payload
          "ints": torch.arange(1000, dtype=torch.int64).reshape(10, 100)}
    twins = {k: _strided_copy(v) for k, v in sd.items()}
    assert all(not v.is_contiguous() for k, v in twins.items() if k != "scalar")
    fixed = checkpoint.uuid.UUID(int=7)
    monkeypatch.setattr(checkpoint.uuid, "uuid4", lambda: fixed)  # one save id, so names and headers match
    for name, state in (("whole", sd), ("copied", twins)):
        save(state, storage_writer=_direct_writer(tmp_path / name, direct_io))
        report = verify_checkpoint(tmp_path / name)
        assert report.ok, report.problems
    data = sorted(p.name for p in (tmp_path / "whole").iterdir() if p.name.endswith(".safetensors"))
    assert data == sorted(p.name for p in (tmp_path / "copied").iterdir() if p.name.endswith(".safetensors"))
    for name in data:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "copied" / name).read_bytes(), name
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(target, str(tmp_path / "whole"))
    assert all(torch.equal(target[k], v) for k, v in sd.items())
