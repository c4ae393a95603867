#!/usr/bin/env bash
# Builds and tests gpipe against Debian 13's LibTorch 2.6, with GCC 14 and Catch2 3, inside
# Debian 13 roots made with debootstrap: the CUDA build (libtorch-cuda-dev with CUDA 12 and NCCL;
# GPIPE_WITH_CUDA and GPIPE_WITH_NCCL on, [cuda] tests compiled, and skipped for want of a GPU),
# which is CI's, or the CPU build (libtorch-dev). Both are C++20, under AddressSanitizer and
# UndefinedBehaviorSanitizer (-O1), warnings as errors, and run every test. A CUDA-enabled LibTorch
# runs every CPU path too, so one build serves CI (two took it 8 minutes more).
#
#   sudo tools/debian13.sh [--prepare] [cpu|cuda|all]        (default: cuda)
#
# --prepare only makes the roots (debootstrap and apt: mostly downloading), so that CI can do it
# in the background while it builds something else.
#
# The roots are kept in $GPIPE_DEBIAN13_CACHE (default /var/cache/gpipe: trixie-base,
# trixie-cpu, trixie-cuda) and made again when missing or when their package list changes. The
# CUDA root does without cuDNN: Debian's nvidia-cudnn is only an installer that downloads it from
# NVIDIA, so an empty stand-in package (equivs) satisfies libtorch-cuda-2.6's dependency, and a
# stub libcudnn.so.9 defining the cuDNN symbols libtorch_cuda.so imports lets it load (it is
# linked with BIND_NOW). Nothing calls cuDNN without a GPU. See docs/building.md.
#
# For each variant it prints the LibTorch version, the compiler and the C++ standard, then
# tools/cmake_test.sh's count; it also installs gpipe and builds a project that finds it with
# find_package(gpipe) (tools/consumer_test.sh). The last line adds them up:
# "N passed, N failed". Needs root (debootstrap, chroot, mount) and Debian's package mirror.
set -uo pipefail
cd "$(dirname "$0")/.."
src=$PWD
prepare_only=false
if [[ "${1:-}" == --prepare ]]; then
  prepare_only=true
  shift
