"""Every public name of ``torch.distributed.checkpoint`` 2.13 exists in ours, with a call signature
that accepts every call torch's accepts.

The names are read from torch itself (each module's ``__all__``, or its public names where
``__all__`` is absent or empty), so a torch upgrade that adds a name fails here until we have
it. Names other helpers are building are listed in :data:`BUILT_ELSEWHERE` and skipped while
they are missing, so the merge turns them on.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed.checkpoint as tdcp

PKG = "hyper_parallel.core.distributed_checkpoint"
TORCH = "torch.distributed.checkpoint"

# torch's public submodules (read from its package directory, so the list does not depend on
# which ones happen to be imported); each has a module of the same name in ours, holding its
# public names. COMMON are the ones users import from, which must be among them.
TORCH_SUBMODULES = sorted(m.name for m in pkgutil.iter_modules(tdcp.__path__) if not m.name.startswith("_"))
COMMON = [
    "staging", "stateful", "state_dict_saver", "state_dict_loader", "filesystem", "default_planner", "format_utils",
    "utils", "planner", "planner_helpers", "metadata", "storage", "optimizer", "state_dict", "logger",
    "logging_handlers", "hf_storage", "quantized_hf_storage", "api",
]

# (module, name) -> who builds it; skipped (not failed) while missing, so the merger turns it on.
BUILT_ELSEWHERE = {
}

# Where our object deliberately differs from torch's in its constructor or signature, and why
# (by name: the package exports the same objects as its faces). Each entry must still differ
# (a stale entry fails), so the list stays the truth.
DELIBERATE = {
    "Metadata": "one class for torch's and HyperParallel's record: version defaults to HyperParallel's '2.0' "
                "(format/records.py); torch's writer stamps its own",
    "MetadataIndex": "one class for both: offset defaults to HyperParallel's (), which equals and hashes like "
                     "torch's None (format/records.py)",
    "WriteResult": "our write results name files and chunk records, not torch's storage_data",
    "AsyncSaveResponse": "returned by async_save, never built by callers; "
                         "result()/done() wait for the commit",
}


def _torch_public(mod: types.ModuleType) -> list[str]:
    """torch's ``__all__``, or, where it is absent or empty, the names the module itself defines
    (not its imported modules, classes and functions); for the package, whose names are all
    re-exports, every public name but its submodules."""
    names = list(getattr(mod, "__all__", None) or [])
    if names:
        return sorted(names)
    out = []
    for name, obj in vars(mod).items():
        if name.startswith("_") or isinstance(obj, types.ModuleType):
            continue
        if mod is tdcp:
            pass
        elif (inspect.isclass(obj) or callable(obj)) and getattr(obj, "__module__", None) != mod.__name__:
            continue  # imported: typing.Any, uuid4, a class of another torch module, ...
        out.append(name)
    return sorted(out)


def _expected(module: str) -> list[tuple[str, str]]:
    mod = importlib.import_module(f"{TORCH}.{module}" if module else TORCH)
    return [(module, n) for n in _torch_public(mod) if not isinstance(getattr(mod, n), types.ModuleType)]


PACKAGE_NAMES = _expected("")
SUB_NAMES = [pair for m in TORCH_SUBMODULES for pair in _expected(m)]


def _ours(module: str, name: str):
    """Our object for torch's ``module.name``: skip while another helper builds it, fail if missing."""
    elsewhere = BUILT_ELSEWHERE.get((module, name)) or BUILT_ELSEWHERE.get((module, "*"))
    try:
        mod = importlib.import_module(f"{PKG}.{module}" if module else PKG)
    except ModuleNotFoundError:
        if elsewhere:
            pytest.skip(f"{module or PKG} is built by {elsewhere}")
        raise
    if not hasattr(mod, name):
        if elsewhere:
            pytest.skip(f"{module}.{name} is built by {elsewhere}")
        pytest.fail(f"torch.distributed.checkpoint{'.' + module if module else ''}.{name} has no counterpart in "
                    f"{mod.__name__}")
    return getattr(mod, name)


def test_the_name_lists_are_read_from_torch_and_not_empty():
    assert torch.__version__.startswith("2.13"), torch.__version__
    assert {"save", "load", "async_save", "CheckpointException", "load_sharded_optimizer_state_dict",
            "DefaultSavePlanner"} <= {n for _, n in PACKAGE_NAMES}
    assert set(COMMON) <= set(TORCH_SUBMODULES)
    assert ("format_utils", "dcp_to_torch_save") in SUB_NAMES and ("logger", "DCP_LOGGER_NAME") in SUB_NAMES
    assert ("logger", "functools") not in SUB_NAMES and ("logger", "Any") not in SUB_NAMES
    assert len(SUB_NAMES) > 70


@pytest.mark.parametrize("name", TORCH_SUBMODULES)
def test_every_submodule_of_torch_has_a_module_of_ours_of_that_name(name):
    try:
        importlib.import_module(f"{PKG}.{name}")
    except ModuleNotFoundError:
        if (name, "*") in BUILT_ELSEWHERE:
            pytest.skip(f"{name} is built by {BUILT_ELSEWHERE[name, '*']}")
        pytest.fail(f"torch.distributed.checkpoint.{name} has no counterpart {PKG}.{name}")


@pytest.mark.parametrize("module,name", PACKAGE_NAMES, ids=[n for _, n in PACKAGE_NAMES])
def test_every_package_name_of_torch_is_ours(module, name):
    _ours(module, name)


@pytest.mark.parametrize("module,name", SUB_NAMES, ids=[f"{m}.{n}" for m, n in SUB_NAMES])
def test_every_submodule_name_of_torch_is_in_our_face_of_that_name(module, name):
    _ours(module, name)


# ---------------------------------------------------------------- signatures


