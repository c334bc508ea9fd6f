"""The shape of ``hyper_parallel.core.distributed_checkpoint``, measured, as a short Markdown report.

A refactor of the package's layout is shown by before/after figures: what stands in the top
folder, how many names the package exports, the longest parameter lists and functions, how
many duplicated runs of lines ``duplicates`` finds, each subpackage's size, and whether the
package's tests sit flat in one folder or mirror the subpackages. The same script run on two
checkouts gives the two columns to compare.

Only the standard library reads the files (``ast`` for the code); the package is never
imported, so an old snapshot or a half-moved tree measures as well as a working one.
Subpackages are found by their ``__init__.py`` at any depth and named by their path relative
to the package, so a tree that moved its internals under ``_src/`` (or nested
``interop/torch/``) reports under the new paths without a change here.

    python scripts/house_report.py                      # this checkout
    python scripts/house_report.py --root /tmp/before   # another checkout (an export of a commit)
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PKG_PARTS = ("hyper_parallel", "core", "distributed_checkpoint")
TESTS_PARTS = ("tests", "core", "distributed_checkpoint")
TOP_N = 5
DUPLICATES_SECONDS = 120


@dataclass(frozen=True)
class Function:
    """One ``def`` of the package: where it is and the two sizes the report ranks."""

    where: str  # module:qualname
    params: int
    lines: int


def module_name(path: Path, pkg_dir: Path) -> str:
    """The module's dotted path relative to the package (``engine.checkpoint``, ``__init__``)."""
    return ".".join(path.relative_to(pkg_dir).with_suffix("").parts)


def source_files(pkg_dir: Path) -> list[Path]:
    """Every ``.py`` file below the package, ``__pycache__`` left out, in a stable order."""
    return sorted(p for p in pkg_dir.rglob("*.py") if "__pycache__" not in p.relative_to(pkg_dir).parts)


def param_count(args: ast.arguments, in_class: bool) -> int:
    """Every parameter: positional-only, ordinary, ``*args``, keyword-only, ``**kwargs``.

    A method's ``self`` or ``cls`` (its first positional parameter under that name) is not
    counted: it is not something a caller passes.
    """
    positional = [a.arg for a in args.posonlyargs + args.args]
    count = len(positional) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)
    if in_class and positional and positional[0] in ("self", "cls"):
        count -= 1
    return count


def functions(tree: ast.Module, module: str) -> list[Function]:
    """Every function and method of one module, nested ones included, named by their qualname."""
    found: list[Function] = []

    def walk(node: ast.AST, prefix: str, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                qualname = prefix + child.name
                lines = child.end_lineno - child.lineno + 1
                found.append(Function(f"{module}:{qualname}", param_count(child.args, in_class), lines))
                walk(child, qualname + ".<locals>.", False)
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".", True)
            else:
                walk(child, prefix, in_class)

    walk(tree, "", False)
    return found


def all_names(init: Path) -> str:
    """The number of names in ``__all__`` of ``init``, read from its literal assignments.

    ``__all__ = [...]``, ``__all__ += [...]`` and ``__all__.extend([...])`` at module level are
    followed; anything else (a computed ``__all__``) is reported as such rather than guessed.
    """
    if not init.is_file():
        return f"no `{init.name}`"
    names: list[str] | None = None
    for node in ast.parse(init.read_text(encoding="utf-8"), str(init)).body:
        value = None
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            names, value = [], node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "__all__":
            names, value = [], node.value
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == "__all__":
            value = node.value
        elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "extend"
              and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "__all__"
              and len(node.value.args) == 1):
            value = node.value.args[0]
        else:
            continue
        try:
            literal = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError):
            return "`__all__` is computed, not a literal list of names"
        if names is None or not isinstance(literal, list | tuple):
            return "`__all__` is computed, not a literal list of names"
        names.extend(literal)
    if names is None:
        return "no `__all__`"
    distinct = len(set(names))
    extra = f" ({len(names) - distinct} listed twice)" if distinct != len(names) else ""
    return f"{distinct} names{extra}"


