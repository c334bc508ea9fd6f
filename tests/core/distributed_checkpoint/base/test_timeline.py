"""The load timeline (HP_DCP_LOAD_TIMELINE): off by default, and when on, every open, read,
checksum and copy of a real load, written where asked, with corruption still caught."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import CorruptCheckpointError, FileSystemReader, load, save
from hyper_parallel.core.distributed_checkpoint._src.base import timeline


def _checkpoint(tmp_path) -> tuple[str, dict]:
    full = {"a": torch.randn(512, 1024), "b": torch.randn(64, 256), "step": torch.tensor(3)}
    path = str(tmp_path / "ckpt")
    save(full, path, no_dist=True)
    return path, full


def _load(path: str, full: dict) -> dict:
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    load(target, path, storage_reader=FileSystemReader(path), no_dist=True)
    return target


def test_off_by_default_nothing_is_recorded(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.ENV, raising=False)
    path, full = _checkpoint(tmp_path)
    timeline.take()
    _load(path, full)
    assert timeline.take() == []


def test_on_a_load_records_its_opens_reads_checksums_and_copies(tmp_path, monkeypatch):
    path, full = _checkpoint(tmp_path)
    where = tmp_path / "timeline"
    where.mkdir()
    monkeypatch.setenv(timeline.ENV, str(where))
    timeline.take()
    target = _load(path, full)
    events = timeline.take()
    assert all(torch.equal(target[k], full[k]) for k in full)
    kinds = timeline.summary(events)
    payload = sum(v.numel() * v.element_size() for v in full.values())
    assert {"open", "read", "checksum", "copy", "read_plan"} <= kinds.keys(), kinds
    assert kinds["read"]["bytes"] >= payload  # the payloads (and the file's index)
    assert kinds["checksum"]["bytes"] >= payload  # every byte loaded was checked
    assert kinds["copy"]["bytes"] == payload
    assert kinds["read_plan"]["count"] == 1
    plan = next(e for e in events if e[0] == "read_plan")
    assert all(plan[1] <= e[1] <= e[2] <= plan[2] for e in events)  # inside the reading, one clock
    for s in kinds.values():
        assert 0 <= s["span_s"] <= s["busy_s"] + 1e-9 and s["cpu_s"] >= 0
    dumped = [json.load(open(where / n)) for n in os.listdir(where)]
    assert len(dumped) == 1 and len(dumped[0]["events"]) == len(events)


def test_on_a_corrupt_byte_is_still_caught(tmp_path, monkeypatch):
    path, full = _checkpoint(tmp_path)
    pattern = full["a"][300, :8].numpy().tobytes()
    name = next(n for n in os.listdir(path) if n.endswith(".safetensors"))
    raw = bytearray(open(os.path.join(path, name), "rb").read())
    raw[raw.find(pattern) + 3] ^= 0x01
    open(os.path.join(path, name), "wb").write(raw)
    monkeypatch.setenv(timeline.ENV, "1")
    with pytest.raises(CorruptCheckpointError, match="'a'"):
        _load(path, full)
    timeline.take()
