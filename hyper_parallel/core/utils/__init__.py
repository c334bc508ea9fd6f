"""``hyper_parallel.core.utils``: HyperParallel's utility import paths (see :mod:`.communication`)."""
