#!/usr/bin/env bash
# The checks that need a GPU, in one prepared run of about five minutes:
#   1. the CUDA tests (tests that skip without a CUDA device);
#   2. GPU decode (vision.gpu.DeviceDecode) against CPU decode, images/s and CPU ms per image;
#   3. pinned-memory hand-over: a batch's time from the workers to the GPU.
# On a machine without a CUDA device (or without torch/torchvision) every part says
# "skipped: <reason>" and the script exits 0.
#
#   tools/device_check.sh            # figures printed, and written to $OUT or bench-out/device
#   PYTHON=/path/to/python tools/device_check.sh
#
# shardloader's own dependencies must import there (zstandard and click among them: carry them
# as wheels where they are missing); the checks pack their corpus uncompressed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench-out/device}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SHARDLOADER_CACHE_DIR=${SHARDLOADER_CACHE_DIR:-$(mktemp -d)}
echo "device check: $(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"

reason=$($PY - <<'EOF'
import sys
sys.path.insert(0, "tools")
from bench_device import missing
print(missing() or "")
EOF
)
status=$?
if [ $status -ne 0 ]; then
    reason="python ($PY) could not run the check (exit $status)"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

echo "== 1. CUDA tests"
if [ -n "$reason" ]; then
    echo "skipped: $reason"
else
    # every test that skips without CUDA, and the modules around them
    timeout 240 $PY -m pytest -q -rs -p no:cacheprovider --basetemp="$(mktemp -d)" \
        tests/test_vision_gpu.py tests/test_vision.py 2>&1 | tee "$OUT/cuda-tests.log"
fi

echo "== 2, 3. GPU decode against CPU decode; pinned-memory hand-over"
timeout 300 $PY tools/bench_device.py --images 2000 --workers 4 --json "$OUT/device.json"
echo "figures: $OUT/device.json"
