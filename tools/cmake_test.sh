#!/usr/bin/env bash
# Builds gpipe with CMake and Ninja in a build folder and runs every test binary: the one test
# runner shared by CI's CMake step, the Debian 13 builds (tools/debian13.sh) and builds against a
# PyTorch install (tools/build_with_pytorch.sh).
#
#   tools/cmake_test.sh BUILD_DIR [cmake configure arguments...]
#
# Prints each binary's last lines and run time and, as its last line, "N passed, N failed,
# N skipped", added up from the binaries' "gpipe-test-summary:" lines (tests/main.cc); a binary
# that printed none (it crashed or was killed) counts as one failed test case, a build that failed
# as one more. Exits non-zero when anything failed. Logs go to BUILD_DIR/logs/<test>.log.
#
# Environment: JOBS (compile jobs, default 2), TEST_JOBS (test binaries run at once, default 1:
# each test uses fresh ports and folders of its own, but on 2 cores two at once took as long in
# all, the multi-process tests already using both), FIRST_TESTS (test binaries to build and run before
# the others, e.g. "cuda_test"), ONLY_TESTS (build and run these test binaries and nothing else),
# TEST_ARGS (arguments for every test binary, e.g. "[cuda]"), TEST_TIMEOUT (seconds a test binary
# may run, default 1800).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: tools/cmake_test.sh BUILD_DIR [cmake arguments...]}
shift
jobs=${JOBS:-2}
test_jobs=${TEST_JOBS:-1}
passed=0; failed=0; skipped=0

# Runs test binary $1 (in the background, from run_tests): its output in logs/$1.log, its exit
# status and seconds in logs/$1.rc.
run_one() {
  local t=$1 log="$build/logs/$1.log" rc=0
  local args=()
  read -ra args <<< "${TEST_ARGS:-}"
  # A binary that hangs is killed after TEST_TIMEOUT seconds (default 1800) and counted failed.
  local t0=$SECONDS
  (cd "$build" && timeout -k 30 "${TEST_TIMEOUT:-1800}" "./$t" "${args[@]}") > "$log" 2>&1 || rc=$?
  echo "$rc $((SECONDS - t0))" > "$build/logs/$t.rc"
}

# Runs the test binaries given, TEST_JOBS at a time, then reports and counts each in order.
run_tests() {
  local t running=0
  mkdir -p "$build/logs"
  for t in "$@"; do
    if ((running >= test_jobs)); then
      wait -n
      running=$((running - 1))
    fi
    rm -f "$build/logs/$t.rc"
    run_one "$t" &
    running=$((running + 1))
  done
  wait
  for t in "$@"; do report_test "$t"; done
}

# Prints the last lines and time of test binary $1's run and adds its counts.
report_test() {
  local t=$1 log="$build/logs/$1.log" line p=0 f=1 s=0 rc=1 secs=0
  [[ -f "$build/logs/$t.rc" ]] && read -r rc secs < "$build/logs/$t.rc"
  tail -n 3 "$log"
  echo "$t: $secs s"
  line=$(grep -a "gpipe-test-summary:" "$log" | tail -n 1)
  if [[ -z "$line" ]]; then
    echo "=== failures in $t"
    echo "$t printed no test summary: counting one failed test case; its last lines:"
    tail -n 30 "$log"
    echo "=== end of failures in $t"
    failed=$((failed + 1))
    return
  fi
  read -r p f s < <(echo "$line" | sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed, ([0-9]+) skipped.*/\1 \2 \3/')
  # A binary whose test cases passed but that exited non-zero (a sanitizer's report) counts one
  # failed test case.
  if ((rc != 0 && f == 0)); then
    echo "=== failures in $t"
    echo "$t exited with $rc after its tests passed: counting one failed test case"
    # Show the first sanitizer report and a count of them all, so that CI's log says what it was.
    grep -a -m 1 -A 40 -E "WARNING: ThreadSanitizer|ERROR: AddressSanitizer|runtime error:" "$log"
    grep -a "^SUMMARY: " "$log" | sort | uniq -c | head -n 10
    echo "=== end of failures in $t"
    passed=$((passed + p)); failed=$((failed + 1)); skipped=$((skipped + s))
    return
  fi
  if ((f > 0)); then
    # Catch2's report of each failed check (file, line, expression, expansion), so that a log
    # that keeps only these lines (tools/debian13.sh) still says what failed.
    echo "=== failures in $t"
    grep -a -B 4 -A 8 -E "FAILED:|failed with|due to unexpected exception" "$log" | head -n 80
    echo "=== end of failures in $t"
  fi
  passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
}

if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"; then
  echo "cmake configure failed"
  echo "0 passed, 1 failed, 0 skipped"
  exit 1
fi
done_tests=" "
to_run=()
for t in ${ONLY_TESTS:-${FIRST_TESTS:-}}; do
  if cmake --build "$build" -j "$jobs" --target "$t"; then
    run_tests "$t"
  else
    failed=$((failed + 1))
  fi
  done_tests+="$t "
done
if [[ -n "${ONLY_TESTS:-}" ]]; then
  echo "$passed passed, $failed failed, $skipped skipped"
  ((failed == 0))
  exit
fi
# Build everything (and keep going past errors, so that one log shows them all).
if ! cmake --build "$build" -j "$jobs" -- -k 0; then
  echo "cmake build failed: counting one failed test case"
  failed=$((failed + 1))
fi
for t in $(cd "$build" && ctest -N | sed -n -E 's/^ *Test +#[0-9]+: (.*)$/\1/p'); do
  [[ "$done_tests" == *" $t "* ]] && continue
  [[ -x "$build/$t" ]] || { echo "$t was not built"; failed=$((failed + 1)); continue; }
  to_run+=("$t")
done
run_tests "${to_run[@]}"
echo "$passed passed, $failed failed, $skipped skipped"
((failed == 0))
