#!/usr/bin/env bash
# Create .venv (if missing) and install hyper-parallel with its dev tools, pinned by
# constraints.txt so torch comes from the CPU wheel. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]"
