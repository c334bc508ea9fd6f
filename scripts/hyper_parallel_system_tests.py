#!/usr/bin/env python
"""Run HyperParallel's DCP system tests against this package, on CPU gloo ranks.

Why: HyperParallel's own system tests (``tests/torch/distributed_checkpoint/`` of
mindspore-ai/hyper-parallel) are what its users' code looks like; passing them unchanged is the
check that our package can stand in for theirs. Given a directory holding a HyperParallel
checkout (or only its ``tests/torch/distributed_checkpoint/`` folder and harness files; the user
brings it, this script fetches nothing), it:

1. copies the case folder into a temporary tree and applies only the NPU rewrite
   (:func:`rewrite_npu`): ``import torch_npu`` dropped, ``.npu()`` -> ``.cpu()``,
   ``device_type="npu"`` -> ``"cpu"``, ``torch.device("npu"`` -> ``torch.device("cpu"``,
   ``"hccl"`` -> ``"gloo"``. The API calls under test are never touched;
2. writes the harness the cases import: ``tests/torch/utils.py`` is our shim (device "cpu",
   ``init_dist`` starting gloo from torchrun's environment and returning ``(rank, 0)``);
   ``tests/torch/common_net.py`` is the checkout's own file (NPU-rewritten) when it has one, else
   our shim of the models the DCP cases build (``--common-net`` chooses);
3. finds every case (``test_*`` functions of the non-``test_*`` files) and the rank count its
   launcher gives it: the ``test_*.py`` launchers call ``TorchCase(file, case, [port], num_proc)``;
   launchers that hold plain test functions run as their own cases on one rank;
4. launches each case alone with ``python -m torch.distributed.run --standalone
   --nproc_per_node N -m pytest file::case``, with a timeout (the process group is killed), and
   prints a table: case, ranks, result, seconds, first error.

Opt-in and slow (8-rank cases take minutes on a small machine); run it by hand::

    nice -n 10 .venv/bin/python scripts/hyper_parallel_system_tests.py /path/to/hyper-parallel \\
        [--only dcp_pp_stage_load] [--timeout 600] [--json results.json] [--list]
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CASE_DIR = Path("tests") / "torch" / "distributed_checkpoint"
REPO_ROOT = Path(__file__).resolve().parent.parent

# --- the NPU rewrite -------------------------------------------------------------------------

_NPU_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    # import torch_npu (alone on its line, any trailing comment): replaced by `pass` so an import
    # that was the only statement of a block leaves the block valid.
    (re.compile(r"^([ \t]*)import[ \t]+torch_npu\b[^\n]*$", re.M), r"\1pass  # torch_npu import dropped"),
    (re.compile(r"^([ \t]*)from[ \t]+torch_npu\b[^\n]*$", re.M), r"\1pass  # torch_npu import dropped"),
    (re.compile(r"\.npu\(\)"), ".cpu()"),
    (re.compile(r"""\bdevice_type(\s*)=(\s*)(["'])npu\3"""), r"device_type\1=\2\3cpu\3"),
    (re.compile(r"""\btorch\.device\((\s*)(["'])npu\2"""), r"torch.device(\1\2cpu\2"),
    (re.compile(r"""(["'])hccl\1"""), r"\1gloo\1"),
)


def rewrite_npu(text: str) -> tuple[str, int]:
    """Apply the NPU rewrite to one source file; return the new text and how many edits it made.

    Only ties to Ascend devices change (see the module docstring); everything else, the calls
    under test included, stays byte for byte.
    """
    total = 0
    for pattern, repl in _NPU_REWRITES:
        text, count = pattern.subn(repl, text)
        total += count
    return text, total


# --- the harness shim ------------------------------------------------------------------------

UTILS_SHIM = '''\
"""CPU stand-in for HyperParallel's tests/torch/utils.py, written by hyper_parallel_system_tests.py.

The cases run under torchrun on gloo ranks: the device is "cpu", and process groups start from
torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).
"""
import torch
import torch.distributed as dist

_DEVICE_TYPE = "cpu"


def get_device_type() -> str:
    """The device the cases run on: always "cpu" here."""
    return _DEVICE_TYPE


def init_dist_gloo() -> int:
    """Start the default gloo process group from torchrun's environment (once); return the rank."""
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    return dist.get_rank()


def init_dist() -> tuple[int, int]:
    """Start gloo as init_dist_gloo does; return (rank, device id 0), as the cases unpack it."""
    return init_dist_gloo(), 0


def init_backend(device_type: str) -> int:
    """Start gloo whatever device_type says (there is no NPU here); return the rank."""
    del device_type
    return init_dist_gloo()


def to_device(tensor: torch.Tensor, device_type: str) -> torch.Tensor:
    """Tensors stay on the CPU."""
    del device_type
    return tensor


def torchrun_case(*args, **kwargs):
    """Launchers are read by the runner, not run: refuse, naming what to use instead."""
    raise RuntimeError("launch cases with scripts/hyper_parallel_system_tests.py, not torchrun_case")
'''