fi
variants=${1:-cuda}
[[ "$variants" == all ]] && variants="cpu cuda"
cache=${GPIPE_DEBIAN13_CACHE:-/var/cache/gpipe}
mkdir -p "$cache"
# The mirror this machine's apt uses (deb822 or one-line sources), else Debian's own.
# (Comments are skipped: Debian's images name a snapshot.debian.org mirror in one.)
mirror=$(grep -hE '^[[:space:]]*(URIs:|deb[[:space:]])' /etc/apt/sources.list.d/*.sources \
           /etc/apt/sources.list 2>/dev/null | grep -oE 'https?://[^ ]+/debian/?' | head -n 1)
mirror=${mirror:-http://deb.debian.org/debian}

# Gloo's headers (gpipe/distributed): libgloo-dev on CPU; the CUDA LibTorch depends on the CUDA
# build of Gloo, whose headers (libgloo-cuda-dev) conflict with libgloo-dev. OpenBLAS, as
# tools/setup.sh installs it on Debian 12: without it LibTorch's libblas.so.3 is the reference BLAS
# (resnet_test under the sanitizers took 99 s with it, 86 s with OpenBLAS).
common="cmake ninja-build g++ libabsl-dev libcatch2-dev nlohmann-json3-dev libopenblas0-pthread"
cudnn_version="9.0.0.312~cuda12+gpipe1"

# A failure while making a root ends the script: it says why and counts one failure (a variant
# that failed after its root was made is counted by the loop below).
die() { echo "debian13: $*"; echo "$total_passed passed, $((total_failed + 1)) failed"; exit 1; }
total_passed=0
total_failed=0

# Every mount under the cache is undone on exit, and before anything is removed: a root is
# deleted only with nothing mounted in it (a bind mount of /dev left by a killed run would
# otherwise take the host's /dev with it).
unmount_all() {
  local m
  findmnt -rno TARGET | grep -E "^$cache/" | sort -r | while read -r m; do umount -l "$m"; done
}
trap unmount_all EXIT
unmount_all

in_root() {  # in_root ROOT COMMAND...
  chroot "$1" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive "${@:2}"
}

base_root() {
  local base="$cache/trixie-base"
  if [[ ! -f "$base/.gpipe-ready" ]]; then
    echo "=== debootstrap Debian 13 (trixie) from $mirror"
    command -v debootstrap > /dev/null || apt-get install -y -q debootstrap > /dev/null ||
      die "cannot install debootstrap"
    unmount_all
    rm -rf --one-file-system "$base"
    debootstrap --variant=minbase trixie "$base" "$mirror" > "$cache/debootstrap.log" 2>&1 ||
      { tail -n 20 "$cache/debootstrap.log"; die "debootstrap failed"; }
    touch "$base/.gpipe-ready"
  fi
}

# An empty package standing in for nvidia-cudnn (the installer script that downloads cuDNN).
cudnn_stand_in() {
  local dir="$cache/cudnn-stand-in"
  local deb="$dir/nvidia-cudnn_${cudnn_version}_all.deb"
  if [[ ! -f "$deb" ]]; then
    command -v equivs-build > /dev/null || apt-get install -y -q equivs > /dev/null ||
      die "cannot install equivs"
    rm -rf "$dir" && mkdir -p "$dir"
    cat > "$dir/nvidia-cudnn.ctl" <<EOF
Section: contrib/libs
Priority: optional
Standards-Version: 3.9.2
Package: nvidia-cudnn
Version: $cudnn_version
Provides: libcudnn.so.9
Description: empty stand-in for the cuDNN installer script (gpipe's Debian 13 CUDA build)
 Satisfies libtorch-cuda-2.6's dependency without downloading cuDNN from NVIDIA.
EOF
    (cd "$dir" && equivs-build nvidia-cudnn.ctl > build.log 2>&1) || die "equivs-build failed"
  fi
  echo "$deb"
}

# A libcudnn.so.9 that defines (as empty functions) every cuDNN symbol libtorch_cuda.so imports,
# with the version node those imports name.
cudnn_stub() {
  local root=$1 lib
  lib=$(in_root "$root" sh -c 'ls /usr/lib/x86_64-linux-gnu/libtorch_cuda.so* | head -n 1')
  in_root "$root" sh -c "
    objdump -T $lib | awk '/\\*UND\\*/ && \$NF ~ /^cudnn/ {print \$NF}' | sort -u > /tmp/cudnn.syms
    [ -s /tmp/cudnn.syms ] || exit 1
    sed 's/.*/void &(void) {}/' /tmp/cudnn.syms > /tmp/cudnn_stub.c
    echo 'libcudnn.so.9 { global: *; };' > /tmp/cudnn_stub.map
    gcc -shared -fPIC -o /usr/lib/x86_64-linux-gnu/libcudnn.so.9 /tmp/cudnn_stub.c \
      -Wl,-soname,libcudnn.so.9 -Wl,--version-script=/tmp/cudnn_stub.map && ldconfig
    wc -l < /tmp/cudnn.syms" || die "could not make the cuDNN stub"
}

make_root() {  # make_root VARIANT
  local v=$1 root="$cache/trixie-$1" packages sources deb=""
  if [[ "$v" == cpu ]]; then
    # zlib and Fashion-MNIST: the example trainers and their data test.
    packages="libtorch-dev libgloo-dev zlib1g-dev dataset-fashion-mnist $common"
    sources="deb $mirror trixie main"
  else
    deb=$(cudnn_stand_in) || die "could not build the nvidia-cudnn stand-in: $deb"
    # libnccl-dev: NCCL's headers, for c10d's NCCL group (gpipe/distributed's "nccl" backend).
    packages="/tmp/$(basename "$deb") libtorch-cuda-dev libgloo-cuda-dev libnccl-dev nvidia-cuda-toolkit zlib1g-dev dataset-fashion-mnist $common"
    sources="deb $mirror trixie main contrib non-free non-free-firmware"
  fi
  if [[ -f "$root/.gpipe-ready" && "$(cat "$root/.gpipe-ready")" == "$packages" ]]; then
    return
  fi
  echo "=== Debian 13 root for the $v build: $packages"
  base_root
  unmount_all
  rm -rf --one-file-system "$root"
  cp -a "$cache/trixie-base" "$root"
  echo "$sources" > "$root/etc/apt/sources.list"
  [[ -n "$deb" ]] && cp "$deb" "$root/tmp/"
  # shellcheck disable=SC2086
  in_root "$root" sh -c "apt-get update -q && apt-get install -y -q --no-install-recommends \
    $packages" > "$root.log" 2>&1 || { tail -n 30 "$root.log"; die "apt-get failed in $root"; }
  if [[ "$v" == cuda ]]; then
    local symbols
    symbols=$(cudnn_stub "$root") || die "could not make the cuDNN stub in $root"
    echo "cuDNN stub: $symbols symbols"
  fi
  echo "$packages" > "$root/.gpipe-ready"
}

