"""Tools over finished checkpoints: verification."""
