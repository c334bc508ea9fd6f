#!/usr/bin/env bash
# Create .venv (if missing) and install hyper-parallel with its dev tools, pinned by
# constraints.txt so torch comes from the CPU wheel. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip here warns about every missing local index folder; keep only the other messages.
pip_install() {
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt "$@" 2>&1 \
    | { grep -v "^WARNING: Location 'file://" || true; }
  return "${PIPESTATUS[0]}"
}
pip_install torch==2.13.0
pip_install -e ".[dev]"
