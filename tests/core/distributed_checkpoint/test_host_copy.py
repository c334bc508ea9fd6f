"""copy_into gives what Tensor.copy_ gives, for every layout the saver and loader use."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint.host_copy import _as_numpy, copy_into


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
