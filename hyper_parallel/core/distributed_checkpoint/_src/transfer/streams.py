"""Ordering copies of accelerator tensors made on worker threads against the caller's stream.

The saver and loader copy between host and accelerator memory in thread pools. A worker
thread's current stream is not the caller's, so without care a device-to-host copy could
read a tensor before the kernels that produce it (queued by the caller) have run, and the
caller could use a target before the host-to-device copies into it have landed.

:class:`StreamFence` marks the caller's current stream when a save or load starts; workers
make their own stream wait for that mark before copying from the device (``before_copy``);
``after_copies`` (caller's thread) waits for every device the workers copied into. CPU-only
runs do nothing here.
"""

from __future__ import annotations

import threading
from typing import Any

import torch


def _accelerator_in_use() -> torch.device | None:
    """The current accelerator device, if one is in use (never initialises one)."""
    if not hasattr(torch, "accelerator") or not torch.accelerator.is_available():
        return None
    kind = torch.accelerator.current_accelerator()
    if kind is None or (kind.type == "cuda" and not torch.cuda.is_initialized()):
        return None
    return torch.device(kind.type, torch.accelerator.current_device_index())


class StreamFence:
    """The caller's stream position at the start of a save or load, for worker threads."""

    def __init__(self) -> None:
        self.device = _accelerator_in_use()
        self.event: Any = None
        if self.device is not None:
            self.event = torch.accelerator.current_stream(self.device).record_event()
        self._touched: set[torch.device] = set()
        self._lock = threading.Lock()

    def before_copy(self, t: torch.Tensor) -> None:
        """In a worker, before copying ``t`` to or from the host: order after the caller's work."""
        if t.device.type in ("cpu", "meta"):
            return
        with self._lock:
            self._touched.add(t.device)
        if self.event is not None and t.device == self.device:
            torch.accelerator.current_stream(t.device).wait_event(self.event)
        else:  # a device the caller's mark does not cover: wait for all of its work
            torch.accelerator.synchronize(t.device)

    def after_copies(self) -> None:
        """In the caller: wait until every copy the workers issued to a device has landed."""
        with self._lock:
            touched, self._touched = self._touched, set()
        for device in touched:
            torch.accelerator.synchronize(device)
