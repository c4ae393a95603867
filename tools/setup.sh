#!/usr/bin/env bash
# Installs everything gpipe needs to build and test on a fresh Debian 12 machine, from Debian's
# packages: a C++ compiler, Bazel 4 with Debian's Java rules, CMake and Ninja, LibTorch (CPU),
# Abseil, Catch2 2, nlohmann's JSON (the planner's files), OpenBLAS (LibTorch's CPU kernels use the reference BLAS otherwise, several
# times slower), zlib and Fashion-MNIST (the example trainers' data), the Gloo headers (c10d's CPU
# process group, compiled into Debian's LibTorch; gpipe/distributed), and Doxygen (the API
# reference, tools/api_docs.sh). Idempotent: installs only what is missing.
#
#   sudo tools/setup.sh
set -euo pipefail

die() {
  echo "tools/setup.sh: $*" >&2
  exit 1
}

[[ -r /etc/os-release ]] || die "cannot tell which system this is (no /etc/os-release); gpipe's setup supports Debian 12 (bookworm)"
# shellcheck disable=SC1091
. /etc/os-release
[[ "${ID:-}" == "debian" ]] || die "this is ${PRETTY_NAME:-an unknown system}, not Debian; install the packages listed in docs/building.md by hand"
[[ "${VERSION_ID:-}" == "12" ]] || echo "tools/setup.sh: warning: tested on Debian 12, this is ${PRETTY_NAME}" >&2

SUDO=()
if [[ "$(id -u)" != 0 ]]; then
  command -v sudo >/dev/null 2>&1 || die "installing packages needs root: run as root or install sudo"
  SUDO=(sudo)
fi

PACKAGES=(
  g++ cmake ninja-build
  bazel-bootstrap bazel-rules-java
  libtorch-dev libabsl-dev catch2
  libopenblas0-pthread
  zlib1g-dev dataset-fashion-mnist
  # The planner's profiles and plans are JSON files (balancing/plan.h).
  nlohmann-json3-dev
  # //examples:gpt trains on the fortunes' English text.
  fortunes
  # gpipe/distributed: Gloo's headers (LibTorch has c10d and Gloo compiled in), and torchrun (in
  # PyTorch's Python package) to launch the distributed trainers and benchmarks.
  libgloo-dev python3-torch
  # The API reference from the public headers' `///` comments (tools/api_docs.sh; CI fails on an
  # undocumented public member).
  doxygen
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} > 0)); then
  echo "tools/setup.sh: installing ${missing[*]}"
  "${SUDO[@]}" apt-get update -q
  # Without recommended packages (GTK, Qt, VA drivers, systemd, GnuPG, ... that the listed
  # packages recommend): 490 packages instead of 625 on a bare Debian 12 (docs/building.md,
  # "Setup time").
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -q --no-install-recommends \
    "${missing[@]}" \
    || die "apt-get could not install ${missing[*]}"
else
  echo "tools/setup.sh: all packages present"
fi

# LibTorch links libblas.so.3; make sure it resolves to OpenBLAS, not the reference BLAS.
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null || true)
case "$blas" in
  *openblas*) echo "tools/setup.sh: BLAS is OpenBLAS ($blas)" ;;
  *) echo "tools/setup.sh: warning: libblas.so.3 is $blas, not OpenBLAS; LibTorch's CPU kernels will be slow" >&2 ;;
esac
echo "tools/setup.sh: done"