def _signature(obj) -> inspect.Signature | None:
    target = obj.__init__ if inspect.isclass(obj) else obj
    if inspect.isclass(obj) and target is object.__init__:
        return None
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if inspect.isclass(obj) and params and params[0].name == "self":
        params = params[1:]
    return sig.replace(parameters=params)


_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
_KEYWORD = (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)
_LITERALS = (type(None), bool, int, float, str)


def signature_problems(ours, theirs) -> list[str]:
    """Why a call valid for ``theirs`` might not be for ``ours`` (empty: every call carries over).

    Torch's public parameters (its ``_private`` ones are not an API) must be ours too, by the same
    name: positional ones (up to torch's first private one) in the same order and still
    positional, keyword ones still keywords; a
    torch default must be a default of ours (equal, where it is a plain literal). Ours may take
    more, as long as each has a default (or is ``*args``/``**kwargs``).
    """
    s_ours, s_theirs = _signature(ours), _signature(theirs)
    if s_theirs is None:
        return []
    if s_ours is None:
        return [f"ours has no inspectable signature; torch's is {s_theirs}"]
    mine = list(s_ours.parameters.values())
    by_name = {p.name: p for p in mine}
    problems = []
    t_pos = []  # torch's positional parameters up to its first private one (nobody passes those positionally)
    for p in s_theirs.parameters.values():
        if p.kind not in _POSITIONAL or p.name.startswith("_"):
            break
        t_pos.append(p)
    o_pos = [p for p in mine if p.kind in _POSITIONAL]
    for i, p in enumerate(t_pos):
        if i >= len(o_pos) or o_pos[i].name != p.name:
            problems.append(f"positional parameter {i} is {p.name!r} in torch, "
                            f"{o_pos[i].name if i < len(o_pos) else None!r} in ours")
    for p in s_theirs.parameters.values():
        if p.name.startswith("_") or p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
            continue
        q = by_name.get(p.name)
        if q is None:
            problems.append(f"no parameter {p.name!r}")
            continue
        if p.kind in _KEYWORD and q.kind not in _KEYWORD:
            problems.append(f"{p.name!r} is a keyword in torch, {q.kind.description} in ours")
        if p.default is not _P.empty:
            if q.default is _P.empty:
                problems.append(f"{p.name!r} has a default in torch ({p.default!r}), none in ours")
            elif isinstance(p.default, _LITERALS) and (type(q.default), q.default) != (type(p.default), p.default):
                problems.append(f"{p.name!r} defaults to {p.default!r} in torch, {q.default!r} in ours")
    named = set(s_theirs.parameters)
    for q in mine:
        if q.name not in named and q.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD) and q.default is _P.empty:
            problems.append(f"ours requires {q.name!r}, which torch does not have")
    return problems


def _callables(pairs):
    out = []
    for module, name in pairs:
        mod = importlib.import_module(f"{TORCH}.{module}" if module else TORCH)
        obj = getattr(mod, name)
        if isinstance(obj, types.ModuleType) or not callable(obj):
            continue
        if inspect.isclass(obj) and issubclass(obj, (enum.Enum, BaseException)):
            continue  # enums are plain data; exceptions are checked by what catches them
        out.append((module, name))
    return out


SIGNED = sorted(set(_callables(PACKAGE_NAMES + SUB_NAMES)))


@pytest.mark.parametrize("module,name", SIGNED, ids=[f"{m}.{n}" if m else n for m, n in SIGNED])
def test_every_torch_call_signature_is_accepted_by_ours(module, name):
    theirs = getattr(importlib.import_module(f"{TORCH}.{module}" if module else TORCH), name)
    ours = _ours(module, name)
    if ours is theirs:
        return  # torch's own object, re-exported (plain data, config or protocol)
    problems = signature_problems(ours, theirs)
    why = DELIBERATE.get(name)
    if why:
        assert problems, f"{module}.{name} is listed as deliberately different ({why}) but now matches torch"
        return
    assert problems == [], f"{module or PKG}.{name}: {problems}"


def test_the_signature_rule_catches_a_renamed_a_missing_and_a_required_parameter():
    def torch_style(state_dict, *, checkpoint_id=None, no_dist=False):
        pass

    def renamed(state_dict, *, path=None, no_dist=False):
        pass

    def required_extra(state_dict, *, checkpoint_id=None, no_dist=False, mesh):
        pass

    def other_default(state_dict, *, checkpoint_id=None, no_dist=True):
        pass

    def more_options(state_dict=None, path=None, *, checkpoint_id=None, no_dist=False, timeout=None, **kw):
        pass

    assert signature_problems(renamed, torch_style) == ["no parameter 'checkpoint_id'"]
    assert signature_problems(required_extra, torch_style) == ["ours requires 'mesh', which torch does not have"]
    assert signature_problems(other_default, torch_style) == ["'no_dist' defaults to False in torch, True in ours"]
    assert signature_problems(more_options, torch_style) == []
    assert signature_problems(torch_style, more_options)  # fewer options is a problem the other way round


def test_torch_submodules_are_attributes_after_a_plain_import() -> None:
    """`import torch.distributed.checkpoint as dcp` makes `dcp.staging`, `dcp.state_dict_saver`...
    attributes; the same must hold for ours after one plain import (a fresh interpreter, so no
    other test's imports help)."""
    code = (
        "import pkgutil, torch.distributed.checkpoint as t\n"
        "import hyper_parallel.core.distributed_checkpoint as o\n"
        "subs = [m.name for m in pkgutil.iter_modules(t.__path__) if not m.name.startswith('_')]\n"
        "print(sorted(s for s in subs if hasattr(t, s) and not hasattr(o, s)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", f"torch's submodules missing as attributes of ours: {out.stdout}"
