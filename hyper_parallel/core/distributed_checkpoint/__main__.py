"""``python -m hyper_parallel.core.distributed_checkpoint``: the checkpoint command line."""

import sys

from hyper_parallel.cli import main

sys.exit(main())
