"""MindSpore checkpoints in and out, against files MindSpore itself wrote.

The fixtures (tests/fixtures/mindspore, made by make_fixtures.py with MindSpore 2.10) and
``expected.json`` — what MindSpore's own ``load_checkpoint`` reads from each of them — need
no MindSpore here. The tests at the end run MindSpore itself, in a subprocess, when
``HP_MINDSPORE_PYTHON`` names a Python that has it (``scripts/setup_mindspore.sh`` makes one
in ``.msenv``, which is found too); otherwise they skip.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import textwrap

import pytest
import torch
from helpers import make_tensor, stored_chunks
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    Layout,
    UnsupportedValueError,
    convert_full_checkpoint_to_dcp,
    export_mindspore,
    import_mindspore,
    load,
    load_layout,
    read_mindspore_checkpoint,
    save,
    save_layout,
)
from hyper_parallel.core.distributed_checkpoint._src.base import protowire as pw
from hyper_parallel.core.distributed_checkpoint._src.base.dtypes import dtype_name, torch_dtype
from hyper_parallel.core.distributed_checkpoint._src.base.errors import MetadataError
from hyper_parallel.core.distributed_checkpoint._src.interop.mindspore import checkpoints as msf
from hyper_parallel.core.distributed_checkpoint._src.interop.mindspore import ckpt as ms_ckpt
from hyper_parallel.core.distributed_checkpoint._src.interop.mindspore import file_model as ms_file
from hyper_parallel.core.distributed_checkpoint._src.interop.mindspore.strategy import (
    parse_strategy,
    read_strategy,
    strategy_to_layouts,
)

REPO = str(pathlib.Path(__file__).resolve().parents[5])
FIX = os.path.join(REPO, "tests", "fixtures", "mindspore")
TP2 = os.path.join(FIX, "tp2")
with open(os.path.join(FIX, "expected.json")) as _f:
    EXPECTED = json.load(_f)


def sha(t: torch.Tensor) -> str:
    t = t.contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def assert_as_mindspore_reads(values: dict, fixture: str) -> None:
    """``values`` holds exactly what MindSpore's load_checkpoint read from ``fixture``, bit for bit."""
    want = EXPECTED[fixture]
    assert set(values) == set(want)
    for name, w in want.items():
        v = values[name]
        if isinstance(w, str):
            assert v == w, name
            continue
        ms_dtype, shape, digest = w
        assert v.dtype == torch_dtype(msf.MS_DTYPES[ms_dtype]), name
        assert list(v.shape) == shape, name
        assert sha(v) == digest, name


def copy_fixture(name: str, tmp_path) -> str:
    dst = str(tmp_path / os.path.basename(name))
    shutil.copyfile(os.path.join(FIX, name), dst)
    return dst


# ---------------------------------------------------------------------------- whole files


@pytest.mark.parametrize("fixture", ["full.ckpt", "full_crc.ckpt", "full.safetensors", "crc.safetensors"])
def test_a_file_written_by_mindspore_imports_bit_exact(fixture, tmp_path):
    meta = import_mindspore(os.path.join(FIX, fixture), tmp_path / "dcp")
    assert meta.user["imported_from"]["platform"] == "mindspore"
    assert_as_mindspore_reads(load(path=str(tmp_path / "dcp")), fixture)


def test_every_mindspore_dtype_arrives_as_its_torch_dtype():
    values = read_mindspore_checkpoint(os.path.join(FIX, "full.ckpt"))
    got = {k: v.dtype for k, v in values.items() if isinstance(v, torch.Tensor)}
    assert got["dense.weight"] == torch.float32 and got["half"] == torch.float16
    assert got["bf16"] == torch.bfloat16 and got["f64"] == torch.float64 and got["mask"] == torch.bool
    assert {got[k] for k in ("i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64")} == {
        torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64}
    assert values["scalar"].shape == () and values["epoch_num"].dtype == torch.int64
    assert values["note"] == "trained by MindSpore"


def test_a_tensor_in_several_messages_of_one_name_is_joined():
    # make_fixtures lowers MindSpore's slice size to 1 KiB: its own writer split these
    with msf.open_mindspore_file(os.path.join(FIX, "full.ckpt")) as f:
        assert len(f.tensors["dense.weight"].pieces) == 3   # 2560 bytes
        assert len(f.tensors["bf16"].pieces) == 2           # 1200 bytes
        values = {n: f.read(n) for n in ("dense.weight", "bf16")}
    want = EXPECTED["full.ckpt"]
    assert sha(values["dense.weight"]) == want["dense.weight"][2] and sha(values["bf16"]) == want["bf16"][2]


def test_messages_split_anywhere_and_packed_dims_still_join(tmp_path):
    # by the wire format, unlike MindSpore's writer: a split inside an element, packed dims
    full = make_tensor((7, 3), torch.float32, seed=1)
    raw = full.reshape(-1).view(torch.uint8).numpy().tobytes()
    packed_dims = pw.len_field(1, pw.varint(7) + pw.varint(3))
    parts = []
    for a, b in ((0, 5), (5, 6), (6, len(raw))):
        tensor = packed_dims + pw.str_field(2, "Float32") + pw.len_field(3, raw[a:b])
        parts.append(pw.len_field(1, pw.str_field(1, "w") + pw.len_field(2, tensor)))
    path = tmp_path / "hand.ckpt"
    path.write_bytes(b"".join(parts))
    assert torch.equal(read_mindspore_checkpoint(path)["w"], full)


def test_convert_full_checkpoint_to_dcp_reads_mindspore_with_src_platform(tmp_path):
    convert_full_checkpoint_to_dcp(os.path.join(FIX, "full.ckpt"), tmp_path / "a", src_platform="mindspore",
                                   prefix="model.")
    sd = load(path=str(tmp_path / "a"))
    assert_as_mindspore_reads(sd["model"], "full.ckpt")
    with pytest.raises(ValueError, match="src_platform"):
        convert_full_checkpoint_to_dcp(os.path.join(FIX, "full.ckpt"), tmp_path / "b", src_platform="jax")


def test_convert_full_checkpoint_to_dcp_takes_hyperparallel_call_forms(tmp_path):
    full = os.path.join(FIX, "full.ckpt")
    convert_full_checkpoint_to_dcp(src_ckpt=full, dst_dir=str(tmp_path / "a"), src_platform="mindspore")
    convert_full_checkpoint_to_dcp(full, str(tmp_path / "b"), "mindspore")  # the platform by position
    for d in ("a", "b"):
        assert_as_mindspore_reads(load(path=str(tmp_path / d)), "full.ckpt")
    with pytest.raises(CheckpointError, match="src_platform='mindspore'"):  # not advice to unpickle
        convert_full_checkpoint_to_dcp(full, str(tmp_path / "c"))
    with pytest.raises(TypeError, match="src_ckpt"):
        convert_full_checkpoint_to_dcp(full, str(tmp_path / "d"), src_ckpt=full)


