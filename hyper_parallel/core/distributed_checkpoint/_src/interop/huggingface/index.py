"""A Hugging Face checkpoint directory: its file names and its index, read one way.

``save_pretrained`` writes ``model.safetensors``, or shards ``model-0000i-of-0000N.safetensors``
and ``model.safetensors.index.json``, whose ``weight_map`` names the file of each tensor.
Without the index, what makes the checkpoint is less certain: torch's reader takes every
``*.safetensors`` file of the directory (what ``safetensors.torch.save_file`` and torch's
writer leave), and :func:`indexless_files` does too where the names show the set is whole:
every shard ``-0000i-of-0000N`` of one set, or files not numbered that way. A set with a
shard missing, two sets, or the temporary file of an export not yet in place is an export or
a download that did not finish, and is refused naming what is missing. The import tools
(:func:`local_sources`) still take numbered shards only through their index.

Not here: the safetensors bytes (:mod:`...format.safetensors`), reading the tensors
(:mod:`.reader`, :mod:`.importing`), writing them (:mod:`.exporting`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

from ...base.errors import CheckpointError, MetadataError, NotACheckpointError
from ...format import metadata as md

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
EXPORT_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")  # a file of an export: one or a shard
NUMBERED = re.compile(r"(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.safetensors")  # file i of a set of n
# a file an export writes before it puts the file in place (hf_export.temporary_name)
UNFINISHED = re.compile(r".+\.safetensors(\.index\.json)?\.tmp-[0-9a-f]{8}")


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


def indexless_files(path: str, listed: Iterable[str]) -> list[str]:
    """The files that make the checkpoint of a directory without an index, from its listing:
    every ``*.safetensors`` file, sorted, when the numbered ones (``<stem>-0000i-of-0000N``)
    are every shard of one set (see the module docstring).

    Raises NotACheckpointError, naming the index and what is wrong: no ``*.safetensors`` file;
    the temporary file of an export not yet in place; numbered shards of two sets; a shard of
    the set missing (named).
    """
    listed = sorted(listed)
    unfinished = [n for n in listed if UNFINISHED.fullmatch(n)]
    if unfinished:
        raise NotACheckpointError(
            f"{path!r} has no {HF_INDEX} and holds {unfinished[0]!r} ({len(unfinished)} such file(s)), a file an "
            "export writes before putting it in place: an export is under way or was killed before it finished, "
            "and the shards there may mix two exports; export again (or wait for the export to finish)")
    names = [n for n in listed if n.endswith(".safetensors")]
    sets: dict[tuple[str, int], set[int]] = {}
    for m in map(NUMBERED.fullmatch, names):
        if m:
            sets.setdefault((m["stem"], int(m["n"])), set()).add(int(m["i"]))
    if len(sets) > 1:
        shown = sorted(f"{stem}-*-of-{n:05d}.safetensors" for stem, n in sets)
        raise NotACheckpointError(
            f"{path!r} holds shard files of {len(sets)} sets ({', '.join(shown[:3])}) and no {HF_INDEX} saying "
            "which makes the checkpoint: files of two exports or downloads, one of which did not finish")
    for (stem, n), present in sets.items():
        missing = sorted(set(range(1, n + 1)) - present)
        beyond = sorted(i for i in present if not 1 <= i <= n)
        if missing or beyond:
            what = [f"{stem}-{i:05d}-of-{n:05d}.safetensors" for i in (missing or beyond)]
            shown = ", ".join(what[:4]) + (f" and {len(what) - 4} more" if len(what) > 4 else "")
            fault = f"lacks {shown}" if missing else f"also holds {shown}, beyond its {n} files"
            raise NotACheckpointError(
                f"{path!r} holds Hugging Face shard files of a set of {n} ({stem}-0000i-of-{n:05d}.safetensors) "
                f"but {fault}, and no {HF_INDEX}: an export or download that did not finish")
    return names


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
