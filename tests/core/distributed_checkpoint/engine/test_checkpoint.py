"""save/load in one process: call styles, values, errors, corruption, custom planners."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
from helpers import assert_same, make_tensor, rows_over_ranks

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    FileSystemReader,
    MetadataError,
    NotACheckpointError,
    StandardLoadPlanner,
    StandardPlanner,
    StandardSavePlanner,
    StateDictMismatchError,
    UnsupportedValueError,
    load,
    save,
)
from hyper_parallel.core.distributed_checkpoint._src.engine.metadata_reader import read_checkpoint_metadata
from hyper_parallel.core.distributed_checkpoint._src.format.sealed_json import seal_json
from hyper_parallel.core.distributed_checkpoint._src.planning.plan_cache import PLAN_CACHE


def small_sd() -> dict:
    return {"model": {"w": make_tensor((6, 4)), "b": make_tensor((4,), seed=1)}, "step": 3}


def test_seed_call_style_round_trips(tmp_path):
    model = torch.nn.Linear(4, 3)
    save(state_dict=model.state_dict(), path=str(tmp_path), planner=StandardPlanner())
    state_dict = load(path=str(tmp_path), planner=StandardPlanner())
    fresh = torch.nn.Linear(4, 3)
    fresh.load_state_dict(state_dict)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_positional_and_checkpoint_id_styles_are_synonyms(tmp_path):
    sd = small_sd()
    save(sd, tmp_path / "a")  # os.PathLike works too
    save(sd, checkpoint_id=str(tmp_path / "b"), use_collectives=True)
    for p in ("a", "b"):
        target = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4)}, "step": 0}
        assert load(target, checkpoint_id=str(tmp_path / p)) is target
        assert_same(sd, target)
    assert_same(sd, load(str(tmp_path / "a")))


def test_works_without_a_process_group_and_with_no_dist(tmp_path):
    assert not torch.distributed.is_initialized()
    sd = small_sd()
    save(sd, str(tmp_path / "x"), no_dist=True)
    assert_same(sd, load(path=str(tmp_path / "x"), no_dist=True))


def test_planner_aliases_are_the_standard_planner():
    assert StandardSavePlanner is StandardPlanner and StandardLoadPlanner is StandardPlanner


def test_every_dtype_and_odd_shape_round_trips(tmp_path):
    sd = {}
    for dt in [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
               torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
               torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]:
        name = str(dt).replace("torch.", "")
        sd[name] = make_tensor((3, 5), dt) if not dt.is_complex else torch.randn(3, 5, dtype=dt)
    sd["zero_dim"] = torch.tensor(7, dtype=torch.int64)
    sd["empty"] = torch.empty(0, 3)
    sd["view"] = make_tensor((8, 6))[2:7, 1::2]
    sd["transposed"] = make_tensor((4, 5)).t()
    sd["expanded"] = torch.arange(3.0).expand(4, 3)
    save(sd, str(tmp_path))
    out = load(path=str(tmp_path))
    assert_same({k: v.contiguous() for k, v in sd.items()}, out)


def test_plain_values_keep_their_types(tmp_path):
    sd = {"t": torch.ones(1), "v": {"i": 3, "f": 2.5, "nan": float("nan"), "ninf": float("-inf"), "s": "x",
                                    "none": None, "b": True, "tup": (1, (2, "3")), "lst": [1, [2.0]],
                                    "int_keys": {0: "a", 5: [1]}, "empty": {}, "empty_list": []},
          "blob": b"\x00\xffdata", "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
          "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                    "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]}}
    save(sd, str(tmp_path))
    assert_same(sd, load(path=str(tmp_path)))


def test_numpy_target_is_filled_in_place(tmp_path):
    save({"a": np.arange(4.0)}, str(tmp_path))
    target = {"a": np.zeros(4)}
    arr = target["a"]
    load(target, str(tmp_path))
    assert target["a"] is arr and arr.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_0d_numpy_array_keeps_its_shape(tmp_path):
    save({"s": np.array(2.5), "i": np.array(7, dtype=np.int32)}, str(tmp_path))
    out = load(path=str(tmp_path))
    assert out["s"].shape == () and out["s"] == 2.5 and out["i"].shape == () and out["i"].dtype == np.int32
    target = {"s": np.array(0.0)}
    load(target, str(tmp_path))
    assert target["s"].shape == () and target["s"] == 2.5


def test_pickle_needs_opt_in_on_save_and_again_on_load(tmp_path):
    sd = {"obj": {1, 2, 3}}
    with pytest.raises(UnsupportedValueError, match="'obj'.*allow_pickle=True"):
        save(sd, str(tmp_path))
    assert not os.path.exists(tmp_path / ".metadata")
    save(sd, str(tmp_path), allow_pickle=True)
    with pytest.raises(UnsupportedValueError, match="'obj'.*pickled"):
        load(path=str(tmp_path))
    assert load(path=str(tmp_path), allow_pickle=True)["obj"] == {1, 2, 3}


def test_loading_never_runs_code_from_the_checkpoint(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    save({"x": Evil()}, str(tmp_path / "c"), allow_pickle=True)
    with pytest.raises(UnsupportedValueError):
        load(path=str(tmp_path / "c"))
    assert not marker.exists()


def test_a_state_dict_that_contains_itself_or_nests_too_deep_is_refused(tmp_path):
    """A cycle is refused naming the key, not a RecursionError; a container shared many times is
    scanned once (45 levels of [x, x] is 2**45 visits otherwise)."""
    loop = [torch.ones(2)]
    loop.append(loop)
    with pytest.raises(UnsupportedValueError, match=r"'a\.1' contains itself"):
        save({"a": loop}, str(tmp_path / "loop"))
    deep = [torch.ones(1)]
    for _ in range(150):
        deep = [deep]
    with pytest.raises(UnsupportedValueError, match="'deep' nests containers more than 100"):
        save({"deep": deep}, str(tmp_path / "deep"))
    shared: list = [1]
    for _ in range(45):
        shared = [shared, shared]
    with pytest.raises(UnsupportedValueError, match="more than 1048576 items"):
        save({"s": shared, "t": torch.ones(1)}, str(tmp_path / "shared"))


def test_shape_dtype_and_kind_mismatches_name_the_key(tmp_path):
    save(small_sd(), str(tmp_path))
    cases = [
        ({"model": {"w": torch.zeros(6, 5), "b": torch.zeros(4)}, "step": 0}, r"'model\.w'.*shape \[6, 4\]"),
        ({"model": {"w": torch.zeros(6, 4, dtype=torch.float64), "b": torch.zeros(4)}, "step": 0},
         r"'model\.w'.*float32.*float64"),
        ({"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4)}, "step": torch.zeros(1)}, r"'step'"),
    ]
    for target, pattern in cases:
        with pytest.raises(StateDictMismatchError, match=pattern):
            load(target, str(tmp_path), planner=StandardPlanner(convert_dtype=False))


def test_a_target_of_another_dtype_is_converted_like_torch_dcp(tmp_path):
    sd = small_sd()
    save(sd, str(tmp_path))
    target = {"model": {"w": torch.zeros(6, 4, dtype=torch.bfloat16), "b": torch.zeros(4, dtype=torch.float64)},
              "step": 0}
    w, b = target["model"]["w"], target["model"]["b"]
    load(target, str(tmp_path))
    assert target["model"]["w"] is w and w.dtype == torch.bfloat16  # filled in place, in its own dtype
    assert torch.equal(w, sd["model"]["w"].to(torch.bfloat16)) and torch.equal(b, sd["model"]["b"].double())
    # a conversion to a lesser kind (float -> int, complex -> real) is done, and named in a warning
    target = {"model": {"w": torch.zeros(6, 4, dtype=torch.int32), "b": torch.zeros(4)}, "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(target, str(tmp_path))
    assert [str(x.message) for x in caught if "lesser kind" in str(x.message) and "'model.w' (float32 -> int32)"
            in str(x.message)], [str(x.message) for x in caught]
    assert torch.equal(target["model"]["w"], sd["model"]["w"].to(torch.int32))


def test_strict_means_every_key_asked_for_exists_and_extra_checkpoint_keys_are_fine(tmp_path):
    save(small_sd(), str(tmp_path))
    target = {"model": {"w": torch.zeros(6, 4), "extra": torch.zeros(1)}, "step": 0}
    with pytest.raises(StateDictMismatchError) as info:
        load(target, str(tmp_path))
    msg = str(info.value)
    assert "'model.extra'" in msg and "does not hold" in msg and "strict=False" in msg
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(target, str(tmp_path), strict=False)
    assert any("model.extra" in str(w.message) for w in caught)
    assert torch.equal(target["model"]["w"], small_sd()["model"]["w"]) and target["step"] == 3
    assert torch.equal(target["model"]["extra"], torch.zeros(1))
    # a model-only target of a bigger checkpoint: the checkpoint's other keys are fine
    only_w = {"model": {"w": torch.zeros(6, 4)}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(only_w, str(tmp_path))
    assert torch.equal(only_w["model"]["w"], small_sd()["model"]["w"])
    # strict="all": every checkpoint key must be asked for (by some rank)
    with pytest.raises(StateDictMismatchError, match=r"asked for by no rank: 'model\.b', 'step'"):
        load({"model": {"w": torch.zeros(6, 4)}}, str(tmp_path), strict="all")
    load({"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4)}, "step": 0}, str(tmp_path), strict="all")
    with pytest.raises(ValueError, match="strict"):
        load(only_w, str(tmp_path), strict="some")


def test_a_directory_without_metadata_is_not_a_checkpoint(tmp_path):
    with pytest.raises(NotACheckpointError, match="no such directory"):
        load(path=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpointError, match=".metadata"):
        load(path=str(tmp_path / "empty"))


def test_unknown_format_version_is_refused_with_upgrade_hint(tmp_path):
    save(small_sd(), str(tmp_path))
    meta = tmp_path / ".metadata"
    doc = json.loads(meta.read_bytes())
    doc["version"] = 99
    meta.write_bytes(seal_json(doc))
    with pytest.raises(MetadataError, match="version 99.*upgrade"):
        load(path=str(tmp_path))


def test_empty_or_garbage_metadata_is_refused(tmp_path):
    save(small_sd(), str(tmp_path))
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(MetadataError, match="empty"):
        load(path=str(tmp_path))
    (tmp_path / ".metadata").write_bytes(b"\x80\x04\x95 pickle")  # torch DCP's or HyperParallel's: never loaded
    with pytest.raises(MetadataError, match="is a Python pickle.*import_torch_dcp.*import_hyper_parallel"):
        load(path=str(tmp_path))
    (tmp_path / ".metadata").write_bytes(b"{garbage")
    with pytest.raises(MetadataError, match="not valid JSON"):
        load(path=str(tmp_path))


def _data_file(path) -> str:
    return next(f for f in os.listdir(path) if f.endswith(".safetensors"))


def load_metadata(path: str):
    return read_checkpoint_metadata(FileSystemReader(path))


def _payload_start(path, entry: str) -> int:
    """Where a safetensors entry's bytes start in the file (read from its own header)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return 8 + n + header[entry]["data_offsets"][0]


