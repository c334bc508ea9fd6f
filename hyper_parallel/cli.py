"""Command line for distributed checkpoints: inspect, verify, transform and convert.

Usage (SRC first, DST a new directory, as in ``cp``)::

    hyper-dcp inspect PATH [--json]
    hyper-dcp verify PATH [--json]
    hyper-dcp gc PATH [--dry-run] [--min-age SECONDS] [--json]
    hyper-dcp ls DIR [--json]              the steps of a CheckpointManager directory
    hyper-dcp transform SRC DST --mesh tp=4 | --layout strategy.json
    hyper-dcp export-hf SRC DST [--prefix model.] [--max-shard-size 5GB]
    hyper-dcp import-hf SRC DST [--prefix model.]
    hyper-dcp import-torch-dcp SRC DST --trust
    hyper-dcp import-hyper-parallel SRC DST --trust [--allow-pickle]
    hyper-dcp export-torch-dcp SRC DST [--overwrite] [--json]
    hyper-dcp import-mindspore SRC.ckpt|SRC.safetensors DST [--prefix model.]
    hyper-dcp import-mindspore SRC_DIR DST --strategy FILE    (rank_<id>/ sliced files)
    hyper-dcp export-mindspore SRC DST.ckpt [--format ckpt|safetensors] [--prefix model.] [--crc]
    python -m hyper_parallel.core.distributed_checkpoint inspect PATH

Progress bars appear on long work when stderr is a terminal; ``--json`` prints one JSON
document for scripts. ``verify`` exits 1 when it finds any problem.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from .core.distributed_checkpoint._src.backends.locations import is_url
from .core.distributed_checkpoint._src.backends.resolve import reader_for, writer_for
from .core.distributed_checkpoint._src.base.dtypes import itemsize
from .core.distributed_checkpoint._src.base.errors import CheckpointError
from .core.distributed_checkpoint._src.engine.commit import DEBRIS_MIN_AGE_S
from .core.distributed_checkpoint._src.engine.metadata_reader import read_checkpoint_metadata
from .core.distributed_checkpoint._src.format.chunks import count as chunk_count
from .core.distributed_checkpoint._src.format.values import encode_value
from .core.distributed_checkpoint._src.tools.verify import verify_checkpoint


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _progress(total: int, desc: str) -> Any:
    """A tqdm bar on a terminal, a no-op otherwise."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)


def _layout_text(layout: dict | None) -> str:
    if not layout:
        return "-"
    names = layout.get("mesh_dim_names") or [str(i) for i in range(len(layout["mesh_shape"]))]
    mesh = ",".join(f"{n}={s}" for n, s in zip(names, layout["mesh_shape"], strict=False))
    return f"({mesh}) [{', '.join(layout['placements'])}]"


def _checkpoint_bytes(path: str) -> int:
    """Total data bytes of a checkpoint (0 when unreadable: the command will say why)."""
    try:
        meta = read_checkpoint_metadata(reader_for(path))
    except (CheckpointError, OSError):
        return 0
    return sum(e.nbytes for e in meta.entries.values())


def _tensor_bytes(path: str) -> int:
    """Bytes of the tensors' global data (replicas once; 0 when unreadable)."""
    try:
        meta = read_checkpoint_metadata(reader_for(path))
    except (CheckpointError, OSError):
        return 0
    return sum(itemsize(e.dtype) * math.prod(e.shape or ()) for e in meta.entries.values() if e.kind == "tensor")


