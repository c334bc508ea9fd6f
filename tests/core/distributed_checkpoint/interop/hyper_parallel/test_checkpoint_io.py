"""checkpoint_io at HyperParallel's path: a flat dict of tensors to one file and back, safetensors
by default, torch.save when asked, never an unrestricted unpickle."""

from __future__ import annotations

import pickle

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint._src.base.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.checkpoint_io import load_checkpoint_file, save_checkpoint_file


def _tensors():
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {"w": w, "w_t": w.t(), "b": torch.tensor([1, 2], dtype=torch.int64), "empty": torch.empty(0, 3)}


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_safetensors_is_the_default_and_round_trips_views_and_shared_memory(tmp_path):
    path = tmp_path / "shard.safetensors"
    save_checkpoint_file(_tensors(), path)
    assert path.read_bytes()[8:9] == b"{"  # a safetensors header, not a zip
    _equal(load_checkpoint_file(path), _tensors())


def test_the_default_writes_safetensors_whatever_the_suffix_as_the_seed_does(tmp_path):
    save_checkpoint_file({"w": torch.ones(2)}, tmp_path / "x.pt")
    _equal(load_checkpoint_file(tmp_path / "x.pt"), {"w": torch.ones(2)})


@pytest.mark.parametrize("fmt", ["pt", "torch"])
def test_another_format_name_uses_torch_save_and_reads_back(tmp_path, fmt):
    path = tmp_path / "x.pt"
    state = {"w": torch.ones(2, 2), "step": 3, "nested": {"m": torch.zeros(1)}}
    save_checkpoint_file(state, path, ckpt_format=fmt)
    assert path.read_bytes()[:4] == b"PK\x03\x04"
    out = load_checkpoint_file(path, ckpt_format=fmt)
    assert out["step"] == 3 and torch.equal(out["w"], state["w"]) and torch.equal(out["nested"]["m"], torch.zeros(1))


def test_none_picks_the_format_by_suffix(tmp_path):
    save_checkpoint_file({"w": torch.ones(1)}, tmp_path / "a.safetensors", ckpt_format=None)
    save_checkpoint_file({"w": torch.ones(1)}, tmp_path / "a.bin", ckpt_format=None)
    assert (tmp_path / "a.bin").read_bytes()[:4] == b"PK\x03\x04"
    assert (tmp_path / "a.safetensors").read_bytes()[:4] != b"PK\x03\x04"
    for name in ("a.safetensors", "a.bin"):
        _equal(load_checkpoint_file(tmp_path / name, ckpt_format=None), {"w": torch.ones(1)})


class _Payload:
    def __reduce__(self):
        return (print, ("unsafe code ran",))


def test_a_torch_file_with_arbitrary_objects_is_refused_not_run(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "x": _Payload()}, path)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint_file(path, ckpt_format="pt")
    assert "unsafe code ran" not in capsys.readouterr().out


def test_a_torch_file_read_as_safetensors_says_which_format_to_pass(tmp_path):
    path = tmp_path / "x.safetensors"
    save_checkpoint_file({"w": torch.ones(1)}, path, ckpt_format="pt")
    with pytest.raises(CorruptCheckpointError, match=r"x.safetensors is a torch.save file.*ckpt_format='pt'"):
        load_checkpoint_file(path)


def test_a_damaged_safetensors_file_names_the_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    save_checkpoint_file({"w": torch.ones(64)}, path)
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(CorruptCheckpointError, match="bad.safetensors"):
        load_checkpoint_file(path)


def test_a_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_checkpoint_file(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("state, match", [
    ([torch.ones(1)], "expects a dict of tensors, got list"),
    ({1: torch.ones(1)}, "key 1 is not a string"),
    ({"step": 3}, "'step' is a int; a safetensors file holds tensors only"),
])
def test_what_safetensors_cannot_hold_is_refused_by_name(tmp_path, state, match):
    with pytest.raises(TypeError, match=match):
        save_checkpoint_file(state, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
