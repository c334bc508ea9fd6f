"""Opening a MindSpore file of either dialect, told apart by its content.

Not here: the dialects (:mod:`.ckpt`, :mod:`.safetensors_files`).
"""

from __future__ import annotations

import mmap
import os

import torch

from ...base.errors import CorruptCheckpointError
from ...format.safetensors import HEAD, header_length
from .ckpt import _Ckpt
from .file_model import MindSporeFile
from .safetensors_files import _Safetensors


def open_mindspore_file(path: str | os.PathLike, *, verify: bool = True) -> MindSporeFile:
    """Open a MindSpore ``..ckpt`` or safetensors file (told apart by content) and index it.

    Args:
        verify: check the crc the file carries, if any (``..ckpt`` trailer, safetensors
            ``crc_num``); reads the file once.

    Raises:
        UnsupportedValueError: an encrypted file, an unknown dtype, a MapParameter.
        CorruptCheckpointError: a truncated or damaged file, a bad crc, messages of one
            tensor that do not add up to it.
    """
    where = os.fspath(path)
    size = os.path.getsize(where)
    if size == 0:
        raise CorruptCheckpointError(f"{where}: empty file; expected a MindSpore .ckpt or safetensors file")
    fd = os.open(where, os.O_RDONLY)
    try:
        # the index is walked on a mapping (only header pages are touched); data is pread later
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            if size >= 9 and mm[8] == ord("{") and header_length(mm[:HEAD]) < size:
                return _Safetensors(where, fd, mm, verify)
            return _Ckpt(where, fd, mm, verify)
    except BaseException:
        os.close(fd)
        raise


def read_mindspore_checkpoint(path: str | os.PathLike, *, verify: bool = True) -> dict[str, torch.Tensor | str]:
    """Every value of a MindSpore ``..ckpt`` or safetensors file: ``{name: tensor or str}``.

    Holds the whole file in memory; :func:`import_mindspore` streams instead.

    Example::

        sd = read_mindspore_checkpoint("lenet.ckpt")
        sd["fc1.weight"].dtype     # torch.float32
    """
    with open_mindspore_file(path, verify=verify) as f:
        return {name: f.read(name) for name in f.tensors}
