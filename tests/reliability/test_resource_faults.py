"""A full disk and a permission error: a clear error, the older checkpoint intact, no debris."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from hyper_parallel.core.distributed_checkpoint import FileSystemWriter, load, save


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs, mounted for the test (needs root; skipped otherwise)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {out.stderr.decode().strip()}")
    yield str(mnt)
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_fails_cleanly_and_keeps_the_old_checkpoint(small_fs):
    path = os.path.join(small_fs, "ckpt")
    old = {"w": torch.arange(1000.0), "step": 1}
    save(old, path)
    before = sorted(os.listdir(path))
    big = {"w": torch.randn(1000), "extra": torch.randn(512, 1024), "step": 2}  # 2 MiB: does not fit
    with pytest.raises(OSError) as info:
        save(big, path)
    assert "No space left" in str(info.value) or info.value.errno == 28
    assert sorted(os.listdir(path)) == before, "the failed save left files behind"
    out = load(path=path)
    assert out["step"] == 1 and torch.equal(out["w"], old["w"])


class ReadOnlyWriter(FileSystemWriter):
    """Simulates a directory the job may not write to (tests run as root, so chmod cannot)."""

    def write_file(self, name, parts):
        raise PermissionError(13, "Permission denied", os.path.join(self.path, name))


def test_a_permission_error_names_the_file_and_leaves_no_checkpoint(tmp_path):
    path = str(tmp_path / "c")
    with pytest.raises(PermissionError, match="Permission denied.*data-r00000"):
        save({"w": torch.ones(3)}, storage_writer=ReadOnlyWriter(path))
    assert not os.path.exists(os.path.join(path, ".metadata"))
