"""HyperParallel's own DCP: its argument names, storage calls, single files, layouts, checkpoints."""
