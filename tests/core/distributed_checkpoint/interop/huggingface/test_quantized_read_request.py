"""``_process_read_request``: torch's per-item hook of its safetensors read loop, on our readers.

torch's ``HuggingFaceStorageReader`` reads each ``ReadItem`` of a plan through this method, given
an open ``safetensors.safe_open`` file; its ``QuantizedHuggingFaceStorageReader`` dequantizes a
block-quantized weight's region there. Code written for torch (subclasses, its own tests) calls
it directly, so our readers have it with the same arguments and effect. Here it is driven as
torch's loop drives it, over real files written at test time (float8 weights beside float32 or
bfloat16 scale grids, some scales in another file), and every result is compared bit for bit
with torch's reader doing the same calls on the same files and with a plain float64
dequantization.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from helpers import bits, local_expected, make_dtensor
from multiprocess import run_ranks
from safetensors import safe_open
from safetensors.torch import save_file
from test_quantized import quantize, reference, write_files
from torch.distributed.checkpoint.quantized_hf_storage import (
    QuantizedHuggingFaceStorageReader as TorchQuantizedReader,
)

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    HuggingFaceStorageReader,
    QuantizedHuggingFaceStorageReader,
    UnsupportedValueError,
)
from hyper_parallel.core.distributed_checkpoint.default_planner import DefaultLoadPlanner
from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, ReadItem

FILE1, FILE2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def read_item(key: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> ReadItem:
    return ReadItem(type=LoadItemType.TENSOR, storage_index=MetadataIndex(key, (0,) * len(offsets)),
                    dest_index=MetadataIndex(key, (0,) * len(offsets)), storage_offsets=torch.Size(offsets),
                    dest_offsets=torch.Size((0,) * len(offsets)), lengths=torch.Size(lengths))


class IntoTensors:
    """A planner for single reads: each item's tensor is a fresh one of the item's lengths, and
    what is committed is kept by key (the hook under test is the reader's, not a planner's)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.committed = dtype, {}

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return torch.full(tuple(item.lengths), float("nan"), dtype=self.dtype)

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed[item.storage_index.fqn] = tensor


# block 4: a 10 x 9 weight has a 3 x 3 grid whose last row and column cover part of a block
BLOCK = 4
SHAPES = {"same.weight": (10, 9), "other.weight": (10, 9), "bf16scale.weight": (10, 12)}


@pytest.fixture
def checkpoint(tmp_path):
    """Two files: ``same`` has its scale beside it, ``other`` in the second file, ``bf16scale``
    a bfloat16 grid; a plain bias and norm beside them."""
    d = str(tmp_path)
    made = {k: quantize(*shape, BLOCK, seed) for seed, (k, shape) in enumerate(SHAPES.items())}
    made["bf16scale.weight"] = (made["bf16scale.weight"][0], made["bf16scale.weight"][1].bfloat16())
    plain = {"bias": torch.arange(10.0), "norm.weight": torch.randn(3, 5, generator=torch.Generator().manual_seed(9))}
    f1 = {k: w for k, (w, _) in made.items()} | {"same.weight_scale_inv": made["same.weight"][1],
                                                  "bf16scale.weight_scale_inv": made["bf16scale.weight"][1],
                                                  "bias": plain["bias"]}
    f2 = {"other.weight_scale_inv": made["other.weight"][1], "norm.weight": plain["norm.weight"]}
    write_files(d, {FILE1: f1, FILE2: f2})
    return d, made, plain


def read_with(reader, d: str, key: str, offsets, lengths, into: torch.dtype = torch.float32) -> torch.Tensor:
    """One item read through ``reader._process_read_request`` from the real file holding ``key``."""
    planner = IntoTensors(into)
    with safe_open(os.path.join(d, reader._weight_map[key]), framework="pt") as f:
        reader._process_read_request(f, read_item(key, offsets, lengths), planner)
    return planner.committed[key]


# ---------------------------------------------------------------------------- one process


# regions: whole; inside one block; across every block boundary; a partial last block row and
# column; one element; one row across blocks
REGIONS = [((0, 0), None), ((1, 1), (2, 2)), ((3, 2), (5, 6)), ((6, 5), (4, 4)), ((9, 8), (1, 1)), ((4, 0), (1, 9))]


@pytest.mark.parametrize("target_dtype", [torch.float32, torch.bfloat16])
def test_regions_dequantize_bit_exact_as_torch_and_the_reference(checkpoint, target_dtype):
    d, made, _ = checkpoint
    ours = QuantizedHuggingFaceStorageReader(d, target_dtype=target_dtype, block_size=BLOCK)
    theirs = TorchQuantizedReader(d, target_dtype=target_dtype, block_size=BLOCK)
    ours.read_metadata()
    theirs.read_metadata()
    for key, (w8, grid) in made.items():
        want_full = reference(w8, grid, BLOCK, target_dtype)
        for offsets, lengths in REGIONS:
            lengths = lengths or w8.shape
            region = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
            for into in (torch.float32, target_dtype):
                got = read_with(ours, d, key, offsets, lengths, into)
                want = read_with(theirs, d, key, offsets, lengths, into)
                assert torch.equal(bits(got), bits(want)), (key, offsets, lengths, into)
                assert torch.equal(bits(got), bits(want_full[region].to(into))), (key, offsets, lengths, into)


