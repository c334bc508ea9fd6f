"""The ranks of the DCP benchmark: real processes on gloo, started once per world size.

``run_ranks("main_ranks", ws, cfg)`` starts ``ws`` processes (forked from a forkserver that
imported torch once), joins them in a gloo group (``file://`` init, explicit timeout,
loopback), runs every multi-process scenario inside them, and returns each rank's records.

Every measurement is taken the same way: (optionally make the files cold) -> barrier ->
each rank runs its part -> the wall time is the latest end minus the earliest start over
all ranks (one machine: ``time.monotonic`` is one clock for every process). Ours and torch
DCP alternate which goes first from one repetition to the next, so slow phases of a noisy
machine fall on both.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import crc32c

from benchmarks.common import cpu_seconds
from benchmarks.dcp_common import (
    MiB,
    TensorSpec,
    check_box,
    drop_page_cache,
    files_under,
    io_counters,
    make_box,
    resident_fraction,
    shard_box,
)

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload([
    "torch", "torch.distributed", "torch.distributed.checkpoint", "safetensors.torch",
    "hyper_parallel.core.distributed_checkpoint", "benchmarks.dcp_common", "benchmarks.dcp_ranks",
])


class RanksFailed(RuntimeError):
    """One or more ranks failed; the message holds every rank's traceback."""


