"""QuantizedHuggingFaceStorageReader at the limits of its arguments and of the scale grids.

A block size beyond the weight (a 1 x 1 grid) is valid, as in torch's reader: it must load the
same bits without any allocation sized by the block. One far larger still (past 2**31 - 1 and the
weight, e.g. 1 << 40, which asked the allocator for 4 TiB) is a ValueError naming the argument at
load, before any allocation. A block size that is not an int from 1 to 2**63 - 1 is refused when
the reader is made; a scale grid that does not fit the weight says which block sizes would fit
it, or that none does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import bits
from test_quantized import quantize, reference, torch_load, write_files

from hyper_parallel.core.distributed_checkpoint import CorruptCheckpointError, QuantizedHuggingFaceStorageReader, load
from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md

FILE = "model.safetensors"
LARGE = [1 << 20, 2**31 - 1]  # beyond the weight: valid
HUGE = [1 << 40, 2**63 - 1]  # far beyond it: refused


def _one_weight(d: str, rows: int, cols: int, grid_block: int, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """One quantized weight with an index (torch's reader needs one), its grid made with ``grid_block``."""
    w8, scale = quantize(rows, cols, grid_block, seed=seed)
    write_files(d, {FILE: {"w.weight": w8, "w.weight_scale_inv": scale}})
    return w8, scale


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("block", HUGE, ids=["2^40", "2^63-1"])
def test_a_block_far_larger_than_the_weight_is_a_value_error_naming_it_before_any_allocation(tmp_path, block):
    _one_weight(str(tmp_path), 3, 50, grid_block=1 << 20)  # a 1 x 1 grid
    reader = QuantizedHuggingFaceStorageReader(tmp_path, block_size=block)
    want = rf"block_size={block} is far larger than weight 'w.weight' of shape \[3, 50\]"
    with pytest.raises(ValueError, match=want):
        load(storage_reader=reader, no_dist=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("block", LARGE, ids=["2^20", "2^31-1"])
@pytest.mark.parametrize("shape", [(4, 4), (5, 300)], ids=["4x4", "5x300"])
def test_a_block_larger_than_the_weight_loads_the_bits_torch_loads(tmp_path, block, shape):
    w8, scale = _one_weight(str(tmp_path), *shape, grid_block=1 << 20)  # a 1 x 1 grid
    assert tuple(scale.shape) == (1, 1)
    out = load(storage_reader=QuantizedHuggingFaceStorageReader(tmp_path, block_size=block), no_dist=True)
    want = reference(w8, scale, 1 << 20, torch.float32)
    assert torch.equal(bits(out["w.weight"]), bits(want))
    theirs = torch_load({"w.weight": torch.zeros(shape)}, str(tmp_path), block_size=block)
    assert torch.equal(bits(out["w.weight"]), bits(theirs["w.weight"]))


@pytest.mark.parametrize("block,shape", [(32, (100, 70)), (1 << 20, (3, 50)), (7, (9, 23))],
                         ids=["32", "2^20", "7"])
def test_reads_of_part_of_a_row_take_each_columns_scale(tmp_path, block, shape):
    """Ranges that start and end inside a block, inside a row, and across rows: every element
    gets its own block's scale (the first and last cells of a range cover part of their block)."""
    w8, scale = _one_weight(str(tmp_path), *shape, grid_block=block)
    want = reference(w8, scale, block, torch.float32).flatten()
    reader = QuantizedHuggingFaceStorageReader(tmp_path, block_size=block)
    reader.set_up(0, True)
    meta = md.Metadata.from_json(reader.read_metadata_bytes())
    record = next(f for f in meta.files if f.name.startswith("dequantized-"))
    rows, cols = shape
    for first, count in [(1, cols - 2), (cols - 3, 5), (block + 1, min(block, cols - block - 2) or 1),
                         (cols + 5, 2 * cols), (0, rows * cols)]:
        if first < 0 or count <= 0 or first + count > rows * cols:
            continue
        buf = bytearray(count * 4)
        reader.read_into(record.name, first * 4, buf)
        got = torch.frombuffer(buf, dtype=torch.float32)
        assert torch.equal(bits(got), bits(want[first:first + count])), (first, count)


@pytest.mark.parametrize("bad", [0, -1, 2**63, 1 << 70, True, 128.0, "128", None],
                         ids=lambda v: f"{type(v).__name__}-{v}")
def test_a_block_size_outside_1_to_2_63_or_not_an_int_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"block_size must be .*found") as info:
        QuantizedHuggingFaceStorageReader("never-read", block_size=bad)
    assert "128" in str(info.value)  # says what a usual value is


def test_an_integral_block_size_of_another_type_is_taken_as_an_int():
    reader = QuantizedHuggingFaceStorageReader("never-read", block_size=np.int64(64))
    assert reader.block_size == 64 and type(reader.block_size) is int


@pytest.mark.parametrize("grid,block,says", [
    ((3, 2), 64, r"this grid fits block_size from 100 to 149: pass the checkpoint's block size"),
    ((1, 1), 128, r"this grid fits block_size >= 300"),
    ((2, 3), 128, r"no block size gives this grid: the scale does not belong to this weight"),
    ((400, 1), 128, r"no block size gives this grid"),
    ((3,), 128, r"no block size gives this grid"),
], ids=["fits-a-range", "fits-any-larger", "fits-none", "more-cells-than-rows", "1-d"])
def test_a_scale_grid_that_does_not_fit_says_which_block_sizes_would(tmp_path, grid, block, says):
    w8, _ = quantize(300, 200)
    write_files(str(tmp_path), {FILE: {"w.weight": w8, "w.weight_scale_inv": torch.ones(grid)}})
    with pytest.raises(CorruptCheckpointError, match=rf"scale 'w.weight_scale_inv' has shape .*{says}"):
        load(storage_reader=QuantizedHuggingFaceStorageReader(tmp_path, block_size=block), no_dist=True)
