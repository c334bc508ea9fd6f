#!/usr/bin/env bash
# Optional: a separate venv with MindSpore (.msenv), for the tests that run MindSpore itself
# and for tests/fixtures/mindspore/make_fixtures.py. hyper-parallel never imports MindSpore;
# it reads and writes MindSpore's files on its own. MindSpore lives apart from .venv because it
# pins its own numpy and protobuf.
#
# Cost measured on the 2-core dev machine: about 2.3 min, a 767 MiB wheel, 2.8 GB installed.
# Afterwards the tests find .msenv by themselves (or set HP_MINDSPORE_PYTHON=/path/to/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .msenv/bin/python ]; then
  "$PY" -m venv .msenv
fi
.msenv/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir "mindspore==2.10.0" "numpy<2" 2>&1 \
  | { grep -v "^WARNING: Location 'file://" || true; }
.msenv/bin/python -c "import mindspore; print('mindspore', mindspore.__version__, 'in', '$(pwd)/.msenv')"