COMMON_NET_SHIM = '''\
"""CPU stand-in for the models of HyperParallel's tests/torch/common_net.py that its DCP cases build.

Written by hyper_parallel_system_tests.py when the checkout gives no common_net.py (or when asked
to). Parameter names, shapes and the order of random draws follow the cases' expectations:
``w1`` first, then ``dense_layers.layers.layer<i>.weight`` (and ``.bias``) in layer order.
"""
import torch
from torch import nn


class SimpleModel(nn.Module):
    """One (8, 8) weight of ones: relu(x @ weight), summed."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8, 8))

    def forward(self, x):
        return torch.sum(torch.relu(torch.matmul(x, self.weight)))


class DenseNet(nn.Module):
    """x @ weight (+ bias); weight from ``weight_init(in, hidden)`` or ones, bias zeros."""

    def __init__(self, in_channels, hidden_size, has_bias=True, weight_init=None):
        super().__init__()
        self.has_bias = has_bias
        make = weight_init if weight_init is not None else torch.ones
        self.weight = nn.Parameter(make(in_channels, hidden_size))
        if has_bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x):
        x = torch.matmul(x, self.weight)
        if self.has_bias:
            x = torch.add(x, self.bias)
        return x


class DenseMutiLayerNet(nn.Module):
    """``layer_num`` DenseNets in ``layers`` (named layer0, layer1, ...), output summed."""

    def __init__(self, hidden_size, layer_num, has_bias=True, dense_weight_init=None):
        super().__init__()
        self.layer_num = layer_num
        self.layers = nn.Sequential()
        for i in range(layer_num):
            self.layers.add_module(f"layer{i}", DenseNet(hidden_size, hidden_size, has_bias, dense_weight_init))

    def forward(self, x):
        for i in range(self.layer_num):
            x = self.layers[i](x)
        return torch.sum(x)


class FullyShardTestNet(nn.Module):
    """``w1`` (random) then a DenseMutiLayerNet; output summed."""

    def __init__(self, dense_hidden, dense_layer_num, has_bias=True, dense_weight_init=None):
        super().__init__()
        self.w1 = nn.Parameter(torch.rand(dense_hidden, dense_hidden))
        self.dense_layers = DenseMutiLayerNet(dense_hidden, dense_layer_num, has_bias, dense_weight_init)

    def forward(self, x):
        return torch.sum(self.dense_layers(torch.matmul(x, self.w1)))
'''


# --- finding cases and their rank counts -----------------------------------------------------

@dataclass
class Case:
    """One upstream test function and how it is launched."""

    file: str
    name: str
    ranks: int
    ranks_from: str  # "launcher", "inferred" (other cases of its file agree), "direct", "default"
    launcher: str = ""
    disabled_upstream: bool = False  # only reached by a commented-out TorchCase
    missing: bool = False  # a launcher names it, but its file is not in the case folder

    @property
    def id(self) -> str:
        return f"{self.file}::{self.name}"


@dataclass
class Launch:
    """One TorchCase(...) found in a launcher."""

    file: str
    case: str
    ranks: int
    launcher: str
    function: str
    commented: bool = False


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _constants(tree: ast.Module) -> dict[str, object]:
    """Module-level NAME = <str or int literal> assignments."""
    found: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def _value(node: ast.AST | None, consts: dict[str, object]) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    return None


def _torch_cases(call: ast.Call, consts: dict[str, object]) -> tuple[str, str, int] | None:
    """(file basename, case, ranks) of a TorchCase(file, case, master_port=None, num_proc=1) call."""
    if _call_name(call) != "TorchCase":
        return None
    args = {i: a for i, a in enumerate(call.args)}
    kwargs = {k.arg: k.value for k in call.keywords if k.arg}
    file = _value(args.get(0, kwargs.get("file_name")), consts)
    case = _value(args.get(1, kwargs.get("case_name")), consts)
    ranks = _value(args.get(3, kwargs.get("num_proc")), consts)
    if not isinstance(file, str) or not isinstance(case, str):
        return None
    return Path(file).name, case, int(ranks) if isinstance(ranks, int) else 1


