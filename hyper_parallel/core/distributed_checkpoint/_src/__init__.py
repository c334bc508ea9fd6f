"""The internals of ``hyper_parallel.core.distributed_checkpoint``: not an API.

Nothing here is a public import path; it may change in any release. Users import the package
(``hyper_parallel.core.distributed_checkpoint``) and the modules beside this folder, whose
paths are torch DCP's and HyperParallel's. See README.md here for the rooms and their layers.
"""