# ---------------------------------------------------------------------------- damaged files


def test_a_truncated_file_is_an_error_naming_the_file_and_the_tensor(tmp_path):
    data = open(os.path.join(FIX, "full.ckpt"), "rb").read()
    for cut in (1, 3, 100, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut{cut}.ckpt"
        path.write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpointError, match="truncated") as info:
            import_mindspore(path, tmp_path / f"dcp{cut}")
        assert str(path) in str(info.value)
        assert not os.path.exists(tmp_path / f"dcp{cut}" / ".metadata")
    path = tmp_path / "half.ckpt"
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="after tensor 'half'|tensor 'half'"):
        read_mindspore_checkpoint(path)


def test_a_cut_anywhere_is_an_error_or_a_clean_prefix_of_whole_tensors(tmp_path):
    # a cut exactly between two tensors leaves a valid, shorter file (as for MindSpore itself;
    # only the crc trailer catches that); everywhere else it is an error, never a wrong tensor
    data = open(os.path.join(FIX, "full.ckpt"), "rb").read()
    whole = read_mindspore_checkpoint(os.path.join(FIX, "full.ckpt"))
    path = tmp_path / "cut.ckpt"
    clean = 0
    for cut in range(1, len(data), 3):
        path.write_bytes(data[:cut])
        try:
            part = read_mindspore_checkpoint(path)
        except CorruptCheckpointError:
            continue
        clean += 1
        assert list(part) == list(whole)[:len(part)]
        assert all(torch.equal(v, whole[k]) if isinstance(v, torch.Tensor) else v == whole[k] for k, v in part.items())
    assert clean < 10


def test_a_missing_slice_message_is_an_error_with_the_byte_counts(tmp_path):
    data = open(os.path.join(FIX, "full.ckpt"), "rb").read()
    fields = list(pw.fields(data, 0, len(data)))
    _, _, a, b = fields[1]  # the second of dense.weight's three messages
    start = a - len(pw.len_header(1, b - a))
    path = tmp_path / "gap.ckpt"
    path.write_bytes(data[:start] + data[b:])
    with pytest.raises(CorruptCheckpointError, match=r"'dense.weight' \(float32 \[40, 16\]\) needs 2560 bytes, "
                                                     r"its 2 message\(s\) hold 1536"):
        read_mindspore_checkpoint(path)


@pytest.mark.parametrize("fixture", ["full_crc.ckpt", "crc.safetensors"])
def test_a_flipped_byte_fails_the_crc(fixture, tmp_path):
    path = copy_fixture(fixture, tmp_path)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40  # inside a tensor's bytes
    open(path, "wb").write(data)
    with pytest.raises(CorruptCheckpointError, match="crc"):
        import_mindspore(path, tmp_path / "dcp")
    import_mindspore(path, tmp_path / "dcp", verify=False)  # the caller may opt out


def test_an_encrypted_file_is_refused_with_what_to_do():
    with pytest.raises(UnsupportedValueError, match="encrypted MindSpore checkpoint.*dec_key"):
        read_mindspore_checkpoint(os.path.join(FIX, "encrypted.ckpt"))


def test_an_unknown_dtype_is_refused_naming_the_tensor(tmp_path):
    tensor = pw.repeated_ints(1, [2]) + pw.str_field(2, "Complex64") + pw.len_field(3, bytes(16))
    path = tmp_path / "c.ckpt"
    path.write_bytes(pw.len_field(1, pw.str_field(1, "z") + pw.len_field(2, tensor)))
    with pytest.raises(UnsupportedValueError, match=r"c.ckpt: tensor 'z' has MindSpore dtype 'Complex64'"):
        read_mindspore_checkpoint(path)


def test_a_map_parameter_is_refused_naming_it(tmp_path):
    path = tmp_path / "m.ckpt"
    path.write_bytes(pw.len_field(1, pw.str_field(1, "table") + pw.len_field(3, b"")))
    with pytest.raises(UnsupportedValueError, match="'table' is a MindSpore MapParameter"):
        read_mindspore_checkpoint(path)


def test_a_file_that_is_not_mindspore_is_a_clear_error(tmp_path):
    path = tmp_path / "x.ckpt"
    path.write_bytes(b"PK\x03\x04 a zip file, say")
    with pytest.raises(CorruptCheckpointError, match="not a MindSpore .ckpt"):
        read_mindspore_checkpoint(path)


def _ms_safetensors(path, entries: dict, meta: dict | None = None, data: bytes = b"") -> None:
    """A safetensors file with exactly this header (``entries``: name -> header entry)."""
    header = json.dumps({"__metadata__": meta or {"format": "ms"}, **entries}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("shape,nbytes", [([-2, -2], 16), ([-1, 0], 0), ([0, -5], 0), ([1] * 65, 4),
                                          ([1 << 40, 1 << 40], 0), ([2.0, 2], 16), ([True, 4], 16)])
def test_a_safetensors_shape_our_checkpoints_cannot_hold_is_refused_naming_file_and_tensor(shape, nbytes, tmp_path):
    # [-2, -2] claims 4 elements (16 bytes) and failed in torch.empty with a raw RuntimeError;
    # [-1, 0] claims none and was imported into a checkpoint our own reader then refused
    path = tmp_path / "neg.safetensors"
    _ms_safetensors(path, {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, nbytes]}}, data=bytes(nbytes))
    with pytest.raises(CorruptCheckpointError, match=r"neg.safetensors: tensor 'w': shape "):
        read_mindspore_checkpoint(path)
    with pytest.raises(CorruptCheckpointError, match=r"neg.safetensors: tensor 'w': shape "):
        import_mindspore(path, tmp_path / "dcp")
    assert not os.path.exists(tmp_path / "dcp" / ".metadata")


def test_a_ckpt_shape_our_checkpoints_cannot_hold_is_refused_naming_file_and_tensor(tmp_path):
    for dims in ([-1, 0], [1] * 65, [1 << 40, 1 << 40]):
        tensor = pw.repeated_ints(1, dims) + pw.str_field(2, "Float32") + pw.len_field(3, b"")
        path = tmp_path / "dims.ckpt"
        path.write_bytes(pw.len_field(1, pw.str_field(1, "w") + pw.len_field(2, tensor)))
        with pytest.raises(CorruptCheckpointError, match=r"dims.ckpt: tensor 'w': shape "):
            import_mindspore(path, tmp_path / "dcp")
        assert not os.path.exists(tmp_path / "dcp" / ".metadata")


