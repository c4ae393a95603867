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
# A source file that includes every public header (gpipe/public_headers.txt), so that the
# consumer fails when an installed header includes one that was not installed. Each listed header
# must have been installed, except gpipe/distributed's when gpipe::distributed was not built
# (then none of them is).
headers_cc="$(cd "$build" && pwd)/consumer-headers.cc"
public_headers() { sed -e 's/#.*//' -e 's/[[:space:]]//g' gpipe/public_headers.txt | grep .; }
write_headers_cc() {
  local h missing=0 distributed=false
  [[ -d "$prefix/include/gpipe/distributed" ]] && distributed=true
  echo "// Every installed public header of gpipe (tools/consumer_test.sh)."
  while read -r h; do
    if [[ -f "$prefix/include/$h" ]]; then
      echo "#include \"$h\""
    elif [[ "$h" != gpipe/distributed/* ]] || $distributed; then
      echo "consumer_test: $h is listed in gpipe/public_headers.txt but was not installed" >&2
      missing=1
    fi
  done < <(public_headers)
  return $missing
}
if cmake --install "$build" --prefix "$prefix" > "$build/consumer-install.log" &&
   write_headers_cc > "$headers_cc" &&
   cmake -S tests/consumer -B "$build/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
     "-DCMAKE_PREFIX_PATH=$prefix${2:+;$2}" "-DGPIPE_CONSUMER_HEADERS=$headers_cc" &&
   cmake --build "$build/consumer" && "$build/consumer/consumer"; then
  echo "1 passed, 0 failed"
else
  echo "find_package(gpipe) consumer test failed"
  echo "0 passed, 1 failed"
  exit 1
fi
