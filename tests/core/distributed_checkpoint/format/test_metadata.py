"""Metadata: JSON round trip, typed values, and validation of hostile input."""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.distributed_checkpoint._src.base.errors import MetadataError
from hyper_parallel.core.distributed_checkpoint._src.format.metadata import (
    Entry,
    FileRecord,
    GridStore,
    Metadata,
    TableStore,
)
from hyper_parallel.core.distributed_checkpoint._src.format.sealed_json import seal_json
from hyper_parallel.core.distributed_checkpoint._src.format.values import decode_value, encode_value, is_json_value

V1_METADATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "fixtures", "v1", "ckpt", ".metadata")
LAYOUT = {"mesh_shape": [2], "mesh_dim_names": ["dp"], "placements": ["S(0)"]}


def sample() -> Metadata:
    files = [FileRecord("data-r00000-0-abc.safetensors", "", 0, 128, 96, 7, 224),
             FileRecord("data-r00001-0-abc.safetensors", "", 1, 128, 96, 9, 224)]
    table = TableStore(np.array([[0, 0], [2, 0]]), np.array([[2, 3], [2, 3]]), np.array([0, 1], dtype=np.int32))
    entries = {
        "w": Entry("w", "tensor", ("w",), "float32", (4, 3), dict(LAYOUT), store=GridStore(tiles=1, offset=1)),
        "b": Entry("b", "tensor", ("b",), "int64", (5,), store=GridStore(writer=1)),
        "t": Entry("t", "tensor", ("t",), "float32", (4, 3), store=table),
        "opt.lr": Entry("opt.lr", "object", ("opt", "lr"), value=(0.1, {1: None})),
    }
    return Metadata(entries, "abc", 2, files=files)


def test_metadata_round_trips_through_json():
    m = sample()
    back = Metadata.from_json(m.to_json())
    assert back.version == 2 and back.files == m.files
    assert back.entries["w"].layout == LAYOUT and back.entries["w"].store == m.entries["w"].store
    assert back.entries["b"].store.writer == 1
    t = back.entries["t"].store
    assert t.offsets.tolist() == [[0, 0], [2, 0]] and t.sizes.tolist() == [[2, 3], [2, 3]] and t.file.tolist() == [0, 1]
    assert back.entries["opt.lr"].value == (0.1, {1: None})
    assert back.file_names() == ["data-r00000-0-abc.safetensors", "data-r00001-0-abc.safetensors"]


def test_a_mesh_over_some_ranks_keeps_its_rank_list():
    m = sample()
    m.entries["w"].layout = {**LAYOUT, "rank_list": [6, 3]}
    back = Metadata.from_json(m.to_json())
    assert back.entries["w"].layout["rank_list"] == [6, 3]
    assert json.loads(m.to_json())["rank_lists"] == [[6, 3]]  # stored once, referenced by index


def _mutated(fn, raw: bytes | None = None) -> bytes:
    """A hostile document: mutated, then sealed with a valid checksum as an attacker would."""
    doc = json.loads(raw if raw is not None else sample().to_json())
    fn(doc)
    return seal_json(doc)


def test_any_changed_byte_of_metadata_is_detected():
    raw = bytearray(sample().to_json())
    for i in range(len(raw)):
        flipped = bytearray(raw)
        flipped[i] ^= 0x01
        with pytest.raises(MetadataError):
            Metadata.from_json(bytes(flipped))


