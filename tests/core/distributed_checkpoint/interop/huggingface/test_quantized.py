"""QuantizedHuggingFaceStorageReader: FP8 block-quantized HF checkpoints, dequantized on load.

Fixtures are written at test time as DeepSeek-V3 stores them: ``<name>.weight`` in float8
(F8_E4M3) beside ``<name>.weight_scale_inv`` (float32, one cell per block), over several
files with ``model.safetensors.index.json``. Every result is compared bit for bit with
torch's own ``QuantizedHuggingFaceStorageReader`` loading the same files, and with a plain
float64 dequantization (exact for float8 x float32, then rounded as torch rounds).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from helpers import RecordingReader, bits, local_expected
from multiprocess import run_ranks
from safetensors.torch import save_file
from torch.distributed.checkpoint.quantized_hf_storage import (
    QuantizedHuggingFaceStorageReader as TorchQuantizedReader,
)

from hyper_parallel.core.distributed_checkpoint import (
    CorruptCheckpointError,
    FileSystemReader,
    QuantizedHuggingFaceStorageReader,
    UnsupportedValueError,
    load,
)
from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md

FILE1, FILE2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def quantize(rows: int, cols: int, block: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A float8 weight and its scale grid, as DeepSeek-V3's quantizer makes them (amax / 448)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3
    grid = (-(-rows // block), -(-cols // block))
    scale = torch.empty(grid)
    w8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            blk = full[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = blk.abs().max().clamp(min=1e-4) / 448
            scale[i, j] = s
            w8[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
    return w8, scale


def reference(w8: torch.Tensor, scale: torch.Tensor, block: int, target: torch.dtype) -> torch.Tensor:
    """Plain dequantization, block by block in float64: a float8 value times a float32 scale
    is exact in float64, so rounding it to float32 gives the float32 product."""
    out = torch.empty(w8.shape, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = w8[rows, cols].double() * float(scale[i, j])
    return out.float().to(target)


def write_files(d: str, files: dict[str, dict[str, torch.Tensor]], index: bool = True) -> None:
    os.makedirs(d, exist_ok=True)
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, os.path.join(d, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    if index:
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)


def deepseek_like(d: str, block: int = 128) -> dict[str, torch.Tensor]:
    """Two files: quantized weights of several shapes (one not a multiple of the block, one
    smaller than a block, one whose scale lies in the other file) beside plain tensors."""
    q = {"layers.0.attn.weight": quantize(300, 200, block, 1), "layers.0.mlp.weight": quantize(256, 384, block, 2),
         "layers.1.tiny.weight": quantize(5, 7, block, 3), "layers.1.split.weight": quantize(130, 129, block, 4)}
    plain = {"embed.weight": torch.randn(11, 6, generator=torch.Generator().manual_seed(5)).bfloat16(),
             "layers.0.norm.weight": torch.rand(200), "layers.0.attn.bias": torch.randn(300)}
    f1 = {k: w for k, (w, _) in q.items()} | {k + "_scale_inv": s for k, (_, s) in q.items()
                                              if k != "layers.1.split.weight"} | {"embed.weight": plain["embed.weight"]}
    f2 = {"layers.1.split.weight_scale_inv": q["layers.1.split.weight"][1]} | {
        k: v for k, v in plain.items() if k != "embed.weight"}
    write_files(d, {FILE1: f1, FILE2: f2})
    return {"quantized": q, "plain": plain}


def torch_load(target: dict, d: str, **kw) -> dict:
    torch_dcp.load(target, storage_reader=TorchQuantizedReader(d, **kw), no_dist=True)
    return target


# ---------------------------------------------------------------------------- one process


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("target_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("into", [torch.float32, torch.bfloat16])
def test_dequantizes_bit_exact_as_torch_and_the_plain_reference(tmp_path, target_dtype, into):
    d = str(tmp_path)
    made = deepseek_like(d)
    shapes = {k: w.shape for k, (w, _) in made["quantized"].items()} | {k: v.shape for k, v in made["plain"].items()}

    def fresh() -> dict[str, torch.Tensor]:
        return {k: torch.zeros(s, dtype=into if k in made["quantized"] else made["plain"][k].dtype)
                for k, s in shapes.items()}

    ours = load(fresh(), storage_reader=QuantizedHuggingFaceStorageReader(d, target_dtype=target_dtype),
                no_dist=True)
    theirs = torch_load(fresh(), d, target_dtype=target_dtype)
    for key, (w8, scale) in made["quantized"].items():
        want = reference(w8, scale, 128, target_dtype).to(into)
        assert torch.equal(bits(ours[key]), bits(want)), key
        assert torch.equal(bits(ours[key]), bits(theirs[key])), key
    for key, v in made["plain"].items():
        assert torch.equal(bits(ours[key]), bits(v)), key
        assert torch.equal(bits(ours[key]), bits(theirs[key])), key


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_block_size_other_than_128_and_a_single_file_without_index(tmp_path):
    w8, scale = quantize(100, 70, 32, seed=7)
    write_files(str(tmp_path), {"model.safetensors": {"w.weight": w8, "w.weight_scale_inv": scale}}, index=False)
    out = load(storage_reader=QuantizedHuggingFaceStorageReader(tmp_path, block_size=32), no_dist=True)
    assert torch.equal(bits(out["w.weight"]), bits(reference(w8, scale, 32, torch.float32)))
    # torch's reader needs the index; with one, it gives the same bits
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"w.weight": "model.safetensors", "w.weight_scale_inv": "model.safetensors"}}, f)
    theirs = torch_load({"w.weight": torch.zeros(100, 70)}, str(tmp_path), block_size=32)
    assert torch.equal(bits(out["w.weight"]), bits(theirs["w.weight"]))


def test_keys_are_torchs_and_scales_load_raw(tmp_path):
    d = str(tmp_path)
    made = deepseek_like(d)
    reader = QuantizedHuggingFaceStorageReader(d, target_dtype=torch.bfloat16)
    ours = md.Metadata.from_json(reader.read_metadata_bytes())
    theirs = TorchQuantizedReader(d).read_metadata().state_dict_metadata
    assert set(ours.entries) == set(theirs)  # the scale tensors stay keys, as in torch
    for key, (w8, _) in made["quantized"].items():
        assert ours.entries[key].dtype == "bfloat16" and ours.entries[key].shape == tuple(w8.shape)
    scale_key = "layers.0.attn.weight_scale_inv"
    target = {scale_key: torch.zeros(3, 2)}
    load(target, storage_reader=QuantizedHuggingFaceStorageReader(d), no_dist=True)
    assert torch.equal(target[scale_key], made["quantized"]["layers.0.attn.weight"][1])
    everything = load(storage_reader=QuantizedHuggingFaceStorageReader(d, target_dtype=torch.bfloat16), no_dist=True)
    assert everything["layers.0.mlp.weight"].dtype == torch.bfloat16 and set(everything) == set(theirs)


def test_reads_each_float8_byte_once_and_only_the_asked_for_weight(tmp_path):
    d = str(tmp_path)
    made = deepseek_like(d)
    rec = RecordingReader(FileSystemReader(d))
    key = "layers.0.mlp.weight"
    target = {key: torch.zeros(256, 384)}
    load(target, storage_reader=QuantizedHuggingFaceStorageReader(d, storage_reader=rec), no_dist=True)
    assert torch.equal(bits(target[key]), bits(reference(*made["quantized"][key], 128, torch.float32)))
    header_end = 8 + int.from_bytes(open(os.path.join(d, FILE1), "rb").read(8), "little")
    data = sum(n for f, o, n in rec.reads if f == FILE1 and o >= header_end)
    # the weight's 256 x 384 float8 bytes, and one scale row (3 float32) per 128-row band
    assert data == 256 * 384 + 2 * 3 * 4, rec.reads
    header_end2 = 8 + int.from_bytes(open(os.path.join(d, FILE2), "rb").read(8), "little")
    assert all(o < header_end2 for f, o, _ in rec.reads if f == FILE2)  # its header only


def test_file_shrunk_after_metadata_is_an_error_naming_it(tmp_path):
    d = str(tmp_path)
    deepseek_like(d)
    reader = QuantizedHuggingFaceStorageReader(d)
    meta = md.Metadata.from_json(reader.read_metadata_bytes())
    header_end = 8 + int.from_bytes(open(os.path.join(d, FILE1), "rb").read(8), "little")
    os.truncate(os.path.join(d, FILE1), header_end + 10)  # the header stays, the data is gone
    record = next(f for f in meta.files if f.name.startswith("dequantized-"))
    with pytest.raises(CorruptCheckpointError, match=FILE1):
        reader.read_into(record.name, 0, bytearray(record.size))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="target_dtype"):
        QuantizedHuggingFaceStorageReader("x", target_dtype=torch.int8)
    with pytest.raises(ValueError, match="block_size"):
        QuantizedHuggingFaceStorageReader("x", block_size=0)


# ---------------------------------------------------------------------------- bad input


def _missing_scale(d):
    w8, s = quantize(10, 10)
    write_files(d, {FILE1: {"a.weight": w8}, FILE2: {"b.weight": w8, "b.weight_scale_inv": s}})


def _wrong_scale_shape(d):
    w8, _ = quantize(300, 200)
    write_files(d, {FILE1: {"a.weight": w8, "a.weight_scale_inv": torch.ones(2, 2)}})


def _weight_not_float8(d):
    write_files(d, {FILE1: {"a.weight": torch.zeros(10, 10, dtype=torch.bfloat16),
                            "a.weight_scale_inv": torch.ones(1, 1)}})


def _scale_not_float(d):
    w8, _ = quantize(10, 10)
    write_files(d, {FILE1: {"a.weight": w8, "a.weight_scale_inv": torch.ones(1, 1, dtype=torch.int32)}})


def _weight_not_2d(d):
    write_files(d, {FILE1: {"a.weight": torch.zeros(4, 4, 4).to(torch.float8_e4m3fn),
                            "a.weight_scale_inv": torch.ones(1, 1)}})


def _truncated(d):
    w8, s = quantize(300, 200)
    write_files(d, {FILE1: {"a.weight": w8, "a.weight_scale_inv": s}})
    os.truncate(os.path.join(d, FILE1), os.path.getsize(os.path.join(d, FILE1)) - 7)


def _mxfp4(d):
    write_files(d, {FILE1: {"e.w_blocks": torch.zeros(2, 4, 8, 16, dtype=torch.uint8),
                            "e.w_scales": torch.zeros(2, 4, 8, dtype=torch.uint8)}})


@pytest.mark.parametrize("make,error,match", [
    (_missing_scale, UnsupportedValueError, rf"{FILE1}: tensor 'a.weight' is float8_e4m3fn with no scale "
                                            r"\('a.weight_scale_inv' is in no file\)"),
    (_wrong_scale_shape, CorruptCheckpointError, rf"{FILE1}: scale 'a.weight_scale_inv' has shape \[2, 2\], but weight "
                                                 r"'a.weight' of shape \[300, 200\].*needs \[3, 2\]"),
    (_weight_not_float8, UnsupportedValueError, rf"{FILE1}: tensor 'a.weight' is bfloat16 .*expected a 2-D float8"),
    (_scale_not_float, UnsupportedValueError, rf"{FILE1}: scale 'a.weight_scale_inv' of 'a.weight' is int32"),
    (_weight_not_2d, UnsupportedValueError, r"'a.weight' is float8_e4m3fn of shape \[4, 4, 4\]"),
    (_truncated, CorruptCheckpointError, rf"{FILE1} is truncated"),
    (_mxfp4, UnsupportedValueError, r"'e.w_blocks' is MXFP4"),
], ids=lambda v: v.__name__.strip("_") if callable(v) else None)
def test_bad_input_is_a_clear_error_naming_key_and_file(tmp_path, make, error, match):
    make(str(tmp_path))
    with pytest.raises(error, match=match):
        load(storage_reader=QuantizedHuggingFaceStorageReader(tmp_path), no_dist=True)


# ---------------------------------------------------------------------------- real ranks


def _quantized_on_ranks(rank: int, ws: int, d: str) -> dict:
    from helpers import make_dtensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    made = {k: quantize(*shape, seed=s) for k, shape, s in _RANK_WEIGHTS}
    mesh = init_device_mesh("cpu", (ws,))
    layouts = {"s0.weight": (mesh, [Shard(0)]), "s1.weight": (mesh, [Shard(1)]), "rep.weight": (mesh, [Replicate()]),
               "big.weight": (mesh, [Shard(0)])}
    if ws == 4:
        layouts["grid.weight"] = (init_device_mesh("cpu", (2, 2)), [Shard(0), Shard(1)])
    else:
        layouts["grid.weight"] = (mesh, [Shard(1)])

    def targets(dtype: torch.dtype) -> dict:
        sd = {k: make_dtensor(torch.zeros(made[k][0].shape, dtype=dtype), m, p) for k, (m, p) in layouts.items()}
        sd["plain.weight"] = torch.zeros(made["plain.weight"][0].shape, dtype=dtype)  # a whole tensor on each rank
        sd["bias"] = torch.zeros(7)
        return sd

    for target_dtype, into in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)):
        ours, theirs = targets(into), targets(into)
        load(ours, storage_reader=QuantizedHuggingFaceStorageReader(d, target_dtype=target_dtype))
        torch_dcp.load(theirs, storage_reader=TorchQuantizedReader(d, target_dtype=target_dtype))
        for key, v in ours.items():
            got = v.to_local() if isinstance(v, DTensor) else v
            other = theirs[key].to_local() if isinstance(v, DTensor) else theirs[key]
            assert torch.equal(bits(got), bits(other)), (key, target_dtype)
            if key == "bias":
                continue
            full = reference(*made[key], 128, target_dtype).to(into)
            want = local_expected(full, v.device_mesh, v.placements) if isinstance(v, DTensor) else full
            assert torch.equal(bits(got), bits(want)), (key, target_dtype)
    # Replicated parts read once and sent to the other ranks (tmp may be tmpfs, where that is off by default)
    shared = targets(torch.float32)
    shared = {k: shared[k] for k in ("rep.weight", "plain.weight")}
    load(shared, storage_reader=QuantizedHuggingFaceStorageReader(d), broadcast_replicated_tensors=True)
    for key, v in shared.items():
        full = reference(*made[key], 128, torch.float32)
        want = local_expected(full, v.device_mesh, v.placements) if isinstance(v, DTensor) else full
        assert torch.equal(bits(v.to_local() if isinstance(v, DTensor) else v), bits(want)), key
    # A Shard(0) rank reads its rows' float8 bytes and its block rows' scale cells, nothing else.
    rec = RecordingReader(FileSystemReader(d))
    (m, p), (w8, scale) = layouts["big.weight"], made["big.weight"]
    big = {"big.weight": make_dtensor(torch.zeros(w8.shape), m, p)}
    load(big, storage_reader=QuantizedHuggingFaceStorageReader(d, storage_reader=rec))
    rows = big["big.weight"].to_local().shape[0]
    row0 = -(-w8.shape[0] // ws) * rank
    with open(os.path.join(d, "big.safetensors"), "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    wbase = 8 + n + header["big.weight"]["data_offsets"][0]
    sbase = 8 + n + header["big.weight_scale_inv"]["data_offsets"][0]
    data = [(o, k) for f, o, k in rec.reads if f == "big.safetensors" and o >= 8 + n]
    weight = [(o, k) for o, k in data if wbase <= o < wbase + w8.numel()]
    cells = [(o, k) for o, k in data if sbase <= o < sbase + scale.numel() * 4]
    assert len(weight) + len(cells) == len(data), data
    cols = w8.shape[1]
    assert sum(k for _, k in weight) == rows * cols, weight
    assert all(wbase + row0 * cols <= o and o + k <= wbase + (row0 + rows) * cols for o, k in weight), weight
    cell_row = scale.shape[1] * 4
    first, last = row0 // 128, (row0 + rows - 1) // 128
    assert all(sbase + first * cell_row <= o and o + k <= sbase + (last + 1) * cell_row for o, k in cells), cells
    return {"rows": rows}


# (key, shape, seed): 300 x 200 splits mid-block on 2 and 4 ranks, in both dims
_RANK_WEIGHTS = [("s0.weight", (300, 200), 11), ("s1.weight", (300, 200), 12), ("rep.weight", (130, 260), 13),
                 ("grid.weight", (300, 200), 14), ("plain.weight", (70, 50), 15), ("big.weight", (512, 256), 16)]


@pytest.mark.parametrize("ws", [2, 4])
def test_dtensor_targets_reshard_bit_exact_as_torch_on_real_ranks(tmp_path, ws):
    d = str(tmp_path)
    made = {k: quantize(*shape, seed=s) for k, shape, s in _RANK_WEIGHTS}
    files: dict[str, dict[str, torch.Tensor]] = {FILE1: {}, FILE2: {"bias": torch.arange(7.0)}, "big.safetensors": {}}
    for i, (key, (w8, scale)) in enumerate(made.items()):
        if key == "big.weight":
            files["big.safetensors"].update({key: w8, key + "_scale_inv": scale})
        else:  # the weight in one file, its scale in the other for every second key
            files[FILE1][key] = w8
            files[FILE1 if i % 2 else FILE2][key + "_scale_inv"] = scale
    write_files(d, files)
    results = run_ranks(_quantized_on_ranks, ws, d, timeout_s=240)
    assert sum(r["rows"] for r in results) == 512
    assert math.prod(made["big.weight"][0].shape) == 512 * 256