def duplicates_line(pkg_dir: Path) -> str:
    """The first line of ``duplicates --repo <package>``: how many pairs of repeated runs it found.

    The tool is not part of the project (CI does not have it); without it the report says so
    instead of failing. Any ``incomplete:`` line it prints is kept, since it qualifies the count.
    """
    tool = shutil.which("duplicates")
    if tool is None:
        return "duplicates: tool not available"
    cmd = [tool, "--repo", str(pkg_dir), "--seconds", str(DUPLICATES_SECONDS)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=DUPLICATES_SECONDS + 60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"duplicates: tool failed ({exc})"
    lines = run.stdout.splitlines()
    if not lines:
        return f"duplicates: no output (exit {run.returncode}): {run.stderr.strip()[:200]}"
    incomplete = [line for line in lines[1:] if line.startswith("incomplete:")]
    return "duplicates: " + "; ".join([lines[0], *incomplete])


def owner(path: Path, pkg_dir: Path) -> Path:
    """The folder whose size a module counts toward: the nearest one with an ``__init__.py``."""
    folder = path.parent
    while folder != pkg_dir and not (folder / "__init__.py").is_file():
        folder = folder.parent
    return folder


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8", errors="replace").splitlines())


def subpackage_rows(files: list[Path], pkg_dir: Path) -> list[str]:
    """One table row per subpackage (and one for the package's own top-level modules).

    A module counts toward the nearest folder above it with an ``__init__.py``, so a nested
    subpackage's modules are not counted again in its parent.
    """
    groups: dict[Path, list[tuple[int, Path]]] = {}
    for folder in sorted({p.parent for p in files if p.name == "__init__.py"}):
        groups[folder] = []
    for path in files:
        groups.setdefault(owner(path, pkg_dir), []).append((line_count(path), path))
    rows = []
    for folder in sorted(groups, key=lambda f: f.relative_to(pkg_dir).parts):
        members = groups[folder]
        name = "`.` (top level)" if folder == pkg_dir else f"`{folder.relative_to(pkg_dir).as_posix()}`"
        if members:
            lines, biggest = max(members, key=lambda m: m[0])
            largest = f"`{biggest.relative_to(folder).as_posix()}` ({lines})"
        else:
            largest = "-"
        rows.append(f"| {name} | {len(members)} | {sum(m[0] for m in members)} | {largest} |")
    return rows


def test_layout(root: Path) -> str:
    """How many ``test_*.py`` files sit directly in the package's test folder, and how many below it."""
    tests_dir = root.joinpath(*TESTS_PARTS)
    if not tests_dir.is_dir():
        return f"no `{'/'.join(TESTS_PARTS)}/` folder"
    found = [p for p in tests_dir.rglob("test_*.py") if "__pycache__" not in p.parts]
    flat = sum(1 for p in found if p.parent == tests_dir)
    return f"{flat} flat in `{'/'.join(TESTS_PARTS)}/`, {len(found) - flat} in subfolders"


def report(root: Path) -> str:
    """The whole Markdown report for the checkout at ``root``."""
    pkg_dir = root.joinpath(*PKG_PARTS)
    rel = "/".join(PKG_PARTS)
    if not pkg_dir.is_dir():
        raise SystemExit(f"house_report: no package folder {pkg_dir} (expected {rel}/ under --root {root})")
    out = [f"# House report: `{rel}/`", "", f"Root: `{root}`", ""]

    entries = sorted(p for p in pkg_dir.iterdir() if p.name != "__pycache__")
    folders = [p.name + "/" for p in entries if p.is_dir()]
    plain = [p.name for p in entries if not p.is_dir()]
    out += ["## Top folder", "", f"folders: {len(folders)}, files: {len(plain)} (`__pycache__` left out)", ""]
    out.append("- folders: " + (", ".join(f"`{n}`" for n in folders) or "none"))
    out.append("- files: " + (", ".join(f"`{n}`" for n in plain) or "none"))
    out.append("")

    out += ["## Public names", "", f"`__all__` in `__init__.py`: {all_names(pkg_dir / '__init__.py')}", ""]

    files = source_files(pkg_dir)
    funcs: list[Function] = []
    unparsed: list[str] = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        except (SyntaxError, UnicodeDecodeError) as exc:
            unparsed.append(f"`{path.relative_to(pkg_dir).as_posix()}` ({type(exc).__name__})")
            continue
        funcs += functions(tree, module_name(path, pkg_dir))

    for title, unit, key in (("Longest parameter lists", "parameters", "params"),
                             ("Longest functions", "lines", "lines")):
        ranked = sorted(funcs, key=lambda f, k=key: (-getattr(f, k), f.where))[:TOP_N]
        out += [f"## {title}", "", f"| {unit} | function |", "|---:|---|"]
        out += [f"| {getattr(f, key)} | `{f.where}` |" for f in ranked]
        out.append("")
    if unparsed:
        out += ["Not parsed (left out of the rankings): " + ", ".join(unparsed), ""]

    out += ["## Duplicates", "", f"`duplicates --repo {rel} --seconds {DUPLICATES_SECONDS}`:", "",
            duplicates_line(pkg_dir), ""]

    out += ["## Subpackages", "",
            "A module counts toward the nearest folder above it with an `__init__.py`.", "",
            "| subpackage | modules | lines | largest module (lines) |", "|---|---:|---:|---|"]
    out += subpackage_rows(files, pkg_dir)
    out.append("")

    out += ["## Tests", "", f"`test_*.py`: {test_layout(root)}", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="a checkout root holding hyper_parallel/ and tests/ (default: this repository)")
    args = parser.parse_args(argv)
    sys.stdout.write(report(args.root.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
