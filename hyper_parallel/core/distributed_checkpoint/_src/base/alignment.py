"""The alignments data is laid out to, named for what they align.

- :data:`DIRECT_IO_ALIGN`: the O_DIRECT block. O_DIRECT requests must be aligned in file
  offset, length and memory address; 4 KiB covers every common device (the kernel's own
  minimum is often 512 bytes). Format-v2 data files start large payloads on it
  (:mod:`..format.data_file`) so that the filesystem backend (:mod:`..backends.direct_io`)
  can write and read them with O_DIRECT, and the saver copies into buffers aligned to it.
- :data:`TENSOR_ALIGN`: where tensor data starts in host memory that this library lays
  out (scratch read buffers): a multiple of every dtype's alignment, so elements read
  there are aligned.
"""

from __future__ import annotations

DIRECT_IO_ALIGN = 4096
TENSOR_ALIGN = 64