def test_a_flipped_byte_names_the_key_and_file(tmp_path):
    sd = {"a": make_tensor((64, 16)), "b": make_tensor((8,), seed=1)}
    save(sd, str(tmp_path))
    name = _data_file(tmp_path)
    start = _payload_start(tmp_path / name, "a@0,0")
    with open(tmp_path / name, "r+b") as f:
        f.seek(start + 1000)
        byte = f.read(1)
        f.seek(start + 1000)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match=rf"'a'.*{name}"):
        load(path=str(tmp_path))
    target = {"a": torch.zeros(64, 16), "b": torch.zeros(8)}
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        load(target, str(tmp_path))


def test_a_truncated_or_missing_data_file_is_detected(tmp_path):
    save({"a": make_tensor((32, 8))}, str(tmp_path))
    name = _data_file(tmp_path)
    size = os.path.getsize(tmp_path / name)
    os.truncate(tmp_path / name, size - 10)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load(path=str(tmp_path))
    os.unlink(tmp_path / name)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        load(path=str(tmp_path))


def test_resharded_partial_reads_are_exact_without_verify_and_checked_with_it(tmp_path):
    full = make_tensor((64, 32))
    save({"w": full}, str(tmp_path))
    for verify, bound in ((False, 1.0), (True, 2.0)):
        target = {"w": torch.zeros(64, 16)}
        reader = FileSystemReader(str(tmp_path))

        class RightHalf(StandardPlanner):
            """Load columns 16..32 of the saved 'w' into a 64x16 target."""

            def _destination(self, key, entry, target):
                from hyper_parallel.core.distributed_checkpoint._src.base.box import Box
                return Box((0, 16), (64, 16)), target

            def _mismatch(self, *a):  # shapes differ on purpose here
                raise AssertionError

        planner = RightHalf()
        planner._destination = RightHalf._destination.__get__(planner)
        load(target, str(tmp_path), storage_reader=reader, planner=planner, verify=verify)
        assert torch.equal(target["w"], full[:, 16:])
        index = sum(f.index_length for f in load_metadata(str(tmp_path)).files)  # read once per file
        assert reader.bytes_read - index <= bound * 64 * 16 * 4, (verify, reader.bytes_read)


