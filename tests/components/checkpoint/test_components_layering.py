"""``hyper_parallel.components`` sits outside the distributed checkpoint package: it imports only
that package's public faces (its own top-level modules), and the package never imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import hyper_parallel

ROOT = Path(hyper_parallel.__file__).parent
DCP = "hyper_parallel.core.distributed_checkpoint"
DCP_DIR = ROOT / "core" / "distributed_checkpoint"


def imported(path: Path) -> list[str]:
    """Every absolute module name a file imports (relative imports resolved against its package)."""
    package = ".".join(("hyper_parallel", *path.relative_to(ROOT).with_suffix("").parts[:-1]))
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def test_components_import_only_the_checkpoint_packages_faces():
    offending = []
    for path in sorted((ROOT / "components").rglob("*.py")):
        for name in imported(path):
            if not name.startswith(DCP + "."):
                continue
            first = name[len(DCP) + 1:].split(".")[0]
            if (DCP_DIR / first).is_dir():  # a subpackage: internals, not a face
                offending.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offending, "\n".join(offending)


def test_the_checkpoint_package_never_imports_components():
    offending = [f"{path.relative_to(ROOT)} imports {name}" for path in sorted(DCP_DIR.rglob("*.py"))
                 for name in imported(path) if name.startswith("hyper_parallel.components")]
    assert not offending, "\n".join(offending)
