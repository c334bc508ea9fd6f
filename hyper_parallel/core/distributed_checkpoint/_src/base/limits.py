"""The bounds on what a checkpoint may describe, shared by every layer that checks them.

``.metadata`` (:mod:`..format.metadata`), layouts (:mod:`..sharding.layout`), MindSpore
strategy files (:mod:`..interop.mindspore.strategy`) and foreign headers (:mod:`..interop`)
refuse the same shapes, meshes and values: far beyond any real job, small enough that
nothing a hostile file says makes a reader allocate, walk or recurse without bound. Only the
numbers live here; each layer raises its own error naming where it read them.
"""

from __future__ import annotations

MAX_NDIM = 64  # dims of a tensor
MAX_ELEMENTS = 1 << 56  # elements of a tensor: far beyond any real tensor; stops overflow games early
MAX_WORLD = 1 << 20  # ranks; beyond any job, small enough that a mesh of it can be walked
MAX_MESH_NDIM = 8  # dims of a device mesh
MAX_TILES = 4096  # column bands a grid store splits each box into

# A plain value is written into .metadata as JSON, each shared list or dict once per use, so
# its size is bounded by what JSON writes, not by its objects: 45 levels of ``[x, x]`` are 91
# objects and 2**45 JSON items. Both bounds are far beyond real values (a step, a config).
MAX_VALUE_DEPTH = 64  # containers inside containers; encoded, at most 3 JSON levels each
MAX_VALUE_ITEMS = 1 << 20  # items as JSON writes them (a shared container counts at each use)
