"""Hostile ``.metadata`` (re-sealed, as an attacker would) is refused by every entry point
before any allocation, read or iteration it controls: load, reshard, offline_transform and
the CLI. Each entry point runs in a fresh process with a memory limit and a deadline, so a
regression shows up as a failed test, not as a dead test runner.

The fuzz test starts from structurally valid metadata (layouts, several chunks, plain
values) and mutates one node deep inside it, so mutations reach entries, chunks and layouts
instead of dying in the JSON parser.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import make_tensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    Layout,
    load,
    offline_transform,
    save,
    verify_checkpoint,
)
from hyper_parallel.core.distributed_checkpoint._src.base.errors import MetadataError
from hyper_parallel.core.distributed_checkpoint._src.engine.streaming_writer import write_streaming
from hyper_parallel.core.distributed_checkpoint._src.format.metadata import METADATA_FILE
from hyper_parallel.core.distributed_checkpoint._src.format.sealed_json import seal_json
from hyper_parallel.core.distributed_checkpoint._src.planning.planner import EntrySpec
from hyper_parallel.core.distributed_checkpoint._src.resharding.reshard import reshard

MEMORY_LIMIT = 4 << 30  # address space of each probe process: far above what a refusal needs


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory):
    """A checkpoint whose tensors have saved layouts (TP=2) and several chunks each."""
    base = tmp_path_factory.mktemp("hostile")
    src, dst = str(base / "full"), str(base / "tp2")
    sd = {"w": make_tensor((8, 6)), "v": make_tensor((6,), seed=1), "step": 7, "name": "x"}
    save(sd, src, no_dist=True)
    tp = Layout((2,), ("tp",))
    offline_transform(src, dst, dst_layout={"w": tp("tp", "None"), "v": tp("tp")})
    return dst, sd


def tampered(src: str, dst: str, mutate) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, METADATA_FILE)
    with open(path) as f:
        doc = json.load(f)
    mutate(doc)
    with open(path, "wb") as f:
        f.write(seal_json(doc))  # a valid checksum: the attacker recomputed it
    return dst


PROBE = textwrap.dedent("""
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    from hyper_parallel.cli import main
    from hyper_parallel.core.distributed_checkpoint import export_torch_dcp, load, offline_transform
    from hyper_parallel.core.distributed_checkpoint._src.resharding.reshard import reshard
    path, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    calls = {{
        "load": lambda: load(path=path),
        "reshard": lambda: reshard(path, out + "-r", dst_mesh={{"tp": 4}}),
        "offline_transform": lambda: offline_transform(path, out + "-t", dst_layout={{"tp": 3}}),
        "export_torch_dcp": lambda: export_torch_dcp(path, out + "-e"),
        "inspect": lambda: sys.exit(main(["inspect", path])),
    }}
    for what in names:
        t0 = time.monotonic()
        try:
            calls[what]()
        except SystemExit as exc:
            print(f"{{what}} EXIT {{exc.code}}")
        except Exception as exc:
            print(f"{{what}} REFUSED {{type(exc).__name__}}: {{exc}}".replace(chr(10), " "))
        else:
            print(f"{{what}} ACCEPTED")
        print(f"{{what}} SECONDS {{time.monotonic() - t0:.2f}}", flush=True)
