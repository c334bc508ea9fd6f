#!/usr/bin/env bash
# Install (scripts/setup.sh), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Optional: HP_WITH_MINDSPORE=1 also installs MindSpore in .msenv (about 2.3 min, 2.8 GB) so the
# tests that run MindSpore itself run instead of skipping.
if [ "${HP_WITH_MINDSPORE:-0}" = 1 ]; then
  bash scripts/setup_mindspore.sh
fi
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