def cmd_inspect(args: argparse.Namespace) -> int:
    meta = read_checkpoint_metadata(reader_for(args.path))
    rows = []
    for key, e in meta.entries.items():
        rows.append({
            "key": key, "kind": e.kind, "dtype": e.dtype, "shape": list(e.shape) if e.shape is not None else None,
            "chunks": chunk_count(meta, e), "bytes": e.nbytes, "layout": e.layout,
            **({"value": encode_value(e.value)} if e.kind == "object" else {}),
        })
    totals = {"keys": len(rows), "tensors": sum(r["kind"] != "object" for r in rows),
              "chunks": sum(r["chunks"] for r in rows), "bytes": sum(r["bytes"] for r in rows),
              "files": len(meta.files), "world_size": meta.world_size, "version": meta.version,
              "save_id": meta.save_id}
    if args.json:
        print(json.dumps({"path": args.path, "entries": rows, "totals": totals}, indent=1))
        return 0
    headers = ["key", "kind", "dtype", "shape", "chunks", "bytes", "saved layout"]
    table = [[r["key"], r["kind"], r["dtype"] or "-",
              "x".join(map(str, r["shape"])) if r["shape"] else ("()" if r["shape"] == [] else "-"),
              str(r["chunks"]), _human(r["bytes"]) if r["kind"] != "object" else repr(r.get("value"))[:30],
              _layout_text(r["layout"])] for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)))
    print(f"\n{totals['keys']} keys ({totals['tensors']} tensors), {totals['chunks']} chunks, "
          f"{_human(totals['bytes'])} in {totals['files']} files; saved by {meta.world_size} rank(s), "
          f"format version {meta.version}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    bar = None if args.json else _progress(_checkpoint_bytes(args.path), "verify")
    report = verify_checkpoint(args.path, progress=bar.update if bar else None)
    if bar:
        bar.close()
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    elif report.ok:
        print(f"OK: {report.keys} keys, {report.chunks} chunks, {_human(report.bytes_checked)} checked "
              f"in {report.files} files")
    else:
        print(f"FAILED: {len(report.problems)} problem(s) in {args.path}:")
        for p in report.problems:
            print(f"  - {p}")
    if report.unreferenced and not args.json:
        print(f"note: {len(report.unreferenced)} unreferenced file(s) left by failed or replaced saves "
              f"(e.g. {report.unreferenced[0]}); `hyper-dcp gc {args.path}` removes them")
    return 0 if report.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    from .core.distributed_checkpoint._src.engine.commit import sweep_debris
    from .core.distributed_checkpoint._src.manager.step_listing import files_other_steps_use

    reader = reader_for(args.path)
    try:
        reader.list_files()
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"{args.path!r} is not a directory: gc cleans a checkpoint directory") from None
    # a manager's step may hold files that later (incremental) steps read: those are not debris;
    # a sibling step that cannot be read safely (a symbolic link, a bad .metadata) makes gc refuse
    keep = files_other_steps_use(args.path)
    report = sweep_debris(reader, writer_for(args.path), dry_run=args.dry_run, keep=keep, min_age_s=args.min_age)
    if args.json:
        print(json.dumps({"path": args.path, "dry_run": args.dry_run, "files": report.removed,
                          "left": [{"file": n, "why": why} for n, why in report.left]}, indent=1))
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(f"{verb} {len(report.removed)} unreferenced file(s)" + "".join(f"\n  {n}" for n in report.removed))
        if report.left:
            print(f"left {len(report.left)} unreferenced file(s) in place:"
                  + "".join(f"\n  {n}: {why}" for n, why in report.left))
    return 0


