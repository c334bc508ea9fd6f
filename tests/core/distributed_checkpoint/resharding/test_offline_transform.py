"""Offline transforms and format conversions, in one process, streaming."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import assert_same, make_dtensor, make_tensor
from multiprocess import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    Layout,
    UnsupportedValueError,
    convert_full_checkpoint_to_dcp,
    dcp_to_full_state_dict,
    full_state_dict_to_dcp_format,
    import_torch_dcp,
    load,
    offline_transform,
    parse_checkpoint_from_huggingface,
    save,
    save_layout,
    save_state_dict_as_huggingface_format,
)

# A transformer-shaped TP parameter set: column-parallel Shard(0), row-parallel Shard(1), norms replicated.
HIDDEN, FFN, LAYERS = 2048, 5632, 6  # ~0.9 GiB of fp32
SHAPES = {}
for i in range(LAYERS):
    SHAPES[f"layers.{i}.attn.wqkv.weight"] = ((3 * HIDDEN, HIDDEN), Shard(0))
    SHAPES[f"layers.{i}.attn.wo.weight"] = ((HIDDEN, HIDDEN), Shard(1))
    SHAPES[f"layers.{i}.mlp.w1.weight"] = ((FFN, HIDDEN), Shard(0))
    SHAPES[f"layers.{i}.mlp.w2.weight"] = ((HIDDEN, FFN), Shard(1))
    SHAPES[f"layers.{i}.norm.weight"] = ((HIDDEN,), Replicate())
LARGEST = max(4 * s[0] * (s[1] if len(s) > 1 else 1) for s, _ in SHAPES.values())


def pattern(shape: tuple[int, ...], box_offsets: tuple[int, ...], box_sizes: tuple[int, ...],
            seed: int) -> torch.Tensor:
    """A region of a deterministic tensor, computed without materialising the whole tensor."""
    idx = torch.zeros(box_sizes, dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        ar = torch.arange(box_offsets[d], box_offsets[d] + box_sizes[d], dtype=torch.int64)
        idx += (ar * stride).reshape([-1 if i == d else 1 for i in range(len(shape))])
        stride *= shape[d]
    return (((idx * 2654435761 + seed * 40503) % 65521).to(torch.float32) / 65521.0) - 0.5


def tp_state(ws: int) -> dict:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    out = {}
    for i, (k, (shape, p)) in enumerate(SHAPES.items()):
        sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, [p])
        local = pattern(shape, tuple(offsets), tuple(sizes), i)
        out[k] = DTensor.from_local(local, mesh, [p], shape=torch.Size(shape),
                                    stride=torch.empty(shape, device="meta").stride(), run_check=False)
    return out


def rank_save_tp(rank: int, ws: int, path: str) -> None:
    save(tp_state(ws), path, sync_files=False)


def rank_load_tp(rank: int, ws: int, path: str) -> int:
    want = tp_state(ws)
    target = {k: DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, shape=v.shape,
                                    stride=v.stride(), run_check=False) for k, v in want.items()}
    load(target, path)
    for k in SHAPES:
        assert torch.equal(target[k].to_local(), want[k].to_local()), f"{k} differs on rank {rank}"
    return sum(v.to_local().numel() for v in target.values())


def test_tp8_to_tp4_offline_in_bounded_memory_then_loads_on_four_ranks(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    if free < 3 << 30:  # it writes 912 MiB twice; a full disk would fail it for no fault of ours
        pytest.skip(f"needs 3 GiB free for its 1.8 GiB of checkpoints; {free >> 20} MiB free")
    src, dst = str(tmp_path / "tp8"), str(tmp_path / "tp4")
    run_ranks(rank_save_tp, 8, src, timeout_s=300)
    total = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    assert total > 800 << 20
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so a child of a big pytest
    # process would report the parent's size.
    script = (
        "import sys\n"
        "from hyper_parallel.core.distributed_checkpoint import offline_transform\n"
        "def hwm():\n"
        "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "before = hwm()\n"
        "offline_transform(sys.argv[1], sys.argv[2], src_layout={'tp': 8}, dst_layout={'tp': 4})\n"
        "print(before, hwm())\n"
    )
    out = subprocess.run([sys.executable, "-c", script, src, dst], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    before_kib, peak_kib = map(int, out.stdout.split())
    peak = peak_kib * 1024
    # bounded by the largest tensor, not the checkpoint (912 MiB): by offline_transform's own
    # default budget (max_memory = 4x the largest tensor here) plus the aligned-buffer pool's
    # 64 MiB; measured over the imports, whose size varies with the environment. (2x + 64 MiB
    # failed now and then: 164 MiB over the imports once under load, 42-116 MiB otherwise.)
    assert peak - before_kib * 1024 < 4 * LARGEST + (64 << 20), \
        f"peak RSS {peak >> 20} MiB (after imports: {before_kib >> 10} MiB), largest tensor {LARGEST >> 20} MiB"
    print(f"\noffline TP8->TP4 of {total >> 20} MiB: peak RSS {peak >> 20} MiB (largest tensor {LARGEST >> 20} MiB)")
    run_ranks(rank_load_tp, 4, dst, timeout_s=300)


def rank_save_small(rank: int, ws: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    save({"w": make_dtensor(make_tensor((4, 6)), mesh, [Shard(0)]), "n": make_tensor((6,), seed=1)}, path)


def test_layouts_are_checked_and_destinations_protected(tmp_path):
    src = str(tmp_path / "a")
    run_ranks(rank_save_small, 2, src)
    mesh = Layout((4,), ("tp",))
    with pytest.raises(ValueError, match="src_layout"):
        offline_transform(src, str(tmp_path / "x"), src_layout={"tp": 4}, dst_layout={"tp": 1})
    with pytest.raises(ValueError, match="src_layout"):
        offline_transform(src, str(tmp_path / "x"), src_layout={"w": Layout((2,), ("tp",))("None", "tp")},
                          dst_layout={"tp": 1})
    # a layout file as dst_layout: 'w' split over columns on 4 ranks
    save_layout({"w": mesh("None", "tp")}, str(tmp_path / "tp4.json"))
    meta = offline_transform(src, str(tmp_path / "b"), src_layout={"tp": 2}, dst_layout=str(tmp_path / "tp4.json"))
    assert meta.entries["w"].layout["placements"] == ["S(1)"]
    assert_same({"w": make_tensor((4, 6)), "n": make_tensor((6,), seed=1)}, load(path=str(tmp_path / "b")))
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        offline_transform(src, str(tmp_path / "b"), dst_layout={"tp": 1})
    offline_transform(src, str(tmp_path / "b"), dst_layout={"tp": 1}, overwrite=True)
    with pytest.raises(ValueError):  # a rule whose number of dims does not fit the tensor
        offline_transform(src, str(tmp_path / "d"), dst_layout={"w": mesh("tp", "None", "None")})


def test_dcp_to_hf_safetensors_and_back_is_bit_exact(tmp_path):
    sd = {"model": {f"layer{i}.weight": make_tensor((64, 32), torch.bfloat16, seed=i) for i in range(6)}, "step": 3}
    save(sd, str(tmp_path / "dcp"))
    index = save_state_dict_as_huggingface_format(str(tmp_path / "dcp"), str(tmp_path / "hf"),
                                                  max_shard_size=3 * 64 * 32 * 2, prefix="model.")
    files = sorted(f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert set(index["weight_map"]) == set(sd["model"])
    assert json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text()) == index
    assert_same(sd["model"], parse_checkpoint_from_huggingface(str(tmp_path / "hf")))
    convert_full_checkpoint_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp2"), prefix="model.")
    assert_same({"model": sd["model"]}, load(path=str(tmp_path / "dcp2")))


def test_full_state_dict_to_dcp_and_back(tmp_path):
    sd = {"a": make_tensor((5, 5)), "b": {"c": make_tensor((3,), torch.int32)}, "n": 1}
    full_state_dict_to_dcp_format(sd, str(tmp_path / "c"))
    assert_same(sd, dcp_to_full_state_dict(str(tmp_path / "c")))
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        full_state_dict_to_dcp_format(sd, str(tmp_path / "c"))
    # HyperParallel's keyword names (they had been refused)
    full_state_dict_to_dcp_format(state_dict=sd, dst_dir=str(tmp_path / "hp"))
    assert_same(sd, dcp_to_full_state_dict(src_dir=str(tmp_path / "hp")))
    with pytest.raises(TypeError, match="exactly one of"):
        dcp_to_full_state_dict(str(tmp_path / "hp"), src_dir=str(tmp_path / "hp"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        full_state_dict_to_dcp_format(sd, str(tmp_path / "afile"))


def test_hf_shards_are_read_as_their_index_places_them(tmp_path):
    # a tensor two shards hold: the tools took the last file's copy (or failed with an
    # internal error) instead of the one weight_map names
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.ones(2), "a": torch.zeros(3)}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"w": torch.full((2,), 9.0), "b": torch.ones(1)}, str(hf / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors",
                                            "a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    expected = {"w": torch.ones(2), "a": torch.zeros(3), "b": torch.ones(1)}
    assert_same(expected, parse_checkpoint_from_huggingface(resume_from_checkpoint=str(hf)))
    convert_full_checkpoint_to_dcp(str(hf), str(tmp_path / "dcp"))
    assert_same(expected, load(path=str(tmp_path / "dcp")))
    # an index naming a shard that lacks the tensor, and duplicates without an index, are errors
    index["weight_map"]["c"] = "model-00002-of-00002.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="places 'c'"):
        parse_checkpoint_from_huggingface(str(hf))
    os.remove(hf / "model.safetensors.index.json")
    for n in (1, 2):  # shards named -of-N need their index: other names are read as they are
        os.rename(hf / f"model-0000{n}-of-00002.safetensors", hf / f"part{n}.safetensors")
    with pytest.raises(CheckpointError, match="'w' is in both"):
        convert_full_checkpoint_to_dcp(str(hf), str(tmp_path / "dcp2"))


def test_torch_files_need_opt_in_for_pickles(tmp_path):
    torch.save({"w": make_tensor((4, 4))}, tmp_path / "weights.pt")
    convert_full_checkpoint_to_dcp(str(tmp_path / "weights.pt"), str(tmp_path / "c1"))
    assert torch.equal(load(path=str(tmp_path / "c1"))["w"], make_tensor((4, 4)))

    # a datetime needs full unpickling: refused by default, accepted (and kept pickled) on opt-in
    torch.save({"w": make_tensor((2,)), "when": datetime.date(2020, 1, 2)}, tmp_path / "pickled.pt")
    with pytest.raises(UnsupportedValueError, match="allow_pickle"):
        convert_full_checkpoint_to_dcp(str(tmp_path / "pickled.pt"), str(tmp_path / "c2"))
    convert_full_checkpoint_to_dcp(str(tmp_path / "pickled.pt"), str(tmp_path / "c2"), allow_pickle=True)
    # a torch file named .ckpt (Lightning's) is still a torch file, not "MindSpore"
    torch.save({"w": make_tensor((2,)), "when": datetime.date(2020, 1, 2)}, tmp_path / "lightning.ckpt")
    with pytest.raises(UnsupportedValueError, match="allow_pickle"):
        convert_full_checkpoint_to_dcp(str(tmp_path / "lightning.ckpt"), str(tmp_path / "c3"))
    assert load(path=str(tmp_path / "c2"), allow_pickle=True)["when"] == datetime.date(2020, 1, 2)


def rank_torch_dcp_save(rank: int, ws: int, path: str) -> None:
    import torch.distributed.checkpoint as tdcp
    mesh = init_device_mesh("cpu", (ws,))
    sd = {"w": make_dtensor(make_tensor((9, 4)), mesh, [Shard(0)]), "b": make_tensor((3,), seed=1),
          "extra": {"step": 7}}
    tdcp.save(sd, checkpoint_id=path)


def test_torch_dcp_checkpoints_import_with_trust(tmp_path):
    src = str(tmp_path / "torch")
    run_ranks(rank_torch_dcp_save, 2, src)
    with pytest.raises(UnsupportedValueError, match="trust=True"):
        import_torch_dcp(src, str(tmp_path / "ours"))
    import_torch_dcp(src, str(tmp_path / "ours"), trust=True)
    out = load(path=str(tmp_path / "ours"))
    assert torch.equal(out["w"], make_tensor((9, 4))) and torch.equal(out["b"], make_tensor((3,), seed=1))
    assert out["extra"]["step"] == 7


def _forged_torch_dcp(path: str, forge) -> None:
    """A one-process torch DCP checkpoint whose pickled ``.metadata`` ``forge`` rewrites."""
    import pickle

    import torch.distributed.checkpoint as tdcp

    with pytest.warns(UserWarning):  # torch: no process group, one process
        tdcp.save({"w": make_tensor((6, 4)), "b": make_tensor((3,), seed=1)}, checkpoint_id=path, no_dist=True)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    forge(meta.state_dict_metadata["w"], meta.storage_data)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def _grow(m, storage, shape, chunk=None):
    m.size = torch.Size(shape)
    if chunk is not None:
        m.chunks[0].sizes = torch.Size(chunk)


FORGED_TORCH_METADATA = {
    # 2**58 bytes: allocated before torch read a byte
    "shape and chunk of 2**56 elements": (lambda m, s: _grow(m, s, [1 << 28, 1 << 28], [1 << 28, 1 << 28]),
                                          r"'w': chunk at \[0, 0\] \(\d+ bytes\) is stored at bytes"),
    "shape of 2**56 elements": (lambda m, s: _grow(m, s, [1 << 28, 1 << 28]), r"'w': its chunks hold 24 of"),
    # rows 6..11 are in no chunk: imported as whatever memory torch.empty gave
    "shape twice what the chunks hold": (lambda m, s: _grow(m, s, [12, 4]), r"'w': its chunks hold 24 of the 48"),
    "chunk outside the shape": (lambda m, s: _grow(m, s, [6, 4], [7, 4]), r"'w': chunk at \[0, 0\] of sizes \[7, 4\]"),
}


@pytest.mark.parametrize("case", sorted(FORGED_TORCH_METADATA))
def test_torch_dcp_import_checks_sizes_against_the_files_before_allocating(tmp_path, case):
    """A torch DCP ``.metadata`` is trusted not to run code (``trust=True``), not to say the truth
    about sizes: each tensor's chunks must cover its shape and lie inside their files before a
    buffer of the shape is allocated."""
    forge, message = FORGED_TORCH_METADATA[case]
    src = str(tmp_path / "torch")
    _forged_torch_dcp(src, forge)
    with pytest.raises(CorruptCheckpointError, match=message):
        import_torch_dcp(src, str(tmp_path / "ours"), trust=True)
    assert not os.path.exists(os.path.join(tmp_path, "ours", ".metadata"))


def test_exported_hf_directory_loads_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    save({"model": model.state_dict()}, str(tmp_path / "dcp"))
    save_state_dict_as_huggingface_format(str(tmp_path / "dcp"), str(tmp_path / "hf"), prefix="model.")
    config.save_pretrained(str(tmp_path / "hf"))
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k




def test_offline_transform_reports_progress(tmp_path):
    sd = {"w": make_tensor((40, 30)), "v": make_tensor((7,), seed=1)}
    save(sd, str(tmp_path / "a"))
    seen: list[int] = []
    offline_transform(str(tmp_path / "a"), str(tmp_path / "b"), dst_layout={"tp": 2}, progress=seen.append)
    assert seen and sum(seen) >= (40 * 30 + 7) * 4
    assert_same(sd, load(path=str(tmp_path / "b")))


def test_hf_export_over_an_earlier_one_leaves_no_stale_shards(tmp_path):
    src = str(tmp_path / "ckpt")
    save({f"layer{i}": make_tensor((64, 64), seed=i) for i in range(4)}, src)
    out = tmp_path / "hf"
    save_state_dict_as_huggingface_format(src, str(out), max_shard_size=20000)
    first = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in first and len(first) == 5
    save_state_dict_as_huggingface_format(src, str(out), max_shard_size="1GB", overwrite=True)
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # old shards and index are gone
    assert parse_checkpoint_from_huggingface(str(out))["layer3"].equal(make_tensor((64, 64), seed=3))


class _Crash(BaseException):
    """Stands for the process dying: nothing of the tool's own cleanup may catch it."""


