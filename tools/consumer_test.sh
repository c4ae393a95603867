#!/usr/bin/env bash
# Installs gpipe from a CMake build folder into a fresh prefix, then builds and runs
# tests/consumer (a project that finds it with find_package(gpipe)) against that prefix.
#
#   tools/consumer_test.sh BUILD_DIR [extra CMAKE_PREFIX_PATH entries, ';'-separated]
#
# Last line: "1 passed, 0 failed" or "0 passed, 1 failed".
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: tools/consumer_test.sh BUILD_DIR [prefix path]}
prefix="$(cd "$build" && pwd)/consumer-install"
rm -rf "$prefix" "$build/consumer"
# A source file that includes every public header (gpipe/public_headers.txt) that was installed
# (the distributed ones only with gpipe::distributed), so that the consumer fails when an
# installed header includes one that was not installed.
headers_cc="$(cd "$build" && pwd)/consumer-headers.cc"
if cmake --install "$build" --prefix "$prefix" > "$build/consumer-install.log" &&
   { echo "// Every installed public header of gpipe (tools/consumer_test.sh)."
     grep -v '^#' gpipe/public_headers.txt | grep . | while read -r h; do
       if [[ -f "$prefix/include/$h" ]]; then echo "#include \"$h\""; fi
     done; } > "$headers_cc" &&
   cmake -S tests/consumer -B "$build/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
     "-DCMAKE_PREFIX_PATH=$prefix${2:+;$2}" "-DGPIPE_CONSUMER_HEADERS=$headers_cc" &&
   cmake --build "$build/consumer" && "$build/consumer/consumer"; then
  echo "1 passed, 0 failed"
else
  echo "find_package(gpipe) consumer test failed"
  echo "0 passed, 1 failed"
  exit 1
fi