def parse_launcher(path: Path) -> tuple[list[Launch], list[str]]:
    """The TorchCase calls of one ``test_*.py`` launcher, and the test functions it runs itself.

    Commented-out ``#TorchCase(...)`` lines are returned too (``commented=True``): upstream
    switched those cases off, but the line still says how many ranks the case takes. A test
    function that launches nothing (no TorchCase, parallel_run or torchrun_case) is a case of its
    own, run in place.
    """
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    consts = _constants(tree)
    source_lines = text.splitlines()
    launches: list[Launch] = []
    direct: list[str] = []
    for func in tree.body:
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        calls = [n for n in ast.walk(func) if isinstance(n, ast.Call)]
        for call in calls:
            got = _torch_cases(call, consts)
            if got:
                launches.append(Launch(*got, launcher=path.name, function=func.name))
        for line in source_lines[func.lineno - 1:func.end_lineno]:
            stripped = line.strip()
            if not (stripped.startswith("#") and "TorchCase(" in stripped):
                continue
            try:
                expr = ast.parse(stripped.lstrip("#").strip().rstrip(","), mode="eval").body
            except SyntaxError:
                continue
            got = _torch_cases(expr, consts) if isinstance(expr, ast.Call) else None
            if got:
                launches.append(Launch(*got, launcher=path.name, function=func.name, commented=True))
        launching = {"TorchCase", "parallel_run", "torchrun_case"}
        if func.name.startswith("test_") and not any(_call_name(c) in launching for c in calls):
            direct.append(func.name)
    return launches, direct


def _test_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


def _pick_ranks(launches: list[Launch]) -> Launch:
    """One launch for a case: a ``*_gloo`` launcher function (the CPU variant) first, live before commented."""
    return sorted(launches, key=lambda la: (la.commented, not la.function.endswith("_gloo")))[0]


def discover(case_dir: Path, default_ranks: int = 1) -> list[Case]:
    """Every case in ``case_dir`` with its rank count, in file then definition order.

    A case no launcher names takes the rank count the launchers give every other case of its
    file ("inferred"), else ``default_ranks``. A file a plain launcher imports by name (as
    ``test_offline_convert_st_torch.py`` imports its ``_impl``) runs through that launcher only.
    A case a launcher names whose file is not in ``case_dir`` is listed with ``missing=True``.
    """
    launches: list[Launch] = []
    cases: list[Case] = []
    direct_sources: list[str] = []
    for launcher in sorted(case_dir.glob("test_*.py")):
        found, direct = parse_launcher(launcher)
        launches += found
        if direct:
            direct_sources.append(launcher.read_text(encoding="utf-8"))
        cases += [Case(launcher.name, name, 1, "direct", launcher.name) for name in direct]
    by_case: dict[tuple[str, str], list[Launch]] = {}
    for la in launches:
        by_case.setdefault((la.file, la.case), []).append(la)
    launched_files = {la.file for la in launches}
    for path in sorted(case_dir.glob("*.py")):
        if path.name.startswith("test_") or path.name == "__init__.py":
            continue
        names = _test_functions(path)
        if not names or (path.name not in launched_files and any(path.stem in src for src in direct_sources)):
            continue
        live = [la for la in launches if la.file == path.name and not la.commented]
        counts = {la.ranks for la in live}
        for name in names:
            seen = by_case.get((path.name, name))
            if seen:
                pick = _pick_ranks(seen)
                cases.append(Case(path.name, name, pick.ranks, "launcher", pick.launcher,
                                  disabled_upstream=all(la.commented for la in seen)))
            elif len(counts) == 1:
                cases.append(Case(path.name, name, next(iter(counts)), "inferred", live[0].launcher))
            else:
                cases.append(Case(path.name, name, default_ranks, "default"))
    for (file, name), seen in by_case.items():
        if not (case_dir / file).is_file():
            pick = _pick_ranks(seen)
            cases.append(Case(file, name, pick.ranks, "launcher", pick.launcher,
                              disabled_upstream=all(la.commented for la in seen), missing=True))
    return cases


# --- building the tree -----------------------------------------------------------------------

