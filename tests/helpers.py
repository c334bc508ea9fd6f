"""Shared test helpers: deterministic tensors, DTensors without communication, deep compare."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


class Counter:
    """A Stateful object (state_dict()/load_state_dict()) holding a value and a tensor."""

    def __init__(self, n: int = 0):
        self.n, self.hist = n, torch.arange(float(n))

    def state_dict(self):
        return {"n": self.n, "hist": self.hist}

    def load_state_dict(self, sd):
        self.n, self.hist = sd["n"], sd["hist"]


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """The same tensor on every rank (values depend only on shape, dtype, seed)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -1000), min(info.max, 1000)
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    return t.to(dtype)


def make_dtensor(full: torch.Tensor, mesh: Any, placements: list[Any]) -> DTensor:
    """Slice this rank's shard out of ``full`` (same on every rank) and wrap it; no comms."""
    sizes, offsets = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=False))].clone()
    dt = DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride(),
                            run_check=False)
    dt.test_full = full  # the global value, for expectations (gloo cannot gather every dtype)
    return dt


def local_expected(full: torch.Tensor, mesh: Any, placements: list[Any]) -> torch.Tensor:
    sizes, offsets = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=False))]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view for exact comparison of any dtype (NaNs and float8 included)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Deep, exact equality: types, dtypes, shapes, bits."""
    if isinstance(a, DTensor) or isinstance(b, DTensor):
        assert isinstance(a, DTensor) and isinstance(b, DTensor), f"{path}: {type(a)} vs {type(b)}"
        assert a.shape == b.shape and a.placements == b.placements, f"{path}: layout differs"
        return assert_same(a.to_local(), b.to_local(), path)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b)}"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.equal(bits(a), bits(b)), f"{path}: values differ"
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, f"{path}: ndarray"
        assert a.tobytes() == b.tobytes(), f"{path}: ndarray values differ"
        return
    assert type(a) is type(b), f"{path}: type {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()) or set(a) == set(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, f"{path}: NaN vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def zeros_like_tree(v: Any) -> Any:
    """A target of the same structure and layouts, with zeroed data."""
    if isinstance(v, DTensor):
        return DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                  shape=v.shape, stride=v.stride(), run_check=False)
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    if isinstance(v, np.ndarray):
        return np.zeros_like(v)
    if isinstance(v, dict):
        return {k: zeros_like_tree(x) for k, x in v.items()}
    if isinstance(v, list):
        return [zeros_like_tree(x) for x in v]
    if isinstance(v, tuple):
        return tuple(zeros_like_tree(x) for x in v)
    return v


def stored_chunks(meta: Any, key: str) -> list[tuple[Any, int, int]]:
    """The chunks of ``key`` as saved: (box, writing rank, bytes), each stored copy once."""
    from hyper_parallel.core.distributed_checkpoint._src.format.chunks import all_chunks

    return [(ref.box, ref.files[0].rank if ref.files else -1, ref.nbytes)
            for ref in all_chunks(meta, meta.entries[key])]


def files_holding(path: str, key: str) -> list[str]:
    """The data files of a checkpoint directory whose safetensors header has a chunk of ``key``."""
    import json
    import os

    out = []
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(path, name), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        if any(k.startswith(key + "@") for k in header):
            out.append(name)
    return out


def payload_start(path: str, entry: str) -> int:
    """Where a safetensors entry's bytes start in a file (read from the file's own header)."""
    import json

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return 8 + n + header[entry]["data_offsets"][0]



def _storage_reader_base() -> type:
    from hyper_parallel.core.distributed_checkpoint._src.backends.protocol import StorageReader

    return StorageReader


class RecordingReader(_storage_reader_base()):
    """Wraps a storage reader and records every byte range read: ``reads`` holds
    (file, offset, length). Only the protocol's basic methods are passed on (no alignment,
    hints or indexes of the wrapped reader), so reads are exactly what the loader asks for."""

    def __init__(self, inner: Any):
        self.inner, self.reads = inner, []

    def read_metadata_bytes(self) -> bytes:
        return self.inner.read_metadata_bytes()

    def file_size(self, name: str) -> int:
        return self.inner.file_size(name)

    def read_into(self, name: str, offset: int, buffer: Any) -> None:
        self.reads.append((name, offset, memoryview(buffer).nbytes))
        self.inner.read_into(name, offset, buffer)

    def list_files(self) -> list[str]:
        return self.inner.list_files()

    def close(self) -> None:
        self.inner.close()


def rows_over_ranks(sd: dict, root: Any, ranks: int = 32) -> str:
    """``sd`` saved by one process under ``root/src``, then rewritten with ``offline_transform``
    for ``ranks`` ranks, each holding rows of every tensor (a file per rank): the new
    checkpoint's directory, ``root/dp<ranks>``."""
    import os

    from hyper_parallel.core.distributed_checkpoint import Layout, offline_transform, save

    src, dst = os.path.join(str(root), "src"), os.path.join(str(root), f"dp{ranks}")
    save(sd, src, no_dist=True)
    offline_transform(src, dst, dst_layout={"*": Layout((ranks,), ("dp",))("dp", "None")})
    return dst
