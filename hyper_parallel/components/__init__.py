"""Training components built on the core: checkpointers and the weight conversions they apply.

Nothing in ``hyper_parallel.core`` imports from here; code here uses the core only through its
public modules (``hyper_parallel.core.distributed_checkpoint.*`` faces).
"""
