"""Command line for distributed checkpoints: inspect, verify, and (when available) transform.

Usage::

    hyper-dcp inspect PATH [--json]
    hyper-dcp verify PATH [--json]
    python -m hyper_parallel.core.distributed_checkpoint inspect PATH

Progress bars appear on long work when stderr is a terminal; ``--json`` prints one JSON
document for scripts. ``verify`` exits 1 when it finds any problem.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .core.distributed_checkpoint import metadata as md
from .core.distributed_checkpoint.errors import CheckpointError
from .core.distributed_checkpoint.filesystem_storage import FileSystemReader
from .core.distributed_checkpoint.verify import verify_checkpoint


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


def cmd_inspect(args: argparse.Namespace) -> int:
    meta = md.Metadata.from_json(FileSystemReader(args.path).read_metadata())
    rows = []
    for key, e in meta.entries.items():
        rows.append({
            "key": key, "kind": e.kind, "dtype": e.dtype, "shape": list(e.shape) if e.shape is not None else None,
            "chunks": len(e.chunks), "bytes": e.nbytes, "layout": e.layout,
            **({"value": md.encode_value(e.value)} if e.kind == "object" else {}),
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
    total = 0
    try:
        meta = md.Metadata.from_json(FileSystemReader(args.path).read_metadata())
        total = sum(e.nbytes for e in meta.entries.values())
    except CheckpointError:
        pass
    bar = None if args.json else _progress(total, "verify")
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
    return 0 if report.ok else 1


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
