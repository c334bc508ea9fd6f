"""copy_into gives what Tensor.copy_ gives, for every layout the saver and loader use."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint._src.transfer.host_copy import _as_numpy, copy_into


def _src(shape, dtype):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(shape, generator=g) * 100
    return t > 0 if dtype is torch.bool else t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool,
                                   torch.float64, torch.float8_e4m3fn])
def test_contiguous_copies_match_torch(dtype):
    src = _src((300, 257), dtype)
    dest = torch.empty_like(src)
    copy_into(dest, src)
    assert torch.equal(dest.view(torch.uint8), src.view(torch.uint8))  # bit for bit (NaN, fp8)
    assert _as_numpy(dest) is not None, "this copy should not have gone through torch"


def test_strided_destinations_and_sources():
    src = _src((512, 96), torch.float32)
    # column bands laid out at a pitch, as the saver gathers them
    buf = torch.zeros(4 * 512 * 32 + 100, dtype=torch.float32)
    bands = src.view(512, 3, 32).permute(1, 0, 2)  # (3 bands, 512 rows, 32 cols), non-contiguous
    dest = buf.as_strided(bands.shape, (512 * 32 + 33, 32, 1))
    copy_into(dest, bands)
    expect = torch.zeros_like(buf)
    expect.as_strided(bands.shape, (512 * 32 + 33, 32, 1)).copy_(bands)
    assert torch.equal(buf, expect)
    # a slice of rows and columns, as the loader copies out of a scratch run
    target = torch.zeros(600, 40, dtype=torch.float32)
    copy_into(target[50:562, 4:36], src[:, 10:42])
    assert torch.equal(target[50:562, 4:36], src[:, 10:42]) and target[:50].abs().sum() == 0


def test_what_numpy_cannot_take_falls_back_to_torch():
    src = _src((256, 256), torch.float32)
    converted = torch.empty(256, 256, dtype=torch.bfloat16)
    copy_into(converted, src)  # another dtype: torch converts
    assert torch.equal(converted, src.to(torch.bfloat16))
    scalar = torch.zeros(())
    copy_into(scalar, torch.tensor(3.5))
    assert scalar.item() == 3.5
    cplx = torch.zeros(128, 128, dtype=torch.complex64)
    copy_into(cplx, torch.ones(128, 128, dtype=torch.complex64) * 1j)
    assert torch.equal(cplx, torch.ones(128, 128, dtype=torch.complex64) * 1j)
    rows = torch.zeros(256, 256)
    copy_into(rows, src[:1].expand(256, 256))  # a zero stride: numpy takes it too
    assert torch.equal(rows, src[:1].expand(256, 256))


def test_a_written_tensor_is_marked_written_for_autograd():
    # copy_ bumps the version counter; a backward that saved the old values must notice
    w = torch.nn.Parameter(torch.ones(256, 256))
    loss = (w * w).sum()  # saves w for backward
    copy_into(w.detach(), torch.full((256, 256), 2.0))
    assert torch.equal(w.detach(), torch.full((256, 256), 2.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("shape,view", [
    ((300, 257), lambda t: t),  # contiguous: pieces of about FED_BYTES
    ((512, 96), lambda t: t.view(512, 3, 32).permute(1, 0, 2)[1]),  # a column band
    ((2000, 700), lambda t: t.t()),  # transposed: rows of 8000 bytes
    ((3, 400_000), lambda t: t[:, 1:]),  # rows larger than a piece: one row at a time
    ((1, 5), lambda t: t[0]),  # 1-D
])
def test_copy_fed_copies_and_hands_over_every_piece_in_order(shape, view):
    from hyper_parallel.core.distributed_checkpoint._src.transfer.host_copy import FED_BYTES, copy_fed

    src = view(_src(shape, torch.float32))
    nbytes = src.numel() * 4
    dest = memoryview(bytearray(nbytes))
    pieces: list[bytes] = []
    assert copy_fed(dest, src, lambda p: pieces.append(bytes(p)))
    want = src.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert bytes(dest) == want and b"".join(pieces) == want
    row = nbytes // src.shape[0]
    assert all(len(p) <= max(FED_BYTES, row) for p in pieces)
    assert len(pieces) == -(-nbytes // max(FED_BYTES // row * row, row))


def test_copy_fed_declines_what_numpy_cannot_view():
    from hyper_parallel.core.distributed_checkpoint._src.transfer.host_copy import copy_fed

    dest = memoryview(bytearray(64 * 64 * 8))
    called = []
    assert not copy_fed(dest, torch.ones(64, 64, dtype=torch.complex64), called.append)
    assert not copy_fed(memoryview(bytearray(8)), torch.ones(64, 64), called.append)  # wrong size
    assert not called and bytes(dest) == bytes(len(dest))


@pytest.mark.parametrize("shape,tiles,dtype,gap", [
    ((128, 1024), 4, torch.float32, 0),  # a small box: one piece for all bands
    ((3000, 512), 4, torch.bfloat16, 4096 - 768),  # many pieces; bands padded apart in the file
    ((40, 6, 5), 3, torch.float32, 8),  # bands of a 3-D tensor (whole trailing dims)
    ((1, 4096), 2, torch.int8, 0),  # one row
])
def test_gather_fed_lays_every_band_at_its_pitch_and_feeds_each_band_in_order(shape, tiles, dtype, gap):
    from hyper_parallel.core.distributed_checkpoint._src.transfer.host_copy import FED_BYTES, gather_fed

    full = _src(shape, torch.float32).to(dtype)
    w = shape[1] // tiles
    bands = [full[:, k * w:(k + 1) * w] for k in range(tiles)]
    stacked = full.view(shape[0], tiles, w, *shape[2:]).transpose(0, 1)  # (tiles, rows, w, ...) view
    band_bytes = bands[0].numel() * full.element_size()
    pitch = band_bytes + gap
    dest = memoryview(bytearray(pitch * (tiles - 1) + band_bytes))
    fed: dict[int, list[bytes]] = {k: [] for k in range(tiles)}
    assert gather_fed(dest, pitch, stacked, lambda k, p: fed[k].append(bytes(p)))
    for k, band in enumerate(bands):
        want = band.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert bytes(dest[k * pitch:k * pitch + band_bytes]) == want, k
        assert b"".join(fed[k]) == want, k  # every byte of the band, once, in order
        assert all(len(p) <= max(FED_BYTES, band_bytes // shape[0]) for p in fed[k])
    assert bytes(dest[band_bytes:pitch]) == bytes(gap)  # the gaps are not written


def test_gather_fed_declines_what_numpy_cannot_view():
    from hyper_parallel.core.distributed_checkpoint._src.transfer.host_copy import gather_fed

    dest = memoryview(bytearray(2 * 64 * 32 * 8))
    full = torch.ones(64, 64, dtype=torch.complex64)
    called = []
    assert not gather_fed(dest, 64 * 32 * 8, full.view(64, 2, 32).transpose(0, 1), lambda k, p: called.append(k))
    assert not gather_fed(memoryview(bytearray(8)), 8, torch.ones(2, 4, 4), lambda k, p: called.append(k))  # small
    assert not called and bytes(dest) == bytes(len(dest))
