"""One checkpoint file in, a flat dict of tensors out (HyperParallel's path ``distributed_checkpoint.checkpoint_io``).

A face over :mod:`._src.interop.hyper_parallel.single_file`: ``save_checkpoint_file(state_dict, path)`` writes
safetensors (or, with another ``ckpt_format``, ``torch.save``) and ``load_checkpoint_file(path)``
reads it back, a ``torch.save`` file only through ``torch.load(weights_only=True)``.
"""

from ._src.interop.hyper_parallel.single_file import load_checkpoint_file, save_checkpoint_file

__all__ = ["save_checkpoint_file", "load_checkpoint_file"]
