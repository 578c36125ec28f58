#!/usr/bin/env bash
# bench/quality.py on the GPU machine, one device call of at most 210 s wall, everything under $OUT:
#   bash bench/quality_gpu.sh            (carry: [".whl-quality"], from bench/quality_wheels.sh)
# The install (~20 s), then the bench with a budget that starts no phase past 150 s of its own (a DiT lever set takes
# ~10 s, a pipeline one ~10 s): a phase cut short by the outer timeout still leaves the lines measured before it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?the device machine sets OUT}
export PYTHONUNBUFFERED=1
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-quality/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "setup done at ${SECONDS} s"
  timeout $((205 - SECONDS)) python3 bench/quality.py --out "$out/quality.jsonl" --budget-s "${QUALITY_BUDGET_S:-150}" "$@"
  echo "bench exited $? at ${SECONDS} s"
} 2>&1 | tee "$out/quality.log"
exit 0