""")

LAYOUT_CALLS = ("load", "reshard", "offline_transform", "inspect")  # every entry point that reads a layout
DATA_CALLS = ("load", "reshard", "offline_transform", "export_torch_dcp")  # every one that reads data


def probe(path: str, out: str, names: tuple[str, ...] = LAYOUT_CALLS) -> dict[str, tuple[str, float]]:
    """The entry points ``names`` on ``path`` in one fresh, memory-limited process:
    {name: (outcome, seconds)}, and {"stderr": (its stderr, 0.0)}."""
    code = PROBE.format(limit=MEMORY_LIMIT)
    done = subprocess.run([sys.executable, "-c", code, path, out, *names], capture_output=True, text=True,
                          timeout=120)
    lines = (done.stdout + done.stderr).splitlines()
    results: dict[str, tuple[str, float]] = {}
    for what in names:
        outcome = next((ln for ln in lines if ln.startswith(f"{what} ") and " SECONDS " not in ln), "")
        seconds = next((float(ln.split()[-1]) for ln in lines if ln.startswith(f"{what} SECONDS")), None)
        assert seconds is not None, f"{what} never finished (memory limit or crash?):\n{done.stdout}{done.stderr}"
        results[what] = (outcome, seconds)
    results["stderr"] = (done.stderr, 0.0)
    return results


def _layout(doc):
    return doc["entries"]["w"]["layout"]


HOSTILE_LAYOUTS = {
    "mesh of 2**40 ranks": lambda d: _layout(d).update(mesh_shape=[1 << 40]),
    "two dims of 2**20": lambda d: _layout(d).update(mesh_shape=[1 << 20, 1 << 20],
                                                     placements=["S(0)", "R"], mesh_dim_names=["a", "b"]),
    "negative mesh size": lambda d: _layout(d).update(mesh_shape=[-2]),
    "a thousand mesh dims": lambda d: _layout(d).update(mesh_shape=[1] * 1000, placements=["R"] * 1000,
                                                        mesh_dim_names=None),
    "shard dim out of range": lambda d: _layout(d).update(placements=["S(9)"]),
    "huge strided split factor": lambda d: _layout(d).update(placements=["_S(0,99999)"]),
    "placement that is code": lambda d: _layout(d).update(placements=["__import__('os')"]),
    "names that repeat": lambda d: _layout(d).update(mesh_shape=[1, 2], placements=["R", "S(0)"],
                                                     mesh_dim_names=["tp", "tp"]),
    "layout that is a list": lambda d: d["entries"]["w"].update(layout=[2, "S(0)"]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_LAYOUTS))
def test_a_hostile_layout_is_refused_by_every_entry_point_in_seconds(laid_out, tmp_path, case):
    src, _ = laid_out
    path = tampered(src, str(tmp_path / "c"), HOSTILE_LAYOUTS[case])
    results = probe(path, str(tmp_path / "out"))
    stderr = results.pop("stderr")[0]
    for what, (outcome, seconds) in results.items():
        if what == "inspect":  # the CLI prints the error and exits 2
            assert outcome == "inspect EXIT 2" and "layout" in stderr, (outcome, stderr)
        else:
            assert "REFUSED MetadataError" in outcome and "layout" in outcome, outcome
        assert seconds < 10, f"{what} took {seconds} s"


# ---------------------------------------------------------------------------- structural fuzz


def _nodes(doc, path=()):
    """Every (path, value) of a JSON document, containers included."""
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, path + (i,))


HOSTILE_VALUES = [-1, 0, 1, 2, 7, 1 << 31, 1 << 40, 1 << 63, -(1 << 63), 2.5, 1e300, None, True, "",
                  "S(0)", "R", "_S(0,2)", "../x", "/etc/passwd", [], [1 << 40], [0, 0, 0], {}, {"$tuple": []},
                  "x" * 300]


def _set(doc, path, value):
    node = doc
    for p in path[:-1]:
        node = node[p]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value


_DELETE = object()
REACHED: dict[str, int] = {"entries": 0, "store": 0, "layout": 0, "files": 0}


@given(st.randoms(use_true_random=False))
@settings(max_examples=int(os.environ.get("HP_FUZZ", "150")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_mutated_valid_metadata_is_refused_or_loads_exactly(laid_out, tmp_path_factory, rnd: random.Random):
    src, sd = laid_out
    with open(os.path.join(src, METADATA_FILE)) as f:
        doc = json.load(f)
    nodes = [(p, v) for p, v in _nodes(doc) if p and p[0] in ("entries", "files", "dirs", "world_size", "version")]
    path, _ = rnd.choice(nodes)
    value = rnd.choice(HOSTILE_VALUES + [_DELETE])
    if value is _DELETE and isinstance(path[-1], int):
        value = rnd.choice(HOSTILE_VALUES)
    _set(doc, path, value)
    for part in REACHED:
        REACHED[part] += part in path
    dst = str(tmp_path_factory.mktemp("fuzz") / "c")
    shutil.copytree(src, dst)
    with open(os.path.join(dst, METADATA_FILE), "wb") as f:
        f.write(seal_json(doc))
    try:
        out = load(path=dst)
    except CheckpointError:
        pass  # refused with our error type (not a KeyError, TypeError, MemoryError ...)
    else:
        # Anything accepted is what was saved, except an entry the mutation rewrote itself: a
        # forged but self-consistent description (another shape, no data to check) is the
        # attacker's checkpoint, and then only has to be what its metadata says.
        for k in ("w", "v"):
            if path[:2] == ("entries", k):
                assert k not in out or isinstance(out[k], torch.Tensor), (k, path, value)
            else:
                assert torch.equal(out[k], sd[k]), (k, path, value)
        assert out.get("step") == sd["step"] or "step" in str(path)
    try:
        reshard(dst, dst + "-r", dst_mesh={"tp": 4})
    except (CheckpointError, ValueError):
        pass
    shutil.rmtree(os.path.dirname(dst))


def test_the_fuzzer_reached_entries_chunks_and_layouts():
    """Runs after the fuzz test (same module, file order): mutations must land deep (entries,
    their stores and layouts, file records)."""
    if not any(REACHED.values()):
        pytest.skip("the fuzz test did not run in this session")
    assert REACHED["entries"] > 50 and REACHED["store"] > 10 and REACHED["layout"] > 5 and REACHED["files"] > 5, \
        REACHED


def test_metadata_error_names_the_layout_field(laid_out, tmp_path):
    src, _ = laid_out
    path = tampered(src, str(tmp_path / "c"), HOSTILE_LAYOUTS["mesh of 2**40 ranks"])
    with pytest.raises(MetadataError, match=r"key 'w': layout mesh"):
        load(path=path)


# ---------------------------------------------------------------------------- sizes and places


def _file_record(doc):
    return doc["files"][0]


HOSTILE_SIZES = {
    # the index of a data file at 8 GiB, 8 GiB long, in a file said to be 32 GiB
    "index range of 2**33": lambda d: _file_record(d).__setitem__(slice(3, 7), [1 << 33, 1 << 33, 0, 1 << 35]),
    # a forged shape: 2**56 bytes of float32 that no file holds
    "shape of 2**56 bytes": lambda d: d["entries"]["w"].update(shape=[1 << 27, 1 << 27]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_SIZES))
def test_a_forged_size_is_checked_against_the_files_before_anything_is_allocated(laid_out, tmp_path, case):
    """Sizes a ``.metadata`` states (index ranges, shapes) are compared with the real sizes of
    the files before a buffer of that size is allocated: every entry point that reads data
    refuses with CorruptCheckpointError naming the file (or the tensor), in seconds."""
    src, _ = laid_out
    path = tampered(src, str(tmp_path / "c"), HOSTILE_SIZES[case])
    results = probe(path, str(tmp_path / "out"), DATA_CALLS)
    results.pop("stderr")
    for what, (outcome, seconds) in results.items():
        assert "REFUSED CorruptCheckpointError" in outcome, (what, outcome)
        assert ".safetensors" in outcome or "'w'" in outcome, (what, outcome)
        assert seconds < 10, f"{what} took {seconds} s"


def test_verify_reports_a_forged_size_as_a_problem_of_the_file(laid_out, tmp_path):
    """verify collects problems instead of raising, a chunk that lies outside its file included."""
    src, _ = laid_out
    for case, mutate in HOSTILE_SIZES.items():
        report = verify_checkpoint(tampered(src, str(tmp_path / case.replace(" ", "_")), mutate))
        assert not report.ok and any(".safetensors" in p for p in report.problems), (case, report.problems)


def _incremental_run(base: str) -> tuple[str, str, dict]:
    """A manager directory with steps 1 and 2, step 2 naming a file of step 1 (incremental)."""
    run = os.path.join(base, "run")
    sd = {"frozen": make_tensor((64, 8)), "lora": make_tensor((4,), seed=1)}
    with CheckpointManager(run, incremental=True) as mgr:
        mgr.save(1, sd)
        sd["lora"] = sd["lora"] + 1
        mgr.save(2, sd)
    step2 = os.path.join(run, "step_00000002")
    with open(os.path.join(step2, METADATA_FILE)) as f:
        assert json.load(f)["dirs"] == ["", "step_00000001"]
    return run, step2, sd


def _rewrite_dirs(step_dir: str, dirs: list[str]) -> None:
    path = os.path.join(step_dir, METADATA_FILE)
    with open(path) as f:
        doc = json.load(f)
    doc["dirs"] = dirs
    with open(path, "wb") as f:
        f.write(seal_json(doc))


def test_dirs_naming_anything_but_a_step_directory_is_refused(tmp_path):
    """``dirs`` in ``.metadata`` holds step directories of the manager and nothing else: a plain
    name that is a link to a directory outside the manager's is refused before a file is opened."""
    run, step2, _ = _incremental_run(str(tmp_path))
    outside = str(tmp_path / "outside")
    shutil.move(os.path.join(run, "step_00000001"), outside)  # the bytes step 2 needs, elsewhere
    os.symlink(outside, os.path.join(run, "lnk"))
    _rewrite_dirs(step2, ["", "lnk"])
    with pytest.raises(MetadataError, match=r"'dirs' names 'lnk', which is not a step directory"):
        load(path=step2)
    for name in ("step_1", "step_0000001", "step_000000010x", ".", "step_00000001/..", 7):
        _rewrite_dirs(step2, ["", name])
        with pytest.raises(MetadataError, match="'dirs'"):
            load(path=step2)


