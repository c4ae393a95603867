#!/usr/bin/env bash
# ThreadSanitizer on the tests that use threads (concurrency_test, gpipe_test,
# stage_backward_test, cut_point_test: sections on the pipeline's threads): builds them with
# CMake, -fsanitize=thread and warnings as errors, together with Abseil built from Debian's own
# source package with the same flags, and runs them with the suppressions in tools/tsan.supp.
# Abseil must be instrumented: absl::Mutex tells TSan about its locking only through annotations
# compiled into Abseil, so with Debian's binary Abseil every access guarded by an absl::Mutex is
# reported as a race. (The distributed tests are not run here: c10d's Gloo backend, inside the
# uninstrumented LibTorch, is reported throughout: reference counts and condition variables that
# TSan cannot see ordered.)
#
#   tools/tsan.sh [BUILD_DIR]     (default build/tsan; Abseil's sources are kept in
#                                  BUILD_DIR/absl-src and reused)
#
# The last line is tools/cmake_test.sh's "N passed, N failed, N skipped"; a TSan report fails the
# binary that printed it (exit code 66).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/tsan}
root=$PWD
mkdir -p "$build"
build=$(cd "$build" && pwd)
flags="-fsanitize=thread -O1 -g1"

src="$build/absl-src"
if ! ls -d "$src"/abseil-*/ > /dev/null 2>&1; then
  echo "=== Abseil's sources (Debian's source package, the installed libabsl-dev's version)"
  . /etc/os-release
  rm -rf "$src" && mkdir -p "$src/lists/partial" "$src/cache/archives/partial"
  {
    echo "deb-src http://deb.debian.org/debian $VERSION_CODENAME main"
    echo "deb-src http://deb.debian.org/debian-security $VERSION_CODENAME-security main"
  } > "$src/sources.list"
  # A private source list, package lists and cache: the machine's own apt state is not touched.
  apt=(-q -o "Dir::Etc::SourceList=$src/sources.list" -o Dir::Etc::SourceParts=/dev/null
       -o "Dir::State::Lists=$src/lists" -o "Dir::Cache=$src/cache")
  version=$(dpkg-query -W -f='${source:Version}' libabsl-dev)
  (cd "$src" && apt-get "${apt[@]}" update > /dev/null &&
     apt-get "${apt[@]}" source --download-only "abseil=$version" > /dev/null 2>&1 &&
     mkdir -p unpack && tar xzf abseil_*.orig.tar.gz -C unpack && mv unpack/abseil-* .) ||
    { echo "could not download Abseil's source"; echo "0 passed, 1 failed, 0 skipped"; exit 1; }
fi

echo "=== gpipe's threaded tests with -fsanitize=thread"
# The libraries in unity groups (Note [Unity builds]): 149 s for this stage against 446 s file by
# file, its tests passing either way (docs/building.md).
# One intra-op thread: OpenMP's own synchronisation inside LibTorch is invisible to TSan.
export OMP_NUM_THREADS=1
export TSAN_OPTIONS="suppressions=$root/tools/tsan.supp exitcode=66 halt_on_error=0 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
ONLY_TESTS="${ONLY_TESTS:-concurrency_test gpipe_test stage_backward_test cut_point_test}" bash tools/cmake_test.sh "$build/gpipe" \
  -DGPIPE_ABSL_SOURCE_DIR="$(ls -d "$src"/abseil-*/ | head -n 1)" -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_CXX_FLAGS_RELEASE=-DNDEBUG -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread -DGPIPE_WERROR=ON \
  -DGPIPE_UNITY_BUILD=ON