def _b64(values, dtype="<i8") -> str:
    return base64.b64encode(np.array(values, dtype=dtype).tobytes()).decode()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["files"][0].__setitem__(0, "../../etc/passwd"), "not a plain file name"),
    (lambda d: d["files"][0].__setitem__(0, "/etc/passwd"), "not a plain file name"),
    (lambda d: d["files"][0].__setitem__(0, "a/b"), "not a plain file name"),
    (lambda d: d["files"][0].__setitem__(3, 10 ** 9), "index offset"),
    (lambda d: d["files"][0].__setitem__(4, -1), "index length"),
    (lambda d: d["files"][0].__setitem__(1, 3), "dir index"),
    (lambda d: d["files"].append(d["files"][0]), "twice"),
    (lambda d: d.__setitem__("dirs", ["", "../up"]), "not a step directory"),
    (lambda d: d.__setitem__("dirs", ["", "lnk"]), "'dirs' names 'lnk', which is not a step directory"),
    (lambda d: d.__setitem__("dirs", ["x"]), "dirs"),
    (lambda d: d["entries"]["w"].__setitem__("shape", [1 << 40, 1 << 40]), "absurdly large"),
    (lambda d: d["entries"]["w"]["store"]["grid"].__setitem__("tiles", 10 ** 6), "tiles"),
    (lambda d: d["entries"]["w"]["store"]["grid"].__setitem__("copies", "some"), "copies"),
    (lambda d: d["entries"]["w"]["store"]["grid"].__setitem__("where", [[1, 9]]), "where dir"),
    (lambda d: d["entries"]["w"].__setitem__("store", {"pickle": {}}), "unknown store"),
    (lambda d: d["entries"]["b"]["store"]["grid"].__setitem__("writer", -3), "writer"),
    (lambda d: d["entries"]["t"]["store"]["table"].__setitem__("offsets", _b64([0, 0, 3, 0])), "outside shape"),
    (lambda d: d["entries"]["t"]["store"]["table"].__setitem__("offsets", _b64([0, 0, 1, 0])), "overlap"),
    (lambda d: d["entries"]["t"]["store"]["table"].__setitem__("file", _b64([0, 5], "<i4")), "names a file"),
    (lambda d: d["entries"]["t"]["store"]["table"].__setitem__("sizes", "!!not base64"), "base64"),
    (lambda d: d["entries"]["t"]["store"]["table"].__setitem__("n", 3), "holds"),
    (lambda d: d["entries"]["w"].__setitem__("dtype", "object"), "dtype"),
    (lambda d: d["entries"]["w"].__setitem__("kind", "exec"), "kind"),
    (lambda d: d["entries"]["w"]["layout"].__setitem__("rank_list", 4), "rank_list"),
    (lambda d: d.__setitem__("rank_lists", [[1, 1]]), "distinct"),
    (lambda d: d["entries"]["opt.lr"].__setitem__("value", {"$pickle": "gASV"}), "bad value"),
    (lambda d: d.__setitem__("format", "torch-dcp"), "not a hyper-parallel checkpoint"),
    (lambda d: d.__setitem__("version", "1"), "version"),
    (lambda d: d.__setitem__("version", 4), "newer"),
    (lambda d: d.__setitem__("entries", []), "entries"),
])
def test_hostile_metadata_is_rejected_with_a_clear_message(mutate, message):
    with pytest.raises(MetadataError, match=message):
        Metadata.from_json(_mutated(mutate))


def test_the_same_box_in_two_files_is_a_replica_not_an_overlap():
    raw = _mutated(lambda d: d["entries"]["t"]["store"]["table"].update(
        n=3, offsets=_b64([0, 0, 2, 0, 0, 0]), sizes=_b64([2, 3] * 3), file=_b64([0, 1, 1], "<i4")))
    assert len(Metadata.from_json(raw).entries["t"].store) == 3


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["files"].__setitem__(0, "../../etc/passwd"), "not a plain file name"),
    (lambda d: d["entries"]["model.w0"]["chunks"][0].__setitem__(3, -5), "chunk start"),
    (lambda d: d["entries"]["model.w0"]["chunks"][0].__setitem__(4, 10 ** 12), "chunk length"),
    (lambda d: d["entries"]["model.w0"]["chunks"][0].__setitem__(0, [8, 0]), "outside shape"),
    (lambda d: d["entries"]["model.w0"]["chunks"][1].__setitem__(0, [1, 0]), "overlap"),
    (lambda d: d["entries"]["model.w0"]["chunks"][0].__setitem__(2, 7), "file index"),
    (lambda d: d["entries"]["model.w0"]["chunks"][0].__setitem__(6, [1, 2, 3]), "checksums"),
])
def test_hostile_v1_metadata_is_still_rejected(mutate, message):
    with open(V1_METADATA, "rb") as f:
        raw = f.read()
    with pytest.raises(MetadataError, match=message):
        Metadata.from_json(_mutated(mutate, raw))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=3) | st.integers(), children, max_size=3),
    max_leaves=10,
)


@given(json_values)
@settings(max_examples=200, deadline=None)
def test_typed_values_round_trip_exactly(value):
    assert is_json_value(value)
    back = decode_value(json.loads(json.dumps(encode_value(value))))
    assert back == value and type(back) is type(value)


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_never_crash_the_parser(raw):
    try:
        Metadata.from_json(raw)
    except MetadataError:
        pass


@given(st.recursive(st.none() | st.integers() | st.text(max_size=4) | st.floats(allow_nan=False, allow_infinity=False),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                    max_leaves=20))
@settings(max_examples=300, deadline=None)
def test_arbitrary_json_documents_are_rejected_or_valid(doc):
    base = json.loads(sample().to_json())
    if isinstance(doc, dict):
        base.update(doc)
    try:
        Metadata.from_json(seal_json(base))
    except MetadataError:
        pass
