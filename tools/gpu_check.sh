#!/usr/bin/env bash
# The checks that only a GPU shows, in one run for a lent GPU machine: builds gpipe against the
# PyTorch of python3 (CUDA), then runs the parts named in PARTS, each under a time limit:
#   tests      every test binary's [cuda] cases;
#   overlap    benchmarks/copy_overlap: copies beside computation, and each lane's lag with the
#              engine's division of the cores and with LibTorch's thread counts (issue 36);
#   schedules  benchmarks/schedule_efficiency on cuda:0, every schedule (issue 40);
#   plan       benchmarks/plan_accuracy on cuda:0 and on {cuda:0, cpu} (issue 40);
#   reference  the reference's benchmarks at full size;
#   cut_points benchmarks/cut_points on the GPU.
#
#   tools/gpu_check.sh OUT_DIR [PREFIX]
#
# PREFIX holds Abseil, Catch2 2 and Gloo's headers for CMake (tools/gpu_prefix.sh makes one from
# Debian 12's; one inside the source tree, where a carried one lies, is copied out first: CMake
# refuses include folders under the source tree); logs and the benchmarks' JSON go to OUT_DIR.
# Environment: PARTS (default "tests overlap schedules plan reference cut_points"; a lease's
# command: "tests overlap schedules plan" with DEADLINE=540, docs/building.md), JOBS (compile
# jobs, default: the cores), BUILD (build folder, default build/gpu), RESNET_SAMPLES /
# AMOEBA_SAMPLES (samples per epoch of the speed runs, two epochs each, the first untimed),
# EXTRA_TARGETS (more CMake targets to build, such as gpt), DEADLINE (seconds from the start by
# which the script must be done: each later part's limit is cut to what is left, and a part with
# under 30 s left is skipped, so that one call of a lease's command runs the parts in order and
# returns what they measured before its own limit). SKIP_BENCH=1, the old spelling, means
# PARTS=tests.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu_check.sh OUT_DIR [PREFIX]}
prefix=${2:-}
mkdir -p "$out"
out=$(realpath "$out")  # (the benchmarks run from the build folder)
if [[ -n "$prefix" ]]; then
  prefix=$(realpath "$prefix")
  if [[ "$prefix" == "$(pwd)"/* ]]; then
    rm -rf /tmp/gpipe-prefix && cp -a "$prefix" /tmp/gpipe-prefix && prefix=/tmp/gpipe-prefix
  fi
  # Debian's Abseil is found at build time through CMake; at run time through the loader's path.
  export LD_LIBRARY_PATH="$prefix/lib/x86_64-linux-gnu:$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
parts=" ${PARTS:-tests overlap schedules plan reference cut_points} "
[[ "${SKIP_BENCH:-0}" == 1 ]] && parts=" tests "
has() { [[ "$parts" == *" $1 "* ]]; }
build=${BUILD:-build/gpu}
jobs=${JOBS:-$(nproc)}
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
# The limit for a part that may take $1 seconds: less where DEADLINE leaves less (0: skip it).
limit() {
  local want=$1 left
  [[ -z "${DEADLINE:-}" ]] && { echo "$want"; return; }
  left=$((DEADLINE - (SECONDS - t0) - 10))
  ((left < 30)) && { echo 0; return; }
  echo $((left < want ? left : want))
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# The host's CPUs (the lanes' threads share them: Note [Dividing the cores] in gpipe/worker.h).
echo "nproc $(nproc); cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2> /dev/null || echo none)"
lscpu 2> /dev/null | grep -E "^(CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|Model name):"
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') || exit 1
python3 -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda,
"GPUs", torch.cuda.device_count())'

tests=""
has tests && tests=$(grep -l '\[cuda\]' tests/*/*_test.cc | xargs -n 1 basename | sed 's/\.cc$//')
benches=""
has overlap && benches+=" copy_overlap"
has schedules && benches+=" schedule_efficiency"
has plan && benches+=" plan_accuracy"
has reference && benches+=" amoebanetd_memory resnet101_speed unet_memory amoebanetd_speed"
has cut_points && benches+=" cut_points"
extra=${EXTRA_TARGETS:-}
stamp configure
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_PREFIX_PATH=$torch_prefix${prefix:+;$prefix}" > "$out/configure.log" 2>&1 ||
  { tail -n 30 "$out/configure.log"; exit 1; }
grep -E "^-- gpipe" "$out/configure.log"
stamp build $tests $benches $extra
# shellcheck disable=SC2086
cmake --build "$build" -j "$jobs" --target $tests $benches $extra > "$out/build.log" 2>&1 ||
  { grep -E -A 5 "error|FAILED" "$out/build.log" | head -n 60; exit 1; }
stamp built

# The [cuda] cases, less the [gpus2] ones where there is one GPU (a run that names tests runs what
# it names: tests/main.cc leaves them out only of a run that names none).
filter='[cuda]'
(($(nvidia-smi -L | wc -l) < 2)) && filter='[cuda]~[gpus2]'
passed=0; failed=0; skipped=0  # (skipped: test binaries DEADLINE left out)
for t in $tests; do
  seconds=$(limit 300)
  ((seconds == 0)) && { stamp "$t: skipped (DEADLINE)"; skipped=$((skipped + 1)); continue; }
  (cd "$build" && timeout -k 10 "$seconds" "./$t" "$filter") > "$out/$t.log" 2>&1
  rc=$?
  line=$(grep -a "gpipe-test-summary:" "$out/$t.log" | tail -n 1)
  stamp "$t (rc $rc): ${line:-no summary}"
  if [[ -z "$line" ]]; then failed=$((failed + 1)); continue; fi
  read -r p f _ < <(echo "$line" | sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed, ([0-9]+) skipped.*/\1 \2 \3/')
  # (Catch2 3 exits with 2 when a filter matched no test: not a failure.)
  ((rc != 0 && f == 0 && p > 0)) && f=1
  passed=$((passed + p)); failed=$((failed + f))
  ((f > 0)) && grep -a -B 5 -A 25 "FAILED" "$out/$t.log" | head -n 80
done
[[ -n "$tests" ]] && stamp "[cuda] tests: $passed passed, $failed failed; $skipped binaries skipped"

# Runs program `name` from the build folder under a limit of `seconds`, its output in OUT/name.log
# and (most programs) its JSON in OUT/name.json; prints the end of its output.
run_prog() {  # name, seconds, arguments...
  local name=$1 seconds
  seconds=$(limit "$2")
  shift 2
  ((seconds == 0)) && { stamp "$name: skipped (DEADLINE)"; return; }
  stamp "$name $* (limit $seconds s)"
  (cd "$build" && timeout -k 10 "$seconds" "./$name" "$@") > "$out/$name.log" 2>&1
  echo "rc $?"
  grep -a -v "^\s*$" "$out/$name.log" | tail -n 40
}
run_bench() {  # the reference's benchmarks: name, seconds, arguments...
  run_prog "$1" "$2" --size=full --json_out="$out/$1.json" "${@:3}"
}
if has overlap; then
  # Copies beside computation (docs/benchmarks.md); each lane's lag with the engine's division of
  # the cores and without (Note [Dividing the cores] in gpipe/worker.h).
  mkdir -p "$out/traces"
  run_prog copy_overlap 240 --steps=9 --rounds=3 --cores=engine,libtorch \
    --trace_dir="$out/traces" --json_out="$out/copy_overlap.json"
fi
if has schedules; then
  # Every schedule with every partition on the one GPU (docs/benchmarks.md, "Schedules").
  run_prog schedule_efficiency 150 --device=cuda --width=2048 --batch=8192 \
    --microbatches=4,8,16,32 --steps=5
fi
if has plan; then
  # The planner's predictions against measured steps on the GPU (issue 40): every partition on the
  # one GPU, then the planner placing two on {cuda:0, cpu} (Note [Placement]).
  # (Rows are written as they are measured: a run stopped by its limit keeps them.)
  for devices in cuda:0,cuda:0,cuda:0 cuda:0,cpu; do
    seconds=$(limit 240)
    ((seconds == 0)) && { stamp "plan_accuracy --devices=$devices: skipped (DEADLINE)"; continue; }
    stamp "plan_accuracy --devices=$devices (limit $seconds s)"
    (cd "$build" && timeout -k 10 "$seconds" ./plan_accuracy --devices="$devices" --rounds=1 \
      --models=resnet8,amoebanet,mlp --timeout=0.5 --repeats=5 --compare_defaults=false \
      --json_out="$out/plan_accuracy_${devices//[:,]/_}.json") \
      > "$out/plan_accuracy_${devices//[:,]/_}.log" 2>&1
    echo "rc $?"
    grep -a -E "^(resnet8|amoebanet|mlp) |configurations:" "$out/plan_accuracy_${devices//[:,]/_}.log" | tail -n 20
  done
fi
if has reference; then
  run_bench amoebanetd_memory 120
  run_bench resnet101_speed 150 --epochs=2 --dataset_size="${RESNET_SAMPLES:-10240}"
  run_bench unet_memory 90
  run_bench amoebanetd_speed 120 --epochs=2 --dataset_size="${AMOEBA_SAMPLES:-2560}"
fi
if has cut_points; then
  # Cut points on the GPU: each section's forward against its own layers (docs/cut-points.md).
  run_prog cut_points 120 --device=cuda --repeats=100
fi
stamp done
echo "$passed passed, $failed failed"
