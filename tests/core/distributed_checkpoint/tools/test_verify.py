"""verify_checkpoint on format-v2 checkpoints whose writer rank wrote several files
(``thread_count > 1``): a chunk lies in one of them, whichever its index names."""

from __future__ import annotations

import json
import os

import torch

from hyper_parallel.core.distributed_checkpoint import save, verify_checkpoint
from hyper_parallel.core.distributed_checkpoint._src.format.sealed_json import seal_json


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"t{i}": torch.randn(300, 300, generator=g) for i in range(6)}


def test_a_writer_with_several_files_verifies_clean(tmp_path):
    save(_state(), str(tmp_path), thread_count=3)
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) == 3
    report = verify_checkpoint(tmp_path)
    assert report.ok, report.problems
    assert report.chunks == 6 and report.files == 3


def test_a_chunk_in_none_of_its_writers_files_is_reported(tmp_path):
    save(_state(), str(tmp_path), thread_count=3)
    meta = tmp_path / ".metadata"
    doc = json.loads(meta.read_bytes())
    doc["entries"]["renamed"] = doc["entries"].pop("t4")  # its rows now name a key no file holds
    doc["entries"]["renamed"]["path"] = ["renamed"]
    meta.write_bytes(seal_json(doc))
    problems = verify_checkpoint(tmp_path).problems
    missing = [p for p in problems if "'renamed'" in p]
    assert len(missing) == 1 and "missing from every file of its writer" in missing[0], problems
    assert all(name in missing[0] for name in os.listdir(tmp_path) if name.endswith(".safetensors"))
    assert any("is no chunk the metadata places in this file" in p for p in problems)  # t4's rows
