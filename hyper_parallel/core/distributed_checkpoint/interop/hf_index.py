"""A Hugging Face checkpoint directory: its file names and its index, read one way.

``save_pretrained`` writes ``model.safetensors``, or shards ``model-0000i-of-0000N.safetensors``
and ``model.safetensors.index.json``, whose ``weight_map`` names the file of each tensor.
Shards without their index are an export or a download that did not finish: nothing says
which shards make the checkpoint, so every reader here refuses them.

Not here: the safetensors bytes (:mod:`..format.safetensors`), reading the tensors
(:mod:`.huggingface`, :mod:`.hf_import`), writing them (:mod:`.hf_export`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

from ..base.errors import CheckpointError, MetadataError
from ..format import metadata as md

try:  # torch's names for the keys its Hugging Face writer puts in a safetensors header
    from torch.distributed.checkpoint._hf_utils import DCP_SHARDING_INFO_KEY, SAVED_OFFSETS_KEY
except ImportError:  # a torch without them: the same strings its files carry
    DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
    SAVED_OFFSETS_KEY = "saved_offsets"

# How every index file's name ends (``model.safetensors.index.json``).
SAFETENSORS_INDEX_SUFFIX = ".safetensors.index.json"
HF_INDEX = "model" + SAFETENSORS_INDEX_SUFFIX
HF_SINGLE = "model.safetensors"
MAX_INDEX_BYTES = 256 << 20
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # transformers' shard names
EXPORT_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")  # a file of an export: one or a shard


def parse_weight_map(raw: bytes | bytearray, where: str) -> dict[str, str]:
    """The ``weight_map`` of an index file's bytes: tensor name -> plain file name.

    Raises MetadataError naming ``where``: not JSON, no non-empty ``weight_map`` object, a
    value that is not a plain file name.
    """
    try:
        doc = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise MetadataError(f"{where} is not valid JSON ({exc})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise MetadataError(f"{where} has no 'weight_map' object mapping tensor names to files")
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise MetadataError(f"{where}: 'weight_map' maps {key!r} to {name!r:.80}, not a file name")
        md.validate_file_name(name, where)
    return weight_map


def unindexed_shards(path: str, shards: list[str]) -> str:
    """The message refusing a directory of shard files without its index."""
    return (f"{path!r} holds Hugging Face shard files ({shards[0]!r}, {len(shards)} in all) but no {HF_INDEX}: an "
            "export or download that did not finish; without the index nothing says which shards make the "
            "checkpoint")


def local_sources(src: str | os.PathLike) -> dict[str, set[str] | None]:
    """The safetensors files of a local Hugging Face checkpoint (a directory or one file), each
    with the tensor names to take from it: those its index's ``weight_map`` assigns to it (a
    name another shard also holds is read from the one the index names), or None (all)
    without an index."""
    src = os.fspath(src)
    if os.path.isfile(src):
        return {src: None}
    if not os.path.isdir(src):
        raise CheckpointError(f"{src!r}: no such file or directory (expected Hugging Face safetensors)")
    index = os.path.join(src, HF_INDEX)
    if os.path.exists(index):
        size = os.path.getsize(index)
        if size > MAX_INDEX_BYTES:
            raise MetadataError(f"{index} has {size} bytes, more than any index needs ({MAX_INDEX_BYTES})")
        with open(index, "rb") as f:
            weight_map = parse_weight_map(f.read(), index)
        names: dict[str, set[str] | None] = {}
        for tensor, n in sorted(weight_map.items(), key=lambda kv: (kv[1], kv[0])):
            names.setdefault(os.path.join(src, n), set()).add(tensor)  # type: ignore[union-attr]
        return names
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{src!r} holds no safetensors files and no {HF_INDEX}")
    sharded = [f for f in files if EXPORT_NAME.match(f) and f != HF_SINGLE]
    if sharded:  # transformers, too, reads sharded files only through their index
        raise CheckpointError(unindexed_shards(src, sharded))
    return {os.path.join(src, f): None for f in files}


def names_to_read(path: str, wanted: set[str] | None, keys: Iterable[str], seen: dict[str, str]) -> list[str]:
    """The names to read from one file of :func:`local_sources` (``keys``: the names it
    holds); a name two files hold without an index saying which is an error naming both."""
    keys = list(keys)
    if wanted is not None and not wanted <= set(keys):
        lost = sorted(wanted - set(keys))
        raise CheckpointError(f"{HF_INDEX} places {lost[0]!r} ({len(lost)} tensor(s)) in {path!r}, which does not "
                              "hold it")
    out = []
    for name in keys:
        if wanted is not None and name not in wanted:
            continue
        if name in seen:
            raise CheckpointError(f"tensor {name!r} is in both {seen[name]!r} and {path!r}, and no "
                                  f"{HF_INDEX} says which holds it")
        seen[name] = path
        out.append(name)
    return out