_W = b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'


@pytest.mark.parametrize("header,why", [
    (b'{"__metadata__": [1], ' + _W + b"}", "'__metadata__' is not an object"),  # AttributeError before
    (b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deep"),  # RecursionError before
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}}', "has byte range"),  # was taken
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, Infinity]}}', "has byte range"),  # OverflowError
])
def test_a_damaged_safetensors_header_is_a_clear_error(header, why, tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(CorruptCheckpointError, match=rf"bad.safetensors: .*{re.escape(why)}"):
        read_mindspore_checkpoint(path)


def test_a_crc_that_is_no_number_fails_the_check(tmp_path):
    path = tmp_path / "crc.safetensors"
    _ms_safetensors(path, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                    meta={"format": "ms", "crc_num": float("inf")}, data=bytes(4))  # OverflowError before
    with pytest.raises(CorruptCheckpointError, match="crc.safetensors: crc32 of the tensors is"):
        read_mindspore_checkpoint(path)


def _ckpt_string(name: str, raw: bytes) -> bytes:
    """A ``.ckpt`` message holding a string value (MindSpore: UTF-32 text, dims [0], type "str")."""
    tensor = pw.repeated_ints(1, [0]) + pw.str_field(2, "str") + pw.len_field(3, raw)
    return pw.len_field(1, pw.str_field(1, name) + pw.len_field(2, tensor))


@pytest.mark.parametrize("raw", [b"\xff\xff\xff\xff", b"\x00\xd8\x00\x00", "ok".encode("utf-32-le") + b"\x41"])
def test_a_string_value_that_is_not_utf32_is_an_error_naming_file_and_key(raw, tmp_path):
    # a code point past U+10FFFF, a surrogate, a length that is no multiple of 4
    path = tmp_path / "s.ckpt"
    path.write_bytes(_ckpt_string("epoch_note", "fine".encode("utf-32-le")) + _ckpt_string("note", raw))
    with pytest.raises(CorruptCheckpointError, match=r"s.ckpt: the string value 'note' is not UTF-32 text"):
        read_mindspore_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"s.ckpt: the string value 'note' is not UTF-32 text"):
        import_mindspore(path, tmp_path / "dcp")
    assert not os.path.exists(tmp_path / "dcp" / ".metadata")


def _mutants(data: bytes, rnd, n: int):
    """``n`` damaged copies of ``data``: cut short, or one to four bytes flipped or replaced."""
    for _ in range(n):
        if rnd.random() < 0.3:
            yield data[:rnd.randrange(len(data))]
            continue
        out = bytearray(data)
        for _ in range(rnd.randint(1, 4)):
            i = rnd.randrange(len(out))
            out[i] = rnd.randrange(256) if rnd.random() < 0.5 else out[i] ^ (1 << rnd.randrange(8))
        yield bytes(out)


_HOSTILE = [-1, -(1 << 40), 1 << 40, 1 << 70, 2.5, 1e308, float("inf"), float("nan"), "7", "x" * 50, None, True,
            [], [[[[1]]]], {}, {"a": [1]}, [-1, 0], [4096, 4096], [1] * 70]


def _json_mutants(doc, rnd, n: int):
    """``n`` copies of the JSON document ``doc``, each with one member (at any depth) replaced by
    a hostile value, so mutations reach shapes, offsets, dev_matrix and tensor_map."""
    def slots(node, out):
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            out.append((node, k))
            if isinstance(v, (dict, list)):
                slots(v, out)
        return out

    for _ in range(n):
        copy = json.loads(json.dumps(doc))
        node, k = rnd.choice(slots(copy, []))
        node[k] = rnd.choice(_HOSTILE)
        yield json.dumps(copy).encode()


def test_damaged_mindspore_files_raise_only_our_errors(tmp_path):
    """Fuzz (fixed seed): cut or flipped copies of .ckpt files, of a safetensors file and of
    both strategy forms, and copies with one header or strategy member replaced by a hostile
    value, are read whole or refused with one of our errors; nothing raw escapes."""
    import random

    rnd = random.Random(30)
    refused = 0

    def read(path) -> None:
        nonlocal refused
        try:
            read_mindspore_checkpoint(path, verify=rnd.random() < 0.5)
        except CheckpointError:
            refused += 1

    def parse(raw: bytes, where: str) -> None:
        nonlocal refused
        try:
            strategy_to_layouts(parse_strategy(raw, where), where)
        except MetadataError:
            refused += 1

    for fixture in ("full.ckpt", "full_crc.ckpt", "full.safetensors", "tp2/rank_1/net1.ckpt"):
        data = open(os.path.join(FIX, fixture), "rb").read()
        path = tmp_path / os.path.basename(fixture)
        for mutant in _mutants(data, rnd, 100):
            path.write_bytes(mutant)
            read(path)
    data = open(os.path.join(FIX, "full.safetensors"), "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    path = tmp_path / "header.safetensors"
    for header in _json_mutants(json.loads(data[8:8 + n]), rnd, 100):
        path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n:])
        read(path)
    for fixture in ("tp2/strategy.ckpt", "tp2/strategy.json"):
        for mutant in _mutants(open(os.path.join(FIX, fixture), "rb").read(), rnd, 100):
            parse(mutant, fixture)
    for mutant in _json_mutants(json.load(open(os.path.join(TP2, "strategy.json"))), rnd, 100):
        parse(mutant, "strategy.json")
    assert refused > 400  # most mutants are damaged enough to be refused


# ---------------------------------------------------------------------------- distributed (TP=2)


@pytest.mark.parametrize("strategy", ["strategy.ckpt", "strategy.json"])
def test_a_tp2_distributed_checkpoint_imports_with_its_layouts(strategy, tmp_path):
    meta = import_mindspore(TP2, tmp_path / "dcp", strategy=os.path.join(TP2, strategy))
    assert meta.world_size == 2
    col = meta.entries["dense1.weight"]
    assert col.shape == (16, 8) and col.layout == {"mesh_shape": [1, 2], "mesh_dim_names": ["dim0", "dim1"],
                                                   "placements": ["R", "S(0)"]}
    assert sorted(b.offsets for b, _, _ in stored_chunks(meta, "dense1.weight")) == [(0, 0), (8, 0)]
    assert meta.entries["dense2.weight"].layout["placements"] == ["R", "S(1)"]
    assert meta.entries["global_step"].layout is None  # not in the strategy: replicated
    assert len(stored_chunks(meta, "dense2.bias")) == 1  # in the strategy, replicated: written once
    assert_as_mindspore_reads(load(path=str(tmp_path / "dcp")), "tp2/full.ckpt")


