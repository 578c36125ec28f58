#!/usr/bin/env bash
# The quality tiers on the GPU machine, everything under $OUT (carry: [".whl-quality"], from bench/quality_wheels.sh):
#   bash bench/quality_gpu.sh [ARGS]   bench/quality.py, eager, every lever (one call of at most 210 s wall): a budget
#                                      that starts no phase past 150 s of its own (a DiT lever set takes ~10 s, a
#                                      pipeline one ~10 s) -> quality.jsonl, quality.log
#   bash bench/quality_gpu.sh w1       bench/bench.py: W1 at `high` beside the reference and lossless in one run,
#                                      compiled as the worker runs it (one call of at most ~540 s wall; phases as
#                                      QUALITY_PHASES, default below) -> w1-high.jsonl, w1-high.log
# The install takes ~20 s; a phase cut short by the outer timeout still leaves the lines measured before it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?the device machine sets OUT}
export PYTHONUNBUFFERED=1
mode=quality
if [ "${1:-}" = w1 ]; then mode=w1-high; shift; fi
{
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-quality/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "setup done at ${SECONDS} s"
  if [ "$mode" = w1-high ]; then
    # Reference W1 once (~66 s), lossless compiled cold (~120 s) + hot (~44 s) + the check run (~44 s), then `high`
    # on the same engine: its blocks recompile with the levers in them, hot, and the check against lossless.
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # the worker's allocator
    phases=${QUALITY_PHASES:-ref:W1*0,ours:W1:cuda:0*1,ours:W1:cuda:0%high*1}
    timeout $((535 - SECONDS)) python3 bench/bench.py --phases "$phases" --out "$out/w1-high.jsonl" "$@"
  else
    timeout $((205 - SECONDS)) python3 bench/quality.py --out "$out/quality.jsonl" --budget-s "${QUALITY_BUDGET_S:-150}" "$@"
  fi
  echo "bench exited $? at ${SECONDS} s"
} 2>&1 | tee "$out/$mode.log"
exit 0
