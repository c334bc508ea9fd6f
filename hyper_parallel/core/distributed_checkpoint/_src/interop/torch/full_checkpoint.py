"""Full checkpoints <-> this format, in one process: a state dict in memory, a torch file,
a Hugging Face directory or a MindSpore file.

- :func:`dcp_to_full_state_dict`, :func:`full_state_dict_to_dcp_format`: whole tensors in memory.
- :func:`convert_full_checkpoint_to_dcp`: a full checkpoint file or directory, its kind told
  by HyperParallel's ``src_platform`` or by the path, handed to the importer of its kind.

Not here: the importers themselves (:mod:`..huggingface.importing`, :mod:`..mindspore.checkpoints`), layout changes
(:mod:`...resharding`).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from ...base.errors import CheckpointError, UnsupportedValueError
from ...engine.checkpoint import load, save
from ...engine.streaming_writer import check_destination
from ...format import metadata as md
from ..huggingface.importing import import_huggingface
from ..hyper_parallel.aliases import one_of
from ..mindspore.checkpoints import import_mindspore


def dcp_to_full_state_dict(src_path: str | os.PathLike | None = None, *, verify: bool = True,
                           allow_pickle: bool = False, src_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Load a whole checkpoint, whatever layout saved it, as full CPU tensors and plain values.

    ``src_dir`` is HyperParallel's name for ``src_path``.

    Example::

        sd = dcp_to_full_state_dict("/ckpt/step100")
        torch.save(sd["model"], "model.pt")
    """
    src_path = one_of(src_path, src_dir, "src_path", "src_dir", "dcp_to_full_state_dict")
    return load(path=src_path, no_dist=True, verify=verify, allow_pickle=allow_pickle)


def full_state_dict_to_dcp_format(state_dict: dict[str, Any], dst_path: str | os.PathLike | None = None, *,
                                  overwrite: bool = False, allow_pickle: bool = False,
                                  dst_dir: str | os.PathLike | None = None) -> md.Metadata:
    """Save an in-memory full state dict (plain tensors) as a checkpoint, in one process.

    ``dst_dir`` is HyperParallel's name for ``dst_path``.
    """
    dst_path = one_of(dst_path, dst_dir, "dst_path", "dst_dir", "full_state_dict_to_dcp_format")

    check_destination(dst_path, overwrite)
    meta = save(state_dict, dst_path, no_dist=True, allow_pickle=allow_pickle)
    assert meta is not None
    return meta



_SRC_PLATFORMS = {"huggingface": "huggingface", "hf": "huggingface", "safetensors": "huggingface",
                  "torch": "torch", "pytorch": "torch", "pt": "torch", "mindspore": "mindspore", "ms": "mindspore"}



def _looks_like_mindspore(path: str) -> bool:
    """A file starting like MindSpore's protobuf (field 1 or 2, length-delimited). Not by its
    ``..ckpt`` suffix: Lightning's torch checkpoints have it too (torch files start with a zip
    header or a pickle opcode)."""
    try:
        with open(path, "rb") as f:
            first = f.read(1)
    except OSError:
        return False
    return first in (b"\x0a", b"\x12")


def convert_full_checkpoint_to_dcp(
    src: str | os.PathLike | None = None,
    dst_path: str | os.PathLike | None = None,
    src_platform: str | None = None,
    *,
    prefix: str = "",
    allow_pickle: bool = False,
    overwrite: bool = False,
    src_ckpt: str | os.PathLike | None = None,
    dst_dir: str | os.PathLike | None = None,
) -> md.Metadata:
    """Convert a full checkpoint (HF safetensors dir/file, a torch ``..pt``/``..bin``, or MindSpore's) to DCP.

    safetensors sources stream one tensor at a time. torch files are opened with
    ``torch.load(weights_only=True, mmap=True)`` — tensors are paged in as they are written;
    a file that needs full unpickling is refused unless ``allow_pickle=True``.

    Args:
        src: a Hugging Face directory, a ``..safetensors`` file, a torch file, or (with
            ``src_platform="mindspore"``) a MindSpore ``..ckpt`` or safetensors file.
        dst_path: the new checkpoint directory.
        src_platform: HyperParallel's argument naming the source: ``"huggingface"``,
            ``"torch"`` or ``"mindspore"`` (read without MindSpore by
            :func:`~..mindspore_format.import_mindspore`, which also takes MindSpore's
            distributed checkpoints). None (default) tells safetensors from torch files by
            the path.
        prefix: prepended to every key (e.g. ``"model."``).
        src_ckpt, dst_dir: HyperParallel's names for ``src`` and ``dst_path`` (its code
            calls ``convert_full_checkpoint_to_dcp(src_ckpt=..., dst_dir=..., src_platform=...)``).

    Raises:
        ValueError: an unknown ``src_platform``, or one that does not fit ``src``.

    Example::

        convert_full_checkpoint_to_dcp("/hf/llama", "/ckpt/llama", src_platform="huggingface")
        convert_full_checkpoint_to_dcp("lenet.ckpt", "/ckpt/lenet", src_platform="mindspore")
    """
    src = one_of(src, src_ckpt, "src", "src_ckpt")
    dst_path = one_of(dst_path, dst_dir, "dst_path", "dst_dir")
    is_st = os.path.isdir(src) or src.endswith(".safetensors")
    if src_platform is not None:
        kind = _SRC_PLATFORMS.get(str(src_platform).lower())
        if kind is None:
            raise ValueError(f"src_platform={src_platform!r}: expected 'huggingface', 'torch' or 'mindspore'")
        if kind == "mindspore":
            return import_mindspore(src, dst_path, prefix=prefix, overwrite=overwrite)
        if kind == "huggingface" and not is_st:
            raise ValueError(f"src_platform='huggingface' needs a directory or a .safetensors file, got {src!r}")
        if kind == "torch" and os.path.isdir(src):
            raise ValueError(f"src_platform='torch' needs a torch file (.pt/.bin), got the directory {src!r}")
    if is_st:
        return import_huggingface(src, dst_path, prefix=prefix, overwrite=overwrite)
    if not os.path.isfile(src):
        raise CheckpointError(f"{src!r}: no such file or directory (expected HF safetensors, a torch "
                              "file or a MindSpore checkpoint)")
    try:
        sd = torch.load(src, map_location="cpu", weights_only=not allow_pickle, mmap=True)
    except Exception as exc:
        if src_platform is None and _looks_like_mindspore(src):
            raise CheckpointError(
                f"{src!r} is not a torch file; it looks like a MindSpore checkpoint: pass "
                "src_platform='mindspore'") from None
        if allow_pickle or isinstance(exc, OSError):  # the caller's trust, or the system's error: as it is
            raise
        if not isinstance(exc, pickle.UnpicklingError):  # weights_only refusals are UnpicklingErrors
            raise CheckpointError(
                f"{src!r} is not a checkpoint this tool reads (HF safetensors, a torch file or a MindSpore "
                f"checkpoint): torch.load failed with {exc.__class__.__name__}: {str(exc)[:200]}") from exc
        raise UnsupportedValueError(
            f"{src!r} cannot be loaded with weights_only=True ({exc.__class__.__name__}); it holds "
            "arbitrary pickled objects. Pass allow_pickle=True only if you trust the file") from None
    if not isinstance(sd, dict):
        raise CheckpointError(f"{src!r} holds a {type(sd).__name__}, expected a state dict")
    if prefix:
        sd = {prefix + k: v for k, v in sd.items()}
    return full_state_dict_to_dcp_format(sd, dst_path, overwrite=overwrite, allow_pickle=allow_pickle)
