#!/usr/bin/env bash
# Packs the service bench's wheels (.whl, from bench/service_wheels.sh) as one installed site-packages tree in
# .whl-packed/site.tar.xz (37 MB against the wheels' 55 MiB: xz over the unpacked files beats the wheels' zip), so a
# call has room for a compile cache beside them: a portable cache from an earlier call (a tarball of its
# /tmp/vsrq-compile-cache) is copied in as .whl-packed/compile-cache.tar.xz and unpacked by bench/service_gpu.sh where
# the machine has none, so a fresh machine's first start loads its graphs instead of compiling them. Then carry
# `.whl-packed` instead of `.whl`. nvidia-cudnn-frontend's wheel (11.6 MB, `--quality high`'s FP8 attention; no room for
# it in .whl) is fetched beside the tree, as a wheel bench/service_gpu.sh installs:
#   bench/service_pack.sh [path/to/compile-cache.tar.xz]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl-packed/' "$exclude" 2>/dev/null || echo '/.whl-packed/' >> "$exclude"
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
python3 -m pip install -q --no-deps --no-index --no-compile --target "$build/site" --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --only-binary=:all: .whl/*.whl
mkdir -p .whl-packed
tar -C "$build" -I 'xz -T0 -9' -cf .whl-packed/site.tar.xz site
if [ $# -ge 1 ]; then cp "$1" .whl-packed/compile-cache.tar.xz; fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d .whl-packed nvidia-cudnn-frontend==1.32.0
du -cb .whl-packed/* | tail -1
