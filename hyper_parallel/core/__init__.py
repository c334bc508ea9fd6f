"""Core components of hyper-parallel."""
