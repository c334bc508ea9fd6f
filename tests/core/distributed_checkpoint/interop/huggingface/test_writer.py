"""HuggingFaceStorageWriter: save straight to Hugging Face safetensors, consolidated or in torch's sharded format.

Real gloo ranks save DTensors (``Shard(0)`` uneven, ``Shard(1)``, ``Replicate``, 2-D meshes) and an
FSDP2-sharded ``transformers`` model; what they write is read back bit-exact with
``safetensors`` itself, with torch's own ``HuggingFaceStorageReader`` through ``torch.distributed.
checkpoint.load`` (onto other placements), with our readers, and with ``from_pretrained``. The
commit and the refusals are checked in one process.
"""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch
from helpers import bits, local_expected, make_dtensor, make_tensor
from multiprocess import run_ranks
from safetensors import safe_open
from safetensors.torch import load_file

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
    RankFailedError,
    StandardPlanner,
    StateDictMismatchError,
    TorchShardedSafetensorsReader,
    UnsupportedValueError,
    load,
    save,
)

INDEX = "model.safetensors.index.json"
# each key's file: file 1 and 2 of 2
MAPPING = {"w": 1, "col": 2, "rep": 1, "band0": 2, "band1": 1, "plain": 2, "scalar": 1}


def _full() -> dict[str, torch.Tensor]:
    """The global values (the same on every rank)."""
    return {
        "w": make_tensor((7, 5), seed=1),  # Shard(0), uneven: rows 0:4 and 4:7
        "col": make_tensor((6, 10), torch.bfloat16, seed=2),  # Shard(1)
        "rep": make_tensor((5, 3), torch.float16, seed=3),  # Replicate: one rank writes it
        "band0": make_tensor((256, 1024), seed=4),  # Shard(0), large: planned as 4 column bands per box
        "band1": make_tensor((300, 1031), seed=5),  # Shard(1), uneven columns, column bands too
        "plain": make_tensor((4,), torch.int64, seed=6),  # a plain tensor, held by every rank
        "scalar": torch.tensor(1.5),
    }


def _placements():
    from torch.distributed.tensor import Replicate, Shard

    return ({"w": Shard(0), "col": Shard(1), "rep": Replicate(), "band0": Shard(0), "band1": Shard(1)},
            {"w": Shard(1), "col": Shard(0), "rep": Shard(0), "band0": Shard(1), "band1": Replicate()})


def _state(mesh, placements, fill: bool) -> dict:
    full = _full()
    out = {}
    for k, v in full.items():
        v = v if fill else torch.zeros_like(v)
        out[k] = make_dtensor(v, mesh, [placements[k]]) if k in placements else v.clone()
    return out


def _check_filled(sd: dict, what: str) -> None:
    for k, want in _full().items():
        v = sd[k]
        if hasattr(v, "to_local"):
            assert torch.equal(bits(v.to_local()), bits(local_expected(want, v.device_mesh, v.placements))), (what, k)
        else:
            assert torch.equal(bits(v), bits(want)), (what, k)