def test_scales_and_plain_tensors_read_raw(checkpoint):
    d, made, plain = checkpoint
    reader = QuantizedHuggingFaceStorageReader(d, block_size=BLOCK)
    reader.read_metadata()
    assert torch.equal(read_with(reader, d, "bias", (2,), (5,)), plain["bias"][2:7])
    assert torch.equal(read_with(reader, d, "norm.weight", (1, 0), (2, 5)), plain["norm.weight"][1:3])
    grid = made["other.weight"][1]
    assert torch.equal(read_with(reader, d, "other.weight_scale_inv", (0, 1), (3, 2)), grid[:, 1:3])


def test_pairs_are_learnt_from_the_files_when_no_metadata_was_read(checkpoint):
    """torch fills its maps in read_metadata; ours reads the index itself on the first call."""
    d, made, _ = checkpoint
    reader = QuantizedHuggingFaceStorageReader(d, block_size=BLOCK)
    w8, grid = made["other.weight"]
    with safe_open(os.path.join(d, FILE1), framework="pt") as f:  # the weight's file; its scale is in FILE2
        planner = IntoTensors(torch.float32)
        reader._process_read_request(f, read_item("other.weight", (2, 3), (7, 6)), planner)
    assert reader._weight_scale_mapping["other.weight"] == "other.weight_scale_inv"
    assert reader._weight_map["other.weight_scale_inv"] == FILE2
    want = reference(w8, grid, BLOCK, torch.float32)[2:9, 3:9]
    assert torch.equal(bits(planner.committed["other.weight"]), bits(want))


def test_maps_set_by_code_written_for_torch_are_used(checkpoint):
    """torch's names are the reader's state: code that sets them (as torch's own tests do) is
    obeyed, so a weight left out of ``_weight_scale_mapping`` reads its raw float8 values."""
    d, made, _ = checkpoint
    reader = QuantizedHuggingFaceStorageReader(d, block_size=BLOCK)
    reader._weight_map = {"same.weight": FILE1, "same.weight_scale_inv": FILE1, "other.weight": FILE1}
    reader._weight_scale_mapping = {"same.weight": "same.weight_scale_inv"}
    reader._tensor_full_shapes = {"same.weight": torch.Size(SHAPES["same.weight"])}
    w8, grid = made["same.weight"]
    got = read_with(reader, d, "same.weight", (1, 2), (8, 7))
    assert torch.equal(bits(got), bits(reference(w8, grid, BLOCK, torch.float32)[1:9, 2:9]))
    raw = read_with(reader, d, "other.weight", (0, 0), SHAPES["other.weight"])
    assert torch.equal(raw, made["other.weight"][0].float())


def test_plain_reader_hook_reads_a_region(checkpoint):
    d, _, plain = checkpoint
    reader = HuggingFaceStorageReader(d)
    planner = IntoTensors(torch.float64)
    with safe_open(os.path.join(d, FILE2), framework="pt") as f:
        reader._process_read_request(f, read_item("norm.weight", (1, 2), (2, 3)), planner)
    assert torch.equal(planner.committed["norm.weight"], plain["norm.weight"][1:3, 2:5].double())


def _mxfp4(d: str) -> None:
    save_file({"mlp.experts_blocks": torch.zeros(2, 3, 4, 8, dtype=torch.uint8),
               "mlp.experts_scales": torch.zeros(2, 3, 4, dtype=torch.uint8)}, os.path.join(d, "model.safetensors"))


def _wrong_grid(d: str) -> None:  # a grid for block 2, read with block 4
    w8, grid = quantize(6, 6, 2, 0)
    save_file({"a.weight": w8, "a.weight_scale_inv": grid}, os.path.join(d, "model.safetensors"))


def _int_scale(d: str) -> None:
    w8, _ = quantize(6, 6, 4, 0)
    save_file({"a.weight": w8, "a.weight_scale_inv": torch.ones(2, 2, dtype=torch.int32)},
              os.path.join(d, "model.safetensors"))


def _three_d(d: str) -> None:
    save_file({"a.weight": torch.zeros(2, 4, 4, dtype=torch.float8_e4m3fn), "a.weight_scale_inv": torch.ones(1, 1)},
              os.path.join(d, "model.safetensors"))


