"""Staging a tensor as its column bands copies exactly its columns into each band, whatever
its dtype and strides: one copy per tensor when the bands are alike (numpy, through a
same-sized integer view, or torch for dtypes numpy cannot hold), one per band otherwise.
The bands an async save stages follow its planner's settings."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import AsyncCheckpointer, StandardPlanner, load
from hyper_parallel.core.distributed_checkpoint._src.asynchronous.buffers import StagingBuffer, copy_into, tensor_spec


def _sources() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(96, 64, generator=g)
    return {
        "float32": base.clone(),
        "bfloat16": base.to(torch.bfloat16),
        "float64": base.double(),
        "int8": (base * 50).to(torch.int8),
        "bool": base > 0,
        "complex64": torch.complex(base, -base),
        "conj": torch.complex(base, base).conj(),  # a view with the conjugate bit set
        "negative_bit": torch.complex(base, base).conj().imag,  # a real view with the negative bit set
        "requires_grad": torch.nn.Parameter(base.clone()),
        "transposed": torch.randn(64, 96, generator=g).t(),  # a strided source
        "three_d": torch.randn(24, 16, 3, generator=g),
        "uneven": torch.randn(40, 31, generator=g),  # bands of unequal widths
    }


@pytest.fixture(params=[1, 2], ids=["one_thread_numpy", "two_threads_torch"])
def torch_threads(request):
    """torch's intra-op threads while staging: 1 copies bands through numpy, more through torch."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("tiles", [2, 4])
def test_each_band_holds_its_columns_and_later_changes_to_the_source_do_not_reach_it(tiles, torch_threads):
    sources = _sources()
    signature = tuple((key, tensor_spec(value)) for key, value in sources.items())
    buffer = StagingBuffer(signature, {}, False, tuple((key, tiles) for key, _ in signature))
    alike = {key: buffer.targets[key].whole is not None for key in sources}
    assert alike["float32"] and alike["bfloat16"] and alike["transposed"] and not alike["uneven"]
    assert buffer.targets["bfloat16"].ints is not None and buffer.targets["complex64"].ints is None
    expected = {key: value.detach().clone().resolve_conj().resolve_neg() for key, value in sources.items()}
    copy_into([(buffer.targets[key], value) for key, value in sources.items()])
    with torch.no_grad():
        for value in sources.values():
            value.zero_()
    for key, target in buffer.targets.items():
        assert len(target.views) == tiles
        for view, (lo, size) in zip(target.views, target.cols, strict=True):
            assert torch.equal(view, expected[key][:, lo:lo + size]), (key, lo, size)


def test_the_bands_a_structure_stages_follow_the_planners_band_settings_between_saves(tmp_path):
    sd = {"w": torch.randn(512, 1024), "b": torch.randn(1024)}
    one_band = StandardPlanner()
    one_band.max_tiles = 1
    ckpt = AsyncCheckpointer()
    for step, planner in enumerate([None, one_band, None, one_band]):
        ckpt.save(sd, str(tmp_path / f"s{step}"), no_dist=True, planner=planner).result(timeout=60)
        # the first two saves stage two layouts (bands, then row-major): a buffer each; the
        # next two reuse them, so the band choice remembered per structure follows the planner
        assert ckpt.stats.allocations == min(step + 1, 2)
        out = load(path=str(tmp_path / f"s{step}"), no_dist=True)
        assert all(torch.equal(out[k], v) for k, v in sd.items())
        for v in sd.values():
            v.add_(1)
    ckpt.close()