def locate(source: Path) -> tuple[Path, Path | None]:
    """(the case folder, the checkout root if there is one) for a checkout, its tests folder or the case folder."""
    source = source.resolve()
    if (source / CASE_DIR).is_dir():
        return source / CASE_DIR, source
    if source.name == CASE_DIR.name and source.parent.name == "torch" and source.parent.parent.name == "tests":
        return source, source.parent.parent.parent
    if any(source.glob("dcp_*.py")) or any(source.glob("test_*.py")):
        return source, None
    raise SystemExit(f"{source}: no {CASE_DIR} under it, and it holds no dcp_*.py or test_*.py cases")


def build_tree(source: Path, dest: Path, common_net: str = "auto") -> dict[str, object]:
    """Copy the cases into ``dest`` (rewritten), write the harness; return what was done."""
    case_dir, root = locate(source)
    out_dir = dest / CASE_DIR
    out_dir.mkdir(parents=True)
    for pkg in (dest / "tests", dest / "tests" / "torch", out_dir):
        (pkg / "__init__.py").touch()
    edits: dict[str, int] = {}
    for path in sorted(case_dir.glob("*.py")):
        text, count = rewrite_npu(path.read_text(encoding="utf-8"))
        (out_dir / path.name).write_text(text, encoding="utf-8")
        if count:
            edits[path.name] = count
    (dest / "tests" / "torch" / "utils.py").write_text(UTILS_SHIM, encoding="utf-8")
    theirs = root / "tests" / "torch" / "common_net.py" if root else case_dir.parent / "common_net.py"
    use_theirs = common_net == "checkout" or (common_net == "auto" and theirs.is_file())
    if use_theirs:
        if not theirs.is_file():
            raise SystemExit(f"--common-net checkout: {theirs} does not exist")
        text, count = rewrite_npu(theirs.read_text(encoding="utf-8"))
        (dest / "tests" / "torch" / "common_net.py").write_text(text, encoding="utf-8")
        edits["../common_net.py"] = count
    else:
        (dest / "tests" / "torch" / "common_net.py").write_text(COMMON_NET_SHIM, encoding="utf-8")
    return {"case_dir": str(case_dir), "common_net": str(theirs) if use_theirs else "shim", "npu_edits": edits}


# --- running ---------------------------------------------------------------------------------

_PEER_NOISE = re.compile(r"Connection (closed|reset) by peer|connectFullMesh|Broken pipe|"
                         r"Socket Timeout|ProcessGroupGloo|DistBackendError|timed out", re.I)
_EXC_LINE = re.compile(r"^E\s+(\w[\w.]*(Error|Exception|Exit|Interrupt)\b.*|assert .*)$")
_OUR_FRAME = re.compile(r"(hyper_parallel/[\w/]+\.py):(\d+)")


@dataclass
class Result:
    """How one case ended."""

    case: str
    ranks: int
    ranks_from: str
    result: str  # pass, fail, skip, timeout, missing
    seconds: float
    first_error: str = ""
    where: str = ""  # the last hyper_parallel frame before the first error, if any
    log: str = ""
    disabled_upstream: bool = False
    extra: dict = field(default_factory=dict)


def first_error(output: str) -> tuple[str, str]:
    """The first root-cause error line pytest printed (peer-disconnect noise skipped), and our frame before it."""
    lines = output.splitlines()
    candidates = [(i, ln) for i, ln in enumerate(lines) if _EXC_LINE.match(ln)]
    if not candidates:
        candidates = [(i, ln) for i, ln in enumerate(lines) if ln.startswith("E ")]
    if not candidates:
        candidates = [(i, ln) for i, ln in enumerate(lines)
                      if re.search(r"\w+(Error|Exception): ", ln) and "ChildFailedError" not in ln]
    fallback = candidates[0] if candidates else None
    chosen = next(((i, ln) for i, ln in candidates if not _PEER_NOISE.search(ln)), fallback)
    if chosen is None:
        return "", ""
    index, line = chosen
    message = re.sub(r"^E\s+", "", line).strip()
    if message.startswith("assert ") and index + 1 < len(lines) and re.match(r"^E\s+\+\s+where ", lines[index + 1]):
        message += " (" + re.sub(r"^E\s+\+\s+", "", lines[index + 1]).strip() + ")"
    where = ""
    for earlier in reversed(lines[:index]):
        match = _OUR_FRAME.search(earlier)
        if match:
            where = f"{match.group(1)}:{match.group(2)}"
            break
    return message[:300], where