@pytest.mark.parametrize("make, key, offsets, lengths, error, match", [
    (_mxfp4, "mlp.experts_blocks", (0, 0, 0, 0), (2, 3, 4, 8), UnsupportedValueError, "'mlp.experts_blocks' is MXFP4"),
    (_wrong_grid, "a.weight", (0, 0), (6, 6), CorruptCheckpointError,
     r"'a.weight_scale_inv' has shape \[3, 3\].*needs \[2, 2\].*block_size=2"),
    (_int_scale, "a.weight", (0, 0), (6, 6), UnsupportedValueError,
     "'a.weight_scale_inv' of 'a.weight' is torch.int32"),
    (_three_d, "a.weight", (0, 0, 0), (2, 4, 4), UnsupportedValueError, r"'a.weight' of shape \[2, 4, 4\]"),
    (_wrong_grid, "a.weight", (4, 0), (3, 6), CheckpointError, r"'a.weight' asks for \[\(4, 7\), \(0, 6\)\].*\[6, 6\]"),
])
def test_bad_input_is_a_clear_error_naming_the_tensor(tmp_path, make, key, offsets, lengths, error, match):
    d = str(tmp_path)
    make(d)
    reader = QuantizedHuggingFaceStorageReader(d, block_size=4)
    with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as f:
        with pytest.raises(error, match=match):
            reader._process_read_request(f, read_item(key, offsets, lengths), IntoTensors(torch.float32))


def test_planner_tensor_of_another_shape_is_refused(checkpoint):
    d, _, _ = checkpoint

    class Wrong(IntoTensors):
        def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
            return torch.zeros(3, 3)

    reader = QuantizedHuggingFaceStorageReader(d, block_size=BLOCK)
    with safe_open(os.path.join(d, FILE1), framework="pt") as f:
        with pytest.raises(CheckpointError, match=r"'same.weight'.*read of \[2, 2\] has shape \[3, 3\]"):
            reader._process_read_request(f, read_item("same.weight", (0, 0), (2, 2)), Wrong(torch.float32))


# ---------------------------------------------------------------------------- real ranks


def _torch_loop(reader, state_dict: dict, planner) -> None:
    """torch's read loop, by hand: metadata, the planner's local plan, then each item through
    ``_process_read_request`` with the safetensors file that holds it."""
    meta = reader.read_metadata()
    planner.set_up_planner(state_dict, meta, True)
    per_file = defaultdict(list)
    for item in planner.create_local_plan().items:
        per_file[reader._weight_map[item.storage_index.fqn]].append(item)
    for name, items in per_file.items():
        with safe_open(os.path.join(reader.path, name), framework="pt") as f:
            for item in items:
                reader._process_read_request(f, item, planner)


def _on_ranks(rank: int, ws: int, d: str) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner as TorchPlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    made = {k: quantize(*shape, 128, seed) for seed, (k, shape) in enumerate(_RANK_SHAPES.items())}
    mesh = init_device_mesh("cpu", (ws,))
    layouts = {"rows.weight": [Shard(0)], "cols.weight": [Shard(1)], "small.weight": [Shard(0)]}

    def targets() -> dict:
        return {k: make_dtensor(torch.zeros(made[k][0].shape, dtype=torch.bfloat16), mesh, p)
                for k, p in layouts.items()}

    ours, theirs = targets(), targets()
    _torch_loop(QuantizedHuggingFaceStorageReader(d, target_dtype=torch.bfloat16), ours, DefaultLoadPlanner())
    _torch_loop(TorchQuantizedReader(d, target_dtype=torch.bfloat16), theirs, TorchPlanner())
    for key, v in ours.items():
        want = local_expected(reference(*made[key], 128, torch.bfloat16), mesh, layouts[key])
        assert torch.equal(bits(v.to_local()), bits(theirs[key].to_local())), key
        assert torch.equal(bits(v.to_local()), bits(want)), key
    # and a whole load of the same files gives the same bits as the hook
    loaded = targets()
    torch_dcp.load(loaded, storage_reader=QuantizedHuggingFaceStorageReader(d, target_dtype=torch.bfloat16))
    for key, v in loaded.items():
        assert torch.equal(bits(v.to_local()), bits(ours[key].to_local())), key


# 300 rows split mid-block on 2 ranks; 200 columns likewise; 5 x 7 smaller than a block
_RANK_SHAPES = {"rows.weight": (300, 200), "cols.weight": (130, 300), "small.weight": (5, 7)}


def test_dtensor_shards_through_torchs_read_loop_on_real_ranks(tmp_path):
    d = str(tmp_path)
    made = {k: quantize(*shape, 128, seed) for seed, (k, shape) in enumerate(_RANK_SHAPES.items())}
    f1 = {k: w for k, (w, _) in made.items()} | {"rows.weight_scale_inv": made["rows.weight"][1]}
    f2 = {k + "_scale_inv": g for k, (_, g) in made.items() if k != "rows.weight"}
    write_files(d, {FILE1: f1, FILE2: f2})
    run_ranks(_on_ranks, 2, d, timeout_s=240)