# Adds a "N passed, N failed" line (else one failure) to the totals.
count() {
  echo "debian13 $2: $1"
  if [[ "$1" =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed ]]; then
    total_passed=$((total_passed + BASH_REMATCH[1]))
    total_failed=$((total_failed + BASH_REMATCH[2]))
  else
    total_failed=$((total_failed + 1))
  fi
}
for v in $variants; do
  [[ "$v" == cpu || "$v" == cuda ]] || die "unknown variant '$v' (cpu, cuda or all)"
  start=$(date +%s)
  make_root "$v"
  root="$cache/trixie-$v"
  if $prepare_only; then
    echo "debian13 $v: root ready ($(($(date +%s) - start)) s)"
    continue
  fi
  mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
  mountpoint -q "$root/dev" || mount --bind /dev "$root/dev"
  # The working tree as git sees it (tracked and untracked-but-not-ignored files). Into a fresh
  # folder, then only the files whose contents changed are copied over the kept copy, stamped
  # now: with the sources' own times, a file edited while an earlier build compiled its old
  # contents looked older than that object, and the kept build ran the stale object.
  rm -rf "$root/src/gpipe.new" && mkdir -p "$root/src/gpipe.new" "$root/src/gpipe"
  git -C "$src" ls-files -z --cached --others --exclude-standard |
    (cd "$src" && tar --null -T - -cf -) | tar -xf - -C "$root/src/gpipe.new"
  (cd "$root/src/gpipe.new" && find . -type f -print0) | while IFS= read -r -d '' f; do
    cmp -s "$root/src/gpipe.new/$f" "$root/src/gpipe/$f" ||
      { mkdir -p "$(dirname "$root/src/gpipe/$f")" && cp "$root/src/gpipe.new/$f" "$root/src/gpipe/$f"; }
  done
  (cd "$root/src/gpipe" && find . -type f -print0) | while IFS= read -r -d '' f; do
    [[ -e "$root/src/gpipe.new/$f" ]] || rm -f "$root/src/gpipe/$f"
  done
  rm -rf "$root/src/gpipe.new"
  # CI's AddressSanitizer + UndefinedBehaviorSanitizer run of every test (at -O1): one build
  # serves both, where a separate sanitized build took CI another 15 min.
  # (The programs are left out: Bazel compiles them, and here they cost about 8 minutes.)
  # File by file (-DGPIPE_UNITY_BUILD=OFF, also when a kept build folder cached ON): this build
  # also checks that each library file includes what it uses.
  args="-DCMAKE_CXX_STANDARD=20 -DGPIPE_SANITIZE=address,undefined -DGPIPE_PROGRAMS=OFF"
  args+=" -DGPIPE_UNITY_BUILD=OFF"
  torch_pkg=libtorch-dev
  [[ "$v" == cuda ]] && torch_pkg=libtorch-cuda-dev
  echo "=== Debian 13, $v: $(in_root "$root" dpkg-query -W -f='${Package} ${Version}' "$torch_pkg"), $(in_root "$root" g++ --version | head -n 1)"
  log="$cache/trixie-$v-test.log"
  # (LibTorch keeps allocations to its exit: LeakSanitizer is off.)
  sanitizer_env="ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0 UBSAN_OPTIONS=print_stacktrace=1"
  in_root "$root" sh -c "cd /src/gpipe && $sanitizer_env JOBS=${JOBS:-2} TEST_JOBS=${TEST_JOBS:-1} \
    bash tools/cmake_test.sh /build/gpipe -DGPIPE_WERROR=ON $args" > "$log" 2>&1
  grep -E "^-- gpipe:" "$log"
  grep -E "error:|warning:" "$log" | head -n 20
  # What failed, as tools/cmake_test.sh reports it.
  sed -n '/^=== failures in /,/^=== end of failures in /p' "$log" | head -n 200
  count "$(tail -n 1 "$log")" "$v"
  # A project of the user's, built against the installed tree with find_package(gpipe).
  in_root "$root" sh -c "cd /src/gpipe && $sanitizer_env bash tools/consumer_test.sh /build/gpipe" \
    > "$cache/trixie-$v-consumer.log" 2>&1
  grep "gpipe consumer:" "$cache/trixie-$v-consumer.log"
  count "$(tail -n 1 "$cache/trixie-$v-consumer.log")" "$v find_package(gpipe) consumer"
  echo "debian13 $v: $(($(date +%s) - start)) s"
done
echo "$total_passed passed, $total_failed failed"
((total_failed == 0))
