"""Test configuration: quiet, deterministic, loopback-only distributed settings."""

import os

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
