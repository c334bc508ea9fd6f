"""backends/open_files: a reader's descriptors stay under a bound, and none is closed in use."""

from __future__ import annotations

import os
import random
import threading

import torch

from hyper_parallel.core.distributed_checkpoint import FileSystemReader, Layout, load, offline_transform, save
from hyper_parallel.core.distributed_checkpoint._src.backends.open_files import OpenFiles, default_limit


def _files(tmp_path, n: int) -> list[str]:
    names = []
    for i in range(n):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * 64)
        names.append(str(tmp_path / f"f{i}"))
    return names


def _opener(opened: list[str]):
    def open_(name: str, direct: bool) -> int | None:
        if direct:
            return None  # as a filesystem refusing O_DIRECT
        opened.append(name)
        return os.open(name, os.O_RDONLY)
    return open_


def test_idle_descriptors_are_closed_beyond_the_limit_least_recent_first(tmp_path):
    names = _files(tmp_path, 10)
    opened: list[str] = []
    files = OpenFiles(_opener(opened), limit=3)
    for name in names:
        with files.held(name) as fd:
            assert os.pread(fd, 1, 0) == bytes([names.index(name)])
        assert len(files) <= 3
    with files.held(names[-1]):  # still open: not opened again
        pass
    assert opened == names
    with files.held(names[0]):  # closed long ago: opened again
        pass
    assert opened == [*names, names[0]]
    with files.held(names[1], direct=True) as fd:
        assert fd is None  # refused once, remembered
    files.close()
    assert len(files) == 0


def test_a_held_descriptor_is_never_closed_even_past_the_limit(tmp_path):
    names = _files(tmp_path, 6)
    files = OpenFiles(_opener([]), limit=2)
    with files.held(names[0]) as first:
        for name in names[1:]:
            with files.held(name):
                pass
        assert os.pread(first, 1, 0) == b"\x00"  # still this file's descriptor
    assert len(files) <= 2
    files.close()


def test_threads_reading_many_files_through_few_descriptors_read_the_right_bytes(tmp_path):
    names = _files(tmp_path, 40)
    files = OpenFiles(_opener([]), limit=4)
    wrong: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            i = rng.randrange(len(names))
            try:
                with files.held(names[i]) as fd:
                    if os.pread(fd, 64, 0) != bytes([i]) * 64:
                        wrong.append(names[i])
            except OSError as exc:  # a descriptor closed under its reader
                wrong.append(f"{names[i]}: {exc}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and len(files) <= 4
    files.close()


def test_the_default_limit_leaves_room_under_the_process_limit():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert 16 <= default_limit() <= max(16, soft // 4)


def test_a_load_touching_more_files_than_the_limit_reads_them_all(tmp_path):
    full = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)
    save({"w": full}, str(tmp_path / "one"), no_dist=True)
    offline_transform(str(tmp_path / "one"), str(tmp_path / "many"),
                      dst_layout={"w": Layout((16,), ("tp",))("tp", "None")})
    assert len([n for n in os.listdir(tmp_path / "many") if n.endswith(".safetensors")]) == 16
    reader = FileSystemReader(str(tmp_path / "many"))
    files = reader._files
    files.limit = 3  # 16 data files through 3 descriptors
    open_at_each_open: list[int] = []
    opener = files._opener

    def counting(name: str, direct: bool) -> int | None:
        open_at_each_open.append(len(files))
        return opener(name, direct)

    files._opener = counting
    target = {"w": torch.zeros(64, 4)}
    load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["w"], full)
    assert len(open_at_each_open) >= 16 and max(open_at_each_open) <= 3 + 4  # the limit, plus reads in flight
    assert len(files) == 0  # closed with the load
