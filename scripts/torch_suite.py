#!/usr/bin/env python
"""Measure PyTorch's own DCP tests against hyper_parallel with the import swapped.

Why: "swap the import and your code keeps working" is a claim best checked with the tests torch
wrote for its own module. Given a directory holding a copy of torch's
``test/distributed/checkpoint/`` (the user brings it: torch's test sources are not in the wheel,
and this script fetches nothing), it builds two trees:

* stock: the files as given;
* swapped: every ``torch.distributed.checkpoint`` and ``torch.distributed.checkpoint.<public
  submodule>`` (imports, ``import ... as dcp``, attribute uses, strings such as ``mock.patch``
  targets) rewritten to ``hyper_parallel.core.distributed_checkpoint[.<submodule>]``. Private
  submodules (``._traverse``, ``._extension``, ...) stay torch's; private *names* imported from
  public submodules move with their module. Nothing else changes.

It runs each file under pytest in both trees, one file at a time with a timeout, and counts only
the tests that pass on stock torch: a test that skips or fails on stock (CUDA-only, a feature newer
than the installed torch) drops out. A file that fails at import in the swapped tree counts all of
its stock-passing tests as failed. The per-file table gives tests collected, stock passes, our
passes among those, and our failures, then the totals and the ratio.

Opt-in and slow (multi-process tests spawn gloo ranks); run it by hand::

    nice -n 10 .venv/bin/python scripts/torch_suite.py /path/to/torch/test/distributed/checkpoint \\
        --json results.json [--only test_planner.py] [--timeout 300]

The package measured is whichever ``hyper_parallel`` the interpreter imports; to measure one commit
while the checkout keeps changing, export it and put it first on the path:
``git archive HEAD hyper_parallel | tar -x -C /tmp/pkg && PYTHONPATH=/tmp/pkg python scripts/torch_suite.py ...``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pkgutil
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

TORCH_DCP = "torch.distributed.checkpoint"
OURS = "hyper_parallel.core.distributed_checkpoint"

# Torch's private submodules of torch.distributed.checkpoint; read from the installed torch when it
# can be imported, this list otherwise (torch 2.13).
_FALLBACK_PRIVATE = frozenset({
    "_async_executor", "_async_process_executor", "_async_thread_executor", "_checkpointer",
    "_consolidate_hf_safetensors", "_dedup_save_plans", "_dedup_tensors", "_experimental",
    "_extension", "_fsspec_filesystem", "_hf_utils", "_nested_dict", "_pg_transport",
    "_sharded_tensor_utils", "_state_dict_stager", "_storage_utils", "_traverse", "_version",
})


def private_submodules() -> frozenset[str]:
    """Names of torch.distributed.checkpoint's private submodules (``_x``), which the swap leaves."""
    try:
        import importlib.util

        spec = importlib.util.find_spec(TORCH_DCP)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return _FALLBACK_PRIVATE
    found = {m.name for m in pkgutil.iter_modules(spec.submodule_search_locations) if m.name.startswith("_")}
    return frozenset(found) | _FALLBACK_PRIVATE


# `torch.distributed.checkpoint` not preceded by a name character or a dot (so `xtorch...` and
# `foo.torch...` stay), not followed by a name character (so `checkpoint_utils` stays), and
# optionally followed by `.name` which decides whether the swap applies.
_DOTTED = re.compile(r"(?<![\w.])torch\.distributed\.checkpoint(?!\w)(?P<next>\.\w+)?")
# `from torch.distributed import checkpoint [as x]` (the only other spelling that binds the package).
_FROM_DIST = re.compile(r"^(?P<indent>[ \t]*)from[ \t]+torch\.distributed[ \t]+import[ \t]+checkpoint\b"
                        r"(?P<alias>[ \t]+as[ \t]+\w+)?[ \t]*$", re.M)


