"""HyperParallel's torch platform package (``hyper_parallel.platform.torch``).

HyperParallel keeps its torch platform class at ``hyper_parallel.platform.torch.platform``;
code and tests name it there (``TorchPlatform``, e.g. to patch one of its methods). Here the
class lives in :mod:`hyper_parallel.platform`; :mod:`.platform` is that path.
"""