def _tp2_copy(tmp_path, ranks=(0, 1)) -> str:
    dst = str(tmp_path / "ms")
    os.makedirs(dst)
    for r in ranks:
        shutil.copytree(os.path.join(TP2, f"rank_{r}"), os.path.join(dst, f"rank_{r}"))
    return dst


def test_a_missing_rank_is_an_error_saying_the_slices_do_not_cover(tmp_path):
    src = _tp2_copy(tmp_path, ranks=(0,))
    with pytest.raises(CheckpointError, match=r"'dense1.weight': no rank file holds its slice at offsets \[8, 0\].*"
                                              r"rank\(s\) \[1\].*does not cover"):
        import_mindspore(src, tmp_path / "dcp", strategy=os.path.join(TP2, "strategy.ckpt"))


def test_slices_that_do_not_fit_the_strategy_are_an_error(tmp_path):
    # rank 1's file holds whole tensors (another run's file): one of two files is wrong, and
    # nothing says which, so both are named with their shapes
    src = _tp2_copy(tmp_path, ranks=(0,))
    os.makedirs(os.path.join(src, "rank_1"))
    shutil.copyfile(os.path.join(TP2, "full.ckpt"), os.path.join(src, "rank_1", "net1.ckpt"))
    with pytest.raises(CheckpointError, match=r"'dense1.weight': its rank files hold slices of different shapes .*"
                                              r"\[8, 8\] in .*net0.ckpt; \[16, 8\] in .*net1.ckpt\. .*strategy.ckpt "
                                              r"\(dev_matrix \[1, 2\], tensor_map \[0, -1\]\) slices it evenly"):
        import_mindspore(src, tmp_path / "dcp", strategy=os.path.join(TP2, "strategy.ckpt"))