def _save_and_read_on_ranks(rank: int, ws: int, d: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader as TorchReader
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    saved, other = _placements()
    sd = _state(mesh, saved, fill=True)
    cons, shards = os.path.join(d, "cons"), os.path.join(d, "shards")
    save(sd, storage_writer=HuggingFaceStorageWriter(cons, MAPPING, save_distributed=True, enable_consolidation=True))
    save(sd, storage_writer=HuggingFaceStorageWriter(shards, MAPPING, save_distributed=True))
    # torch's own reader and torch's load, onto other placements
    for where in (cons, shards):
        target = _state(mesh, other, fill=False)
        dcp.load(target, storage_reader=TorchReader(where))
        _check_filled(target, f"torch load {where}")
    # ours
    target = _state(mesh, other, fill=False)
    load(target, storage_reader=HuggingFaceStorageReader(cons))
    _check_filled(target, "our load, consolidated")
    target = _state(mesh, other, fill=False)
    load(target, storage_reader=TorchShardedSafetensorsReader(shards))
    _check_filled(target, "our load, sharded")
    # a key the mapping lacks fails every rank, naming it, and writes nothing
    bad = os.path.join(d, "bad")
    with pytest.raises(RankFailedError, match="'rep' is not in fqn_to_index_mapping"):
        save(sd, storage_writer=HuggingFaceStorageWriter(bad, {k: 1 for k in MAPPING if k != "rep"},
                                                         save_distributed=True, enable_consolidation=True))
    assert os.listdir(bad) == []
    # a rank-local save is refused
    with pytest.raises(UnsupportedValueError, match="lays out its own files"):
        save(sd, storage_writer=HuggingFaceStorageWriter(bad, save_distributed=True), use_collectives=False)


@pytest.fixture(scope="module")
def two_rank_output(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hf_writer"))
    run_ranks(_save_and_read_on_ranks, 2, d, timeout_s=240)
    return d


def test_consolidated_files_hold_every_tensor_whole_bit_exact(two_rank_output):
    d = os.path.join(two_rank_output, "cons")
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(os.listdir(d)) == [*names, INDEX]  # no "sharded" directory, no temporary file
    with open(os.path.join(d, INDEX)) as f:
        index = json.load(f)
    assert index["weight_map"] == {k: names[i - 1] for k, i in MAPPING.items()}
    full = _full()
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in full.values())
    got = {k: v for n in names for k, v in load_file(os.path.join(d, n)).items()}
    assert got.keys() == full.keys()
    for k, v in full.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(bits(got[k]), bits(v)), k
    with safe_open(os.path.join(d, names[0]), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_sharded_files_are_torchs_format(two_rank_output):
    d = os.path.join(two_rank_output, "shards")
    files = sorted(os.listdir(d))
    assert files == [f"shard-0000{r}-model-0000{i}-of-00002.safetensors" for r in (1, 2) for i in (1, 2)]
    full = _full()
    pieces: dict[str, list] = {}
    for name in files:
        with safe_open(os.path.join(d, name), "pt") as f:
            meta = f.metadata()
            assert meta["DCP_VERSION"] == "1.0" and meta["format"] == "pt"
            info = json.loads(meta["DCP_SHARDING_INFO"])
            assert set(info) == set(f.keys())
            for k in f.keys():
                assert name.endswith(f"model-0000{MAPPING[k]}-of-00002.safetensors")  # the file its mapping gives it
                pieces.setdefault(k, []).append((info[k]["saved_offsets"], f.get_tensor(k)))
    for k, v in full.items():  # the shards tile each tensor exactly: replicated data once
        rebuilt = torch.full_like(v, 0)
        covered = 0
        for offsets, t in pieces[k]:
            rebuilt[tuple(slice(o, o + s) for o, s in zip(offsets, t.shape, strict=True))] = t
            covered += t.numel()
        assert covered == v.numel() and torch.equal(bits(rebuilt), bits(v)), k


# ---------------------------------------------------------------------------- 4 ranks: FSDP2, 2-D mesh


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=130, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # values no initialisation of from_pretrained's could produce
        for i, p in enumerate(model.parameters()):
            p.add_(i + 0.25)
    return cfg, model


def _fsdp_and_2d_on_ranks(rank: int, ws: int, d: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    cfg, model = _tiny_llama()
    mesh = init_device_mesh("cpu", (ws,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    assert all(isinstance(v, DTensor) for v in sd.values())
    mapping = {k: 1 if ".layers.0." in k else 2 for k in sd}
    out = os.path.join(d, "llama")
    save(sd, storage_writer=HuggingFaceStorageWriter(out, mapping, enable_consolidation=True, save_distributed=True))
    if rank == 0:
        cfg.save_pretrained(out)
    # 2-D mesh: both dims sharding, and replicate x shard
    mesh2 = init_device_mesh("cpu", (2, 2))
    grid = {"s0s1": make_dtensor(make_tensor((9, 7), seed=11), mesh2, [Shard(0), Shard(1)]),
            "rs1": make_dtensor(make_tensor((5, 6), torch.bfloat16, seed=12), mesh2, [Replicate(), Shard(1)]),
            "s1s0": make_dtensor(make_tensor((6, 9), seed=13), mesh2, [Shard(1), Shard(0)])}
    save(grid, storage_writer=HuggingFaceStorageWriter(os.path.join(d, "grid")))
    save(grid, storage_writer=HuggingFaceStorageWriter(os.path.join(d, "grid_shards"), save_distributed=True))


def _grid_full() -> dict[str, torch.Tensor]:
    return {"s0s1": make_tensor((9, 7), seed=11), "rs1": make_tensor((5, 6), torch.bfloat16, seed=12),
            "s1s0": make_tensor((6, 9), seed=13)}


@pytest.fixture(scope="module")
def four_rank_output(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hf_writer4"))
    run_ranks(_fsdp_and_2d_on_ranks, 4, d, timeout_s=300)
    return d


def test_fsdp2_model_saved_on_four_ranks_loads_with_from_pretrained_bit_exact(four_rank_output):
    from transformers import AutoModelForCausalLM

    _, reference = _tiny_llama()
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(four_rank_output, "llama"))
    want, got = reference.state_dict(), loaded.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(bits(got[k]), bits(v)), k
    ids = torch.arange(10).unsqueeze(0)
    assert torch.equal(loaded(ids).logits, reference(ids).logits)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_two_dim_mesh_saved_on_four_ranks_reads_back_whole(four_rank_output):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader as TorchReader

    full = _grid_full()
    got = load_file(os.path.join(four_rank_output, "grid", "model-00001-of-00001.safetensors"))
    ours = load(storage_reader=TorchShardedSafetensorsReader(os.path.join(four_rank_output, "grid_shards")))
    theirs = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(theirs, storage_reader=TorchReader(os.path.join(four_rank_output, "grid_shards")), no_dist=True)
    for k, v in full.items():
        for what, t in (("consolidated", got[k]), ("our reader", ours[k]), ("torch reader", theirs[k])):
            assert t.dtype == v.dtype and torch.equal(bits(t), bits(v)), (what, k)


# ---------------------------------------------------------------------------- one process: commit, refusals


class _Spy(StandardPlanner):
    """Calls ``hook(key)`` as each value is handed to the writer."""

    def __init__(self, hook):
        super().__init__()
        self.hook = hook

    def resolve_data(self, item):
        self.hook(item.key)
        return super().resolve_data(item)


def _small() -> dict[str, torch.Tensor]:
    return {"a": make_tensor((8, 3), seed=1), "b": make_tensor((5,), torch.bfloat16, seed=2)}


def test_nothing_looks_like_a_checkpoint_before_the_commit(tmp_path):
    out = str(tmp_path / "hf")
    seen: list[list[str]] = []
    save(_small(), storage_writer=HuggingFaceStorageWriter(out), no_dist=True,
         planner=_Spy(lambda key: seen.append(sorted(os.listdir(out)))))
    assert seen and all(len(names) == 1 and ".safetensors.tmp-" in names[0] for names in seen), seen
    assert sorted(os.listdir(out)) == ["model-00001-of-00001.safetensors", INDEX]


def test_failed_save_keeps_the_previous_checkpoint_and_leaves_no_debris(tmp_path):
    out = str(tmp_path / "hf")
    save(_small(), storage_writer=HuggingFaceStorageWriter(out, {"a": 1, "b": 2}), no_dist=True)
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}

    def fail(key):
        if key == "b":
            raise OSError("disk on fire")

    changed = {k: v + 1 for k, v in _small().items()}
    with pytest.raises(OSError, match="disk on fire"):
        save(changed, storage_writer=HuggingFaceStorageWriter(out), no_dist=True, planner=_Spy(fail))
    assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before
    got = load(storage_reader=HuggingFaceStorageReader(out))
    assert all(torch.equal(bits(got[k]), bits(v)) for k, v in _small().items())


def _regroup_failure_on_ranks(rank: int, ws: int, d: str) -> None:
    """Rank 1 cannot produce its part of a Shard(1) tensor while the ranks regroup rows: every
    rank fails (none waits for the missing part), naming rank 1's error, and no file is left."""
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (ws,))
    sd = {"col": make_dtensor(make_tensor((64, 48), seed=7), mesh, [Shard(1)]),
          "row": make_dtensor(make_tensor((64, 48), seed=8), mesh, [Shard(0)])}
    out = os.path.join(d, "hf")
    save(sd, storage_writer=HuggingFaceStorageWriter(out, enable_consolidation=True))  # regrouped: fine
    got = load_file(os.path.join(out, "model-00001-of-00001.safetensors"))
    assert torch.equal(got["col"], make_tensor((64, 48), seed=7))
    assert torch.equal(got["row"], make_tensor((64, 48), seed=8))

    def fail(key):
        if key == "col" and rank == 1:
            raise OSError("rank 1 lost its shard")

    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 lost its shard"):
        save(sd, storage_writer=HuggingFaceStorageWriter(out + "-2", enable_consolidation=True), planner=_Spy(fail))
    assert time.monotonic() - t0 < 60, "a rank waited for the part that never came"
    torch.distributed.barrier()  # every rank has removed its files
    left = os.listdir(out + "-2") if os.path.isdir(out + "-2") else []
    assert not [n for n in left if "safetensors" in n], left


def test_a_rank_failing_while_rows_are_regrouped_fails_every_rank_and_leaves_no_file(tmp_path):
    run_ranks(_regroup_failure_on_ranks, 2, str(tmp_path), timeout_s=240)


def test_saving_over_an_export_replaces_it_whole(tmp_path):
    out = str(tmp_path / "hf")
    save(_small(), storage_writer=HuggingFaceStorageWriter(out, {"a": 1, "b": 3}), no_dist=True)
    assert len(os.listdir(out)) == 3  # files 1 and 3 of 3 (none holds file 2), index
    (tmp_path / "hf" / "config.json").write_text("{}")
    new = {"c": make_tensor((2, 2), seed=9)}
    save(new, storage_writer=HuggingFaceStorageWriter(out), no_dist=True)
    assert sorted(os.listdir(out)) == ["config.json", "model-00001-of-00001.safetensors", INDEX]
    got = load(storage_reader=HuggingFaceStorageReader(out))
    assert got.keys() == {"c"} and torch.equal(got["c"], new["c"])


def test_sharded_save_over_a_larger_one_leaves_only_its_own_shards(tmp_path):
    out = str(tmp_path / "hf")
    save(_small(), storage_writer=HuggingFaceStorageWriter(out, {"a": 1, "b": 2}, save_distributed=True),
         no_dist=True)
    assert len(os.listdir(out)) == 2
    save(_small(), storage_writer=HuggingFaceStorageWriter(out, save_distributed=True), no_dist=True)
    assert os.listdir(out) == ["shard-00001-model-00001-of-00001.safetensors"]
    got = load(storage_reader=TorchShardedSafetensorsReader(out))
    assert all(torch.equal(bits(got[k]), bits(v)) for k, v in _small().items())


@pytest.mark.parametrize("sd, mapping, error, match", [
    ({"a": torch.zeros(2), "b": torch.zeros(2)}, {"a": 1}, StateDictMismatchError,
     "'b' is not in fqn_to_index_mapping"),
    ({"a": torch.zeros(2, dtype=torch.complex128)}, None, UnsupportedValueError, "'a' is a complex128 tensor"),
    ({"a": torch.zeros(2), "step": 3}, None, UnsupportedValueError, "'step' is a plain value"),
    ({"a": torch.zeros(2), "blob": b"xy"}, None, UnsupportedValueError, "'blob' is bytes"),
    ({"a": torch.zeros(2), "__metadata__": torch.zeros(1)}, None, UnsupportedValueError, "'__metadata__'"),
    ({"step": 3}, None, UnsupportedValueError, "'step' is a plain value"),
    ({}, None, CheckpointError, "holds no tensor"),
], ids=["unmapped-key", "complex128", "int", "bytes", "reserved-name", "no-tensor", "empty"])
def test_bad_input_is_a_clear_error_naming_the_key(tmp_path, sd, mapping, error, match):
    out = str(tmp_path / "hf")
    with pytest.raises(error, match=match):
        save(sd, storage_writer=HuggingFaceStorageWriter(out, mapping), no_dist=True)
    assert os.listdir(out) == []


@pytest.mark.parametrize("kwargs, match", [
    ({"fqn_to_index_mapping": {"a": 0}}, "maps 'a' to 0"),
    ({"fqn_to_index_mapping": {}}, "empty"),
    ({"thread_count": 0}, "thread_count"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        HuggingFaceStorageWriter(str(tmp_path), **kwargs)


def test_urls_are_refused():
    with pytest.raises(UnsupportedValueError, match="POSIX filesystem"):
        HuggingFaceStorageWriter("s3://bucket/model")


def test_torchs_arguments_and_module_name():
    from torch.distributed.checkpoint import HuggingFaceStorageWriter as Torch

    from hyper_parallel.core.distributed_checkpoint import hf_storage

    assert hf_storage.HuggingFaceStorageWriter is HuggingFaceStorageWriter
    assert hf_storage.HuggingFaceStorageReader is HuggingFaceStorageReader
    theirs = list(inspect.signature(Torch.__init__).parameters.values())
    ours = list(inspect.signature(HuggingFaceStorageWriter.__init__).parameters.values())
    assert [(p.name, p.default) for p in ours[:len(theirs)]] == [(p.name, p.default) for p in theirs]
    w = HuggingFaceStorageWriter("/tmp/x", save_distributed=True, enable_consolidation=True)
    assert (w.path, w.consolidated_output_path) == ("/tmp/x", "/tmp/x")
    w.reset("/tmp/y")  # save(checkpoint_id=...) points it elsewhere
    assert (w.path, w.consolidated_output_path) == ("/tmp/y", "/tmp/y")
    w = HuggingFaceStorageWriter("/tmp/x", enable_consolidation=True, consolidated_output_path="/tmp/out")
    assert w.output_dir == "/tmp/out"
