"""Fail when a public name of the checkpoint package has no docstring of its own.

Public names are what ``hyper_parallel.core.distributed_checkpoint.__all__`` and each face
module's ``__all__`` export (the faces are the package's top-level modules). Names that are
torch's own objects, re-exported under torch's paths, are documented by torch and skipped;
every object defined in ``hyper_parallel`` must carry a docstring, since the API reference
(docs/reference/api/) is generated from them. Also checks that the reference page lists
every face, so a new face cannot be missing from the site.

    python scripts/check_docstrings.py      # exit 1 and a list of what is missing
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "hyper_parallel.core.distributed_checkpoint"
MODULES_PAGE = ROOT / "docs" / "reference" / "api" / "modules.md"


def faces() -> list[str]:
    """The package's top-level modules (not its subpackages, not ``__main__``)."""
    pkg = importlib.import_module(PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)
                  if not m.ispkg and m.name != "__main__")


def own_doc(obj: object) -> str:
    """The docstring an object itself carries (a class's, not one inherited from a base)."""
    if inspect.isclass(obj):
        return (obj.__dict__.get("__doc__") or "").strip()
    return (getattr(obj, "__doc__", None) or "").strip()


def problems() -> list[str]:
    """Every public name defined here without a docstring, and every face the page omits."""
    out: list[str] = []
    sys.path.insert(0, str(ROOT))
    modules = [PACKAGE] + [f"{PACKAGE}.{f}" for f in faces()]
    for name in modules:
        mod = importlib.import_module(name)
        if not (mod.__doc__ or "").strip():
            out.append(f"{name}: module has no docstring")
        for attr in getattr(mod, "__all__", []):
            obj = getattr(mod, attr)
            if inspect.ismodule(obj):
                continue
            if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue  # constants and instances: documented where they are defined
            home = getattr(obj, "__module__", "") or ""
            if not home.startswith("hyper_parallel"):
                continue  # torch's own object under torch's name
            if not own_doc(obj):
                out.append(f"{name}.{attr} ({home}): no docstring")
    page = MODULES_PAGE.read_text(encoding="utf-8")
    for f in faces():
        if f"::: {PACKAGE}.{f}\n" not in page:
            out.append(f"{MODULES_PAGE.relative_to(ROOT)}: face {f} is not listed (add '::: {PACKAGE}.{f}')")
    return out


def main() -> int:
    found = problems()
    for p in found:
        print(p)
    if found:
        print(f"{len(found)} public name(s) lack documentation")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
