"""Benchmarks of hyper-parallel's DCP. Run ``python benchmarks/bench_dcp.py --help``."""