def swap_source(text: str, private: Iterable[str] | None = None) -> tuple[str, int]:
    """The swapped text of one test file and how many references were rewritten.

    Every ``torch.distributed.checkpoint`` whose next component is not one of torch's private
    submodules becomes ``hyper_parallel.core.distributed_checkpoint`` (the next component, a public
    submodule or an attribute, is kept as written). This covers ``import x``, ``import x as y``,
    ``from x[.sub] import ...`` (private names included), attribute uses in code and dotted paths
    inside strings (``mock.patch("torch.distributed.checkpoint.filesystem.os.fsync")``).
    """
    private = frozenset(private_submodules() if private is None else private)
    count = 0

    def repl(m: re.Match[str]) -> str:
        nonlocal count
        nxt = m.group("next") or ""
        if nxt and nxt[1:] in private:
            return m.group(0)
        count += 1
        return OURS + nxt

    out = _DOTTED.sub(repl, text)

    def repl_from(m: re.Match[str]) -> str:
        nonlocal count
        count += 1
        alias = m.group("alias") or " as checkpoint"
        return f"{m.group('indent')}from hyper_parallel.core import distributed_checkpoint{alias}"

    out = _FROM_DIST.sub(repl_from, out)
    return out, count


# ---------------------------------------------------------------------------------------------
# Running pytest on one file and reading back per-test outcomes.
# ---------------------------------------------------------------------------------------------

# A pytest plugin written next to the trees: it appends one JSON line per test outcome as the run
# goes, so a file killed by its timeout still reports the tests that finished.
_PLUGIN = '''
import json, os

_OUT = os.environ["TORCH_SUITE_REPORT"]


def _write(rec):
    with open(_OUT, "a") as f:
        f.write(json.dumps(rec) + "\\n")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        outcome = report.outcome
        if report.when != "call" and outcome == "failed":
            outcome = "error"
        text = "" if outcome in ("passed", "skipped") else str(report.longrepr)[-20000:]
        if outcome == "skipped" and isinstance(report.longrepr, tuple):
            text = str(report.longrepr[2])[:300]
        _write({"nodeid": report.nodeid, "when": report.when, "outcome": outcome, "text": text})


def pytest_collectreport(report):
    if report.failed:
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": "collect_error",
                "text": str(report.longrepr)[-20000:]})


def pytest_collection_finish(session):
    _write({"nodeid": "", "when": "collected", "outcome": "collected",
            "text": json.dumps([i.nodeid for i in session.items])})
'''


@dataclass
class FileRun:
    """Outcome of one pytest run of one file in one tree."""

    collected: list[str] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    collect_error: str = ""
    timed_out: bool = False
    seconds: float = 0.0
    returncode: int | None = None
    tail: str = ""


def run_file(tree: Path, rel: str, python: str, timeout: float, env: dict[str, str]) -> FileRun:
    """Run ``pytest rel`` inside ``tree`` with a timeout (the whole process group is killed)."""
    report = tree / f".report-{os.getpid()}.jsonl"
    report.unlink(missing_ok=True)
    run_env = dict(env, TORCH_SUITE_REPORT=str(report),
                   PYTHONPATH=os.pathsep.join([str(tree.parent)] + [p for p in [env.get("PYTHONPATH")] if p]))
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_torch_suite_plugin",
           "--rootdir", str(tree), "-o", "addopts=", rel]
    started = time.monotonic()
    res = FileRun()
    proc = subprocess.Popen(cmd, cwd=tree, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        res.timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    res.seconds = time.monotonic() - started
    res.returncode = proc.returncode
    res.tail = out.decode(errors="replace")[-3000:]
    if report.exists():
        for line in report.read_text().splitlines():
            rec = json.loads(line)
            if rec["outcome"] == "collected":
                res.collected = json.loads(rec["text"])
            elif rec["outcome"] == "collect_error":
                res.collect_error = rec["text"]
            else:
                prev = res.outcomes.get(rec["nodeid"])
                # A teardown error turns a pass into a failure; keep the worst outcome.
                if prev in (None, "passed") or rec["outcome"] in ("failed", "error"):
                    res.outcomes[rec["nodeid"]] = rec["outcome"]
                    if rec["text"]:
                        res.texts[rec["nodeid"]] = rec["text"]
        report.unlink()
    if not res.collected and not res.collect_error and res.returncode not in (0, 5):
        res.collect_error = res.tail  # pytest died before collecting (e.g. sys.exit at import)
    return res


_EXC_LINE = re.compile(r"^(?:E\s+)?(?:[\w.]+\.)?(?P<name>[A-Z]\w*(?:Error|Exception|Failure|Exit|Interrupt)|"
                       r"AssertionError|StopIteration|Failed)(?::\s*(?P<msg>.*))?$")


def first_error(text: str) -> str:
    """The line naming the exception of a failed test (``Type: message``), for grouping.

    Multi-process tests report the child's traceback inside the parent's failure; the innermost
    ``Type: message`` line that is not the harness's own wrapper is the useful one.
    """
    lines = [ln.strip() for ln in text.splitlines()]

    def exception_lines(candidates: list[str]) -> list[str]:
        out = []
        for ln in candidates:
            bare = ln[1:].strip() if ln.startswith("E ") else ln
            if _EXC_LINE.match(bare) and "exited with error code" not in bare \
                    and not bare.startswith("RuntimeError: Process "):
                out.append(bare)
        return out

    # pytest's own "E   Type: message" lines first (the source it quotes can hold look-alike text)
    for ln in exception_lines([ln for ln in lines if ln.startswith("E ")]) + exception_lines(lines):
        return ln[:300]
    found = [ln for ln in lines if _EXC_LINE.match(ln[1:].strip() if ln.startswith("E ") else ln)]
    if found:
        return found[0][:300]
    for ln in reversed(lines):
        if ln.startswith("E "):
            return ln[1:].strip()[:300]
    return (lines[-1] if lines else "")[:300]


# ---------------------------------------------------------------------------------------------
# The measurement.
# ---------------------------------------------------------------------------------------------


@dataclass
class FileResult:
    """One file: both runs reduced to the counted numbers and our failures."""

    file: str
    rewrites: int
    collected: int
    stock_pass: int
    ours_pass: int
    stock_note: str = ""
    ours_note: str = ""
    failures: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)
    stock_seconds: float = 0.0
    ours_seconds: float = 0.0


