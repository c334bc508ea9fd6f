#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the end-to-end demo (the project's main job).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/demo.py "$@"