def _crash_at(monkeypatch, n: int) -> list[int]:
    """Make the ``n``-th rename or deletion (counting from 1) kill the export, after it happened."""
    count = [0]
    for name in ("replace", "remove", "unlink"):
        real = getattr(os, name)

        def step(*args, _real=real, **kw):
            _real(*args, **kw)
            count[0] += 1
            if count[0] == n:
                raise _Crash(n)
        monkeypatch.setattr(os, name, step)
    return count


@pytest.mark.parametrize(("old_shard", "new_shard"), [(20000, 20000), (20000, "1GB"), ("1GB", 20000)])
def test_hf_export_over_an_earlier_one_killed_at_any_point_never_mixes_the_two(tmp_path, monkeypatch, old_shard,
                                                                                new_shard):
    """A killed export with overwrite=True leaves the old export whole, the new one whole, or a
    directory every reader refuses. It used to rename the new shards over the old ones one at a
    time under the old index: killed halfway, both readers loaded half old, half new."""
    from hyper_parallel.core.distributed_checkpoint import HuggingFaceStorageReader
    from hyper_parallel.core.distributed_checkpoint._src.base.errors import NotACheckpointError

    old = {f"l{i}": torch.full((64, 64), float(i)) for i in range(4)}
    new = {f"l{i}": torch.full((64, 64), 100.0 + i) for i in range(4)}
    save(old, str(tmp_path / "old"))
    save(new, str(tmp_path / "new"))
    seen = set()
    for n in range(1, 30):
        out = str(tmp_path / f"hf{n}")
        save_state_dict_as_huggingface_format(str(tmp_path / "old"), out, max_shard_size=old_shard)
        with monkeypatch.context() as m:
            count = _crash_at(m, n)
            try:
                save_state_dict_as_huggingface_format(str(tmp_path / "new"), out, max_shard_size=new_shard,
                                                      overwrite=True)
                finished = True
            except _Crash:
                finished = False
        # transformers reads model.safetensors before the index: the two never stand side by side
        assert not {"model.safetensors", "model.safetensors.index.json"} <= set(os.listdir(out)), (n, os.listdir(out))
        for read in (lambda out=out: load(storage_reader=HuggingFaceStorageReader(out)),
                     lambda out=out: parse_checkpoint_from_huggingface(out),
                     lambda out=out: load(path=convert_full_checkpoint_to_dcp(out, out + ".dcp", overwrite=True)
                                          and out + ".dcp")):
            try:
                got = read()
            except (NotACheckpointError, CheckpointError) as exc:
                assert "model.safetensors.index.json" in str(exc), exc  # says what is missing
                seen.add("refused")
                continue
            which = [name for name, want in (("old", old), ("new", new))
                     if set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)]
            assert which, (n, {k: v[0, 0].item() for k, v in got.items()})
            seen.add(which[0])
        if finished:
            assert not [f for f in os.listdir(out) if ".tmp-" in f], os.listdir(out)
            assert count[0] < n
            break
    else:
        raise AssertionError("the export never finished")
    assert "new" in seen, seen