class Renaming(StandardPlanner):
    """A custom planner: keys are saved under 'v2.' and loaded back from there."""

    def transform_state_dict(self, state_dict):
        return {"v2." + k: v for k, v in state_dict.items() if not k.startswith("skip")}


def test_a_custom_planner_can_rename_and_filter_keys(tmp_path):
    sd = {"w": make_tensor((3, 3)), "skip_me": torch.ones(2), "step": 4}
    save(sd, str(tmp_path), planner=Renaming())
    out = load(path=str(tmp_path))
    assert set(out) == {"v2"} and set(out["v2"]) == {"w", "step"}
    target = {"w": torch.zeros(3, 3), "step": 0}
    load(target, str(tmp_path), planner=Renaming())
    assert torch.equal(target["w"], sd["w"])


def test_global_plans_are_cached_while_the_structure_is_unchanged(tmp_path):
    PLAN_CACHE.clear()
    calls = []

    class Counting(StandardPlanner):
        def create_global_save_plan(self, plans):
            calls.append(1)
            return super().create_global_save_plan(plans)

    sd = small_sd()
    for step in range(3):
        sd["step"] = step
        sd["model"]["w"] += 1
        save(sd, str(tmp_path), planner=Counting())
    assert len(calls) == 1
    assert_same(sd, load(path=str(tmp_path)))
    sd["model"]["w"] = torch.zeros(7, 4)  # new shape: new plan
    save(sd, str(tmp_path), planner=Counting())
    assert len(calls) == 2


