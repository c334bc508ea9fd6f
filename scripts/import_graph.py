"""The import graph of ``hyper_parallel.core.distributed_checkpoint``: its layers, checked and drawn.

The package is a stack of subpackages (:data:`LAYERS`, bottom first). A module may import
the modules of lower layers, and the modules of its own subpackage listed before it;
nothing else: no circles, no import running back up, whether it sits at the top of a module
or inside a function. Siblings of one layer do not import each other. The faces (the
package's own modules, which re-export for the public import paths) sit above every layer
and import only subpackages.

    python scripts/import_graph.py            # list every broken rule (exit 1 if any)
    python scripts/import_graph.py --write    # regenerate docs/layers.md, the picture

``tests/core/distributed_checkpoint/test_layers.py`` checks both: the rules hold, and the
committed picture is the one this script draws.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "hyper_parallel.core.distributed_checkpoint"
PKG_DIR = ROOT.joinpath(*PKG.split("."))
PICTURE = ROOT / "docs" / "layers.md"
INTERNAL = "_src"  # the private subpackage that holds every layer; the faces sit beside it

# Bottom first. A layer is one or more sibling subpackages; inside a subpackage a module may
# import only the modules listed before it.
LAYERS: list[dict[str, list[str]]] = [
    {"base": ["errors", "torch_options", "limits", "alignment", "box", "areas", "dtypes", "gc_pause", "timeline",
              "sizes", "file_names", "allowlist_pickle", "file_exchange", "atomic_file", "protowire", "priority",
              "overrides", "either_protocol", "options", "public_path"]},
    {"coordination": ["coordinator"]},
    {"state": ["flatten", "nested_paths", "topology_mapper", "train_state", "version_stamp"]},
    {"sharding": ["ragged", "sharded_tensor", "placements", "grid", "layout", "strategy", "records",
                  "shard_lookup", "tensor_map_areas"]},
    {"format": ["values", "row_checksums", "chunk_info", "validation", "sealed_json", "records", "file_table",
                "metadata",
                "versioning", "chunks", "torch_view", "metadata_build",
                "storage_info", "safetensors", "data_file", "torch_pickles"]},
    {"backends": ["locations", "protocol", "direct_io", "open_files", "opener_reads", "filesystem",
                  "placed_writes", "fsspec", "resolve", "storage_mappings", "torch_abcs", "torch_format",
                  "torch_storage"],
     "planning": ["records", "protocols", "planner", "plan_cache", "per_call", "staged_bands", "streamed_snapshot",
                  "leaves",
                  "global_plan", "ragged_items", "chunk_lists", "ownership", "replica_sources",
                  "hyper_parallel_plans",
                  "planner_base", "save_planner", "load_planner", "standard_planner", "chunk_reads", "torch_planners",
                  "torch_protocol", "hyper_parallel_protocol",
                  "remap_blocks", "region_buffers", "deferred_reads", "remap"]},
    {"transfer": ["host_copy", "read_threads", "streams", "unchanged", "chunk_checks", "saver", "host_mailboxes",
                  "row_exchange", "plan_writer", "loader", "torch_reads",
                  "shared_reads", "broadcasts"]},
    {"engine": ["phase_result", "in_flight", "incremental", "fragments", "metadata_reader", "step_siblings", "commit",
                "streaming_writer", "scope", "targets", "plan_exchange", "rank_local_save", "protocol_run",
                "flattened", "save_run", "load_run", "checkpoint"]},
    {"asynchronous": ["buffers", "response", "streamed_staging", "process_hooks", "torch_stagers", "staged_snapshot",
                      "checkpointer",
                      "persist_process", "api"],
     "interop": ["hyper_parallel", "hyper_parallel.aliases", "hyper_parallel.single_file",
                 "huggingface", "huggingface.index", "huggingface.protocols", "huggingface.reader",
                 "hyper_parallel.storage_calls", "huggingface.quantized", "huggingface.exporting",
                 "huggingface.torch_writes", "huggingface.writer", "huggingface.torch_storage",
                 "huggingface.consolidate", "huggingface.importing", "hyper_parallel.importing",
                 "mindspore", "mindspore.file_model", "mindspore.ckpt", "mindspore.safetensors_files",
                 "mindspore.reader", "mindspore.strategy", "mindspore.distributed", "mindspore.checkpoints",
                 "hyper_parallel.layout_files",
                 "torch", "torch.exporting", "torch.importing", "torch.full_checkpoint", "torch.deprecated_calls",
                 "torch.save_file", "torch.sharded_optimizer"],
     "tools": ["verify"]},
    {"resharding": ["bulk_write", "merged_boxes", "reshard", "offline_transform", "handler"],
     "manager": ["ownership", "step_directory", "step_listing", "step_deletion", "retention", "local_format",
                 "local_directory", "local_replication", "local_save", "local_recovery", "local_tier",
                 "checkpoint_manager"]},
]


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name relative to the package ("" = __init__)."""
    out = {}
    for path in sorted(PKG_DIR.rglob("*.py")):
        parts = list(path.relative_to(PKG_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package's modules it imports, wherever in its body the import sits."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        here = name.split(".") if name else []
        package = here if path.name == "__init__.py" else here[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    if node.level - 1 > len(package):
                        continue  # above the package (hyper_parallel.platform, ...)
                    base = package[: len(package) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                elif node.module == PKG or (node.module or "").startswith(PKG + "."):
                    mod = node.module[len(PKG) + 1:]
                else:
                    continue
                for alias in node.names:
                    sub = f"{mod}.{alias.name}" if mod else alias.name
                    targets.append(sub if sub in mods else mod)
            elif isinstance(node, ast.Import):
                targets = [a.name[len(PKG) + 1:] for a in node.names if a.name.startswith(PKG + ".")]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def subpackage(name: str) -> str:
    """The subpackage of ``_src`` a module belongs to ("" for the faces, the package and ``_src`` itself)."""
    parts = name.split(".")
    return parts[1] if parts[0] == INTERNAL and len(parts) > 1 else ""




def ranks() -> dict[str, tuple[int, int]]:
    """module -> (layer, position inside its subpackage); a subpackage's __init__ is position -1."""
    out: dict[str, tuple[int, int]] = {}
    for i, layer in enumerate(LAYERS):
        for sub, order in layer.items():
            out[f"{INTERNAL}.{sub}"] = (i, -1)
            out.update({f"{INTERNAL}.{sub}.{m}": (i, j) for j, m in enumerate(order)})
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def violations() -> list[str]:
    """Every broken rule, one line each; empty when the package is layered."""
    mods = modules()
    graph = imports(mods)
    rank = ranks()
    faces = {m for m in mods if m.split(".")[0] != INTERNAL}
    problems = [f"{m}: not placed in LAYERS (scripts/import_graph.py)" for m in sorted(mods)
                if m not in rank and m not in faces and m != INTERNAL]
    problems += [f"{INTERNAL} (its __init__) imports {d}: it only says the folder is not an API"
                 for d in sorted(graph.get(INTERNAL, ()))]
    problems += [f"circle: {' -> '.join(c)}" for c in cycles(graph)]
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if m in faces:
                if d in faces and m != "":
                    problems.append(f"{m} imports {d}: a face imports subpackages only")
                continue
            if d in faces:
                problems.append(f"{m} imports the face {d or 'the package'}: import the subpackage's module")
            elif m in rank and d in rank:
                (lm, pm), (ld, pd) = rank[m], rank[d]
                if subpackage(m) == subpackage(d):
                    if pd >= pm:
                        problems.append(f"{m} imports {d}: inside {subpackage(m)}/, only modules listed before it")
                elif ld >= lm:
                    problems.append(f"{m} imports {d}: {subpackage(d)}/ is not below {subpackage(m)}/")
    return problems


def picture() -> str:
    """docs/layers.md: the layers, the imports between subpackages, and each module's size."""
    mods = modules()
    graph = imports(mods)
    edges = sorted({(subpackage(m), subpackage(d)) for m, deps in graph.items() for d in deps
                    if subpackage(m) and subpackage(d) and subpackage(m) != subpackage(d)})
    lines = [
        "# The layers of `hyper_parallel.core.distributed_checkpoint`",
        "",
        "Generated by `python scripts/import_graph.py --write`; do not edit. Arrows point from a",
        "subpackage to the ones it imports: always down. The faces (top) only re-export.",
        "",
        "```mermaid",
        "flowchart TD",
        '  faces["faces: __init__, api, planner, standard_planner, saver, loader, storage,<br/>'
        'filesystem_storage, metadata, reshard, async_staging, offline_transform, layout, util,<br/>'
        'HyperParallel\'s newer: versioning, topology_mapper, checkpoint_io, ragged_utils, ragged, broadcast, '
        'remap_planner, async_persist,<br/>'
        "torch DCP's: state_dict_saver, state_dict_loader, filesystem, format_utils, optimizer, planner_helpers,<br/>"
        'utils, staging, stateful, state_dict, logger, logging_handlers, hf_storage, resharding,<br/>'
        '_consolidate_hf_safetensors"]',
    ]
    for i, layer in reversed(list(enumerate(LAYERS))):
        lines.append(f'  subgraph L{i}["layer {i}"]')
        lines += [f"    {sub}" for sub in layer]
        lines.append("  end")
    lines.append("  faces --> " + " & ".join(sorted(LAYERS[-1])))
    lines += [f"  {a} --> {b}" for a, b in edges]
    lines += ["```", "", "| layer | subpackage | what it owns | modules, bottom first |", "|---|---|---|---|"]
    for i, layer in reversed(list(enumerate(LAYERS))):
        for sub, order in layer.items():
            listed = ", ".join(m for m in order if f"{INTERNAL}.{sub}.{m}" in mods)
            lines.append(f"| {i} | `_src/{sub}/` | {_summary(mods.get(INTERNAL + '.' + sub))} | {listed} |")
    return "\n".join(lines) + "\n"


def _summary(path: Path | None) -> str:
    """The first paragraph of a module's docstring, on one line (sizes stay out: the picture
    changes when the layers do, not with every edit)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) if path else None
    return " ".join((doc or "").split("\n\n")[0].split()).replace("|", "\\|")


def sizes() -> list[tuple[str, int]]:
    """(module, lines) for every module of the package, largest first."""
    return sorted(((m, len(p.read_text().splitlines())) for m, p in modules().items()), key=lambda x: -x[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check the package's layering; draw docs/layers.md.")
    ap.add_argument("--write", action="store_true", help="regenerate docs/layers.md")
    ap.add_argument("--sizes", action="store_true", help="print every module's line count, largest first")
    args = ap.parse_args(argv)
    if args.sizes:
        print("\n".join(f"{n:6d}  {m or '__init__'}" for m, n in sizes()))
    if args.write:
        PICTURE.write_text(picture())
    problems = violations()
    print("\n".join(problems) if problems else "layered: no circles, every import points down")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