def _write_ms_ckpt(path, values: dict[str, torch.Tensor]) -> None:
    """A ``.ckpt`` as ``mindspore.save_checkpoint`` writes it (the export's message writer)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        for name, t in values.items():
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            f.write(ms_ckpt._ckpt_message(name, ms_file._TO_MS[dtype_name(t.dtype)], list(t.shape), len(raw)) + raw)


def _sliced_checkpoint(tmp_path, name: str, slices: dict[int, torch.Tensor], items: dict) -> tuple[str, str]:
    """A MindSpore distributed checkpoint: ``rank_<r>/net<r>.ckpt`` holding ``slices[r]``, and a JSON strategy."""
    src = str(tmp_path / "ms")
    for r, t in slices.items():
        _write_ms_ckpt(os.path.join(src, f"rank_{r}", f"net{r}.ckpt"), {name: t, "global_step": torch.tensor([7])})
    strategy = os.path.join(src, "strategy.json")
    with open(strategy, "w") as f:
        json.dump({"current_stage": 0, "parallel_layout_item": {
            k: {"dev_matrix": dm, "tensor_map": tm, "field": 0, "opt_weight_shard_step": 0,
                "opt_weight_shard_size": 0} for k, (dm, tm) in items.items()}}, f)
    return src, strategy


def test_a_slice_of_the_wrong_shape_is_blamed_on_its_own_file(tmp_path):
    # rank 0's slice is 3x2 where the 4-way row split gives every rank 2x2: the global shape
    # comes from the shape most files hold, so rank 0's file is the one named
    full = make_tensor((8, 2), torch.float32, 1)
    slices = {r: full[2 * r:2 * r + 2] for r in range(4)}
    slices[0] = torch.zeros(3, 2)
    src, strategy = _sliced_checkpoint(tmp_path, "w", slices, {"w": ([4], [0, -1])})
    with pytest.raises(CheckpointError, match=r"'w': .*rank_0/net0.ckpt holds \[3, 2\], but the other 3 rank file\(s\) "
                                              r"\(ranks \[1, 2, 3\]\) hold \[2, 2\] and .*strategy.json "
                                              r"\(dev_matrix \[4\], tensor_map \[0, -1\]\) slices it evenly") as err:
        import_mindspore(src, tmp_path / "dcp", strategy=strategy)
    assert "net1.ckpt" not in str(err.value)


def test_two_rank_files_of_different_shapes_are_both_named(tmp_path):
    # two ranks, 3x2 and 2x2: either could be right (a global 6x2 or 4x2), so both are named
    src, strategy = _sliced_checkpoint(tmp_path, "w", {0: torch.zeros(3, 2), 1: torch.ones(2, 2)},
                                       {"w": ([2], [0, -1])})
    with pytest.raises(CheckpointError, match=r"'w': .*no shape is held by most of them: "
                                              r"\[3, 2\] in .*rank_0/net0.ckpt; \[2, 2\] in .*rank_1/net1.ckpt\. "
                                              r".*strategy.json"):
        import_mindspore(src, tmp_path / "dcp", strategy=strategy)


def _two_stage_checkpoint(tmp_path, extra: dict | None = None) -> tuple[str, str, dict[str, torch.Tensor]]:
    """A 2-stage pipeline checkpoint (2 ranks a stage) with a merged strategy ("<stage>-<name>")."""
    full = {"a": make_tensor((4, 2), torch.float32, 1), "b": make_tensor((4, 2), torch.float32, 2)}
    slices = {0: {"a": full["a"][:2]}, 1: {"a": full["a"][2:]},                            # stage 0: a, rows
              2: {"b": full["b"][:, :1].contiguous()}, 3: {"b": full["b"][:, 1:].contiguous()}}  # stage 1: b, cols
    src = str(tmp_path / "ms")
    for r, values in slices.items():
        _write_ms_ckpt(os.path.join(src, f"rank_{r}", f"net{r}.ckpt"), {**values, "global_step": torch.tensor([7])})
    item = {"field": 0, "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}
    layouts = {"0-a": {"dev_matrix": [2], "tensor_map": [0, -1], **item},
               "1-b": {"dev_matrix": [2], "tensor_map": [-1, 0], **item}}
    layouts.update({k: {**v, **item} for k, v in (extra or {}).items()})
    strategy = os.path.join(src, "strategy.json")
    with open(strategy, "w") as f:
        json.dump({"current_stage": 1, "parallel_layout_item": layouts}, f)
    return src, strategy, full


def test_a_missing_pipeline_stage_is_an_error_naming_its_parameters_and_ranks(tmp_path):
    src, strategy, full = _two_stage_checkpoint(tmp_path)
    import_mindspore(src, tmp_path / "whole", strategy=strategy)
    back = load(path=str(tmp_path / "whole"))
    assert torch.equal(back["a"], full["a"]) and torch.equal(back["b"], full["b"])
    shutil.rmtree(os.path.join(src, "rank_2"))
    shutil.rmtree(os.path.join(src, "rank_3"))  # stage 1 lost: 'b' is in no rank file
    with pytest.raises(CheckpointError, match=r"strategy.json names parameter\(s\) that no rank file holds.*"
                                              r"\['b'\] on rank\(s\) \[2, 3\]\. Rank files found: \[0, 1\]"):
        import_mindspore(src, tmp_path / "dcp", strategy=strategy)


def test_a_strategy_parameter_no_rank_saved_is_skipped_when_its_slices_have_rank_files(tmp_path, caplog):
    # a training job's strategy names optimizer states too; a checkpoint of the network alone
    # lacks them, and MindSpore's transform_checkpoints ignores them: so do we, with a warning
    src, strategy, full = _two_stage_checkpoint(
        tmp_path, extra={"1-moments.b": {"dev_matrix": [2], "tensor_map": [-1, 0]}})
    with caplog.at_level("WARNING"):
        meta = import_mindspore(src, tmp_path / "dcp", strategy=strategy)
    assert sorted(meta.entries) == ["a", "b", "global_step"]
    assert "moments.b" in caplog.text and "not imported" in caplog.text
    # data parallel x2: ranks 2, 3 (replicas of ranks 0, 1) are missing, yet every slice has a file
    w = make_tensor((4, 2), torch.float32, 3)
    src, strategy = _sliced_checkpoint(tmp_path / "dp", "w", {0: w[:2], 1: w[2:]},
                                       {"w": ([2, 2], [0, -1]), "moments.w": ([2, 2], [0, -1])})
    meta = import_mindspore(src, tmp_path / "dp" / "dcp", strategy=strategy)
    assert sorted(meta.entries) == ["global_step", "w"]
    assert torch.equal(load(path=str(tmp_path / "dp" / "dcp"))["w"], w)


def test_a_strategy_of_another_checkpoint_is_an_error(tmp_path):
    doc = json.load(open(os.path.join(TP2, "strategy.json")))
    doc["parallel_layout_item"]["dense1.weight"]["tensor_map"] = [-1, 0, -1]  # a 3-d parameter
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"wrong.json: parameter 'dense1.weight' \(shape \[8, 8\] in .*net0.ckpt\)"
                                              r".*does not describe a 2-d tensor"):
        import_mindspore(TP2, tmp_path / "dcp", strategy=wrong)
    del doc["parallel_layout_item"]["dense1.weight"]  # unnamed: must then be the same on every rank
    wrong.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="'dense1.weight' is not in the strategy file"):
        import_mindspore(TP2, tmp_path / "dcp2", strategy=wrong)


def test_a_directory_needs_a_strategy_and_a_file_takes_none(tmp_path):
    with pytest.raises(ValueError, match="pass its strategy file"):
        import_mindspore(TP2, tmp_path / "a")
    with pytest.raises(ValueError, match="single file"):
        import_mindspore(os.path.join(FIX, "full.ckpt"), tmp_path / "b", strategy=os.path.join(TP2, "strategy.ckpt"))


def test_optimizer_parallel_slicing_is_refused_by_name(tmp_path):
    doc = json.load(open(os.path.join(TP2, "strategy.json")))
    doc["parallel_layout_item"]["dense1.weight"]["opt_weight_shard_size"] = 2
    path = tmp_path / "opt.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="'dense1.weight'.*optimizer parallel.*transform_checkpoints"):
        import_mindspore(TP2, tmp_path / "dcp", strategy=path)


def _load_tp2_under_other_layout(rank: int, world: int, dcp: str) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    full = read_mindspore_checkpoint(os.path.join(TP2, "full.ckpt"))
    # MindSpore saved dense1.weight S(0), dense2.weight S(1), embedding S(0), big S(1): load each otherwise
    plan = {"dense1.weight": [Shard(1)], "dense2.weight": [Shard(0)], "embedding.table": [Shard(1)],
            "big.weight": [Shard(0)], "proj.weight": [Replicate()], "dense1.bias": [Replicate()],
            "adam_m.dense1.weight": [Shard(1)], "dense2.bias": [Shard(0)], "global_step": [Replicate()]}
    sd = {k: DTensor.from_local(torch.zeros_like(full[k].chunk(2, p[0].dim)[rank]) if isinstance(p[0], Shard)
                                else torch.zeros_like(full[k]), mesh, p, shape=full[k].shape,
                                stride=full[k].stride(), run_check=False)
          for k, p in plan.items()}
    sd["learning_rate"] = torch.zeros(())
    load(sd, checkpoint_id=dcp)
    for k, p in plan.items():
        want = full[k].chunk(2, p[0].dim)[rank] if isinstance(p[0], Shard) else full[k]
        got = sd[k].to_local()
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8) if got.dtype == torch.bool else got,
                                                       want), f"rank {rank}: {k}"
    assert torch.equal(sd["learning_rate"], full["learning_rate"])


def test_a_tp2_mindspore_checkpoint_loads_bit_exact_on_two_torch_ranks_under_another_layout(tmp_path):
    import_mindspore(TP2, tmp_path / "dcp", strategy=os.path.join(TP2, "strategy.ckpt"))
    run_ranks(_load_tp2_under_other_layout, 2, str(tmp_path / "dcp"), timeout_s=90)


# ---------------------------------------------------------------------------- strategy files


def test_a_mindspore_strategy_file_loads_as_our_layouts():
    proto = load_layout(os.path.join(TP2, "strategy.ckpt"))
    assert proto == load_layout(os.path.join(TP2, "strategy.json"))
    mesh = Layout((1, 2), ("dim0", "dim1"))
    assert proto["dense1.weight"] == mesh("dim1", "None")        # tensor_map [0, -1]
    assert proto["dense2.weight"] == mesh("None", "dim1")        # tensor_map [-1, 0]
    assert proto["proj.weight"] == Layout((2, 1), ("dim0", "dim1"))(("dim0", "dim1"), "None")  # [[1, 0], -1]
    assert proto["proj.weight"].tensor_map == ((1, 0), -1)


@pytest.mark.parametrize("fmt", ["mindspore", "mindspore-json"])
def test_our_layouts_save_as_a_mindspore_strategy_and_read_back(fmt, tmp_path):
    strategy = load_layout(os.path.join(TP2, "strategy.ckpt"))
    want = read_strategy(os.path.join(TP2, "strategy.ckpt"))
    if fmt == "mindspore-json":  # the JSON form cannot hold a multi-axis tensor_map (see below)
        del strategy["proj.weight"], want["proj.weight"]
    path = str(tmp_path / ("s.ckpt" if fmt == "mindspore" else "s.json"))
    save_layout(strategy, path, format=fmt)
    assert load_layout(path) == strategy
    assert read_strategy(path) == want
    with pytest.raises(ValueError, match="glob pattern"):
        save_layout({"*.weight": strategy["dense1.weight"]}, path, format=fmt)


def test_a_multi_axis_layout_is_refused_in_the_json_form_naming_it(tmp_path):
    # MindSpore's JSON reader takes one list of ints per tensor_map: [[1, 0], -1] fails there
    strategy = load_layout(os.path.join(TP2, "strategy.ckpt"))
    path = tmp_path / "s.json"
    with pytest.raises(ValueError, match=r"s.json: cannot write 'proj.weight' \(tensor_map \[\[1, 0\], -1\]\) in "
                                         r"MindSpore's JSON strategy form.*format=\"mindspore\""):
        save_layout(strategy, str(path), format="mindspore-json")
    assert not os.listdir(tmp_path)  # nothing written
    save_layout(strategy, str(tmp_path / "s.ckpt"), format="mindspore")  # the protobuf form holds it
    assert load_layout(str(tmp_path / "s.ckpt"))["proj.weight"].tensor_map == ((1, 0), -1)


def test_a_merged_pipeline_strategy_puts_each_stage_on_its_ranks(tmp_path):
    # merge_pipeline_strategys names parameters "<stage>-<name>"; stage 1 of a 2-device stage is ranks 2, 3
    item = {"dev_matrix": [2], "tensor_map": [0, -1], "field": 0, "opt_weight_shard_step": 0,
            "opt_weight_shard_size": 0}
    path = tmp_path / "merged.json"
    path.write_text(json.dumps({"current_stage": 1, "parallel_layout_item": {"0-embed": item, "1-head": item}}))
    strategy = load_layout(str(path))
    assert list(strategy["embed"].layout.rank_list) == [0, 1] and list(strategy["head"].layout.rank_list) == [2, 3]
    assert strategy["head"].chunk_box(3, (6, 4)).offsets == (3, 0)


def _proto_strategy(name: str, dev_matrix: list[int], tensor_map: list[int]) -> bytes:
    """A protobuf ParallelStrategyMap with one parallel_layout_item, as MindSpore writes it."""
    layouts = pw.len_field(1, pw.repeated_ints(1, dev_matrix)) + pw.len_field(2, pw.repeated_ints(1, tensor_map))
    return pw.int_field(1, 0) + pw.len_field(3, pw.str_field(1, name) + pw.len_field(2, layouts))


@pytest.mark.parametrize("name,dev_matrix,why", [
    ("w", [1 << 20, 1 << 20], "1099511627776 devices, more than any job"),  # a MemoryError before
    ("w", [4096, 4096], "16777216 devices, more than any job"),  # minutes over 16.7M ranks before
    ("3-w", [1 << 19], "on pipeline stage 3, ranks up to 2097151"),
    ("99999999999999999999999-w", [2], "more than any job"),
    ("w", [1] * 9, "a dev_matrix of 9 dims; a mesh has at most 8"),
])
def test_a_strategy_larger_than_any_job_is_refused_naming_file_and_parameter(name, dev_matrix, why, tmp_path):
    # the bounds of our own .metadata (MAX_WORLD ranks, MAX_MESH_NDIM mesh dims), checked as
    # the file is read, so nothing allocates or walks its ranks
    item = {"dev_matrix": dev_matrix, "tensor_map": [0, -1], "field": 0, "opt_weight_shard_step": 0,
            "opt_weight_shard_size": 0}
    as_json = tmp_path / "big.json"
    as_json.write_text(json.dumps({"current_stage": 0, "parallel_layout_item": {name: item}}))
    as_proto = tmp_path / "big.ckpt"
    as_proto.write_bytes(_proto_strategy(name, dev_matrix, [0, -1]))
    short = name.split("-", 1)[-1]
    for path in (as_json, as_proto):
        match = rf"{path.name}: parameter {short!r} has .*{re.escape(why)}"
        with pytest.raises(MetadataError, match=match):
            read_strategy(path)
        with pytest.raises(MetadataError, match=match):  # not "not a layout file"
            load_layout(str(path))
        with pytest.raises(MetadataError, match=match):
            import_mindspore(TP2, tmp_path / "dcp", strategy=path)
    assert not os.path.exists(tmp_path / "dcp")


def test_a_mesh_larger_than_any_job_is_refused_in_our_layout_files_too(tmp_path):
    with pytest.raises(ValueError, match=r"mesh_shape \(4096, 4096\) has 16777216 positions, more than any job"):
        Layout((4096, 4096), ("dp", "tp"))
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"format": "hyper-parallel-layout", "version": 1,
                                "meshes": [{"mesh_shape": [4096, 4096], "alias_name": ["dp", "tp"]}],
                                "layouts": [{"name": "*", "mesh": 0, "tensor_map": [0, -1]}]}))
    with pytest.raises(ValueError, match="big.json: bad mesh: .*more than any job"):
        load_layout(str(path))
    path.write_bytes(b"[" * 100_000)  # nested deeper than the JSON reader goes: not a layout file
    with pytest.raises(ValueError, match="not a layout file: neither JSON"):
        load_layout(str(path))


def test_a_file_that_is_no_strategy_is_a_clear_layout_error():
    with pytest.raises(ValueError, match="neither JSON .* nor a MindSpore strategy"):
        load_layout(os.path.join(FIX, "encrypted.ckpt"))


# ---------------------------------------------------------------------------- export


def test_export_writes_the_bytes_mindspore_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(ms_ckpt, "SLICE_BYTES", 1024)  # the fixtures' lowered slice size
    import_mindspore(os.path.join(FIX, "full.ckpt"), tmp_path / "dcp")
    for fixture, crc in (("full.ckpt", False), ("full_crc.ckpt", True)):
        out = tmp_path / fixture
        summary = export_mindspore(tmp_path / "dcp", out, crc=crc)
        assert summary.tensors == 17 and not summary.skipped
        assert out.read_bytes() == open(os.path.join(FIX, fixture), "rb").read()


def test_export_safetensors_carries_mindspores_crc(tmp_path):
    import_mindspore(os.path.join(FIX, "crc.safetensors"), tmp_path / "dcp")
    out = tmp_path / "out.safetensors"
    export_mindspore(tmp_path / "dcp", out, crc=True)
    header = json.loads(out.read_bytes()[8:8 + struct.unpack("<Q", out.read_bytes()[:8])[0]])
    theirs = open(os.path.join(FIX, "crc.safetensors"), "rb").read()
    their_header = json.loads(theirs[8:8 + struct.unpack("<Q", theirs[:8])[0]])
    assert int(header["__metadata__"]["crc_num"]) == int(their_header["__metadata__"]["crc_num"])
    assert_as_mindspore_reads(read_mindspore_checkpoint(out), "crc.safetensors")


def test_export_splits_large_tensors_and_skips_what_mindspore_cannot_hold(tmp_path, monkeypatch):
    monkeypatch.setattr(ms_ckpt, "SLICE_BYTES", 1000)
    sd = {"model": {"w": make_tensor((50, 7), torch.bfloat16, 3), "e": torch.zeros(0, 4)},
          "step": 7, "name": "run-1", "blob": b"\x00\x01", "hist": [1, 2]}
    save(sd, str(tmp_path / "dcp"), no_dist=True)
    summary = export_mindspore(tmp_path / "dcp", tmp_path / "m.ckpt")
    assert summary.skipped == ["blob", "hist"]  # bytes and a list have no MindSpore counterpart
    with msf.open_mindspore_file(tmp_path / "m.ckpt") as f:
        assert len(f.tensors["model.w"].pieces) == 1  # 700 bytes
    back = read_mindspore_checkpoint(tmp_path / "m.ckpt")
    assert torch.equal(back["model.w"], sd["model"]["w"]) and back["model.e"].shape == (0, 4)
    assert back["step"].dtype == torch.int64 and int(back["step"]) == 7 and back["name"] == "run-1"
    summary = export_mindspore(tmp_path / "dcp", tmp_path / "w.ckpt", prefix="model.")
    assert set(read_mindspore_checkpoint(tmp_path / "w.ckpt")) == {"w", "e"}
    with pytest.raises(CheckpointError, match="already exists"):
        export_mindspore(tmp_path / "dcp", tmp_path / "w.ckpt")


def test_export_refuses_a_dtype_mindspore_has_no_name_for(tmp_path):
    save({"f8": torch.zeros(4, dtype=torch.float8_e4m3fn)}, str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(UnsupportedValueError, match="'f8' has dtype float8_e4m3fn"):
        export_mindspore(tmp_path / "dcp", tmp_path / "x.ckpt")
    assert not [f for f in os.listdir(tmp_path) if f.startswith("x.ckpt")]  # nor a temporary file


def test_export_refuses_a_tensor_named_like_the_safetensors_header_member(tmp_path):
    # it replaced safetensors' __metadata__ member: an unreadable file (or an AssertionError with crc)
    save({"__metadata__": torch.ones(2, dtype=torch.uint8), "w": torch.ones(2)}, str(tmp_path / "dcp"), no_dist=True)
    for crc in (False, True):
        with pytest.raises(UnsupportedValueError, match="'__metadata__'.*reserves"):
            export_mindspore(tmp_path / "dcp", tmp_path / "x.safetensors", crc=crc)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("x.")]
    export_mindspore(tmp_path / "dcp", tmp_path / "x.ckpt")  # a .ckpt file may hold the name
    assert torch.equal(load(path=str(import_mindspore(tmp_path / "x.ckpt", tmp_path / "back") and tmp_path / "back"))
                       ["__metadata__"], torch.ones(2, dtype=torch.uint8))


def test_export_reads_a_resharded_checkpoint_whole(tmp_path):
    # a distributed import has two chunks per sliced tensor; the export joins them
    import_mindspore(TP2, tmp_path / "dcp", strategy=os.path.join(TP2, "strategy.ckpt"))
    export_mindspore(tmp_path / "dcp", tmp_path / "whole.ckpt")
    assert_as_mindspore_reads(read_mindspore_checkpoint(tmp_path / "whole.ckpt"), "tp2/full.ckpt")


# ---------------------------------------------------------------------------- with MindSpore itself


def mindspore_python() -> str | None:
    if os.environ.get("HP_MINDSPORE_PYTHON"):
        return os.environ["HP_MINDSPORE_PYTHON"]
    exe = os.path.join(REPO, ".msenv", "bin", "python")
    installed = glob.glob(os.path.join(REPO, ".msenv", "lib", "python*", "site-packages", "mindspore", "__init__.py"))
    return exe if os.path.exists(exe) and installed else None


needs_mindspore = pytest.mark.skipif(
    mindspore_python() is None,
    reason="MindSpore not available: set HP_MINDSPORE_PYTHON to a Python with mindspore (scripts/setup_mindspore.sh)")

_DESCRIBE = textwrap.dedent("""
    import hashlib, json, sys
    import mindspore as ms
    def describe(path, **kw):
        fmt = "safetensors" if path.endswith(".safetensors") else "ckpt"
        out = {}
        for name, p in ms.load_checkpoint(path, format=fmt, **kw).items():
            out[name] = p if isinstance(p, str) else [str(p.dtype), list(p.shape),
                                                      hashlib.sha256(p.asnumpy().tobytes()).hexdigest()]
        return out
