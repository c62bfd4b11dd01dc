#!/usr/bin/env bash
# Shrink ./.whl for the device's carry limit (64 MiB with the working tree): every wheel larger than
# $MIN_MB (default 8) MB is unpacked and packed again as NAME.tar.xz -- its installed layout, package
# directories and .dist-info, compressed with xz (FlashAttention-3's 27.5 MB wheel becomes 9.6 MB) -- and
# the wheel is removed. Run on the host after ../shared/gpu/prepare.sh:
#
#   bash benchmarks/gpu_carry.sh            # prints the install line for the device
#
# On the device the .tar.xz files are unpacked into the same --target directory pip installs the other
# wheels into (benchmarks/gpu_suite.sh does both).
set -euo pipefail
cd "$(dirname "$0")/.."
min_bytes=$(( ${MIN_MB:-8} * 1024 * 1024 ))
shopt -s nullglob
for wheel in .whl/*.whl; do
  size=$(stat -c %s "$wheel")
  [ "$size" -gt "$min_bytes" ] || continue
  name=$(basename "$wheel" .whl)
  if python3 -c "import sys, zipfile; sys.exit(any('.data/' in n for n in zipfile.ZipFile(sys.argv[1]).namelist()))" "$wheel"; then :; else
    echo "kept $name: it has a .data directory (only pip installs those)"; continue
  fi
  tmp=$(mktemp -d)
  python3 -m zipfile -e "$wheel" "$tmp"
  tar -cJf ".whl/$name.tar.xz" -C "$tmp" .
  rm -rf "$tmp" "$wheel"
  echo "packed $name: $size -> $(stat -c %s ".whl/$name.tar.xz") bytes"
done
du -sh .whl
echo "On the device, begin the command with (compileall: the bytecode a user's pip install writes; without it a"
echo "timed run's first imports compile diffusers and the project, 10 s of a W17 bench's planning on an H200):"
echo '  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && for f in .whl/*.tar.xz; do tar -xJf "$f" -C .site || exit 1; done; python3 -m compileall -q -j 0 .site worldfoundry plugins >/dev/null; export PYTHONPATH=$PWD/.site:$PWD:$PYTHONPATH;'
