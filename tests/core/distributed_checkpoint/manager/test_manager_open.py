"""What a manager reads of each step when it opens a directory: the document without its entries,
and the files later steps name, indexed by directory (so opening 1,000 steps is not quadratic)."""

from __future__ import annotations

import random

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import CheckpointManager
from hyper_parallel.core.distributed_checkpoint._src.base.errors import MetadataError
from hyper_parallel.core.distributed_checkpoint._src.base.options import RetentionOptions
from hyper_parallel.core.distributed_checkpoint._src.format import metadata as md
from hyper_parallel.core.distributed_checkpoint._src.manager.retention import Retention
from hyper_parallel.core.distributed_checkpoint.filesystem import FileSystemReader


def test_a_document_without_entries_keeps_files_and_user_data_and_its_seal(tmp_path):
    with CheckpointManager(tmp_path, incremental=True) as m:
        sd = {"a": torch.arange(8.0), "b": torch.ones(3)}
        m.save(1, sd, metrics={"loss": 0.5})
        sd["a"].add_(1)
        m.save(2, sd, metrics={"loss": 0.25})
    raw = FileSystemReader(str(tmp_path / md.step_dir_name(2))).read_metadata_bytes()
    full, light = md.Metadata.from_json(raw), md.Metadata.from_json(raw, entries=False)
    assert light.entries == {} and full.entries
    assert light.files == full.files and light.user == full.user and light.dirs == full.dirs
    assert light.referenced_dirs() == [md.step_dir_name(1)]  # step 2 reads b from step 1's file
    broken = raw.replace(b'"loss"', b'"LOSS"')
    with pytest.raises(MetadataError):
        md.Metadata.from_json(broken, entries=False)  # the seal is still checked


class _Meta:
    def __init__(self, named):
        self.files = [md.FileRecord(f, dir=d) for d, f in named]


def test_kept_files_by_directory_match_a_walk_of_every_step():
    rng = random.Random(0)
    r = Retention(RetentionOptions())
    dirs = [md.step_dir_name(s) for s in range(1, 9)]
    steps: dict[int, set] = {}
    for round_ in range(200):
        step = rng.randrange(1, 30)
        if rng.random() < 0.3 and steps:
            doomed = rng.choice(sorted(steps))
            r.forget([doomed])
            steps.pop(doomed)
        else:
            named = {(rng.choice(dirs), f"f{rng.randrange(5)}") for _ in range(rng.randrange(4))}
            r.learn(step, _Meta(named))
            steps[step] = named
        for d in dirs:
            walked = tuple(sorted({f for named in steps.values() for dd, f in named if dd == d}))
            assert r.kept_files(d) == walked, (round_, d)
