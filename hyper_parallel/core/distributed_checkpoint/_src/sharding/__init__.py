"""How tensors are split over meshes: layouts (HyperParallel's and torch's words), the chunk
grid of a layout, and strategy files (ours and MindSpore's dialect)."""