def test_saving_over_a_checkpoint_replaces_it_and_removes_old_files(tmp_path):
    save(small_sd(), str(tmp_path))
    first = set(os.listdir(tmp_path))
    sd2 = small_sd()
    sd2["step"] = 9
    save(sd2, str(tmp_path))
    second = set(os.listdir(tmp_path))
    assert not (first - {".metadata"}) & second
    assert load(path=str(tmp_path))["step"] == 9


def test_a_url_path_uses_fsspec_storage():
    sd = small_sd()
    save(sd, "memory://ckpt/a")
    assert_same(sd, load(path="memory://ckpt/a"))


def test_an_empty_state_dict_and_a_path_that_is_a_file(tmp_path):
    save({}, str(tmp_path / "e"))
    assert load(path=str(tmp_path / "e")) == {}
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        save({"w": torch.ones(1)}, str(tmp_path / "f"))


def _tails(files) -> list:
    """What a many-file load hints of each file before reading its index: the index and as
    many bytes before it."""
    return [(f.path, f.index_offset - f.index_length, 2 * f.index_length) for f in files]


class _Hinting(FileSystemReader):
    """Records the prefetch hints a load gives; ``accept=False`` plays a storage without them."""

    def __init__(self, path, accept=True):
        super().__init__(path)
        self.accept, self.hints = accept, []

    def prefetch(self, ranges):
        ranges = list(ranges)
        self.hints.append(ranges)
        return super().prefetch(ranges) if self.accept else False