def _note(run: FileRun) -> str:
    if run.timed_out:
        return "timeout"
    if run.collect_error:
        return "import error: " + first_error(run.collect_error)
    return ""


def discover(root: Path) -> list[str]:
    """The test files under root (``test_*.py``), relative, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("test_*.py"))


def build_trees(src: Path, work: Path, files: list[str]) -> dict[str, int]:
    """Copy src into work/stock and work/ours (swapped); return rewrites per test file."""
    private = private_submodules()
    rewrites: dict[str, int] = {}
    for name in ("stock", "ours"):
        tree = work / name
        if tree.exists():
            shutil.rmtree(tree)
        shutil.copytree(src, tree, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".report-*"))
    for py in (work / "ours").rglob("*.py"):
        text = py.read_text()
        new, n = swap_source(text, private)
        ast.parse(new, filename=str(py))  # the swap must keep every file valid Python
        py.write_text(new)
        rel = str(py.relative_to(work / "ours"))
        if rel in files:
            rewrites[rel] = n
    (work / "_torch_suite_plugin.py").write_text(_PLUGIN)
    return rewrites


def measure(src: Path, files: list[str], work: Path, python: str, timeout: float,
            stock_cache: dict[str, dict] | None = None, log=print, on_file=None) -> list[FileResult]:
    """Run every file in both trees and count (see the module docstring for the rules).

    ``on_file(results_so_far)`` is called after each file, so a long run can save as it goes.
    """
    rewrites = build_trees(src, work, files)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["CUDA_VISIBLE_DEVICES"] = ""
    results = []
    for rel in files:
        cached = (stock_cache or {}).get(rel)
        if cached is not None and cached.get("timed_out"):
            cached = None  # an incomplete stock run is run again, not reused
        if cached is not None:
            stock = FileRun(collected=cached["collected"], outcomes=cached["outcomes"],
                            collect_error=cached.get("collect_error", ""), timed_out=cached.get("timed_out", False),
                            seconds=cached.get("seconds", 0.0))
        else:
            stock = run_file(work / "stock", rel, python, timeout, env)
        passed = [t for t, o in stock.outcomes.items() if o == "passed"]
        if not passed:
            ours = FileRun()
        elif rewrites.get(rel, 0) == 0 and stock.seconds and cached is None:
            ours = stock  # the swap changed nothing in this file: the same text gives the same run
        else:
            ours = run_file(work / "ours", rel, python, timeout, env)
        res = FileResult(file=rel, rewrites=rewrites.get(rel, 0), collected=len(stock.collected),
                         stock_pass=len(passed), ours_pass=0, stock_note=_note(stock), ours_note=_note(ours),
                         stock_seconds=round(stock.seconds, 1), ours_seconds=round(ours.seconds, 1))
        for t in passed:
            o = ours.outcomes.get(t)
            if o == "passed":
                res.ours_pass += 1
            elif ours.collect_error:
                res.failures[t] = "import error: " + first_error(ours.collect_error)
            elif o is None:
                res.failures[t] = "timeout" if ours.timed_out else "not run"
            else:
                res.failures[t] = f"{o}: " + first_error(ours.texts.get(t, ""))
                res.details[t] = ours.texts.get(t, "")[-3000:]
        res.__dict__["_stock_raw"] = {"collected": stock.collected, "outcomes": stock.outcomes,
                                      "collect_error": stock.collect_error, "timed_out": stock.timed_out,
                                      "seconds": stock.seconds}
        results.append(res)
        log(f"{rel}: collected {res.collected}, stock pass {res.stock_pass}, ours pass {res.ours_pass}"
            f" ({res.stock_seconds}s / {res.ours_seconds}s) {res.stock_note} {res.ours_note}".rstrip())
        if on_file is not None:
            on_file(results)
    return results


def table(results: list[FileResult]) -> str:
    """The per-file table (markdown) with the totals and the ratio."""
    rows = ["| file | rewrites | tests | stock pass | ours pass | ours fail | note |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        note = "; ".join(x for x in (f"stock {r.stock_note}" if r.stock_note else "",
                                     f"ours {r.ours_note}" if r.ours_note else "") if x)
        rows.append(f"| {r.file} | {r.rewrites} | {r.collected} | {r.stock_pass} | {r.ours_pass} | "
                    f"{r.stock_pass - r.ours_pass} | {note[:120]} |")
    s = sum(r.stock_pass for r in results)
    o = sum(r.ours_pass for r in results)
    t = sum(r.collected for r in results)
    ratio = f"{100.0 * o / s:.1f}%" if s else "n/a"
    rows.append(f"| **total** | | {t} | {s} | {o} | {s - o} | {ratio} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite", type=Path, help="a copy of torch's test/distributed/checkpoint directory")
    p.add_argument("--only", action="append", default=[], help="run only this file (relative path; repeatable)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per file and tree (default 300)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--work", type=Path, help="where to build the stock and swapped trees (default: a temp dir)")
    p.add_argument("--reuse-stock", type=Path, help="a previous --json whose stock runs to reuse")
    p.add_argument("--python", default=sys.executable, help="interpreter with torch, pytest and hyper_parallel")
    args = p.parse_args(argv)

    src = args.suite.resolve()
    if not src.is_dir():
        p.error(f"{src} is not a directory")
    files = discover(src)
    if args.only:
        wanted = [f.removeprefix("./") for f in args.only]
        missing = [f for f in wanted if f not in files]
        if missing:
            p.error(f"not test files under {src}: {', '.join(missing)}")
        files = wanted
    stock_cache = None
    if args.reuse_stock:
        prev = json.loads(args.reuse_stock.read_text())
        stock_cache = {r["file"]: r["stock_raw"] for r in prev["files"] if "stock_raw" in r}
    work = args.work or Path(tempfile.mkdtemp(prefix="torch_suite-"))
    work.mkdir(parents=True, exist_ok=True)

    def save(results: list[FileResult]) -> None:
        if not args.json:
            return
        payload = {"suite": str(src), "timeout": args.timeout, "files": []}
        for r in results:
            d = asdict(r)
            d["stock_raw"] = r.__dict__["_stock_raw"]
            payload["files"].append(d)
        s = sum(r.stock_pass for r in results)
        o = sum(r.ours_pass for r in results)
        payload["totals"] = {"stock_pass": s, "ours_pass": o, "ratio": (o / s) if s else None}
        args.json.write_text(json.dumps(payload, indent=1))

    results = measure(src, files, work, args.python, args.timeout, stock_cache, on_file=save)
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
