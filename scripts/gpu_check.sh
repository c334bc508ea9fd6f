#!/usr/bin/env bash
# One command for a machine with CUDA: the GPU tests (tests/gpu: save, load, reshard and
# async save on CUDA tensors, stream ordering), the local tier's device check, and the
# async-staging benchmark (benchmarks/bench_gpu_staging.py: D2H GiB/s, blocking time,
# compute lost beside torch DCP), whose report lands in $OUT/gpu_staging.md.
#
#   bash scripts/gpu_check.sh            # uses python3 (it must hold a CUDA build of torch)
#   PYTHON=/path/to/python WHEELS=dir bash scripts/gpu_check.sh   # install missing deps from wheels
#
# Uses the machine's own torch (a CUDA build); installs nothing from the network. Writes
# logs and results under $OUT when it is set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
export OUT PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.cuda.is_available()); \
sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check here')"
if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl
fi
"$PY" -c "import crc32c, xxhash, safetensors, numpy, pytest" || {
    echo "missing a dependency: pass WHEELS=dir with wheels of crc32c/xxhash for this python"; exit 1; }
status=0
"$PY" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" || status=1
"$PY" scripts/device_check_local_tier.py 2>&1 | tee "$OUT/local_tier_check.log" || status=1
# D2H GiB/s (pageable, pinned), async blocking vs one pinned memcpy, compute lost vs torch DCP,
# the pinned pool reused across saves, a memory budget's peak: SIZE_MB (default 2048) of state
"$PY" benchmarks/bench_gpu_staging.py --size-mb "${SIZE_MB:-2048}" --dir "${BENCH_DIR:-$OUT}" \
    --out "$OUT/gpu_staging.md" 2>&1 | tee "$OUT/gpu_staging.log" || status=1
exit $status