def test_a_step_directory_that_is_a_symbolic_link_is_not_followed(tmp_path):
    """A sibling step directory that is a link (to a copy outside the manager's directory) is
    refused by name, though ``O_NOFOLLOW`` on the file alone would have followed it."""
    run, step2, _ = _incremental_run(str(tmp_path))
    outside = str(tmp_path / "outside")
    shutil.move(os.path.join(run, "step_00000001"), outside)
    os.symlink(outside, os.path.join(run, "step_00000001"))
    with pytest.raises(CorruptCheckpointError, match=r"step_00000001/data-.*symbolic link"):
        load(path=step2)
    report = verify_checkpoint(step2)
    assert any("symbolic link" in p for p in report.problems), report.problems


def test_an_incremental_step_loads_through_a_linked_checkpoint_path(tmp_path):
    """The caller's own path may be a link: the sibling is found beside the step's real directory."""
    run, step2, sd = _incremental_run(str(tmp_path))
    latest = str(tmp_path / "latest")
    os.symlink(step2, latest)
    out = load(path=latest)
    assert torch.equal(out["frozen"], sd["frozen"]) and torch.equal(out["lora"], sd["lora"])
    assert verify_checkpoint(latest).ok


# ---------------------------------------------------------------------------- what a save must never write


@pytest.mark.parametrize("shape", [(-1, 0), (1,) * 65, (1 << 40, 1 << 40)])
def test_a_shape_the_reader_refuses_is_never_written(tmp_path, shape):
    # every write path (save, imports, transforms) builds its entries in one place, which checks
    # each shape as the reader will; before, an import of a [-1, 0] tensor committed a
    # checkpoint whose .metadata its own reader refused
    dst = str(tmp_path / "c")
    entries = {"w": EntrySpec("tensor", ("w",), "float32", shape), "step": EntrySpec("object", ("step",))}
    with pytest.raises(MetadataError, match=r"the checkpoint being written, key 'w': shape"):
        write_streaming(dst, entries, [[]], lambda item: 7)
    assert not os.path.exists(os.path.join(dst, METADATA_FILE))