""")


def run_mindspore(code: str, timeout: float = 240) -> str:
    out = subprocess.run([mindspore_python(), "-c", _DESCRIBE + textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, "GLOG_v": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@needs_mindspore
def test_an_exported_checkpoint_loads_in_mindspore_bit_exact(tmp_path):
    sd = {"w32": make_tensor((33, 17), torch.float32, 1), "w16": make_tensor((9, 4), torch.float16, 2),
          "wbf": make_tensor((5, 6), torch.bfloat16, 3), "i8": make_tensor((7,), torch.int8, 4),
          "u8": make_tensor((3, 3), torch.uint8, 5), "i32": make_tensor((4,), torch.int32, 6),
          "i64": make_tensor((2, 3), torch.int64, 7), "b": make_tensor((5,), torch.bool, 8),
          "f64": make_tensor((2,), torch.float64, 9), "s": torch.tensor(1.5), "note": "hello"}
    save(sd, str(tmp_path / "dcp"), no_dist=True)
    export_mindspore(tmp_path / "dcp", tmp_path / "m.ckpt")
    export_mindspore(tmp_path / "dcp", tmp_path / "c.ckpt", crc=True)
    export_mindspore(tmp_path / "dcp", tmp_path / "m.safetensors")
    # MindSpore 2.10's crc_check on safetensors fails on its own float16/bfloat16 ("cannot include
    # dtype 'E' in a buffer"), so the crc'd safetensors file holds the other dtypes
    no_half = {k: v for k, v in sd.items() if k not in ("w16", "wbf")}
    save(no_half, str(tmp_path / "dcp32"), no_dist=True)
    export_mindspore(tmp_path / "dcp32", tmp_path / "c.safetensors", crc=True)
    got = json.loads(run_mindspore(f"""
        print(json.dumps([describe({str(tmp_path / 'm.ckpt')!r}),
                          describe({str(tmp_path / 'c.ckpt')!r}, crc_check=True),
                          describe({str(tmp_path / 'm.safetensors')!r}),
                          describe({str(tmp_path / 'c.safetensors')!r}, crc_check=True)]))
    """).strip().splitlines()[-1])
    to_ms = {v: k for k, v in msf.MS_DTYPES.items()}
    for i, desc in enumerate(got):
        source = no_half if i == 3 else sd
        want = {k: [to_ms[dtype_name(v.dtype)], list(v.shape), sha(v)] for k, v in source.items()
                if isinstance(v, torch.Tensor)}
        if i < 2:
            want["note"] = "hello"  # strings exist in .ckpt only
        assert desc == want, i


@needs_mindspore
def test_a_tensor_above_mindspores_slice_size_imports_bit_exact(tmp_path):
    n = (513 << 20) // 4  # int32 elements: 513 MiB, above MindSpore's 512 MiB slice size
    path = str(tmp_path / "big.ckpt")
    run_mindspore(f"""
        import numpy as np
        ms.save_checkpoint([{{"name": "big", "data": ms.Parameter(ms.Tensor(np.arange({n}, dtype=np.int32)),
                                                                 name="big")}}], {path!r})
    """)
    with msf.open_mindspore_file(path) as f:
        assert len(f.tensors["big"].pieces) == 2  # MindSpore wrote it in two messages
    import_mindspore(path, tmp_path / "dcp")
    big = load(path=str(tmp_path / "dcp"))["big"]
    assert torch.equal(big, torch.arange(n, dtype=torch.int32))


@needs_mindspore
def test_mindspore_slices_by_our_strategy_file_as_we_read_it(tmp_path):
    # our strategy file, read by MindSpore's transform_checkpoints; its slices, read back by us
    mesh = Layout((2, 2), ("dp", "tp"))
    strategy = {"a": mesh("tp", "None"), "b": mesh("None", ("dp", "tp"))}
    sd = {"a": make_tensor((6, 3), torch.float32, 1), "b": make_tensor((3, 8), torch.float32, 2)}
    save(sd, str(tmp_path / "dcp"), no_dist=True)
    os.makedirs(tmp_path / "full" / "rank_0")
    export_mindspore(tmp_path / "dcp", tmp_path / "full" / "rank_0" / "net.ckpt")
    save_layout(strategy, str(tmp_path / "strategy.ckpt"), format="mindspore")
    run_mindspore(f"""
        ms.transform_checkpoints({str(tmp_path / 'full')!r}, {str(tmp_path / 'ms')!r}, "net", None,
                                 {str(tmp_path / 'strategy.ckpt')!r})
    """)
    assert sorted(os.listdir(tmp_path / "ms")) == ["rank_0", "rank_1", "rank_2", "rank_3"]
    import_mindspore(tmp_path / "ms", tmp_path / "back", strategy=tmp_path / "strategy.ckpt")
    back = load(path=str(tmp_path / "back"))
    assert torch.equal(back["a"], sd["a"]) and torch.equal(back["b"], sd["b"])


@needs_mindspore
def test_mindspore_reads_our_json_strategy_and_not_a_multi_axis_one(tmp_path):
    # why save_layout(format="mindspore-json") refuses a multi-axis layout: MindSpore's own
    # JSON reader fails on the nested list, while our single-axis JSON file reads as we wrote it
    mesh = Layout((2, 2), ("dp", "tp"))
    save_layout({"a": mesh("tp", "None"), "b": mesh("None", "dp")}, str(tmp_path / "s.json"), format="mindspore-json")
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"current_stage": 0, "parallel_layout_item": {"w": {
        "dev_matrix": [2, 1], "tensor_map": [[1, 0], -1], "field": 0, "opt_weight_shard_step": 0,
        "opt_weight_shard_size": 0}}}))
    got = json.loads(run_mindspore(f"""
        s = ms.build_searched_strategy({str(tmp_path / 's.json')!r})
        ours = {{k: [list(v.dev_matrix[0].dim), [list(t.dim) for t in v.tensor_map]] for k, v in s.items()}}
        try:
            ms.build_searched_strategy({str(nested)!r})
            nested = "read"
        except TypeError as exc:
            nested = str(exc)
        print(json.dumps([ours, nested]))
    """).strip().splitlines()[-1])
    assert got[0] == {"a": [[2, 2], [[0, -1]]], "b": [[2, 2], [[-1, 1]]]}
    assert "[1, 0] has type" in got[1]


@needs_mindspore
def test_mindspore_refuses_a_missing_stage_and_ignores_an_unsaved_strategy_parameter(tmp_path):
    # the rules the importer follows, as MindSpore's transform_checkpoints applies them
    src, strategy, _ = _two_stage_checkpoint(tmp_path, extra={"1-moments.b": {"dev_matrix": [2],
                                                                             "tensor_map": [-1, 0]}})
    partial = str(tmp_path / "partial")
    shutil.copytree(src, partial, ignore=shutil.ignore_patterns("rank_2", "rank_3"))
    got = json.loads(run_mindspore(f"""
        out = []
        for src, dst in (({src!r}, {str(tmp_path / 'a')!r}), ({partial!r}, {str(tmp_path / 'b')!r})):
            try:
                ms.transform_checkpoints(src, dst, "n", {strategy!r}, None)
                out.append(sorted(ms.load_checkpoint(dst + "/rank_0/n0.ckpt")))
            except ValueError as exc:
                out.append(str(exc))
        print(json.dumps(out))
    """).strip().splitlines()[-1])
    assert got[0] == ["a", "b", "global_step"]  # 'moments.b' in no file: ignored
    assert "checkpoint file of rank2 is needed" in got[1] or "checkpoint file of rank3 is needed" in got[1]