def test_hf_files_an_import_cannot_trust_are_refused_naming_the_file(tmp_path):
    # shards named -of-N without their index (an export killed before it wrote the index) had
    # been imported as whatever files were there; a truncated shard failed inside safetensors
    # naming neither file nor tensor; a tensor named __metadata__ was exported as an unreadable file
    sd = {f"l{i}.w": torch.full((64, 64), float(i)) for i in range(3)}
    hf = str(tmp_path / "hf")
    save_state_dict_as_huggingface_format(sd, hf, max_shard_size="16KiB")
    os.rename(os.path.join(hf, "model.safetensors.index.json"), str(tmp_path / "index.json"))
    for call in (lambda: parse_checkpoint_from_huggingface(hf),
                 lambda: convert_full_checkpoint_to_dcp(hf, str(tmp_path / "a"))):
        with pytest.raises(CheckpointError, match="model-00001-of-00003.safetensors.*no model.safetensors.index"):
            call()
    os.rename(str(tmp_path / "index.json"), os.path.join(hf, "model.safetensors.index.json"))
    shard = os.path.join(hf, "model-00002-of-00003.safetensors")
    os.truncate(shard, os.path.getsize(shard) - 100)
    for call in (lambda: parse_checkpoint_from_huggingface(hf),
                 lambda: convert_full_checkpoint_to_dcp(hf, str(tmp_path / "b"))):
        with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors is truncated"):
            call()
    save({"__metadata__": torch.ones(2), "w": torch.ones(2)}, str(tmp_path / "ck"))
    with pytest.raises(UnsupportedValueError, match="'__metadata__'.*reserves"):
        save_state_dict_as_huggingface_format(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert not os.listdir(tmp_path / "out")


def test_importing_a_safetensors_file_of_many_tensors_opens_it_once_to_read(tmp_path, monkeypatch):
    # safe_open parses a file's whole header: opening it per tensor made an import of one
    # file of 4000 small tensors take 25 s (0.4 s once per file)
    import safetensors
    from safetensors.torch import save_file

    sd = {f"layers.{i}.bias": torch.full((3,), float(i)) for i in range(300)}
    save_file(sd, str(tmp_path / "model.safetensors"))
    opened = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda path, **kw: opened.append(path) or real(path, **kw))
    convert_full_checkpoint_to_dcp(str(tmp_path / "model.safetensors"), str(tmp_path / "dcp"))
    assert len(opened) <= 2, len(opened)  # once to list the tensors, once to read them
    out = load(path=str(tmp_path / "dcp"))
    assert all(torch.equal(out[k], v) for k, v in sd.items()) and len(out) == len(sd)


def _hf_export_of_dtensors(rank: int, ws: int, out: str) -> str:
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {"w": distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)])}
    try:
        save_state_dict_as_huggingface_format(out + f"/r{rank}", sd)
    except UnsupportedValueError as exc:
        return str(exc)
    return "exported"


def test_hf_export_failures_are_clear_and_leave_no_partial_file(tmp_path):
    # a sharded state dict had failed inside numpy(); a failure mid-file left model.safetensors.tmp-*
    out = run_ranks(_hf_export_of_dtensors, 2, str(tmp_path))
    assert all("'w' is a DTensor" in msg and "full" in msg for msg in out), out
    sd = {f"l{i}": make_tensor((64, 64), seed=i) for i in range(4)}
    save(sd, str(tmp_path / "ck"))
    data = next(f for f in os.listdir(tmp_path / "ck") if f.endswith(".safetensors"))
    with open(tmp_path / "ck" / data, "r+b") as f:  # a flipped byte in the last tensor: caught mid-export
        f.seek(os.path.getsize(tmp_path / "ck" / data) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CheckpointError):
        save_state_dict_as_huggingface_format(str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert not [f for f in os.listdir(tmp_path / "hf") if ".tmp-" in f], os.listdir(tmp_path / "hf")
