#!/usr/bin/env bash
# GPipe's overhead per task counted in instructions, not timed: benchmarks/overhead's floor and
# GPipe steps run under valgrind's callgrind, which counts the instructions each executes, the same
# on a busy machine as on a quiet one (the wall-clock overhead of one configuration moved between
# 16 and 30 us per task from run to run on the project's 2-vCPU VM). Prints, per configuration,
# the instructions per task of the floor and of GPipe and their difference.
#
#   bazel build -c opt //benchmarks:overhead
#   benchmarks/overhead_instructions.sh [bazel-bin/benchmarks/overhead] [4x128:never,4x128:except_last]
#
# Needs valgrind (apt-get install valgrind). About a minute per configuration.
set -euo pipefail
binary=${1:-bazel-bin/benchmarks/overhead}
configurations=${2:-4x128:never,4x128:except_last}
rounds=3
command -v valgrind > /dev/null || { echo "overhead_instructions.sh: needs valgrind" >&2; exit 1; }
[[ -x "$binary" ]] || { echo "overhead_instructions.sh: no $binary; bazel build -c opt //benchmarks:overhead" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The instructions of one counted function over a run: callgrind's total while it is on the stack.
count() {
  local config=$1 function=$2
  valgrind --tool=callgrind --callgrind-out-file="$work/out" \
    "--toggle-collect=(anonymous namespace)::$function(std::function<void ()> const&, int)" \
    "$binary" --only="$config" --count_rounds=$rounds --warmup=1 > "$work/stdout" 2> "$work/stderr"
  grep -q "counted $rounds rounds" "$work/stdout" || { cat "$work/stderr" >&2; exit 1; }
  sed -nE 's/.*Collected : ([0-9]+).*/\1/p' "$work/stderr"
}
printf "%-20s %14s %14s %14s\n" configuration "floor/task" "gpipe/task" "overhead/task"
IFS=, read -ra configs <<< "$configurations"
for config in "${configs[@]}"; do
  partitions=${config%%x*}
  rest=${config#*x}
  chunks=${rest%%:*}
  tasks=$((partitions * chunks))
  floor=$(count "$config" count_floor_rounds)
  gpipe=$(count "$config" count_gpipe_rounds)
  awk -v c="$config" -v f="$floor" -v g="$gpipe" -v n=$((tasks * rounds)) \
    'BEGIN { printf "%-20s %14.0f %14.0f %14.0f\n", c, f / n, g / n, (g - f) / n }'
done
