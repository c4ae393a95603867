#!/usr/bin/env bash
# Checks that each file of gpipe's libraries compiles alone, with only what it includes: unity
# builds (Note [Unity builds] in gpipe/unity.bzl) compile them in groups, where a file after the
# first of its group would compile without an include it needs. Runs `g++ -fsyntax-only` on each
# (no code generated: a few seconds a file), two at a time; prints the files that fail with the
# compiler's first errors, and as its last line "N passed, N failed" (one per file).
#
#   tools/check_includes.sh
set -uo pipefail
cd "$(dirname "$0")/.."
flags=(-std=c++17 -fsyntax-only -Wall -Wextra -Werror -DNDEBUG -DUSE_C10D_GLOO
       -DGPIPE_WITH_DISTRIBUTED=1 -I. -Ithird_party -isystem /usr/include/torch/csrc/api/include)
files=$(ls gpipe/*.cc gpipe/distributed/*.cc balancing/*.cc examples/models/*.cc \
          examples/training/*.cc | grep -v "_test\.cc$")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
check() {
  local f=$1 log
  log="$2/$(echo "$f" | tr / _).log"
  if g++ "${@:3}" "$f" > "$log" 2>&1; then rm -f "$log"; fi
}
export -f check
echo "$files" | xargs -P "${JOBS:-2}" -I{} bash -c 'check "$@"' _ {} "$out" "${flags[@]}"
failed=0
for log in "$out"/*.log; do
  [[ -e "$log" ]] || continue
  failed=$((failed + 1))
  echo "=== $(basename "$log" .log): does not compile alone"
  grep -m 5 "error:" "$log"
done
total=$(echo "$files" | wc -l)
echo "$((total - failed)) passed, $failed failed"
((failed == 0))