def _metric_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _json_safe(value: Any) -> Any:
    """Metrics for --json: non-finite floats become strings ("nan"), so the output is valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def cmd_ls(args: argparse.Namespace) -> int:
    import os

    from .core.distributed_checkpoint._src.manager.step_listing import list_steps

    if not is_url(args.path) and not os.path.isdir(args.path):
        raise CheckpointError(f"{args.path!r} is not a directory")
    infos = list_steps(args.path)
    committed = [i.step for i in infos if i.state == "committed"]
    latest = max(committed) if committed else None
    if args.json:
        steps = [{"step": i.step, "path": i.path, "state": i.state, "files": i.files, "bytes": i.bytes,
                  "metrics": _json_safe(i.metrics), "references": list(i.references), "error": i.error}
                 for i in infos]
        print(json.dumps({"path": args.path, "latest_committed": latest, "steps": steps}, indent=1))
        return 0
    if not infos:
        print(f"no step directories in {args.path}")
        return 0
    # an incremental step's files may live in a step that never committed: those are not debris
    needed = {r for i in infos if i.state == "committed" for r in i.references}
    kept = [i for i in infos if i.state != "committed" and i.step in needed]
    headers = ["step", "state", "files", "size", "metrics", "references"]
    table = [[str(i.step) + (" (latest)" if i.step == latest else ""),
              i.state + (" (files in use)" if i in kept else ""), str(i.files), _human(i.bytes),
              ", ".join(f"{k}={_metric_text(v)}" for k, v in (i.metrics or {}).items()) or "-",
              ", ".join(map(str, i.references)) or "-"] for i in infos]
    widths = [max(len(h), *(len(t[c]) for t in table)) for c, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip())
    others = len(infos) - len(committed) - len(kept)
    print(f"\n{len(committed)} committed step(s), total {_human(sum(i.bytes for i in infos))}"
          + (f"; {len(kept)} not committed whose files committed steps use (do not delete them)"
             if kept else "")
          + (f"; {others} not committed (a save in flight, or debris the next manager start sweeps)"
             if others else ""))
    for i in infos:
        if i.error:
            print(f"step {i.step}: {i.error}")
    return 0


def _mesh_arg(text: str) -> dict[str, int]:
    """``tp=4`` or ``dp=2,tp=4`` -> ``{"dp": 2, "tp": 4}``."""
    out: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(f"--mesh wants name=size[,name=size...], found {text!r}")
        if name.strip() in out:
            raise argparse.ArgumentTypeError(f"--mesh names the dim {name.strip()!r} twice in {text!r}; each mesh dim "
                                             "needs its own name")
        out[name.strip()] = int(size)
    return out


def _report(args: argparse.Namespace, what: str, dst: str, meta: Any, seconds: float) -> int:
    info = {"command": what, "destination": dst, "seconds": round(seconds, 3)}
    if meta is not None:
        info.update(keys=len(meta.entries), files=len(meta.files),
                    bytes=sum(e.nbytes for e in meta.entries.values()))
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        extra = f": {info['keys']} keys, {_human(info['bytes'])} in {info['files']} files" if meta is not None else ""
        print(f"{what} -> {dst}{extra} ({seconds:.2f} s)")
    return 0


def cmd_transform(args: argparse.Namespace) -> int:
    from .core.distributed_checkpoint._src.resharding.offline_transform import offline_transform

    if (args.layout is None) == (args.mesh is None):
        raise ValueError("transform needs exactly one of --layout FILE or --mesh name=size")
    t0 = time.perf_counter()
    bar = None if args.json else _progress(_checkpoint_bytes(args.src), "transform")
    try:
        meta = offline_transform(args.src, args.dst, src_layout=args.src_mesh,
                                 dst_layout=args.layout if args.layout is not None else args.mesh,
                                 max_memory=args.max_memory, overwrite=args.overwrite,
                                 progress=bar.update if bar else None, min_chunk_bytes=args.min_chunk_bytes)
    finally:
        if bar:
            bar.close()
    return _report(args, "transform", args.dst, meta, time.perf_counter() - t0)


def cmd_export_hf(args: argparse.Namespace) -> int:
    from .core.distributed_checkpoint._src.interop.huggingface.exporting import save_state_dict_as_huggingface_format

    t0 = time.perf_counter()
    bar = None if args.json else _progress(_checkpoint_bytes(args.src), "export-hf")
    try:
        index = save_state_dict_as_huggingface_format(args.src, args.dst, max_shard_size=args.max_shard_size,
                                                      prefix=args.prefix, overwrite=args.overwrite,
                                                      progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"command": "export-hf", "destination": args.dst, "seconds": round(seconds, 3),
                          "tensors": len(index["weight_map"]), "bytes": index["metadata"]["total_size"]}, indent=1))
    else:
        print(f"export-hf -> {args.dst}: {len(index['weight_map'])} tensors, "
              f"{_human(index['metadata']['total_size'])} ({seconds:.2f} s)")
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from .core.distributed_checkpoint._src.interop.torch.full_checkpoint import convert_full_checkpoint_to_dcp

    t0 = time.perf_counter()
    meta = convert_full_checkpoint_to_dcp(args.src, args.dst, prefix=args.prefix,
                                          allow_pickle=args.allow_pickle, overwrite=args.overwrite)
    return _report(args, "import", args.dst, meta, time.perf_counter() - t0)


def cmd_import_torch_dcp(args: argparse.Namespace) -> int:
    from .core.distributed_checkpoint._src.interop.torch.importing import import_torch_dcp

    t0 = time.perf_counter()
    meta = import_torch_dcp(args.src, args.dst, trust=args.trust, overwrite=args.overwrite)
    return _report(args, "import-torch-dcp", args.dst, meta, time.perf_counter() - t0)


def cmd_import_hyper_parallel(args: argparse.Namespace) -> int:
    from .core.distributed_checkpoint._src.interop.hyper_parallel.importing import import_hyper_parallel

    t0 = time.perf_counter()
    meta = import_hyper_parallel(args.src, args.dst, trust=args.trust, allow_pickle=args.allow_pickle,
                                 overwrite=args.overwrite)
    return _report(args, "import-hyper-parallel", args.dst, meta, time.perf_counter() - t0)

def cmd_export_torch_dcp(args: argparse.Namespace) -> int:
    from .core.distributed_checkpoint._src.interop.torch.exporting import export_torch_dcp

    t0 = time.perf_counter()
    bar = None if args.json else _progress(_tensor_bytes(args.src), "export-torch-dcp")
    try:
        tmeta = export_torch_dcp(args.src, args.dst, overwrite=args.overwrite, allow_pickle=args.allow_pickle,
                                 max_chunk_bytes=args.max_chunk_size, progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    seconds = time.perf_counter() - t0
    infos = tmeta.storage_data.values()
    info = {"command": "export-torch-dcp", "destination": args.dst, "seconds": round(seconds, 3),
            "keys": len(tmeta.state_dict_metadata), "files": len({i.relative_path for i in infos}),
            "bytes": sum(i.length for i in infos)}
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(f"export-torch-dcp -> {args.dst}: {info['keys']} keys, {_human(info['bytes'])} in {info['files']} "
              f"files ({seconds:.2f} s); load it with torch.distributed.checkpoint.load")
    return 0


def _mindspore_bytes(src: str) -> int:
    """Bytes a MindSpore import will write (0 when unknown: the bar then just counts)."""
    import os

    try:
        if os.path.isfile(src):
            return os.path.getsize(src)
        return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(src) for f in fs)
    except OSError:
        return 0


def cmd_import_mindspore(args: argparse.Namespace) -> int:
    from .core.distributed_checkpoint._src.interop.mindspore.checkpoints import import_mindspore

    t0 = time.perf_counter()
    bar = None if args.json else _progress(_mindspore_bytes(args.src), "import-mindspore")
    try:
        meta = import_mindspore(args.src, args.dst, strategy=args.strategy, prefix=args.prefix,
                                verify=not args.no_verify, overwrite=args.overwrite,
                                progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    return _report(args, "import-mindspore", args.dst, meta, time.perf_counter() - t0)


def cmd_export_mindspore(args: argparse.Namespace) -> int:
    from .core.distributed_checkpoint._src.interop.mindspore.checkpoints import export_mindspore

    bar = None if args.json else _progress(_checkpoint_bytes(args.src), "export-mindspore")
    try:
        summary = export_mindspore(args.src, args.dst, format=args.format, prefix=args.prefix, crc=args.crc,
                                   overwrite=args.overwrite, progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    if args.json:
        print(json.dumps({"command": "export-mindspore", "destination": args.dst, "format": summary.format,
                          "seconds": round(summary.seconds, 3), "tensors": summary.tensors,
                          "bytes": summary.bytes, "skipped": summary.skipped}, indent=1))
    else:
        skipped = f"; skipped {len(summary.skipped)} value(s) MindSpore cannot hold: " + ", ".join(
            summary.skipped[:10]) if summary.skipped else ""
        print(f"export-mindspore -> {args.dst} ({summary.format}): {summary.tensors} values, "
              f"{_human(summary.bytes)} ({summary.seconds:.2f} s){skipped}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyper-dcp", description="Inspect, verify and transform checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="list keys, dtypes, shapes, chunks, bytes and saved layouts")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("verify", help="check every checksum, file and coverage; exit 1 on any problem")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("gc", help="remove data files no committed .metadata names (files a save in progress "
                                  "may commit, those newer than the .metadata, are left)")
    p.add_argument("path")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed")
    p.add_argument("--min-age", type=float, default=DEBRIS_MIN_AGE_S, metavar="SECONDS",
                   help="also remove debris newer than the committed .metadata once this old (default: a day)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(fn=cmd_gc)
    p = sub.add_parser("ls", help="list the steps of a CheckpointManager directory: state, size, metrics")
    p.add_argument("path", help="the manager's directory (a path or an fsspec URL)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(fn=cmd_ls)

    def src_dst(p: argparse.ArgumentParser, dst: str = "a new directory (see --overwrite)") -> None:
        p.add_argument("src")
        p.add_argument("dst", help=dst)
        p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at DST")
        p.add_argument("--json", action="store_true", help="print JSON for scripts")

    p = sub.add_parser("transform", help="rewrite a checkpoint for another parallel layout")
    src_dst(p)
    p.add_argument("--layout", help="a layout strategy JSON file (see save_layout)")
    p.add_argument("--mesh", type=_mesh_arg, help="destination mesh, e.g. tp=4 or dp=2,tp=4")
    p.add_argument("--src-mesh", type=_mesh_arg, help="check the source was saved on this mesh")
    p.add_argument("--max-memory", type=int, default=None, help="bytes of tensor data held at once")
    p.add_argument("--min-chunk-bytes", type=int, default=None,
                   help="store shards smaller than this as chunks of several consecutive ranks (fewer files for "
                        "tens of thousands of ranks of tiny shards; 1-d meshes)")
    p.set_defaults(fn=cmd_transform)
    p = sub.add_parser("export-hf", help="export tensors as Hugging Face sharded safetensors")
    src_dst(p)
    p.add_argument("--prefix", default="", help="export keys starting with it, without it (e.g. model.)")
    p.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors file (e.g. 5GB, 512MiB)")
    p.set_defaults(fn=cmd_export_hf)
    p = sub.add_parser("import-hf", help="import HF safetensors (dir or file) or a torch .pt/.bin file")
    src_dst(p)
    p.add_argument("--prefix", default="", help="prepend to every key (e.g. model.)")
    p.add_argument("--allow-pickle", action="store_true", help="allow torch files that need full unpickling")
    p.set_defaults(fn=cmd_import_hf)
    p = sub.add_parser("import-torch-dcp", help="import a torch.distributed.checkpoint checkpoint")
    src_dst(p)
    p.add_argument("--trust", action="store_true", help="its metadata is a pickle: load it only if you trust it")
    p.set_defaults(fn=cmd_import_torch_dcp)
    p = sub.add_parser("import-hyper-parallel", help="import a checkpoint HyperParallel's DCP wrote")
    src_dst(p)
    p.add_argument("--trust", action="store_true", help="its metadata is a pickle: read it only if you trust it")
    p.add_argument("--allow-pickle", action="store_true",
                   help="carry values that are pickles of more than plain data over, still pickled")
    p.set_defaults(fn=cmd_import_hyper_parallel)
    p = sub.add_parser("export-torch-dcp", help="export as a torch.distributed.checkpoint checkpoint (torch's format)")
    src_dst(p)
    p.add_argument("--allow-pickle", action="store_true", help="export values saved as pickles (unpickles them)")
    p.add_argument("--max-chunk-size", default="256MiB", help="largest torch chunk (e.g. 512MiB); larger boxes are cut")
    p.set_defaults(fn=cmd_export_torch_dcp)
    p = sub.add_parser("import-mindspore", help="import a MindSpore .ckpt/safetensors file, or a distributed "
                       "checkpoint directory (rank_<id>/) with --strategy")
    src_dst(p)
    p.add_argument("--strategy", help="the MindSpore strategy file (protobuf or JSON) of a distributed checkpoint")
    p.add_argument("--prefix", default="", help="prepend to every name (e.g. model.)")
    p.add_argument("--no-verify", action="store_true", help="skip the crc checks of the MindSpore files")
    p.set_defaults(fn=cmd_import_mindspore)
    p = sub.add_parser("export-mindspore", help="export as one MindSpore .ckpt (or safetensors) file")
    src_dst(p, "the file to write (.ckpt or .safetensors; see --overwrite)")
    p.add_argument("--format", choices=("ckpt", "safetensors"), default=None,
                   help="default: from DST's extension (.safetensors, else ckpt)")
    p.add_argument("--prefix", default="", help="export keys starting with it, without it (e.g. model.)")
    p.add_argument("--crc", action="store_true", help="add MindSpore's crc (load_checkpoint(crc_check=True))")
    p.set_defaults(fn=cmd_export_mindspore)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CheckpointError as exc:
        # the library speaks of its keyword argument; here it is a flag
        print(f"error: {str(exc).replace('overwrite=True', '--overwrite')}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
