"""HyperParallel compatibility: its import paths, meshes over some ranks, its offline helpers'
signatures, its single-file saver/loader, and importing checkpoints its own DCP wrote.

The checkpoints under ``tests/fixtures/hyper_parallel`` were written by HyperParallel's code
(see ``make_fixtures.py`` there); the values are ``expected_value(key, shape, dtype)``.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import pickle
import shutil
import signal
import struct
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import stored_chunks
from multiprocess import run_ranks

import hyper_parallel
from hyper_parallel.cli import main as cli_main
from hyper_parallel.core.distributed_checkpoint import (
    convert_full_checkpoint_to_dcp,
    import_hyper_parallel,
    load,
    parse_checkpoint_from_huggingface,
    save,
    save_state_dict_as_huggingface_format,
)
from hyper_parallel.core.distributed_checkpoint._src.base.errors import (
    CheckpointError,
    CorruptCheckpointError,
    MetadataError,
    UnsupportedValueError,
)
from hyper_parallel.core.distributed_checkpoint._src.interop.hyper_parallel import importing as hpi
from hyper_parallel.core.distributed_checkpoint.loader import load_checkpoint
from hyper_parallel.core.distributed_checkpoint.saver import save_checkpoint

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "fixtures", "hyper_parallel")
sys.path.insert(0, FIXTURES)
from make_fixtures import OBJECTS, TENSORS, expected_value  # noqa: E402

# ------------------------------------------------------------------------------ import paths


def test_hyper_parallel_import_paths_are_torchs_objects():
    import torch.distributed.fsdp as fsdp
    import torch.distributed.tensor as tdt

    from hyper_parallel.core.dtensor import device_mesh, dtensor, placement_types
    from hyper_parallel.core.fully_shard import api, utils

    assert device_mesh.DeviceMesh is torch.distributed.device_mesh.DeviceMesh
    assert hyper_parallel.init_device_mesh is device_mesh.init_device_mesh
    assert dtensor.DTensor is tdt.DTensor is hyper_parallel.DTensor
    assert dtensor.distribute_tensor is tdt.distribute_tensor
    assert dtensor.distribute_module is tdt.distribute_module
    for name in ("Shard", "Replicate", "Partial", "Placement"):
        assert getattr(placement_types, name) is getattr(tdt, name)
    assert api.fully_shard is fsdp.fully_shard is hyper_parallel.fully_shard
    assert utils.MixedPrecisionPolicy is fsdp.MixedPrecisionPolicy
    policy = utils.MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                        output_dtype=torch.float32, cast_forward_inputs=True)
    assert policy.cast_forward_inputs


def test_get_platform_without_a_process_group():
    from hyper_parallel.platform import get_platform

    platform = get_platform()
    assert platform is hyper_parallel.get_platform()
    assert (platform.get_rank(), platform.get_world_size()) == (0, 1)
    platform.barrier()  # no-op without a process group


# ------------------------------------------------------------------------------ rank_list meshes


def _sub_mesh_job(rank: int, ws: int, path: str) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
    from hyper_parallel.platform import get_platform

    platform = get_platform()
    out: dict = {"rank": platform.get_rank(), "world": platform.get_world_size()}
    if rank < 2:  # HyperParallel's pattern: only the mesh's ranks build it
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), rank_list=(0, 1))
        out["mesh"] = mesh.mesh.tolist()
        x = DTensor.from_local(torch.full((2, 3), float(rank)), mesh, [Shard(0)])
        out["full"] = x.full_tensor().tolist()
        again = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), rank_list=(0, 1))
        y = DTensor.from_local(torch.ones(2), again, [Replicate()])
        out["again"] = y.redistribute(again, [Shard(0)]).to_local().tolist()
    else:
        try:
            init_device_mesh("cpu", (2,), rank_list=(0, 1))
        except ValueError as exc:
            out["outsider"] = str(exc)
        # ranks 2-3 make their own 2-D... 1x2 mesh, concurrently with ranks 0-1
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"), rank_list=(2, 3))
        x = DTensor.from_local(torch.full((1, 2), float(rank)), mesh, [Replicate(), Shard(1)])
        out["full"] = x.full_tensor().tolist()
    # a 2x2 mesh over every rank given as rank_list, then groups by rank tuple
    mesh4 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), rank_list=range(4))
    out["tp_group"] = dist.get_process_group_ranks(mesh4.get_group("tp"))
    group = platform.create_group((0, 2) if rank % 2 == 0 else (1, 3))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    out["pair_sum"] = t.item()
    # HyperParallel's 4 -> 2 load (its newest dcp_save_and_load.py): saved over every rank,
    # loaded by ranks 0-1 on a rank_list mesh while ranks 2-3 call load({}) (its older
    # dcp_api.py has them not call load at all, which works too)
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    full = torch.arange(32.0).reshape(8, 4)
    save({"w": DTensor.from_local(full.chunk(4)[rank].clone(), world, [Shard(0)]), "step": 3}, checkpoint_id=path)
    target = {}
    if rank < 2:
        sub = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",), rank_list=(0, 1))
        target = {"w": DTensor.from_local(torch.zeros(4, 4), sub, [Shard(0)]), "step": 0}
    load(target, checkpoint_id=path)
    if rank < 2:
        out["loaded"] = torch.equal(target["w"].to_local(), full.chunk(2)[rank]) and target["step"] == 3
    platform.barrier()
    return out


def test_rank_list_mesh_on_two_of_four_ranks(tmp_path):
    outs = run_ranks(_sub_mesh_job, 4, str(tmp_path / "ckpt"), timeout_s=90)
    for r, o in enumerate(outs):
        assert (o["rank"], o["world"]) == (r, 4)
        assert o["tp_group"] == ([0, 1] if r < 2 else [2, 3])
        assert o["pair_sum"] == (2.0 if r % 2 == 0 else 4.0)
    for r in (0, 1):
        assert outs[r]["mesh"] == [0, 1]
        assert outs[r]["full"] == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
        assert outs[r]["again"] == [1.0]
        assert outs[r]["loaded"]
    for r in (2, 3):
        assert "not in rank_list" in outs[r]["outsider"]
        assert outs[r]["full"] == [[2.0, 2.0, 3.0, 3.0]]


def test_rank_list_checks_its_arguments():
    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh

    with pytest.raises(TypeError):
        init_device_mesh("cpu", 2)
    with pytest.raises(ValueError, match="distinct"):
        init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "a"))


# ------------------------------------------------------------------------------ offline helpers


def test_hf_export_takes_hyper_parallels_argument_order(tmp_path):
    sd = {"layer.weight": torch.randn(4, 8), "bias": torch.randn(8), "note": "skipped: not a tensor"}
    single = tmp_path / "single"
    save_state_dict_as_huggingface_format(str(single), sd, max_shard_size="1GB")
    assert sorted(os.listdir(single)) == ["model.safetensors"]  # one shard: no index, as transformers
    got = parse_checkpoint_from_huggingface(str(single))
    assert set(got) == {"layer.weight", "bias"} and torch.equal(got["bias"], sd["bias"])

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    index = save_state_dict_as_huggingface_format(save_directory=str(tmp_path / "shard"), state_dict={"a": a, "b": b},
                                                  max_shard_size=a.numel() * a.element_size() - 1)
    assert sorted(os.listdir(tmp_path / "shard")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert json.loads((tmp_path / "shard" / "model.safetensors.index.json").read_text()) == index
    # our order, (src, dst_dir), still works
    save_state_dict_as_huggingface_format({"w": a}, str(tmp_path / "ours"))
    assert torch.equal(parse_checkpoint_from_huggingface(str(tmp_path / "ours"))["w"], a)
    with pytest.raises(TypeError):
        save_state_dict_as_huggingface_format(str(tmp_path / "x"))


def test_convert_full_checkpoint_takes_src_platform(tmp_path):
    w = torch.randn(6, 6)
    save_state_dict_as_huggingface_format(str(tmp_path / "hf"), {"p": w})
    convert_full_checkpoint_to_dcp(str(tmp_path / "hf"), str(tmp_path / "a"), src_platform="huggingface")
    assert torch.equal(load(path=str(tmp_path / "a"))["p"], w)
    torch.save({"x": w}, tmp_path / "full.pt")
    convert_full_checkpoint_to_dcp(str(tmp_path / "full.pt"), str(tmp_path / "b"), src_platform="torch")
    assert torch.equal(load(path=str(tmp_path / "b"))["x"], w)
    with pytest.raises(ValueError, match="huggingface"):
        convert_full_checkpoint_to_dcp(str(tmp_path / "full.pt"), str(tmp_path / "c"), src_platform="huggingface")
    with pytest.raises(ValueError, match="expected"):
        convert_full_checkpoint_to_dcp(str(tmp_path / "hf"), str(tmp_path / "c"), src_platform="jax")

    # "mindspore" goes to import_mindspore (tests/core/distributed_checkpoint/interop/mindspore/test_mindspore.py)
    ms_ckpt = os.path.join(FIXTURES, "..", "mindspore", "full.ckpt")
    meta = convert_full_checkpoint_to_dcp(ms_ckpt, str(tmp_path / "m"), src_platform="MindSpore", prefix="model.")
    assert meta.user["imported_from"]["platform"] == "mindspore" and "model.dense.weight" in meta.entries


def test_single_file_save_checkpoint_and_load_checkpoint(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = tmp_path / "sub" / "tmp1.safetensors"
    save_checkpoint({"model_state_dict": model.state_dict(), "tied": model.weight}, str(path))
    out = load_checkpoint(str(path))
    assert set(out) == {"model_state_dict", "tied"}
    assert torch.equal(out["model_state_dict"]["weight"], model.weight) and torch.equal(out["tied"], model.weight)
    save_checkpoint(model, tmp_path / "flat.safetensors")  # a module: its state dict, flat
    assert set(load_checkpoint(tmp_path / "flat.safetensors")) == {"weight", "bias"}
    with pytest.raises(ValueError, match="extension"):
        save_checkpoint({"w": model.weight}, str(tmp_path / "noext"))
    with pytest.raises(TypeError, match="tensors only"):
        save_checkpoint({"w": model.weight, "step": 3}, str(tmp_path / "x.safetensors"))
    with open(tmp_path / "old.safetensors", "wb") as f:  # an older HyperParallel: torch.save under that name
        torch.save({"a": torch.ones(2)}, f)
    assert torch.equal(load_checkpoint(tmp_path / "old.safetensors")["a"], torch.ones(2))


# ------------------------------------------------------------------------------ import_hyper_parallel


def _check_imported(path: str, tensors=TENSORS, objects=OBJECTS) -> None:
    out = load(path=path)
    assert set(out) == set(tensors) | set(objects)
    for key, (shape, dtype, _) in tensors.items():
        assert out[key].dtype == dtype and torch.equal(out[key], expected_value(key, shape, dtype)), key
    for key, value in objects.items():
        assert out[key] == value and type(out[key]) is type(value), key


@pytest.mark.parametrize("mode", ["collective", "rank_local"])
def test_hyper_parallel_checkpoints_import_bit_exact(tmp_path, mode):
    meta = import_hyper_parallel(os.path.join(FIXTURES, mode), str(tmp_path / "ours"), trust=True)
    assert meta.user["imported_from"] == "hyper-parallel"
    assert len(stored_chunks(meta, "layers.0.weight")) == 2  # each saved shard is one chunk
    _check_imported(str(tmp_path / "ours"))
    # and it reshards: a target holding rows 1..3 of a Shard(0) tensor reads across both chunks
    target = {"embed": torch.zeros(6, 4, dtype=torch.float64), "layers.0.bias": torch.zeros(6, dtype=torch.bfloat16)}
    load(target, str(tmp_path / "ours"), strict=False)
    assert torch.equal(target["embed"], expected_value("embed", (6, 4), torch.float64))


def test_import_needs_trust_and_refuses_to_overwrite(tmp_path):
    src = os.path.join(FIXTURES, "collective")
    with pytest.raises(UnsupportedValueError, match="trust=True"):
        import_hyper_parallel(src, str(tmp_path / "o"))
    assert cli_main(["import-hyper-parallel", src, str(tmp_path / "o")]) == 2
    assert cli_main(["import-hyper-parallel", src, str(tmp_path / "o"), "--trust"]) == 0
    with pytest.raises(CheckpointError, match="overwrite"):
        import_hyper_parallel(src, str(tmp_path / "o"), trust=True)
    with pytest.raises(MetadataError, match="not a pickle"):  # already ours
        import_hyper_parallel(str(tmp_path / "o"), str(tmp_path / "o2"), trust=True)


class _Hostile:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_metadata_pickle_is_refused_and_never_runs(tmp_path):
    src = tmp_path / "evil"
    shutil.copytree(os.path.join(FIXTURES, "collective"), src)
    marker = tmp_path / "pwned"
    (src / ".metadata").write_bytes(pickle.dumps({"x": _Hostile(str(marker))}))
    with pytest.raises(UnsupportedValueError, match=r"refusing to unpickle (posix|os)\.system"):
        import_hyper_parallel(str(src), str(tmp_path / "o"), trust=True)
    assert not marker.exists()
    # a global smuggled inside an allowed class's state is refused the same way
    buf = io.BytesIO()
    _NewestLayout(buf, protocol=4).dump(hpi.HPMetadata(state_dict_metadata={"a": eval}))
    raw = buf.getvalue()
    with pytest.raises(UnsupportedValueError, match="builtins.eval"):
        hpi.HyperParallelUnpickler(io.BytesIO(raw), "test").load()


def test_missing_rank_files_are_clear_errors(tmp_path):
    src = tmp_path / "c"
    shutil.copytree(os.path.join(FIXTURES, "collective"), src)
    (src / "_rank1_.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"_rank1_\.safetensors.*missing"):
        import_hyper_parallel(str(src), str(tmp_path / "o"), trust=True)
    assert not (tmp_path / "o").exists()

    local = tmp_path / "l"
    shutil.copytree(os.path.join(FIXTURES, "rank_local"), local)
    (local / ".rank1_metadata").unlink()  # rank 0's metadata alone covers half of each sharded tensor
    with pytest.raises(CheckpointError, match="cover 12 of its 24 elements"):
        import_hyper_parallel(str(local), str(tmp_path / "o"), trust=True)
    shutil.copy(local / ".rank0_metadata", local / ".rank2_metadata")  # ranks 0 and 2, no 1
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] is missing"):
        import_hyper_parallel(str(local), str(tmp_path / "o"), trust=True)


def test_values_that_need_pickle_are_refused_unless_allowed(tmp_path):
    src = tmp_path / "c"
    shutil.copytree(os.path.join(FIXTURES, "collective"), src)
    when = datetime.date(2020, 1, 2)
    (src / "sched_rank0.bytes").write_bytes(pickle.dumps(when))
    with pytest.raises(UnsupportedValueError, match="datetime"):
        import_hyper_parallel(str(src), str(tmp_path / "o"), trust=True)
    meta = import_hyper_parallel(str(src), str(tmp_path / "o"), trust=True, allow_pickle=True)
    assert meta.entries["sched"].kind == "pickle"
    assert load(path=str(tmp_path / "o"), allow_pickle=True)["sched"] == when


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail (rather than hang the run) when the block takes longer than ``seconds``."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _self_referencing() -> list:
    x: list = []
    x.append(x)
    return x


def _shared(levels: int) -> list:
    x: Any = 0
    for _ in range(levels):
        x = [x, x]  # levels + 1 objects, 2**levels leaves as JSON writes it
    return x


def _deep(levels: int) -> Any:
    x: Any = 0
    for _ in range(levels):
        x = {"k": (x,)}
    return x


@pytest.mark.parametrize("value,why", [
    (_self_referencing(), r"sched\[0\]: it contains itself \(a reference cycle\)"),  # a RecursionError before
    (_shared(45), "it holds more than 1048576 items"),  # 287 bytes, minutes before (2**45 items)
    (_deep(200), "more than 64 deep"),
])
def test_value_pickles_whose_json_form_is_unbounded_are_refused_in_bounded_time(tmp_path, value, why):
    src = tmp_path / "c"
    shutil.copytree(os.path.join(FIXTURES, "collective"), src)
    raw = pickle.dumps(value)
    (src / "sched_rank0.bytes").write_bytes(raw)
    with deadline(20), pytest.raises(UnsupportedValueError, match=rf"sched_rank0.bytes: the value 'sched' .*{why}.*"
                                                                  "allow_pickle=True"):
        import_hyper_parallel(str(src), str(tmp_path / "o"), trust=True)
    assert not (tmp_path / "o" / ".metadata").exists()
    # it is a legitimate Python value: carried over still pickled, it loads back whole
    with deadline(20):
        meta = import_hyper_parallel(str(src), str(tmp_path / "o"), trust=True, allow_pickle=True)
    assert meta.entries["sched"].kind == "pickle"
    back = load(path=str(tmp_path / "o"), allow_pickle=True)["sched"]
    assert pickle.dumps(back) == raw


def test_a_value_pickle_that_builds_nothing_is_a_corrupt_file(tmp_path):
    # well-formed opcodes (one pickle, STOP at its end) that fail as they run: APPEND with no list
    src = tmp_path / "c"
    shutil.copytree(os.path.join(FIXTURES, "collective"), src)
    (src / "sched_rank0.bytes").write_bytes(b"\x80\x04K\x01K\x02a.")
    with pytest.raises(CorruptCheckpointError, match=r"sched_rank0.bytes: the value 'sched' is a damaged pickle"):
        import_hyper_parallel(str(src), str(tmp_path / "o"), trust=True, allow_pickle=True)


def test_a_data_file_with_a_negative_dim_is_a_corrupt_file(tmp_path):
    # current HyperParallel writes real safetensors; the library refuses a negative dim with an
    # error naming neither the file nor the tensor
    src = tmp_path / "c"
    shutil.copytree(os.path.join(FIXTURES, "collective"), src)
    header = json.dumps({"embed": {"dtype": "F64", "shape": [-1, 0], "data_offsets": [0, 0]}}).encode()
    (src / "_rank0_.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CorruptCheckpointError, match=r"_rank0_.safetensors: not a readable safetensors file"):
        import_hyper_parallel(str(src), str(tmp_path / "o"), trust=True)
    assert not (tmp_path / "o" / ".metadata").exists()


def test_the_single_file_loader_refuses_a_negative_dim_naming_the_file(tmp_path):
    path = tmp_path / "neg.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [-1, 0], "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CorruptCheckpointError, match=r"neg.safetensors: tensor .w.: shape .*\[-1, 0\]"):
        load_checkpoint(str(path))
    save_checkpoint({"model": {"w": torch.ones(2)}}, str(path))
    raw = path.read_bytes()
    assert b'\\"w\\"]]' in raw
    path.write_bytes(raw.replace(b'\\"w\\"]]', b'\\"x\\"]]'))  # the nesting names no tensor
    with pytest.raises(CorruptCheckpointError, match="neg.safetensors: its 'hyper_parallel.nesting' metadata"):
        load_checkpoint(str(path))


class _NewestLayout(pickle._Pickler):
    """Pickles the importer's stand-ins under current HyperParallel's module paths."""

    def save_global(self, obj, name=None):
        if getattr(obj, "__module__", None) == hpi.__name__ and obj.__name__.startswith("HP"):
            module = "storage" if obj is hpi.HPStorageInfo else "metadata"
            self.save(f"hyper_parallel.core.distributed_checkpoint.{module}")
            self.save(obj.__name__[2:])
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def test_newest_hyper_parallel_layout_imports(tmp_path):
    """Current HyperParallel writes real safetensors (chunk keys may differ from the fqn),
    packs a rank's values into one _rank<r>_.bytes at offsets, and names rank-local metadata
    <r>.metadata. This rewrites the fixture that way, as its filesystem writer does."""
    from safetensors.torch import save_file

    src, dst = os.path.join(FIXTURES, "collective"), tmp_path / "newest"
    dst.mkdir()
    with open(os.path.join(src, ".metadata"), "rb") as f:
        meta = hpi.HyperParallelUnpickler(f, "fixture").load()
    storage, packed = {}, io.BytesIO()
    for index, info in meta.storage_data.items():
        if info.relative_path.endswith(".bytes"):
            raw = open(os.path.join(src, info.relative_path), "rb").read()
            info = hpi.HPStorageInfo("_rank0_.bytes", packed.tell(), len(raw))
            packed.write(raw)
        else:
            info = hpi.HPStorageInfo(info.relative_path, 0, -1, f"{index.fqn}.__dcp_chunk_0")
        storage[index] = info
    (dst / "_rank0_.bytes").write_bytes(packed.getvalue())
    for r in (0, 1):
        name = f"_rank{r}_.safetensors"
        with open(os.path.join(src, name), "rb") as f:
            tensors = torch.load(f, weights_only=True)
        save_file({f"{k}.__dcp_chunk_0": v.contiguous() for k, v in tensors.items()}, str(dst / name))
    meta.storage_data = storage
    meta.planner_data = {k: (k,) for k in meta.state_dict_metadata}
    buf = io.BytesIO()
    _NewestLayout(buf, protocol=4).dump(meta)
    (dst / ".metadata").write_bytes(buf.getvalue())
    assert b"hyper_parallel.core.distributed_checkpoint.metadata" in buf.getvalue()
    import_hyper_parallel(str(dst), str(tmp_path / "ours"), trust=True)
    _check_imported(str(tmp_path / "ours"))

    # rank-local, newest file names: <r>.metadata
    local = tmp_path / "local"
    shutil.copytree(os.path.join(FIXTURES, "rank_local"), local)
    for r in (0, 1):
        (local / f".rank{r}_metadata").rename(local / f"{r}.metadata")
    import_hyper_parallel(str(local), str(tmp_path / "ours2"), trust=True)
    _check_imported(str(tmp_path / "ours2"))


def test_loading_a_hyper_parallel_checkpoint_directly_says_how_to_import_it():
    from hyper_parallel.core.distributed_checkpoint import MetadataError, NotACheckpointError, load

    with pytest.raises(MetadataError, match="import_hyper_parallel"):
        load(path=os.path.join(FIXTURES, "collective"), no_dist=True)
    with pytest.raises(NotACheckpointError, match="rank-local checkpoint of HyperParallel.*import_hyper_parallel"):
        load(path=os.path.join(FIXTURES, "rank_local"), no_dist=True)


def test_importing_a_hyper_parallel_checkpoint_onto_itself_is_refused(tmp_path):
    import shutil

    from hyper_parallel.core.distributed_checkpoint import import_hyper_parallel

    src = str(tmp_path / "hp")
    shutil.copytree(os.path.join(FIXTURES, "collective"), src)
    before = sorted(os.listdir(src))
    with pytest.raises(ValueError, match="is the source checkpoint"):
        import_hyper_parallel(src, src + "/", trust=True, overwrite=True)
    assert sorted(os.listdir(src)) == before
    import_hyper_parallel(src, str(tmp_path / "ours"), trust=True)  # still HyperParallel's, whole


def test_hyper_parallel_metadata_names_and_a_whole_chunk_info(tmp_path):
    # HyperParallel's tests import these from the metadata module (ImportError before), and mark
    # replicated plain tensors with a ChunkInfo covering them whole; a part is refused, not ignored
    from hyper_parallel.core.distributed_checkpoint import load, save
    from hyper_parallel.core.distributed_checkpoint.metadata import (
        CHUNK_INFO,
        BytesStorageMetadata,
        ChunkInfo,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    assert {BytesStorageMetadata, MetadataIndex, TensorProperties}  # torch's classes, as HyperParallel's
    whole = torch.arange(6.0).reshape(2, 3)
    setattr(whole, CHUNK_INFO, ChunkInfo(ChunkStorageMetadata(offsets=(0, 0), sizes=(2, 3)), (2, 3), (0,)))
    meta = save({"w": whole}, str(tmp_path / "ck"), no_dist=True)
    assert isinstance(meta.state_dict_metadata["w"], TensorStorageMetadata)
    target = torch.zeros(2, 3)
    setattr(target, CHUNK_INFO, getattr(whole, CHUNK_INFO))
    load({"w": target}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert torch.equal(target, whole)
    part = torch.zeros(1, 3)
    setattr(part, CHUNK_INFO, ChunkInfo(ChunkStorageMetadata(offsets=(1, 0), sizes=(1, 3)), (2, 3), (0,)))
    with pytest.raises(UnsupportedValueError, match=r"'w': its chunk_info places it at \[1, 0\].*DTensor"):
        save({"w": part}, str(tmp_path / "ck2"), no_dist=True)
    with pytest.raises(UnsupportedValueError, match="chunk_info"):
        load({"w": part}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)


# HyperParallel's pipelined-load system test (dcp_load_pipeline): 4 ranks on a (dp=2, tp=2)
# mesh, parameters replicated over everyone / sharded over tp / private, loaded into
# rank-poisoned buffers with broadcast_replicated_tensors=True, three loads in a row with no
# thread left behind, plain values alongside.
_PIPE_PLACEMENTS = {"everyone": ("R", "R"), "column": ("R", "S1"), "private": ("S0", "S1")}
_PIPE_SHARD_OF = {"everyone": lambda r: 0, "column": lambda r: r % 2, "private": lambda r: r}
_PIPE_SCALARS = {"epoch": 12, "learning_rate": 0.0003, "step": 4500, "tags": ["warmup", "cosine"],
                 "limits": {"grad_clip": 1.0, "patience": 3}}


def _pipeline_job(rank: int, ws: int, root: str) -> dict:
    import threading

    from hyper_parallel import DTensor
    from hyper_parallel.core.distributed_checkpoint.util import _MAX_BROADCASTS_IN_FLIGHT
    from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
    from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
    from hyper_parallel.platform import get_platform

    platform = get_platform()
    mesh = init_device_mesh(device_type="cpu", mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"))
    kinds = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}

    def state(specs, poisoned):
        out = {}
        for index, (name, kind) in enumerate(specs):
            value = -100.0 - rank if poisoned else index + 1.0 + _PIPE_SHARD_OF[kind](rank) / 8.0
            out[name] = DTensor.from_local(torch.full((4, 4), value), mesh,
                                           [kinds[p] for p in _PIPE_PLACEMENTS[kind]])
        return out

    shared = [(f"shared{i:02d}", "everyone") for i in range(3 * _MAX_BROADCASTS_IN_FLIGHT)]
    interleaved = [spec for i in range(_MAX_BROADCASTS_IN_FLIGHT + 2) for spec in (
        (f"round{i:02d}_a_everyone", "everyone"), (f"round{i:02d}_b_column", "column"),
        (f"round{i:02d}_c_private", "private"))]
    results = {}
    for name, specs, scalars, loads in (("in_flight", shared, False, 1), ("interleaved", interleaved, False, 1),
                                        ("non_tensor", interleaved[:12], True, 1), ("repeated", shared[:12], False, 3)):
        path = os.path.join(root, name)
        saved = state(specs, poisoned=False)
        expected = {k: v.to_local().clone() for k, v in saved.items()}
        if scalars:
            saved.update(_PIPE_SCALARS)
        save(saved, checkpoint_id=path, use_collectives=True)
        platform.barrier()
        threads_before = threading.active_count()
        ok = True
        for _ in range(loads):
            target = state(specs, poisoned=True)
            if scalars:
                target.update({"epoch": -1, "learning_rate": -1.0, "step": -1, "tags": ["wrong", "wrong"],
                               "limits": {"grad_clip": -1.0, "patience": -1}})
            load(target, checkpoint_id=path, use_collectives=True, broadcast_replicated_tensors=True)
            ok &= all(torch.equal(target[k].to_local(), v) for k, v in expected.items())
            ok &= all(target[k] == v for k, v in _PIPE_SCALARS.items()) if scalars else True
        results[name] = (ok, threading.active_count() <= threads_before)
    return results


def test_hyper_parallels_pipelined_load_test_runs_as_written(tmp_path):
    for out in run_ranks(_pipeline_job, 4, str(tmp_path), timeout_s=180):
        assert out == {k: (True, True) for k in ("in_flight", "interleaved", "non_tensor", "repeated")}, out
