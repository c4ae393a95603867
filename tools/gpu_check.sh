#!/usr/bin/env bash
# The checks that only a GPU shows, in one run for a lent GPU machine: builds gpipe against the
# PyTorch of python3 (CUDA), runs every test binary's [cuda] cases, then the reference's
# benchmarks at full size on the GPUs present and benchmarks/cut_points, each under a time limit.
#
#   tools/gpu_check.sh OUT_DIR [PREFIX]
#
# PREFIX holds Abseil and Catch2 2 for CMake (include/, lib/...; Debian 12's copied in works with
# PyTorch's C++11-ABI wheels); logs and the benchmarks' JSON go to OUT_DIR. Environment: JOBS
# (compile jobs, default: the cores), BUILD (build folder, default build/gpu), SKIP_BENCH=1 (tests
# only), RESNET_SAMPLES / AMOEBA_SAMPLES (samples per epoch of the speed runs, two epochs each,
# the first untimed), EXTRA_TARGETS (more CMake targets to build, such as gpt).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu_check.sh OUT_DIR [PREFIX]}
prefix=${2:-}
mkdir -p "$out"
out=$(realpath "$out")  # (the benchmarks run from the build folder)
# Debian's Abseil is found at build time through CMake; at run time through the loader's path.
[[ -n "$prefix" ]] && export LD_LIBRARY_PATH="$prefix/lib/x86_64-linux-gnu:$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
build=${BUILD:-build/gpu}
jobs=${JOBS:-$(nproc)}
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') || exit 1
python3 -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda,
"GPUs", torch.cuda.device_count())'

tests=$(grep -l '\[cuda\]' tests/*/*_test.cc | xargs -n 1 basename | sed 's/\.cc$//')
benches="amoebanetd_memory resnet101_speed unet_memory amoebanetd_speed"
[[ "${SKIP_BENCH:-0}" == 1 ]] && benches=""
[[ -n "$benches" ]] && benches="plan_accuracy $benches cut_points"
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
passed=0; failed=0
for t in $tests; do
  (cd "$build" && timeout -k 10 300 "./$t" "$filter") > "$out/$t.log" 2>&1
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
stamp "[cuda] tests: $passed passed, $failed failed"

run_bench() {  # name, seconds, arguments...
  local name=$1 limit=$2
  shift 2
  stamp "$name $*"
  (cd "$build" && timeout -k 10 "$limit" "./$name" --size=full --json_out="$(realpath "$out")/$name.json" "$@") \
    > "$out/$name.log" 2>&1
  echo "rc $?"
  grep -a -v "^\s*$" "$out/$name.log" | tail -n 14
}
if [[ -n "$benches" ]]; then
  # The planner's predictions against measured steps on the GPU (issue 40): every partition on the
  # one GPU, then the planner placing two on {cuda:0, cpu} (Note [Placement]).
  for devices in cuda:0,cuda:0,cuda:0 cuda:0,cpu; do
    stamp "plan_accuracy --devices=$devices"
    (cd "$build" && timeout -k 10 240 ./plan_accuracy --devices="$devices" --rounds=1 \
      --models=resnet8,amoebanet,mlp --timeout=0.5 --repeats=5 --compare_defaults=false \
      --json_out="$(realpath "$out")/plan_accuracy_${devices//[:,]/_}.json") \
      > "$out/plan_accuracy_${devices//[:,]/_}.log" 2>&1
    echo "rc $?"
    grep -a -E "^(resnet8|amoebanet|mlp) |configurations:" "$out/plan_accuracy_${devices//[:,]/_}.log" | tail -n 20
  done
  run_bench amoebanetd_memory 120
  run_bench resnet101_speed 150 --epochs=2 --dataset_size="${RESNET_SAMPLES:-10240}"
  run_bench unet_memory 90
  run_bench amoebanetd_speed 120 --epochs=2 --dataset_size="${AMOEBA_SAMPLES:-2560}"
  # Cut points on the GPU: each section's forward against its own layers (docs/cut-points.md).
  stamp "cut_points --device=cuda"
  (cd "$build" && timeout -k 10 120 ./cut_points --device=cuda --repeats=100) \
    > "$out/cut_points.log" 2>&1
  echo "rc $?"
  grep -a -v "^\s*$" "$out/cut_points.log" | tail -n 9
fi
stamp done
echo "$passed passed, $failed failed"