def _worker(rank: int, ws: int, init_file: str, fn_name: str, cfg: dict, pg_timeout_s: float, q: Any) -> None:
    try:  # die with the parent, so an interrupted benchmark leaves no ranks behind
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws,
                                timeout=timedelta(seconds=pg_timeout_s))
        q.put((rank, "ok", globals()[fn_name](rank, ws, cfg)))
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))
        sys.stderr.flush()
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(fn_name: str, ws: int, cfg: dict, timeout_s: float = 3600, pg_timeout_s: float = 900) -> list[Any]:
    """Run ``<fn_name>(rank, ws, cfg)`` on ``ws`` gloo ranks; return each rank's result."""
    q = _CTX.SimpleQueue()
    init_file = os.path.join(cfg["dir"], f".init-{fn_name}-{os.getpid()}-{time.monotonic_ns()}")
    procs = [_CTX.Process(target=_worker, args=(r, ws, init_file, fn_name, cfg, pg_timeout_s, q)) for r in range(ws)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < ws and time.monotonic() < deadline:
            while not q.empty():
                r, kind, payload = q.get()
                results[r] = (kind, payload)
            if any(kind != "ok" for kind, _ in results.values()):
                time.sleep(2.0)  # let the other ranks report their side of it
                while not q.empty():
                    r, kind, payload = q.get()
                    results[r] = (kind, payload)
                break
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
            if dead:
                time.sleep(0.5)
                if q.empty():
                    for i in dead:
                        results[i] = ("crash", f"rank {i} died with exit code {procs[i].exitcode}")
                    break
            time.sleep(0.05)
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == ws else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(init_file):
            os.unlink(init_file)
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    missing = [r for r in range(ws) if r not in results]
    if bad or missing:
        lines = [f"{fn_name}: {len(bad)} rank(s) failed, no result from {missing}"]
        lines += [f"===== rank {r} [{k}] =====\n{tb}" for r, (k, tb) in sorted(bad.items())]
        raise RanksFailed("\n".join(lines))
    return [results[r][1] for r in range(ws)]


# ---------------------------------------------------------------------------- in a rank


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


class _Rank:
    """One rank's state dict, helpers and records (``records[scenario][variant] = [rep, ...]``)."""

    def __init__(self, rank: int, ws: int, cfg: dict):
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        self.torch = torch
        self.rank, self.ws, self.cfg = rank, ws, cfg
        self.dir = cfg["dir"]
        self.specs = [TensorSpec(**s) for s in cfg["specs"]]
        self.mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
        self.records: dict[str, dict[str, list[dict]]] = {}
        self.notes: list[str] = []
        self.cold_method = cfg.get("cold", "auto")
        self._raw_buffer: bytearray | None = None  # raw_read's destination, reused

    # ------------------------------------------------------------ building blocks

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def dtensors(self, dim: int, fill: bool) -> dict[str, Any]:
        """This rank's ``Shard(dim)`` piece of every tensor, as DTensors on the 1-D mesh."""
        from torch.distributed.tensor import DTensor, Shard

        out = {}
        for spec in self.specs:
            offsets, sizes = shard_box(spec, dim, self.ws, self.rank)
            if fill:
                local = make_box(spec, offsets, sizes)
            else:
                local = self.torch.zeros(sizes, dtype=getattr(self.torch, spec.dtype))
            out[spec.name] = DTensor.from_local(local, self.mesh, [Shard(dim)], run_check=False,
                                                shape=self.torch.Size(spec.shape), stride=(spec.shape[1], 1))
        return out

    def check(self, sd: dict[str, Any], dim: int | None) -> bool:
        """Does ``sd`` hold the right values (``dim`` None: whole plain tensors)?"""
        ok = True
        for spec in self.specs:
            value = sd[spec.name]
            if dim is None:
                ok &= check_box(value, spec, (0, 0))
            else:
                offsets, _ = shard_box(spec, dim, self.ws, self.rank)
                ok &= check_box(value._local_tensor, spec, offsets)
        return bool(ok)

    def local_bytes(self) -> int:
        total = 0
        for spec in self.specs:
            _, sizes = shard_box(spec, 0, self.ws, self.rank)
            total += sizes[0] * sizes[1] * (4 if spec.dtype == "float32" else 2)
        return total

    def make_cold(self, paths: list[str]) -> dict[str, Any]:
        """Rank 0 drops the page cache of ``paths`` (and checks with mincore); all wait."""
        out: dict[str, Any] = {}
        if self.rank == 0:
            out["cold_method"] = drop_page_cache(paths, self.cold_method)
            out["resident_before"] = resident_fraction(paths)
        self.barrier()
        return out

    def read_once(self, paths: list[str]) -> None:
        """Read every file under ``paths`` once, untimed (each rank its round-robin share).

        On this VM the first read of freshly written data is served slower (~1.2 GiB/s)
        than every later read of it (~2 GiB/s), even with the page cache dropped: a load
        timed on never-read files and a raw read timed on the same files once read would
        not compare like with like. So every reader is timed on files read once before,
        each repetition from a cold page cache (:meth:`make_cold`)."""
        files = sorted(files_under(paths))[self.rank::self.ws]
        buf = memoryview(bytearray(8 << 20))
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
        self.barrier()

    def sync_disk(self) -> None:
        if self.rank == 0:
            os.sync()
        self.barrier()

    def timed(self, fn: Callable[[], dict | None], cold: list[str] | None = None) -> dict[str, Any]:
        """One measurement: cold files (optional) -> barrier -> fn on every rank -> span."""
        torch = self.torch
        import torch.distributed as dist

        rec: dict[str, Any] = self.make_cold(cold) if cold else {}
        self.barrier()
        io0 = io_counters()
        c0 = cpu_seconds()
        t0 = time.monotonic()
        extra = fn() or {}
        t1 = time.monotonic()
        c1 = cpu_seconds()
        io1 = io_counters()
        span = torch.tensor([-t0, t1], dtype=torch.float64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        rec.update(extra)
        rec.update({
            "wall_s": float(span[0] + span[1]), "rank_s": t1 - t0, "t0": t0, "cpu_s": c1 - c0,
            "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
            "disk_read": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
            "disk_write": io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
        })
        return rec

    def record(self, scenario: str, variant: str, rec: dict[str, Any], nbytes: int | None = None) -> None:
        self.records.setdefault(scenario, {}).setdefault(variant, []).append(rec)
        if self.rank == 0:
            rate = f", {nbytes / rec['wall_s'] / (1 << 30):.2f} GiB/s" if nbytes and rec["wall_s"] > 0 else ""
            _log(f"{scenario} / {variant}: {rec['wall_s']:.3f} s{rate}")

    def guard(self, scenario: str, fn: Callable[[], None]) -> None:
        """Run a scenario; an error is recorded (not raised) once every rank is past it."""
        try:
            fn()
        except Exception as exc:  # recorded in the report; the other scenarios still run
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
            self.records.setdefault(scenario, {}).setdefault("_error", []).append({"error": msg})
            _log(f"{scenario}: FAILED on rank {self.rank}: {msg}")
            traceback.print_exc()
        self.barrier()

    def rmtree(self, *paths: str) -> None:
        self.barrier()
        if self.rank == 0:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
        self.barrier()

    def order(self, rep: int, variants: list[str]) -> list[str]:
        return variants if rep % 2 == 0 else variants[::-1]

    # ------------------------------------------------------------ the two libraries

    def ours_save(self, sd: dict, path: str) -> None:
        from hyper_parallel.core.distributed_checkpoint import save

        kw = {"thread_count": self.cfg["ours_save_threads"]} if self.cfg.get("ours_save_threads") else {}
        save(sd, checkpoint_id=path, sync_files=True, **kw)

    def torch_save(self, sd: dict, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True))

    def ours_load(self, sd: dict, path: str, **kw: Any) -> dict:
        from hyper_parallel.core.distributed_checkpoint import FileSystemReader, load

        if self.cfg.get("ours_load_threads"):
            kw.setdefault("thread_count", self.cfg["ours_load_threads"])
        reader = FileSystemReader(path)
        load(sd, storage_reader=reader, **kw)
        return {"bytes_read": reader.bytes_read}

    def _raw_files(self, path: str) -> list[str]:
        return sorted(e.path for e in os.scandir(path) if e.name.endswith(".safetensors"))[self.rank::self.ws]

    def raw_prepare(self, path: str) -> None:
        """Allocate and touch :meth:`raw_read`'s memory, outside any timing (as the limits'
        buffers are), so no repetition pays its page faults."""
        size = max((os.path.getsize(f) for f in self._raw_files(path)), default=0)
        if self._raw_buffer is None or len(self._raw_buffer) < size:
            self._raw_buffer = bytearray(b"\1" * size)

    def raw_read(self, path: str) -> dict:
        """The paired read limit: this rank's share of ``path``'s data files (whole files,
        round-robin over ranks) read front to back with plain ``readinto`` calls of
        ``io_chunk`` bytes into reused memory. Timed in the same repetitions as the loads, on
        the files they read: this disk reads recently written files faster than older ones,
        so a limit measured at another time on other files says little about a load."""
        files = self._raw_files(path)
        view, chunk = memoryview(self._raw_buffer), self.cfg["io_chunk"]
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                off = 0
                while got := fh.readinto(view[off:off + chunk]):
                    off += got
        return {}

    def raw_write(self, tensors: Any, path: str) -> dict:
        """The paired write limit: this rank's local tensors (the bytes its save writes;
        DTensors' local pieces, anything else skipped) written front to back into one file
        of ``path`` with plain ``write`` calls of ``io_chunk`` bytes, then fsync: what a save
        costs at the least, in the same repetitions as the saves (this disk's speed drifts
        over a run)."""
        os.makedirs(path, exist_ok=True)
        chunk = self.cfg["io_chunk"]
        fd = os.open(os.path.join(path, f"raw-r{self.rank:05d}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for value in tensors:
                local = getattr(value, "_local_tensor", value)
                if not isinstance(local, self.torch.Tensor) or not local.numel():
                    continue
                data = memoryview(local.detach().contiguous().reshape(-1).view(self.torch.uint8).numpy())
                for off in range(0, data.nbytes, chunk):
                    view = data[off:off + chunk]
                    while view.nbytes:
                        view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return {}

    def torch_load(self, sd: dict, path: str, **kw: Any) -> dict:
        import torch.distributed.checkpoint as dcp

        dcp.load(sd, storage_reader=dcp.FileSystemReader(path), **kw)
        return {}

    def profiled(self, name: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once more (untimed), profiled on rank 0 (``--profile``).

        With py-spy in the venv (``pip install py-spy``): wall-clock samples of every thread,
        raw collapsed stacks in ``<out>/profile-<name>.txt``. Without it: cProfile of the
        calling thread only (the library's reader/writer threads are not seen), written as
        ``<out>/profile-<name>.cprofile.txt``. The name gets ``cfg["profile_tag"]``.
        """
        name += self.cfg.get("profile_tag", "")
        spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
        if not os.path.exists(spy):
            spy = shutil.which("py-spy") or ""
        proc = prof = None
        if self.rank == 0 and spy:
            out = os.path.join(self.cfg["out"], f"profile-{name}.txt")
            cmd = [spy, "record", "--pid", str(os.getpid()), "--rate", "250", "--format", "raw",
                   "--idle", "--threads", "-o", out]
            # --native needs to pause the process for each sample; without it, sample without pausing
            cmd.append("--native" if self.cfg.get("profile_native") else "--nonblocking")
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.5)  # let it attach
        elif self.rank == 0:
            import cProfile

            prof = cProfile.Profile()
        self.barrier()
        if prof is not None:
            prof.enable()
        fn()
        if prof is not None:
            prof.disable()
        self.barrier()
        if prof is not None:
            import io
            import pstats

            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("cumulative").print_stats(40)
            stats.sort_stats("tottime").print_stats(25)
            with open(os.path.join(self.cfg["out"], f"profile-{name}.cprofile.txt"), "w") as f:
                f.write("cProfile of rank 0's calling thread only (py-spy not installed)\n" + text.getvalue())
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                err = b"py-spy did not stop"
            if proc.returncode not in (0, -signal.SIGINT, 130):
                _log(f"py-spy for {name}: exit {proc.returncode}: {err.decode(errors='replace')[-300:]}")


# ---------------------------------------------------------------------------- scenarios


def prep_ranks(rank: int, ws: int, cfg: dict) -> dict:
    """Save the ``ws``-rank checkpoints (ours and torch's) that the main ranks reshard from."""
    b = _Rank(rank, ws, cfg)
    sd = b.dtensors(0, fill=True)
    paths = cfg["prep_paths"]
    b.record("prep", "ours", b.timed(lambda: b.ours_save(sd, paths["ours"])))
    b.record("prep", "torch", b.timed(lambda: b.torch_save(sd, paths["torch"])))
    return {"records": b.records}


def main_ranks(rank: int, ws: int, cfg: dict) -> dict:
    """Every multi-process scenario, in one group of ranks, on one state dict."""
    b = _Rank(rank, ws, cfg)
    torch = b.torch
    reps = cfg["reps"]
    total = sum(s.nbytes for s in b.specs)
    t_setup = time.monotonic()
    sd = b.dtensors(0, fill=True)
    if rank == 0:
        _log(f"state dict ready: {len(b.specs)} tensors, {total / (1 << 30):.3f} GiB global, "
             f"{time.monotonic() - t_setup:.1f} s")
    b.barrier()
    kept: dict[str, str] = {}

    # ---- machine limits: memcpy, sequential write (with/without fsync), cold/warm read
    def limits() -> None:
        n = b.local_bytes()
        src = torch.empty(n, dtype=torch.uint8)
        words = n // 8
        src[: words * 8].view(torch.int64).copy_(torch.arange(words, dtype=torch.int64))
        reused = torch.empty(n, dtype=torch.uint8)
        reused.fill_(1)
        chunk = cfg["io_chunk"]
        ldir = os.path.join(b.dir, "limits")
        os.makedirs(ldir, exist_ok=True)
        path = os.path.join(ldir, f"raw-r{rank:05d}.bin")
        mv_src = memoryview(src.numpy())
        mv_dst = memoryview(reused.numpy())

        # page-aligned copies for O_DIRECT (its buffers, offsets and sizes must be aligned)
        n_al = -(-n // 4096) * 4096
        al_src, al_dst = mmap.mmap(-1, max(n_al, 4096)), mmap.mmap(-1, max(n_al, 4096))
        al_src[:n] = mv_src
        al_dst.write(b"\1" * len(al_dst))
        direct_ok = [hasattr(os, "O_DIRECT")]

        def write(fsync: bool, direct: bool = False) -> None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
            view_all, size = (memoryview(al_src), n_al) if direct else (mv_src, n)
            fd = os.open(path, flags, 0o644)
            try:
                for off in range(0, size, chunk):
                    view = view_all[off:min(size, off + chunk)]
                    while view.nbytes:
                        view = view[os.write(fd, view):]
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

        def read(direct: bool = False) -> None:
            view_all, size = (memoryview(al_dst), n_al) if direct else (mv_dst, n)
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                off = 0
                while off < size:
                    got = os.preadv(fd, [view_all[off:min(size, off + chunk)]], off)
                    if not got:
                        raise OSError(f"{path} ends at {off}")
                    off += got
            finally:
                os.close(fd)

        write(True)  # untimed: the first write of a run is often slow for reasons of its own
        os.unlink(path)
        if direct_ok[0]:
            try:  # O_DIRECT is refused by some filesystems (tmpfs): then those limits are skipped
                write(True, direct=True)
                read(direct=True)
            except OSError as exc:
                direct_ok[0] = False
                b.notes.append(f"O_DIRECT limits skipped: {exc}")
            if os.path.exists(path):
                os.unlink(path)
        for _ in range(reps):
            def fresh() -> None:
                dst = torch.empty(n, dtype=torch.uint8)
                dst.copy_(src)

            def into_reused() -> None:
                reused.copy_(src)

            def checksum() -> None:  # what a save's checksums cost at least: one crc32c pass
                crc = 0
                for off in range(0, n, 1 << 20):
                    crc = crc32c.crc32c(mv_src[off:off + (1 << 20)], crc)

            b.record("limits", "memcpy_fresh", b.timed(fresh), total)
            b.record("limits", "memcpy_reused", b.timed(into_reused), total)
            b.record("limits", "crc32c", b.timed(checksum), total)
            for fsync in (False, True):
                b.sync_disk()
                b.record("limits", "write_fsync" if fsync else "write", b.timed(lambda f=fsync: write(f)), total)
                b.barrier()
                os.unlink(path)
            write(True)
            b.record("limits", "read_cold", b.timed(read, cold=[ldir]), total)
            b.record("limits", "read_warm", b.timed(read), total)
            b.barrier()
            os.unlink(path)
            if direct_ok[0]:
                b.sync_disk()
                b.record("limits", "write_direct", b.timed(lambda: write(True, direct=True)), total)
                b.record("limits", "read_direct", b.timed(lambda: read(direct=True), cold=[ldir]), total)
                b.barrier()
                os.unlink(path)
        al_src.close()
        al_dst.close()
        b.rmtree(ldir)

    # ---- sync save: ours and torch DCP, fresh directory per repetition
    def sync_save() -> None:
        for i in range(cfg["warmup"]):
            for lib, fn in (("ours", b.ours_save), ("torch", b.torch_save)):
                path = os.path.join(b.dir, f"warmup-{lib}-{i}")
                fn(sd, path)
                b.rmtree(path)
        # raw: the paired write limit (the same bytes written plainly, in the same repetitions)
        savers = {"ours": b.ours_save, "torch": b.torch_save, "raw": lambda s, p: b.raw_write(s.values(), p)}
        for rep in range(reps):
            for lib in b.order(rep, list(savers)):
                path = os.path.join(b.dir, f"save-{lib}-{rep}")
                fn = savers[lib]
                b.sync_disk()
                b.record("sync_save", lib, b.timed(lambda fn=fn, path=path: fn(sd, path)), total)
                if lib == "raw":
                    b.rmtree(path)
                    continue
                if lib in kept:
                    b.rmtree(kept[lib])
                kept[lib] = path
        if cfg.get("profile"):
            b.profiled("ours-save", lambda: b.ours_save(sd, os.path.join(b.dir, "profile-save")))
            b.rmtree(os.path.join(b.dir, "profile-save"))

    def load_case(scenario: str, target: dict, dim: int | None, sources: dict[str, str],
                  variants: dict[str, Callable[[str], dict]]) -> None:
        b.read_once(sorted(set(sources.values())))  # see read_once: every reader on files read once
        for rep in range(reps):
            for name in b.order(rep, list(variants)):
                src = sources[name]
                checked = rep == 0 and name != "raw"  # check the values once, outside the timing
                if checked:
                    for v in target.values():
                        (v._local_tensor if hasattr(v, "_local_tensor") else v).zero_()
                rec = b.timed(lambda name=name, src=src: variants[name](src), cold=[src])
                if checked:
                    rec["correct"] = b.check(target, dim) if (dim is not None or rank == 0) else True
                b.record(scenario, name, rec, total)

    # ---- load in the same layout (Shard(0) on the same ranks), cold cache
    target_s0: dict = {}

    def load_same() -> None:
        target_s0.update(b.dtensors(0, fill=False))
        b.raw_prepare(kept["ours"])
        load_case("load_same", target_s0, 0, {"ours": kept["ours"], "torch": kept["torch"], "raw": kept["ours"]}, {
            "ours": lambda p: b.ours_load(target_s0, p),
            "torch": lambda p: b.torch_load(target_s0, p),
            "raw": b.raw_read,  # the read limit on our checkpoint's files, in the same repetitions
        })
        if cfg.get("profile"):
            b.make_cold([kept["ours"]])
            b.profiled("ours-load", lambda: b.ours_load(target_s0, kept["ours"]))

    # ---- resharded load: saved Shard(0), loaded Shard(1), same ranks
    def load_s0_s1() -> None:
        target = b.dtensors(1, fill=False)
        b.raw_prepare(kept["ours"])
        load_case("load_reshard_s0_s1", target, 1,
                  {"ours": kept["ours"], "ours_noverify": kept["ours"], "torch": kept["torch"], "raw": kept["ours"]}, {
                      "ours": lambda p: b.ours_load(target, p, verify=True),
                      "ours_noverify": lambda p: b.ours_load(target, p, verify=False),
                      "torch": lambda p: b.torch_load(target, p),
                      "raw": b.raw_read,
                  })
        if cfg.get("profile"):
            b.make_cold([kept["ours"]])
            b.profiled("ours-load-s0-s1", lambda: b.ours_load(target, kept["ours"], verify=True))
            b.make_cold([kept["ours"]])
            b.profiled("ours-load-s0-s1-noverify", lambda: b.ours_load(target, kept["ours"], verify=False))

    # ---- resharded load: saved by 2N ranks, loaded by these N
    def load_2n_n() -> None:
        if not target_s0:
            target_s0.update(b.dtensors(0, fill=False))
        prep = cfg["prep_paths"]
        load_case("load_reshard_2n_n", target_s0, 0, {"ours": prep["ours"], "torch": prep["torch"]}, {
            "ours": lambda p: b.ours_load(target_s0, p),
            "torch": lambda p: b.torch_load(target_s0, p),
        })

    # ---- N ranks -> 1 process without a process group (rank 0 alone), then the
    #      single-process references (torch.save, safetensors) on the same full tensors
    full: dict = {}

    def load_n_1() -> None:
        if rank == 0:
            full.update({s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in b.specs})
        load_case("load_n_1", full, None, {"ours": kept["ours"], "torch": kept["torch"]}, {
            "ours": lambda p: b.ours_load(full, p, no_dist=True) if rank == 0 else {},
            "torch": lambda p: b.torch_load(full, p, no_dist=True) if rank == 0 else {},
        })

    def references() -> None:
        import safetensors.torch as st

        rdir = os.path.join(b.dir, "reference")
        tpath, spath = os.path.join(rdir, "full.pt"), os.path.join(rdir, "full.safetensors")
        if rank == 0:
            os.makedirs(rdir, exist_ok=True)
            if not full:
                full.update({s.name: make_box(s, (0, 0), s.shape) for s in b.specs})

        def torch_save() -> None:
            with open(tpath, "wb") as f:
                torch.save(full, f)
                f.flush()
                os.fsync(f.fileno())

        def st_save() -> None:
            st.save_file(full, spath)
            fd = os.open(spath, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        for _ in range(reps):
            b.sync_disk()
            b.record("reference", "torch_save", b.timed(lambda: torch_save() if rank == 0 else None), total)
            b.sync_disk()
            b.record("reference", "safetensors_save", b.timed(lambda: st_save() if rank == 0 else None), total)
            b.record("reference", "torch_load", b.timed(
                lambda: (torch.load(tpath, weights_only=True), None)[1] if rank == 0 else None, cold=[rdir]), total)
            b.record("reference", "safetensors_load", b.timed(
                lambda: (st.load_file(spath), None)[1] if rank == 0 else None, cold=[rdir]), total)
        full.clear()
        b.rmtree(rdir)

    # ---- async save with a compute loop running in every rank
    def async_case() -> None:
        import torch.distributed.checkpoint as dcp

        from hyper_parallel.core import distributed_checkpoint as hp

        have_ours = hasattr(hp, "async_save")
        n = cfg["compute_n"]  # 0: no compute loop (the save alone; the loop polls and sleeps)
        a, w, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)

        def step() -> None:
            torch.mm(a, w, out=c) if n else time.sleep(0.001)

        def rate_for(seconds: float) -> float:
            k, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < seconds:
                step()
                k += 1
            return k / (time.monotonic() - t0)

        def run(lib: str, path: str) -> dict:
            idle = rate_for(cfg["compute_s"])
            b.barrier()
            done_at: list[float] = []
            t0 = time.monotonic()
            cpu0, own0 = time.process_time(), time.thread_time()  # the save's threads = process - this one
            if lib.startswith("ours"):
                kw = {}
                if lib == "ours_untiled":  # no column bands: the background writes without copying
                    kw["planner"] = hp.StandardPlanner()
                    kw["planner"].max_tiles = 1
                start = {"ours_nice0": getattr(at_caller_priority, "save", None),
                         "ours_flat": getattr(staging_flat, "save", None)}.get(lib, hp.async_save)
                resp = start(sd, checkpoint_id=path, sync_files=True,
                             callback=lambda r: done_at.append(time.monotonic()), **kw)
                finished = resp.done
                wait = resp.result
            else:
                ret = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True))
                fut = getattr(ret, "upload_completion", ret)
                fut.add_done_callback(lambda f: done_at.append(time.monotonic()))
                finished = fut.done
                wait = fut.result
            t_ret = time.monotonic()
            k = 0
            while not finished():
                step()
                k += 1
            t_seen = time.monotonic()
            wait()
            background_cpu = (time.process_time() - cpu0) - (time.thread_time() - own0)
            during = k / (t_seen - t_ret) if t_seen - t_ret > 0 and k else None
            kept = during / idle if during and idle else None
            rec = {"blocking_s": t_ret - t0, "committed_s": (done_at[0] if done_at else t_seen) - t0,
                   "idle_rate": idle, "during_rate": during, "kept": kept, "background_cpu_s": background_cpu,
                   # compute time this save cost the loop: the call, plus the share of the window it took
                   "lost_s": (t_ret - t0) + (t_seen - t_ret) * (1 - kept) if kept is not None else t_seen - t0}
            b.barrier()
            return rec

        # the default runs the background threads at nice 10 (priority.py); this one at the loop's
        at_caller_priority = hp.AsyncCheckpointer(background_nice=0) if have_ours else None
        # a flat snapshot (the default lays host tensors out as the file's column bands): a
        # faster copy, and the background copies the bands out of it
        staging_flat = hp.AsyncCheckpointer(stage_bands=False) if have_ours else None
        libs = ["ours", "ours_flat", "ours_untiled", "ours_nice0", "torch"] if have_ours else ["torch"]
        if not have_ours:
            b.notes.append("async_save not in hyper_parallel.core.distributed_checkpoint: ours skipped")
        for i in range(cfg["warmup_async"]):
            for lib in libs:
                path = os.path.join(b.dir, f"async-warmup-{lib}-{i}")
                b.sync_disk()
                b.record("async_save", f"{lib}_first", run(lib, path) | {"wall_s": 0.0})
                b.rmtree(path)
        for rep in range(reps):
            for lib in b.order(rep, libs):
                path = os.path.join(b.dir, f"async-{lib}-{rep}")
                b.sync_disk()
                rec = run(lib, path)
                rec["wall_s"] = rec["committed_s"]
                b.records.setdefault("async_save", {}).setdefault(lib, []).append(rec)
                if rank == 0:
                    _log(f"async_save / {lib}: blocks {rec['blocking_s']:.3f} s, committed "
                         f"{rec['committed_s']:.3f} s, compute kept {rec['kept'] or 0:.2f}")
                b.rmtree(path)

    # ---- the model-shaped case: FSDP2 + AdamW through get_state_dict / set_state_dict
    model_info: dict[str, Any] = {}

    def model_case() -> None:
        model_info.update(_model_case(b, cfg))

    steps = [("limits", limits), ("sync_save", sync_save), ("load_same", load_same),
             ("load_reshard_s0_s1", load_s0_s1), ("load_reshard_2n_n", load_2n_n),
             ("load_n_1", load_n_1), ("reference", references), ("async_save", async_case),
             ("model", model_case)]
    skip = set(cfg.get("skip", []))
    for name, fn in steps:
        if name in skip:
            continue
        if name.startswith("load") and name != "load_reshard_2n_n" and not {"ours", "torch"} <= kept.keys():
            b.records.setdefault(name, {})["_error"] = [{"error": "no checkpoint: sync_save did not run"}]
            continue
        b.guard("model_save" if name == "model" else name, fn)
    b.barrier()
    return {"records": b.records, "notes": b.notes, "local_bytes": b.local_bytes(), "kept": kept,
            "pid": os.getpid(), "io_chunk_mib": cfg["io_chunk"] / MiB, "model": model_info}


def _model_case(b: _Rank, cfg: dict) -> dict:
    """Model + AdamW state of an FSDP2 model, saved and loaded by ours and by torch DCP.

    Save = ``get_state_dict`` + save; load = ``get_state_dict`` + load + ``set_state_dict``
    (what a training script runs); ``call_s`` in each record is the library call alone.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from benchmarks import dcp_model as dm

    spec = dm.parse_model(cfg["model"])
    t0 = time.monotonic()
    model, opt = dm.sharded_model_and_optimizer(spec, b.ws)
    sd = dm.state_dict_of(model, opt)
    ref = {k: v.clone() for k, v in dm.local_tensors(sd).items()}
    leaves = _leaves(sd)
    sharded = sum(v._local_tensor.numel() * v._local_tensor.element_size() for v in leaves if isinstance(v, DTensor))
    plain = sum(v.numel() * v.element_size() for v in leaves
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor))  # replicated: counted once
    total_t = torch.tensor([sharded], dtype=torch.int64)
    dist.all_reduce(total_t)
    total = int(total_t.item()) + plain
    del sd, leaves
    if b.rank == 0:
        _log(f"model: {dm.param_count(*spec) / 1e6:.1f} M parameters, FSDP2 on {b.ws} ranks, AdamW stepped; "
             f"state {total / (1 << 30):.3f} GiB in {len(ref)} tensors per rank ({time.monotonic() - t0:.1f} s)")

    def save_with(lib: str, path: str) -> dict:
        t_a = time.monotonic()
        state = dm.state_dict_of(model, opt)
        t_b = time.monotonic()
        if lib == "raw":  # the paired limit: the same local bytes written plainly
            b.raw_write(_leaves(state), path)
        else:
            (b.ours_save if lib == "ours" else b.torch_save)(state, path)
        return {"call_s": time.monotonic() - t_b, "state_dict_s": t_b - t_a}

    def load_with(lib: str, path: str) -> dict:
        t_a = time.monotonic()
        state = dm.state_dict_of(model, opt)
        t_b = time.monotonic()
        extra = (b.ours_load if lib == "ours" else b.torch_load)(state, path)
        t_c = time.monotonic()
        dm.apply_state_dict(model, opt, state)
        return {"call_s": t_c - t_b, "state_dict_s": (t_b - t_a) + (time.monotonic() - t_c), **extra}

    def scramble() -> None:
        with torch.no_grad():
            for t in dm.local_tensors(dm.state_dict_of(model, opt)).values():
                t.zero_()

    kept: dict[str, str] = {}
    for i in range(cfg["warmup"]):
        for lib in ("ours", "torch"):
            path = os.path.join(b.dir, f"model-warmup-{lib}-{i}")
            save_with(lib, path)
            b.rmtree(path)
    for rep in range(cfg["reps"]):
        for lib in b.order(rep, ["ours", "torch", "raw"]):
            path = os.path.join(b.dir, f"model-save-{lib}-{rep}")
            b.sync_disk()
            b.record("model_save", lib, b.timed(lambda lib=lib, path=path: save_with(lib, path)), total)
            if lib == "raw":
                b.rmtree(path)
                continue
            if lib in kept:
                b.rmtree(kept[lib])
            kept[lib] = path
    b.raw_prepare(kept["ours"])
    for rep in range(cfg["reps"]):
        for lib in b.order(rep, ["ours", "torch", "raw"]):
            if lib == "raw":  # the paired limit: readinto of our checkpoint's files
                b.record("model_load", lib, b.timed(lambda: b.raw_read(kept["ours"]), cold=[kept["ours"]]), total)
                continue
            if rep == 0:
                scramble()
            rec = b.timed(lambda lib=lib: load_with(lib, kept[lib]), cold=[kept[lib]])
            if rep == 0:
                now = dm.local_tensors(dm.state_dict_of(model, opt))
                rec["correct"] = set(now) == set(ref) and all(torch.equal(now[k], ref[k]) for k in ref)
            b.record("model_load", lib, rec, total)
    if cfg.get("profile"):
        b.profiled("ours-model-save", lambda: save_with("ours", os.path.join(b.dir, "profile-model-save")))
        b.rmtree(os.path.join(b.dir, "profile-model-save"))
        b.make_cold([kept["ours"]])
        b.profiled("ours-model-load", lambda: load_with("ours", kept["ours"]))
    b.rmtree(*kept.values())
    return {"params": dm.param_count(*spec), "spec": list(spec), "bytes": total, "tensors_per_rank": len(ref)}


def _leaves(sd: Any) -> list[Any]:
    if isinstance(sd, dict):
        return [x for v in sd.values() for x in _leaves(v)]
    if isinstance(sd, (list, tuple)):
        return [x for v in sd for x in _leaves(v)]
    return [sd]


def hsdp_ranks(rank: int, ws: int, cfg: dict) -> dict:
    """HSDP load: ``[Replicate(), Shard(0)]`` on a ``(2, ws/2)`` mesh, saved and loaded in the
    same layout; every rank's bytes read (reader's ``bytes_read``, ``rchar``, storage
    ``read_bytes``) next to the checkpoint's size."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    b = _Rank(rank, ws, cfg)
    shards = ws // 2
    mesh = init_device_mesh("cpu", (2, shards), mesh_dim_names=("replicate", "shard"))
    shard = mesh.get_coordinate()[1]

    def dtensors(fill: bool) -> dict[str, Any]:
        out = {}
        for spec in b.specs:
            offsets, sizes = shard_box(spec, 0, shards, shard)
            local = make_box(spec, offsets, sizes) if fill else torch.zeros(sizes, dtype=getattr(torch, spec.dtype))
            out[spec.name] = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False,
                                                shape=torch.Size(spec.shape), stride=(spec.shape[1], 1))
        return out

    def correct(target: dict[str, Any]) -> bool:
        return all(check_box(target[s.name]._local_tensor, s, shard_box(s, 0, shards, shard)[0]) for s in b.specs)

    total = sum(s.nbytes for s in b.specs)
    sd = dtensors(True)
    kept = {lib: os.path.join(b.dir, f"hsdp-{lib}") for lib in ("ours", "torch")}
    for lib in ("ours", "torch"):
        b.sync_disk()
        fn = b.ours_save if lib == "ours" else b.torch_save
        b.record("hsdp_save", lib, b.timed(lambda fn=fn, lib=lib: fn(sd, kept[lib])), total)
    sd.clear()
    sizes = {}
    for lib, path in kept.items():
        sizes[lib] = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                         if n != ".metadata" and not n.startswith("."))
    target = dtensors(False)
    # ours: shared reads (the default on disks and network storage); ours_noshare: every replica
    # reads for itself (broadcast_replicated_tensors=False; the default for files in memory)
    loaders = {"ours": (b.ours_load, {"broadcast_replicated_tensors": True}),
               "ours_noshare": (b.ours_load, {"broadcast_replicated_tensors": False}),
               "torch": (b.torch_load, {})}
    for rep in range(cfg["reps"]):
        for lib in b.order(rep, list(loaders)):
            if rep == 0:
                for v in target.values():
                    v._local_tensor.zero_()
            fn, kw = loaders[lib]
            path = kept["torch" if lib == "torch" else "ours"]
            rec = b.timed(lambda fn=fn, kw=kw, path=path: fn(target, path, **kw), cold=[path])
            if rep == 0:
                rec["correct"] = correct(target)
            b.record("hsdp_load", lib, rec, total)
    b.rmtree(*kept.values())
    return {"records": b.records, "notes": b.notes, "checkpoint_bytes": sizes, "shard": shard,
            "replica": mesh.get_coordinate()[0]}
