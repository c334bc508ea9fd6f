"""The bounds a checkpoint's layouts must stay within: larger than any job, small enough to walk."""

MAX_WORLD = 1 << 20  # ranks; beyond any job, small enough that a mesh of it can be walked
MAX_NDIM = 64  # tensor dims
MAX_MESH_NDIM = 8  # mesh dims