def test_a_plain_dict_stored_whole_still_reports_the_keys_the_target_adds(tmp_path):
    # a dict of plain values is one entry; a target with more keys must not lose them silently
    save({"w": torch.ones(2), "extra": {"a": 1, "b": {"x": 2}, 3: "three"}}, str(tmp_path))
    target = {"w": torch.zeros(2), "extra": {"a": 0, "b": {"x": 0, "y": 9}, "c": 5, 3: ""}}
    with pytest.raises(StateDictMismatchError) as info:
        load(target, str(tmp_path))
    assert "'extra.b.y', 'extra.c'" in str(info.value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(target, str(tmp_path), strict=False)
    assert any("'extra.b.y', 'extra.c'" in str(w.message) for w in caught)
    assert target["extra"] == {"a": 1, "b": {"x": 2, "y": 9}, "c": 5, 3: "three"}
    # keys only the checkpoint holds are loaded: a dict that starts empty gets the saved one
    fresh = {"w": torch.zeros(2), "extra": {}}
    load(fresh, str(tmp_path))
    assert fresh["extra"] == {"a": 1, "b": {"x": 2}, 3: "three"}


@pytest.mark.parametrize("accept", [True, False])
def test_a_tensor_spread_over_many_files_is_hinted_then_read_exactly(tmp_path, accept):
    sd = {f"w{i}": make_tensor((256, 8), seed=i) for i in range(3)}
    dst = rows_over_ranks(sd, tmp_path)
    reader = _Hinting(dst, accept)
    target = {"w1": torch.zeros(256, 8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # strict=False: the other keys are not asked for
        load(target, storage_reader=reader, strict=False)
    assert torch.equal(target["w1"], sd["w1"])
    meta = read_checkpoint_metadata(FileSystemReader(dst))
    # every file's index first, with as many bytes before it (where its last chunks lie)
    tails = set(_tails(meta.files))
    assert set(reader.hints[0]) == tails
    if accept:  # then the 8-row chunk of "w1" in each of the 32 files: 256 bytes, not in those tails
        assert len(reader.hints) == 2 and len(reader.hints[1]) == 32
        assert all(length == 8 * 8 * 4 for _, _, length in reader.hints[1])
    else:
        assert len(reader.hints) == 2  # hinted, refused, and read from several threads as before


def test_chunks_just_before_a_files_index_come_with_it_and_need_no_hint_of_their_own(tmp_path):
    # 32 files of 20 chunks of 8 bytes: each file's index (~600 bytes) is longer than its chunks
    sd = {f"w{i:02d}": make_tensor((64, 1), seed=i) for i in range(20)}
    dst = rows_over_ranks(sd, tmp_path)
    reader = _Hinting(dst)
    target = {"w07": torch.zeros(64, 1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(target, storage_reader=reader, strict=False)
    assert torch.equal(target["w07"], sd["w07"])
    meta = read_checkpoint_metadata(FileSystemReader(dst))
    assert all(f.index_length > 20 * 8 for f in meta.files)
    assert reader.hints == [_tails(sorted(meta.files, key=lambda f: f.rank))]  # one hint a file, none for the data
    assert reader.read_calls == 2 * 32  # a file's index, then its chunk


def test_many_files_are_hinted_a_window_ahead_of_the_reads(tmp_path, monkeypatch):
    from hyper_parallel.core.distributed_checkpoint._src.transfer import loader

    monkeypatch.setattr(loader, "HINT_WINDOW", 8)  # 32 files: hinted 8 at first, then 4 more at a time
    sd = {"w": make_tensor((256, 8))}
    dst = rows_over_ranks(sd, tmp_path)
    reader = _Hinting(dst)
    target = {"w": torch.zeros(256, 8)}
    load(target, storage_reader=reader)
    assert torch.equal(target["w"], sd["w"])
    meta = read_checkpoint_metadata(FileSystemReader(dst))
    tails = set(_tails(meta.files))
    index_hints = [h for h in reader.hints if h and h[0] in tails]
    assert len(index_hints[0]) == 8 and all(len(h) <= 8 for h in index_hints) and len(index_hints) > 2
    hinted = [r for h in index_hints for r in h]
    assert sorted(hinted) == sorted(tails)  # each once


def test_a_single_file_a_load_needs_little_of_is_hinted_then_read(tmp_path):
    sd = {f"w{i}": make_tensor((4, 8), seed=i) for i in range(3)}
    save(sd, str(tmp_path / "c"), no_dist=True)
    reader = _Hinting(str(tmp_path / "c"))
    target = {k: torch.zeros(4, 8) for k in sd}
    load(target, storage_reader=reader)
    assert_same(sd, target)
    assert len(reader.hints) == 1 and sorted(length for _, _, length in reader.hints[0]) == [128] * 3


def test_plain_values_inside_tuples_load_in_place(tmp_path):
    # a tuple holding a tensor kept the target's plain values (tuples cannot change: the
    # load now puts a new tuple where the old one sat, around the same tensor objects)
    import collections

    Pair = collections.namedtuple("Pair", "weight count")
    sd = {"t": (torch.ones(2), 3, "s", None), "nested": [(torch.ones(3), (7, torch.ones(1)))],
          "named": Pair(torch.ones(4), 9)}
    save(sd, str(tmp_path / "ck"), no_dist=True)
    target = {"t": (torch.zeros(2), 0, "", 1), "nested": [(torch.zeros(3), (0, torch.zeros(1)))],
              "named": Pair(torch.zeros(4), 0)}
    tensors = [target["t"][0], target["nested"][0][1][1], target["named"].weight]
    load(target, str(tmp_path / "ck"), no_dist=True)
    assert_same(sd, target)
    assert type(target["named"]) is Pair and type(target["nested"][0][1]) is tuple
    assert target["t"][0] is tensors[0] and target["nested"][0][1][1] is tensors[1]  # loaded in place
    assert target["named"].weight is tensors[2]


@pytest.mark.parametrize("before", [(4,), (2,), (6,)])
def test_a_complex128_payload_8_bytes_off_its_alignment_loads(tmp_path, before):
    # small payloads are packed 8-aligned; a complex128 one 8 bytes off 16 crashed the process
    # (torch's copy of misaligned complex<double>) on load and on offline reshard
    from hyper_parallel.core.distributed_checkpoint._src.resharding.reshard import reshard

    sd = {"a": torch.ones(before), "z": torch.tensor(2 + 3j, dtype=torch.complex128),
          "zz": torch.arange(6, dtype=torch.float64).reshape(3, 2).to(torch.complex128) * (1 + 2j)}
    save(sd, str(tmp_path / "ck"), no_dist=True)
    assert_same(sd, load(path=str(tmp_path / "ck"), no_dist=True))
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    load(target, str(tmp_path / "ck"), no_dist=True)
    assert_same(sd, target)
    reshard(str(tmp_path / "ck"), str(tmp_path / "rs"), dst_mesh={"dp": 2})
    assert_same(sd, load(path=str(tmp_path / "rs"), no_dist=True))


def test_tensors_the_format_cannot_hold_are_refused_naming_the_key(tmp_path):
    cases = {"meta": (torch.empty(3, device="meta"), "meta device"),
             "sparse": (torch.eye(3).to_sparse(), "sparse_coo tensor"),
             "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor")}
    for name, (bad, what) in cases.items():
        with pytest.raises(UnsupportedValueError, match=rf"'layer17\.bias'.*{what}"):
            save({"layer0.weight": torch.ones(2), "layer17.bias": bad}, str(tmp_path / name), no_dist=True)
        assert not os.path.exists(tmp_path / name / ".metadata")


def test_meta_targets_are_materialized_and_unwritable_targets_named(tmp_path):
    path = str(tmp_path / "ck")
    sd = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.arange(3.0), "step": 4}
    save(sd, path, no_dist=True)
    # a model built on the meta device: the load replaces the targets (as torch DCP does)
    target = {"w": torch.empty(2, 3, device="meta"), "b": torch.zeros(3), "step": 0}
    load(target, path, no_dist=True)
    assert target["w"].device.type == "cpu"
    assert_same(sd, target)
    # a failed load leaves the meta targets as they were; one strict=False skips stays on meta
    target = {"w": torch.empty(2, 3, device="meta"), "b": torch.zeros(4), "step": 0}
    with pytest.raises(StateDictMismatchError):
        load(target, path, no_dist=True)
    assert target["w"].device.type == "meta"
    target = {"w": torch.empty(2, 3, device="meta"), "x": torch.empty(1, device="meta"), "step": 0}
    with pytest.warns(UserWarning, match="'x'"):
        load(target, path, no_dist=True, strict=False)
    assert target["w"].device.type == "cpu" and target["x"].device.type == "meta"
    # targets torch cannot write in place: a clear error naming the key, not torch's own
    with pytest.raises(StateDictMismatchError, match=r"'b'.*share memory"):
        load({"w": torch.zeros(2, 3), "b": torch.zeros(1).expand(3)}, path, no_dist=True)
    with torch.inference_mode():
        frozen = torch.zeros(3)
    with pytest.raises(StateDictMismatchError, match=r"'b'.*inference_mode"):
        load({"w": torch.zeros(2, 3), "b": frozen}, path, no_dist=True)


def test_a_load_without_a_target_keeps_the_saved_key_order(tmp_path):
    sd = {"z": torch.ones(1), "b": 3, "a": {"y": torch.ones(1), "x": 1, 5: torch.ones(1), 2: "s"},
          "m": torch.ones(1), 0: 1}
    save(sd, str(tmp_path / "ck"), no_dist=True)
    out = load(path=str(tmp_path / "ck"), no_dist=True)
    assert list(out) == list(sd) and list(out["a"]) == list(sd["a"])


def test_a_value_needing_pickle_inside_a_plain_container_is_named_itself(tmp_path):
    for sd, where in (({"d": {"q": np.int64(4)}}, "d.q"), ({"l": [torch.ones(2), {"q": np.int64(4)}]}, "l.1.q")):
        with pytest.raises(UnsupportedValueError, match=rf"'{where}': a numpy\.int64"):
            save(sd, str(tmp_path / "ck"), no_dist=True)


def test_big_endian_numpy_arrays_save_their_values(tmp_path):
    # torch cannot view a non-native byte order: save had failed with torch's own error
    a = np.arange(6, dtype=">f4").reshape(2, 3)
    save({"be": a}, str(tmp_path / "ck"), no_dist=True)
    out = load(path=str(tmp_path / "ck"))["be"]
    assert out.dtype == np.float32 and np.array_equal(out, a)
    with pytest.raises(StateDictMismatchError, match=r"'be'.*byte order"):
        load({"be": np.zeros((2, 3), dtype=">f4")}, str(tmp_path / "ck"), no_dist=True)


def test_a_plain_dict_loads_into_the_callers_own_dict(tmp_path):
    # a training loop holding extra["data"] kept reading position 0 after a resume: the load
    # had put a new dict in its place
    from hyper_parallel.core.distributed_checkpoint import TrainState

    data = {"position": 512, "epoch": 2}
    def parts():
        model = torch.nn.Linear(2, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    save({"app": TrainState(*parts(), extra={"data": data, "w": torch.ones(2)})}, str(tmp_path / "ck"), no_dist=True)
    mine = {"position": 0, "epoch": 0}
    state = TrainState(*parts(), extra={"data": mine, "w": torch.zeros(2)})
    load({"app": state}, str(tmp_path / "ck"), no_dist=True)
    assert state.extra["data"] is mine and mine == {"position": 512, "epoch": 2}
    target = {"cfg": {"lr": 0.0, "nested": {"a": 0}}}
    inner = target["cfg"]["nested"]
    save({"cfg": {"lr": 0.5, "nested": {"a": 1}}}, str(tmp_path / "plain"), no_dist=True)
    load(target, str(tmp_path / "plain"), no_dist=True)
    assert target["cfg"]["nested"] is inner and inner == {"a": 1} and target["cfg"]["lr"] == 0.5


# ----------------------------------------------------------------------------- torch DCP drop-in


def test_checkpoint_id_wins_over_the_storage_objects_own_place_as_in_torch(tmp_path):
    # save(checkpoint_id=step2, storage_writer=<writer of step1>) had overwritten step1 silently,
    # and load(checkpoint_id=s3, storage_reader=<reader of s1>) had returned s1's values
    from hyper_parallel.core.distributed_checkpoint import FileSystemWriter, async_save

    s1, s2, s3 = (str(tmp_path / n) for n in ("step1", "step2", "step3"))
    writer = FileSystemWriter(s1, sync_files=False)
    save({"w": torch.ones(2)}, checkpoint_id=s1, storage_writer=writer)
    save({"w": torch.full((2,), 2.0)}, checkpoint_id=s2, storage_writer=writer)  # the writer goes to step2
    async_save({"w": torch.full((2,), 3.0)}, checkpoint_id=s3, storage_writer=FileSystemWriter(s1),
               no_dist=True).result()
    out = {"w": torch.zeros(2)}
    for path, value in ((s1, 1.0), (s2, 2.0), (s3, 3.0)):
        load(out, checkpoint_id=path, storage_reader=FileSystemReader(s1))
        assert torch.equal(out["w"], torch.full((2,), value)), path

    class Fixed(FileSystemReader):  # a storage object that cannot be pointed elsewhere
        reset = None

    with pytest.raises(ValueError, match="checkpoint_id=.*step2.* points at .*step1.* no reset"):
        load(out, checkpoint_id=s2, storage_reader=Fixed(s1))


def test_torch_planner_hooks_are_refused_not_silently_ignored(tmp_path):
    # overrides of torch's hook names were never called: a filtered key was saved anyway, a
    # commit_tensor post-processing never ran (torch's own planners: test_torch_objects.py)
    class DropSecret(StandardSavePlanner):
        def set_up_planner(self, state_dict, *args, **kwargs):
            super().set_up_planner(state_dict, *args, **kwargs)

    class Scale(StandardLoadPlanner):
        def commit_tensor(self, read_item, tensor):
            tensor.mul_(10)

    path = str(tmp_path / "ck")
    with pytest.raises(UnsupportedValueError, match=r"DropSecret.set_up_planner: a torch.distributed.checkpoint "
                                                    r"planner hook.*override transform_state_dict"):
        save({"w": torch.ones(2)}, path, planner=DropSecret())
    save({"w": torch.ones(2)}, path)
    with pytest.raises(UnsupportedValueError, match=r"Scale.commit_tensor.*after load\(\) returns"):
        load({"w": torch.zeros(2)}, checkpoint_id=path, planner=Scale())


def test_torch_writer_and_planner_arguments_are_accepted(tmp_path):
    from hyper_parallel.core.distributed_checkpoint import FileSystemWriter, async_save

    path = str(tmp_path / "ck")
    writer = FileSystemWriter(path, True, False, 2, 1 << 20)  # torch's order: ..., sync_files, thread_count
    assert (writer.sync_files, writer.thread_count) == (False, 2)
    save({"a": torch.ones(64, 64), "b": torch.zeros(64, 64)}, storage_writer=writer,
         planner=StandardSavePlanner(flatten_state_dict=True, dedup_replicated_tensors=True))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) == 2  # the writer's thread_count
    with pytest.raises(CheckpointError, match="overwrite=False"):
        save({"a": torch.ones(2)}, storage_writer=FileSystemWriter(path, overwrite=False))
    out = load({"a": torch.zeros(64, 64), "extra": torch.zeros(1)}, checkpoint_id=path,
               planner=StandardLoadPlanner(flatten_state_dict=True, allow_partial_load=True))
    assert torch.equal(out["a"], torch.ones(64, 64))
    with pytest.raises(UnsupportedValueError, match="flatten_state_dict=False, but 'n' is a nested container"):
        save({"n": {"a": torch.ones(2)}}, str(tmp_path / "n"), planner=StandardSavePlanner(flatten_state_dict=False))
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    async_save({"a": torch.ones(2)}, checkpoint_id=str(tmp_path / "a"), no_dist=True,
               async_checkpointer_type=AsyncCheckpointerType.THREAD).result()