def run_case(case: Case, tree: Path, python: str, timeout: float, log_dir: Path) -> Result:
    """Launch one case alone under torchrun in a fresh working directory; kill its group on timeout."""
    work = tree / "work" / f"{case.file.removesuffix('.py')}__{case.name}"
    work.mkdir(parents=True, exist_ok=True)
    target = tree / CASE_DIR / case.file
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.ranks}",
           "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--rootdir", str(tree),
           f"{target}::{case.name}"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update(HYPER_PARALLEL_PLATFORM="torch", HYPER_PARALLEL_TEST_DEVICE_TYPE="cpu",
               OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    log = log_dir / f"{case.file.removesuffix('.py')}__{case.name}.log"
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = round(time.monotonic() - start, 1)
    output = log.read_text(encoding="utf-8", errors="replace")
    error, where = first_error(output)
    if rc is None:
        result = "timeout"
        error = error or f"no result within {timeout:.0f} s"
    elif rc == 0:
        passed = re.search(r"\b\d+ passed\b", output)
        result = "skip" if re.search(r"\b\d+ skipped\b", output) and not passed else "pass"
        if result == "skip":
            skip = re.search(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", output)
            error = skip.group(1).strip() if skip else "skipped"
        else:
            error, where = "", ""
    else:
        result = "fail"
        error = error or f"exit status {rc}"
    return Result(case.id, case.ranks, case.ranks_from, result, seconds, error, where, str(log),
                  case.disabled_upstream)


def _table(results: list[Result]) -> str:
    rows = ["| case | ranks | result | s | first error |", "|---|---|---|---|---|"]
    for r in results:
        ranks = f"{r.ranks}" + ("" if r.ranks_from == "launcher" else f" ({r.ranks_from})")
        note = " (off upstream)" if r.disabled_upstream else ""
        error = r.first_error.replace("|", "\\|") + (f" [{r.where}]" if r.where else "")
        rows.append(f"| {r.case}{note} | {ranks} | {r.result} | {r.seconds} | {error} |")
    counts: dict[str, int] = {}
    for r in results:
        counts[r.result] = counts.get(r.result, 0) + 1
    rows.append("")
    rows.append(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + f" (of {len(results)})")
    return "\n".join(rows)


def _selected(cases: list[Case], only: list[str]) -> list[Case]:
    if not only:
        return cases
    return [c for c in cases if any(fnmatch.fnmatch(c.id, pat) or pat in c.id for pat in only)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a HyperParallel checkout, or its tests/torch/distributed_checkpoint")
    parser.add_argument("--only", action="append", default=[], help="run cases whose file::case contains this "
                        "(or matches this glob); repeatable")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case (default 600)")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--list", action="store_true", help="list the cases and their rank counts; run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the temporary tree (logs, checkpoints)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for torchrun (default: this one)")
    parser.add_argument("--default-ranks", type=int, default=1, help="ranks for a case no launcher names")
    parser.add_argument("--common-net", choices=("auto", "checkout", "shim"), default="auto",
                        help="tests/torch/common_net.py: the checkout's (auto: when it has one) or our shim")
    args = parser.parse_args(argv)

    tree = Path(tempfile.mkdtemp(prefix="hp_system_"))
    try:
        info = build_tree(args.source, tree, args.common_net)
        cases = _selected(discover(tree / CASE_DIR, args.default_ranks), args.only)
        if args.list:
            for c in cases:
                off = ", off upstream" if c.disabled_upstream else ""
                miss = ", file missing" if c.missing else ""
                print(f"{c.id}  ranks={c.ranks} ({c.ranks_from}{', ' + c.launcher if c.launcher else ''}{off}{miss})")
            return 0
        log_dir = tree / "logs"
        log_dir.mkdir()
        results = []
        for case in cases:
            print(f"[{len(results) + 1}/{len(cases)}] {case.id} on {case.ranks} rank(s) ...", flush=True)
            if case.missing:
                res = Result(case.id, case.ranks, case.ranks_from, "missing", 0.0,
                             f"{case.launcher} names {case.file}, which is not in the case folder")
            else:
                res = run_case(case, tree, args.python, args.timeout, log_dir)
            print(f"    {res.result} in {res.seconds} s {res.first_error[:160]}", flush=True)
            results.append(res)
        print()
        print(_table(results))
        if args.json:
            args.json.write_text(json.dumps({"tree": str(tree) if args.keep else None, **info,
                                             "results": [asdict(r) for r in results]}, indent=2),
                                 encoding="utf-8")
        if args.keep:
            print(f"\ntree kept at {tree}")
        return 0 if all(r.result in ("pass", "skip") for r in results) else 1
    finally:
        if not args.keep:
            shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
