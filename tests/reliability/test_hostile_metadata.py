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
    Layout,
    load,
    offline_transform,
    save,
)
from hyper_parallel.core.distributed_checkpoint.metadata import METADATA_FILE, MetadataError, seal_json
from hyper_parallel.core.distributed_checkpoint.offline_transform import write_streaming
from hyper_parallel.core.distributed_checkpoint.planner import EntrySpec
from hyper_parallel.core.distributed_checkpoint.reshard import reshard

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
    from hyper_parallel.core.distributed_checkpoint import load, offline_transform
    from hyper_parallel.core.distributed_checkpoint.reshard import reshard
    path, out = sys.argv[1:3]
    calls = {{
        "load": lambda: load(path=path),
        "reshard": lambda: reshard(path, out + "-r", dst_mesh={{"tp": 4}}),
        "offline_transform": lambda: offline_transform(path, out + "-t", dst_layout={{"tp": 3}}),
        "inspect": lambda: sys.exit(main(["inspect", path])),
    }}
    for what, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
        except SystemExit as exc:
            print(f"{{what}} EXIT {{exc.code}}")
        except Exception as exc:
            print(f"{{what}} REFUSED {{type(exc).__name__}}: {{exc}}")
        else:
            print(f"{{what}} ACCEPTED")
        print(f"{{what}} SECONDS {{time.monotonic() - t0:.2f}}", flush=True)
""")


def probe(path: str, out: str) -> dict[str, tuple[str, float]]:
    """Every entry point on ``path`` in one fresh, memory-limited process: {name: (outcome, seconds)}."""
    code = PROBE.format(limit=MEMORY_LIMIT)
    done = subprocess.run([sys.executable, "-c", code, path, out], capture_output=True, text=True, timeout=120)
    lines = (done.stdout + done.stderr).splitlines()
    results: dict[str, tuple[str, float]] = {}
    for what in ("load", "reshard", "offline_transform", "inspect"):
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

