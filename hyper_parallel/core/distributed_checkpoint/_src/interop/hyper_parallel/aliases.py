"""HyperParallel's argument names: one value given under our name or HyperParallel's.

HyperParallel's code calls the converters with its own keywords (``src_ckpt=``,
``dst_dir=``, ``resume_from_checkpoint=``...); each converter takes both.
"""

from __future__ import annotations

import os


def one_of(ours: object, theirs: object, name: str, alias: str,
           func: str = "convert_full_checkpoint_to_dcp") -> str:
    """An argument given under our name or HyperParallel's (not both, not neither), as a path."""
    if (ours is None) == (theirs is None):
        raise TypeError(f"{func}() needs exactly one of {name}= and {alias}=")
    return os.fspath(ours if ours is not None else theirs)
