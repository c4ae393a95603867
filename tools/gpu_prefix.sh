#!/usr/bin/env bash
# Gathers what a PyTorch wheel lacks for building gpipe on a lent GPU machine into one prefix
# folder (about 11 MiB): Debian 12's Abseil (headers, shared libraries, CMake package), Catch2 2
# (headers, CMake package) and Gloo's headers (c10d's ProcessGroupGloo.hpp includes them). Run it
# here, where tools/setup.sh installed them; carry the folder to the GPU machine and pass it to
# tools/gpu_check.sh as PREFIX.
#
#   tools/gpu_prefix.sh build/gpu-prefix    # build/ is ignored by git, so `carry` must name it
set -euo pipefail
dest=${1:?usage: tools/gpu_prefix.sh DEST}
arch=lib/x86_64-linux-gnu
for need in /usr/include/absl /usr/include/catch2 /usr/include/gloo /usr/$arch/cmake/absl \
  /usr/lib/cmake/Catch2; do
  [[ -e "$need" ]] || { echo "missing $need: run tools/setup.sh first" >&2; exit 1; }
done
rm -rf "$dest"
mkdir -p "$dest/include" "$dest/$arch/cmake" "$dest/lib/cmake"
cp -a /usr/include/absl /usr/include/catch2 /usr/include/gloo "$dest/include/"
cp -a /usr/$arch/cmake/absl "$dest/$arch/cmake/"
cp -a /usr/$arch/libabsl_*.so* "$dest/$arch/"
cp -a /usr/lib/cmake/Catch2 "$dest/lib/cmake/"
du -sh "$dest"
