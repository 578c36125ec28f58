#!/usr/bin/env bash
# Fetches into .whl-quality/ the wheels bench/quality.py needs on the GPU machine (Python 3.12; its image has torch,
# numpy, psutil, safetensors, huggingface-hub, pillow): diffusers and av at the project's pins, and
# nvidia-cudnn-frontend 1.32.0 (the `fp8` extra, its wheel alone) for cuDNN's FP8 attention: 54 MB, under the 64 MiB a
# call carries. A folder of its own: the service bench's .whl (55 MiB) has no room for the 11.6 MB cudnn-frontend
# wheel. Run from the repository root, then carry `.whl-quality` (bench/quality_gpu.sh installs it):
#   bench/quality_wheels.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl-quality/' "$exclude" 2>/dev/null || echo '/.whl-quality/' >> "$exclude"
mkdir -p .whl-quality
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl-quality diffusers==0.42.1 av==18.1.0 nvidia-cudnn-frontend==1.32.0
du -cb .whl-quality/*.whl | tail -1
