"""Metadata: JSON round trip, typed values, and validation of hostile input."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.distributed_checkpoint.metadata import (
    ChunkRecord,
    Entry,
    Metadata,
    MetadataError,
    decode_value,
    encode_value,
    is_json_value,
    replicas,
    seal_json,
)


def sample() -> Metadata:
    chunk = ChunkRecord((0, 0), (2, 3), "data-r00000-0-abc.safetensors", 128, 24, 2, (123,))
    entries = {
        "w": Entry("w", "tensor", ("w",), "float32", (4, 3), [chunk,
                   ChunkRecord((2, 0), (2, 3), "data-r00001-0-abc.safetensors", 128, 24, 2, (7,))],
                   {"mesh_shape": [2], "mesh_dim_names": ["dp"], "placements": ["S(0)"]}),
        "opt.lr": Entry("opt.lr", "object", ("opt", "lr"), value=(0.1, {1: None})),
    }
    return Metadata(entries, "abc", 2)


def test_metadata_round_trips_through_json():
    m = sample()
    back = Metadata.from_json(m.to_json())
    assert back.entries["w"].chunks == m.entries["w"].chunks
    assert back.entries["w"].layout == m.entries["w"].layout
    assert back.entries["opt.lr"].value == (0.1, {1: None})
    assert back.files == ["data-r00000-0-abc.safetensors", "data-r00001-0-abc.safetensors"]


def _mutated(fn) -> bytes:
    """A hostile document: mutated, then sealed with a valid checksum as an attacker would."""
    doc = json.loads(sample().to_json())
    fn(doc)
    return seal_json(doc)


def test_any_changed_byte_of_metadata_is_detected():
    raw = bytearray(sample().to_json())
    for i in range(len(raw)):
        flipped = bytearray(raw)
        flipped[i] ^= 0x01
        with pytest.raises(MetadataError):
            Metadata.from_json(bytes(flipped))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["files"].__setitem__(0, "../../etc/passwd"), "not a plain file name"),
    (lambda d: d["files"].__setitem__(0, "/etc/passwd"), "not a plain file name"),
    (lambda d: d["files"].__setitem__(0, "a/b"), "not a plain file name"),
    (lambda d: d["entries"]["w"].__setitem__("shape", [1 << 40, 1 << 40]), "absurdly large"),
    (lambda d: d["entries"]["w"]["chunks"][0].__setitem__(3, -5), "chunk start"),
    (lambda d: d["entries"]["w"]["chunks"][0].__setitem__(4, 10 ** 12), "chunk length"),
    (lambda d: d["entries"]["w"]["chunks"][0].__setitem__(0, [3, 0]), "outside shape"),
    (lambda d: d["entries"]["w"]["chunks"][1].__setitem__(0, [1, 0]), "overlap"),
    (lambda d: d["entries"]["w"]["chunks"][0].__setitem__(2, 7), "file index"),
    (lambda d: d["entries"]["w"].__setitem__("dtype", "object"), "dtype"),
    (lambda d: d["entries"]["w"].__setitem__("kind", "exec"), "kind"),
    (lambda d: d["entries"]["w"]["chunks"][0].__setitem__(6, [1, 2, 3]), "checksums"),
    (lambda d: d["entries"]["opt.lr"].__setitem__("value", {"$pickle": "gASV"}), "bad value"),
    (lambda d: d.__setitem__("format", "torch-dcp"), "not a hyper-parallel checkpoint"),
    (lambda d: d.__setitem__("version", "1"), "version"),
    (lambda d: d.__setitem__("entries", []), "entries"),
])
def test_hostile_metadata_is_rejected_with_a_clear_message(mutate, message):
    with pytest.raises(MetadataError, match=message):
        Metadata.from_json(_mutated(mutate))


def test_the_same_box_in_two_files_is_a_replica_not_an_overlap():
    raw = _mutated(lambda d: d["entries"]["w"]["chunks"].append(
        [[0, 0], [2, 3], 1, 512, 24, 2, [5]]))
    chunks = Metadata.from_json(raw).entries["w"].chunks
    assert len(chunks) == 3 and [len(g) for g in replicas(chunks)] == [2, 1]


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
