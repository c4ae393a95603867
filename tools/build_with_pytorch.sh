#!/usr/bin/env bash
# Builds gpipe with CMake against the LibTorch inside a PyTorch install (the `torch` package of
# the Python found as $PYTHON, default python3) and runs its tests; CUDA-enabled PyTorch gives a
# CUDA-enabled gpipe whose [cuda] tests run where a GPU is present.
#
#   tools/build_with_pytorch.sh [BUILD_DIR] [cmake arguments...]
#
# Abseil and Catch2 must be findable by CMake (installed, or their prefix passed with
# -DCMAKE_PREFIX_PATH=... among the arguments: it is appended to the PyTorch one). The last line is
# tools/cmake_test.sh's "N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
build=${1:-build/pytorch}
shift || true
torch_prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)') ||
  { echo "no PyTorch found for $py"; echo "0 passed, 1 failed, 0 skipped"; exit 1; }
"$py" -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda,
"GPUs", torch.cuda.device_count() if torch.cuda.is_available() else 0,
"C++11 ABI", torch.compiled_with_cxx11_abi())'
extra=()
prefix="$torch_prefix"
for a in "$@"; do
  if [[ "$a" == -DCMAKE_PREFIX_PATH=* ]]; then
    prefix="$prefix;${a#-DCMAKE_PREFIX_PATH=}"
  else
    extra+=("$a")
  fi
done
exec bash tools/cmake_test.sh "$build" "-DCMAKE_PREFIX_PATH=$prefix" "${extra[@]}"
