"""scripts/house_report.py measures a package it has never seen: a small one written here.

The report gives the before/after figures of a refactor of the DCP package's layout, so each
figure is checked against a tree whose answer is known: the top folder's listing, the size of
``__all__``, the longest parameter list and function, per-subpackage sizes (nested and
``_src``-style folders included) and the flat/nested count of test files. The script runs as
a command, as it is used, on a checkout root made in ``tmp_path``.
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "house_report.py"

MOD = textwrap.dedent('''\
    """A module with a known longest parameter list and longest function."""


    def many(a, b, /, c, *args, d, e=1, **kwargs):
        return a


    class Box:
        def method(self, x, y):
            return x

        @classmethod
        def make(cls, z):
            return cls()


    def long_one():
        x = 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        return x
    ''')


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout root with a fake DCP package (two subpackages, one nested) and its tests."""
    pkg = tmp_path / "hyper_parallel" / "core" / "distributed_checkpoint"
    write(pkg / "__init__.py", '"""Faces."""\n__all__ = ["save", "load", "Box"]\n__all__ += ["extra"]\n')
    write(pkg / "api.py", "def save(state, path):\n    return None\n")
    write(pkg / "__pycache__" / "api.cpython-311.pyc", "not code")
    write(pkg / "_src" / "__init__.py", "")
    write(pkg / "_src" / "engine" / "__init__.py", "")
    write(pkg / "_src" / "engine" / "mod.py", MOD)
    write(pkg / "_src" / "engine" / "small.py", "X = 1\n")
    write(pkg / "_src" / "engine" / "inner" / "__init__.py", "def nested(p, q, r):\n    return p\n")
    tests = tmp_path / "tests" / "core" / "distributed_checkpoint"
    write(tests / "test_a.py", "")
    write(tests / "test_b.py", "")
    write(tests / "conftest.py", "")
    write(tests / "engine" / "test_c.py", "")
    return tmp_path


def run_report(root: Path, path_env: str | None = None) -> str:
    env = dict(os.environ)
    if path_env is not None:
        env["PATH"] = path_env
    done = subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True,
                          env=env, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def table(report: str, heading: str) -> list[list[str]]:
    """The data rows of the Markdown table under ``## heading``, cells stripped."""
    section = report.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_figures_of_a_known_tree(checkout: Path, tmp_path: Path) -> None:
    empty_bin = tmp_path / "empty_bin"
    empty_bin.mkdir()
    report = run_report(checkout, path_env=str(empty_bin))

    assert "folders: 1, files: 2 (`__pycache__` left out)" in report
    assert "- folders: `_src/`" in report
    assert "- files: `__init__.py`, `api.py`" in report
    assert "`__all__` in `__init__.py`: 4 names" in report

    params = table(report, "Longest parameter lists")
    # a, b, c, *args, d, e, **kwargs; then nested's 3; the methods lose self/cls.
    assert params[0] == ["7", "`_src.engine.mod:many`"]
    assert params[1] == ["3", "`_src.engine.inner.__init__:nested`"]
    assert ["2", "`_src.engine.mod:Box.method`"] in params
    assert len(params) == 5

    longest = table(report, "Longest functions")
    assert longest[0] == ["10", "`_src.engine.mod:long_one`"]

    assert "duplicates: tool not available" in report

    subpackages = {row[0]: row[1:] for row in table(report, "Subpackages")}
    mod_lines = MOD.count("\n")
    assert subpackages == {
        "`.` (top level)": ["2", "5", "`__init__.py` (3)"],
        "`_src`": ["1", "0", "`__init__.py` (0)"],
        "`_src/engine`": ["3", str(mod_lines + 1), f"`mod.py` ({mod_lines})"],
        "`_src/engine/inner`": ["1", "2", "`__init__.py` (2)"],
    }

    assert "`test_*.py`: 2 flat in `tests/core/distributed_checkpoint/`, 1 in subfolders" in report


@pytest.mark.skipif(shutil.which("duplicates") is None, reason="the duplicates tool is not on PATH (not in CI)")
def test_duplicates_count_of_a_repeated_function(checkout: Path) -> None:
    pkg = checkout / "hyper_parallel" / "core" / "distributed_checkpoint"
    body = "".join(f"    total = total + values[{i}] * weights[{i}]\n" for i in range(8))
    for name in ("one", "two"):
        write(pkg / f"{name}.py", f"def {name}(values, weights):\n    total = 0\n{body}    return total\n")
    report = run_report(checkout)
    line = next(line for line in report.splitlines() if line.startswith("duplicates: "))
    assert line.startswith("duplicates: 1 pair"), line
