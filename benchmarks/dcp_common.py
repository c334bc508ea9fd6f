"""Pieces every process of the DCP benchmark shares: the state dict, cold caches, counters.

The state dict is transformer-like: an embedding, layers of attention and MLP weights
alternating fp32 and bf16, and a head sized so the total is exactly the requested size.
Every element is a cheap function of its global index, so any rank can make (or check) any
box of any tensor without the rest of it, whatever layout it was saved or loaded in.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

_DTYPE_SIZE = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the benchmark's state dict."""

    name: str
    shape: tuple[int, int]
    dtype: str
    index: int

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * _DTYPE_SIZE[self.dtype]


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"64MiB"``, ``"512M"``, ``"4096"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read size {text!r}; write e.g. 1GiB, 64MiB or a number of bytes")
    unit = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * unit)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def transformer_specs(total_bytes: int) -> list[TensorSpec]:
    """2-D tensors adding up to ``total_bytes`` (rounded down to whole rows of the head)."""
    if total_bytes < 64 * KiB:
        raise ValueError(f"state size {total_bytes} B is too small; use at least 64 KiB")
    h = 64
    while 48 * (2 * h) ** 2 <= total_bytes // 4 and 2 * h <= 4096:  # one fp32 layer <= a quarter
        h *= 2
    specs: list[TensorSpec] = []
    used = 0

    def add(name: str, shape: tuple[int, int], dtype: str) -> bool:
        nonlocal used
        spec = TensorSpec(name, shape, dtype, len(specs))
        if used + spec.nbytes > total_bytes:
            return False
        specs.append(spec)
        used += spec.nbytes
        return True

    add("model.embed.weight", (min(8 * h, max(64, total_bytes // 8 // (4 * h) // 64 * 64)), h), "float32")
    layer = 0
    while True:
        dtype = "float32" if layer % 2 == 0 else "bfloat16"
        pre = f"model.layers.{layer}."
        shapes = (("attn.qkv.weight", (3 * h, h)), ("attn.out.weight", (h, h)),
                  ("mlp.up.weight", (4 * h, h)), ("mlp.down.weight", (h, 4 * h)))
        if not all(add(pre + name, shape, dtype) for name, shape in shapes):
            break
        layer += 1
    rows = (total_bytes - used) // (4 * h) // 64 * 64
    if rows:
        add("model.head.weight", (rows, h), "float32")
    return specs


def model_specs(total_bytes: int, layers: int = 36) -> list[TensorSpec]:
    """A state dict shaped like a real model: many tensors, a few large ones.

    ``layers`` blocks of 12 tensors (two norms, attention qkv/out, MLP up/down, each weight
    with its bias), plus an embedding, a final norm (weight, bias) and a head sized so the
    total is close to ``total_bytes``: 36 layers give 436 tensors. Vectors (norms, biases)
    are stored as ``(8, n / 8)`` so every tensor stays 2-D and splits along either dim.
    Layers alternate fp32 and bf16.
    """
    if total_bytes < 256 * KiB:
        raise ValueError(f"state size {total_bytes} B is too small for {layers} layers; use at least 256 KiB")

    def layer_shapes(h: int) -> list[tuple[str, tuple[int, int]]]:
        v = lambda n: (8, n // 8)  # noqa: E731
        return [("ln1.weight", v(h)), ("ln1.bias", v(h)), ("attn.qkv.weight", (3 * h, h)),
                ("attn.qkv.bias", v(3 * h)), ("attn.out.weight", (h, h)), ("attn.out.bias", v(h)),
                ("ln2.weight", v(h)), ("ln2.bias", v(h)), ("mlp.up.weight", (4 * h, h)), ("mlp.up.bias", v(4 * h)),
                ("mlp.down.weight", (h, 4 * h)), ("mlp.down.bias", v(h))]

    def layers_bytes(h: int) -> int:
        per = sum(a * b for _, (a, b) in layer_shapes(h))
        return sum(per * (4 if i % 2 == 0 else 2) for i in range(layers))

    h = 16
    while layers_bytes(h + 16) <= 0.75 * total_bytes:
        h += 16
    specs: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, int], dtype: str) -> None:
        specs.append(TensorSpec(name, shape, dtype, len(specs)))

    add("model.embed.weight", (max(8, min(8 * h, total_bytes // 16 // (4 * h)) // 8 * 8), h), "float32")
    for i in range(layers):
        for name, shape in layer_shapes(h):
            add(f"model.layers.{i}.{name}", shape, "float32" if i % 2 == 0 else "bfloat16")
    add("model.norm.weight", (8, h // 8), "float32")
    add("model.norm.bias", (8, h // 8), "float32")
    used = sum(s.nbytes for s in specs)
    add("model.head.weight", (max(8, (total_bytes - used) // (4 * h) // 8 * 8), h), "float32")
    return specs


def chunk_box(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of part ``index`` of ``size`` split like ``torch.chunk`` / ``Shard``."""
    step = -(-size // parts)
    off = min(size, index * step)
    return off, max(0, min(step, size - off))


def shard_box(spec: TensorSpec, dim: int, parts: int, index: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Global (offsets, sizes) of rank ``index``'s ``Shard(dim)`` piece on a 1-D mesh."""
    off, n = chunk_box(spec.shape[dim], parts, index)
    offsets, sizes = [0, 0], list(spec.shape)
    offsets[dim], sizes[dim] = off, n
    return (offsets[0], offsets[1]), (sizes[0], sizes[1])


def _row_blocks(spec: TensorSpec, offsets: tuple[int, int], sizes: tuple[int, int]) -> Iterator[tuple[int, object]]:
    import torch

    cols = torch.arange(offsets[1], offsets[1] + sizes[1], dtype=torch.int32) * 7 + spec.index * 17
    step = max(1, (8 * MiB) // max(1, sizes[1] * 4))
    for r0 in range(0, sizes[0], step):
        r1 = min(sizes[0], r0 + step)
        rows = torch.arange(offsets[0] + r0, offsets[0] + r1, dtype=torch.int32) * 131
        yield r0, (rows[:, None] + cols[None, :]).remainder_(251).sub_(125)


def make_box(spec: TensorSpec, offsets: tuple[int, int], sizes: tuple[int, int]):
    """The values of one box of a tensor (exact in fp32 and bf16: integers in [-125, 125])."""
    import torch

    out = torch.empty(sizes, dtype=getattr(torch, spec.dtype))
    for r0, block in _row_blocks(spec, offsets, sizes):
        out[r0:r0 + block.shape[0]].copy_(block)
    return out


def check_box(tensor, spec: TensorSpec, offsets: tuple[int, int]) -> bool:
    """True when ``tensor`` holds exactly the box of ``spec`` that starts at ``offsets``."""
    for r0, block in _row_blocks(spec, offsets, tuple(tensor.shape)):
        if not bool((tensor[r0:r0 + block.shape[0]] == block.to(tensor.dtype)).all()):
            return False
    return True


# ---------------------------------------------------------------------------- page cache


def files_under(paths: Iterable[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isfile(p):
            out.append(p)
        elif os.path.isdir(p):
            for root, _, names in os.walk(p):
                out.extend(os.path.join(root, n) for n in names)
    return out


def drop_page_cache(paths: Iterable[str], method: str = "auto") -> str:
    """Make the files under ``paths`` cold; returns the method that worked.

    ``drop_caches`` writes 3 to /proc/sys/vm/drop_caches (root only, whole machine);
    ``fadvise`` asks the kernel to drop these files' clean pages (any user). Dirty pages are
    flushed first (``sync``) so both leave nothing of the files cached.
    """
    os.sync()
    if method in ("auto", "drop_caches"):
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            if method == "drop_caches":
                raise
    for path in files_under(paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_fraction(paths: Iterable[str]) -> float:
    """Fraction of the files' pages that are in the page cache now (``mincore``)."""
    total = resident = 0
    for path in files_under(paths):
        size = os.path.getsize(path)
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            try:
                pages = -(-size // mmap.PAGESIZE)
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) == 0:
                    resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
                    total += pages
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def io_counters() -> dict[str, int]:
    """This process's /proc/self/io: ``rchar`` (bytes asked of read calls), ``read_bytes``
    (bytes fetched from storage), and their write twins."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def rss_status() -> dict[str, int]:
    """VmRSS / VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * KiB
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KiB
    return 0
