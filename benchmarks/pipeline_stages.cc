// A pipeline across two processes on loopback: how close its training step comes to the ideal
// speed-up n·m/(m+n−1) over the same two stages run one after the other in one process, and what
// a task costs when it crosses processes. Run it under torchrun:
//
//   torchrun --no_python --nproc_per_node=2 --redirects=1 --tee=1
//            bazel-bin/benchmarks/pipeline_stages --steps=10
//
// Speed: each rank owns one stage of an MLP (--layers blocks of Linear(--width, --width) + Tanh
// per stage, float32, one intra-op thread per process), micro-batches of --rows rows, m = 1 … 32
// micro-batches per step, no checkpointing. The serial baseline is the plain Sequential (both
// stages) trained on the same micro-batches by rank 0 alone, one thread, while rank 1 waits.
// Each m is measured in --rounds rounds, each the pipeline's steps then the baseline's, and the
// speed-up is the median of the rounds' (Note [Measuring in rounds]).
// Beside it, rank 0 alone runs both stages as two partitions of one PipelineStage (a thread each,
// stage-local backward: Note [Partitions within a stage]) on the same micro-batches.
// Overhead: the same with one Linear(16, 16) per stage and one-row micro-batches, where a step is
// almost all overhead, against a GPipe in one process with two partitions (one worker each).
// --schedule=1f1b, zb, interleaved, zb1p, zbv or dualpipev runs the stages under that schedule
// (speed only; zbv and dualpipev: 4 slices in a V, stage 0 holding the first and the last;
// interleaved and zb1p: --virtual_stages per process, each a slice of the stage's blocks, and
// even m only;
// --microbatch_group g for the m that g divides, Note [Micro-batch groups] in gpipe/schedule.h).
// --bind_cores_to_rank binds each process to its share of the cores (Note [Binding cores to
// ranks] in gpipe/distributed/core_binding.h); rank 0's runs alone use every core.
// --shared_memory=0 sends every micro-batch over Gloo instead of through the stages' rings of
// shared memory (Note [Shared memory between stages on one host] in
// gpipe/distributed/internal/shared_memory.h).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "benchmarks/timing.h"
#include "gpipe/distributed/core_binding.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/gpipe.h"
#include "gpipe/schedule.h"
#include "gpipe/schedule_check.h"
#include "gpipe/trace.h"
#include "gpipe/worker.h"

ABSL_FLAG(int, steps, 10, "timed steps per configuration and round (after 2 untimed ones)");
ABSL_FLAG(int, rounds, 3,
          "rounds per m, each the pipeline's steps then the baseline's (the speed-up: the median "
          "of the rounds')");
ABSL_FLAG(int64_t, width, 512, "features of each Linear layer");
ABSL_FLAG(int, layers, 4, "Linear + Tanh blocks per stage");
ABSL_FLAG(int64_t, rows, 128, "rows per micro-batch");
ABSL_FLAG(std::string, svg, "",
          "also draw one step with 8 micro-batches across both processes as SVG to this file "
          "(rank 0)");
ABSL_FLAG(std::string, trace, "", "and write that step as Chrome-trace JSON to this file");
ABSL_FLAG(std::string, json_out, "", "also write the results as JSON to this file (rank 0)");
ABSL_FLAG(std::string, schedule, "gpipe",
          "the stages' schedule: gpipe, 1f1b, interleaved, zb, zb1p, zbv or dualpipev (ideal: "
          "one thread's time / 2 / (1 - the schedule's simulated bubble, F = I = W = 1))");
ABSL_FLAG(int64_t, virtual_stages, 2, "with --schedule=interleaved: virtual stages per process");
ABSL_FLAG(bool, bind_cores_to_rank, false,
          "bind each process to its share of the host's cores (Note [Binding cores to ranks] in "
          "gpipe/distributed/core_binding.h); rank 0's one-process runs (the serial baseline and "
          "the two partitions) run unbound, on every core");
ABSL_FLAG(int64_t, microbatch_group, 0,
          "with --schedule=interleaved: micro-batches per group (0: the stages, 2), for each m "
          "that it divides (the others: 2)");

ABSL_FLAG(int64_t, shared_memory, int64_t{8} << 20,
          "bytes of each shared-memory ring between the stages (PipelineStageOptions::"
          "shared_memory); 0: every link over Gloo");

namespace {

using gpipe_benchmarks::median;

namespace nn = torch::nn;
using gpipe::distributed::PipelineStage;
using gpipe::distributed::PipelineStageOptions;
using gpipe::distributed::ProcessGroup;

nn::Sequential mlp(int64_t width, int layers_per_stage) {
  at::manual_seed(0);
  nn::Sequential seq;
  for (int k = 0; k < 2 * layers_per_stage; ++k) {
    seq->push_back(nn::Linear(width, width));
    seq->push_back(nn::Tanh());
  }
  return seq;
}

at::Tensor mse(const gpipe::Batch& out, const at::Tensor& y) {
  return nn::functional::mse_loss(out.tensor(), y);
}

// v: the virtual stages per process (1 unless interleaved or zb1p; 2 on a V: zbv, dualpipev).
int64_t virtual_stages() {
  const gpipe::ScheduleKind kind = gpipe::schedule_kind(absl::GetFlag(FLAGS_schedule));
  if (gpipe::v_shaped(kind)) return 2;
  return gpipe::takes_virtual_stages(kind) ? absl::GetFlag(FLAGS_virtual_stages) : 1;
}

// Whether the schedule needs m to be a multiple of the stages (interleaving with v > 1).
bool interleaves() {
  return gpipe::takes_virtual_stages(gpipe::schedule_kind(absl::GetFlag(FLAGS_schedule))) &&
         virtual_stages() > 1;
}

// The micro-batch group for m micro-batches (0: the schedule's default).
int64_t microbatch_group(int64_t m) {
  const int64_t g = absl::GetFlag(FLAGS_microbatch_group);
  const bool grouped =
      gpipe::schedule_kind(absl::GetFlag(FLAGS_schedule)) == gpipe::ScheduleKind::kInterleaved;
  return grouped && interleaves() && g > 0 && m % g == 0 ? g : 0;
}

// The two stages' balance over mlp(width, layers)'s 4 * layers modules: 2 * v slices (the last
// takes what is left).
std::vector<int64_t> stage_balance(int layers) {
  const int64_t v = virtual_stages();
  std::vector<int64_t> balance(2 * v, 4 * layers / (2 * v));
  balance.back() += 4 * layers - 2 * v * balance.back();
  return balance;
}

// Note [Measuring in rounds]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On the shared 2-core machine the same configuration's speed-up moved between 65% and 83% of
// its ideal from one run to the next (docs/journal/2026-11-26-benchmarks.md, "measured in
// rounds, and micro-batch groups"): the machine's speed drifts over
// seconds, and a baseline timed a few seconds away from the pipeline is timed on another
// machine, in effect. So each m is measured in rounds, each the pipeline's steps right before the
// baseline's, and the speed-up reported is the median of the rounds' speed-ups (a round's ratio
// sees one speed of the machine); the milliseconds shown are the medians over the rounds.

// Median milliseconds of `step` over the timed steps (`warmup` untimed ones first).
template <typename F>
double time_ms(F step, int warmup = 2) {
  std::vector<double> ms;
  for (int s = 0; s < absl::GetFlag(FLAGS_steps) + warmup; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    const double t = gpipe_benchmarks::ms_since(t0);
    if (s >= warmup) ms.push_back(t);
  }
  return median(ms);
}

// Both ranks: one training step of the two-process pipeline.
std::function<void()> pipeline_step(const ProcessGroup& group, int64_t width, int layers,
                                    int64_t rows, int64_t m) {
  const nn::Sequential seq = mlp(width, layers);
  const int64_t v = virtual_stages();
  auto stage = std::make_shared<PipelineStage>(
      seq, PipelineStageOptions(stage_balance(layers)).chunks(m)
               .checkpoint(gpipe::Checkpoint::kNever)
               .schedule(gpipe::PipelineSchedule::of(
                   gpipe::schedule_kind(absl::GetFlag(FLAGS_schedule)),
                   v,
                   microbatch_group(m)))
               .shared_memory(absl::GetFlag(FLAGS_shared_memory)),
      group);
  const at::Tensor x = at::randn({rows * m, width});
  const at::Tensor y = at::randn({rows * m, width});
  return [stage, x, y] {
    (*stage)->zero_grad();
    // (On a V, stage 0 takes both.)
    (*stage)->step((*stage)->is_first() ? gpipe::Batch(x) : gpipe::distributed::no_input(),
                   (*stage)->is_last() ? y : at::Tensor(), mse);
  };
}

// Both ranks: the two-process pipeline's step time.
double pipeline_ms(const ProcessGroup& group, int64_t width, int layers, int64_t rows,
                   int64_t m) {
  return time_ms(pipeline_step(group, width, layers, rows, m));
}

// Rank 0 alone: both stages as two partitions of one PipelineStage in one process, each on a
// thread of its own (Note [Partitions within a stage]), in a group of rank 0 alone.
std::function<void()> partitions_step(const ProcessGroup& alone, int64_t width, int layers,
                                      int64_t rows, int64_t m) {
  auto stage = std::make_shared<PipelineStage>(
      mlp(width, layers),
      PipelineStageOptions({4 * layers}).local_balance({2 * layers, 2 * layers})
          .chunks(m).checkpoint(gpipe::Checkpoint::kNever),
      alone);
  const at::Tensor x = at::randn({rows * m, width});
  const at::Tensor y = at::randn({rows * m, width});
  return [stage, x, y] {
    (*stage)->zero_grad();
    (*stage)->step(gpipe::Batch(x), y, mse);
  };
}

// Rank 0 alone: the plain Sequential on the same micro-batches, one after the other.
std::function<void()> serial_step(int64_t width, int layers, int64_t rows, int64_t m) {
  nn::Sequential seq = mlp(width, layers);
  const at::Tensor x = at::randn({rows * m, width});
  const at::Tensor y = at::randn({rows * m, width});
  return [seq, x, y, m]() mutable {
    seq->zero_grad();
    std::vector<at::Tensor> outs;
    for (const at::Tensor& xi : x.chunk(m)) outs.push_back(seq->forward(xi));
    nn::functional::mse_loss(at::cat(outs), y).backward();
  };
}

// Rank 0 alone: a GPipe of the same two stages in one process, one worker per partition.
double gpipe_ms(int64_t width, int layers, int64_t rows, int64_t m) {
  gpipe::GPipe pipe(mlp(width, layers), gpipe::GPipeOptions({2 * layers, 2 * layers})
                                            .chunks(m)
                                            .checkpoint(gpipe::Checkpoint::kNever)
                                            .devices({at::kCPU, at::kCPU}));
  const at::Tensor x = at::randn({rows * m, width});
  const at::Tensor y = at::randn({rows * m, width});
  return time_ms([&] {
    pipe->zero_grad();
    nn::functional::mse_loss(pipe->forward(x), y).backward();
  });
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // Before any thread starts (Gloo's, the stages'): they inherit the binding.
  const std::vector<int> all_cpus = gpipe::distributed::allowed_cpus();
  std::vector<int> own_cpus = all_cpus;
  if (absl::GetFlag(FLAGS_bind_cores_to_rank)) own_cpus = gpipe::distributed::bind_cores_to_rank();
  gpipe_benchmarks::keep_freed_memory();
  gpipe::set_intra_op_threads(1);
  const gpipe::distributed::GroupOptions options = gpipe::distributed::options_from_env();
  const ProcessGroup group = gpipe::distributed::new_gloo_group(options);
  TORCH_CHECK(group->getSize() == 2, "pipeline_stages: run it with 2 processes "
              "(torchrun --nproc_per_node=2), not ", group->getSize());
  const bool rank0 = group->getRank() == 0;
  const int64_t width = absl::GetFlag(FLAGS_width);
  const int layers = absl::GetFlag(FLAGS_layers);
  const int64_t rows = absl::GetFlag(FLAGS_rows);

  // Rank 0's group of its own, for the one-process stage of two partitions.
  ProcessGroup alone;
  if (rank0) {
    alone = gpipe::distributed::new_gloo_group(
        gpipe::distributed::GroupOptions().master_port(options.master_port() + 1));
  }
  std::vector<std::string> speed_json;
  if (rank0) {
    std::printf("two-process pipeline, training step (%s schedule): 2 stages of %d x Linear(%ld, "
                "%ld) + Tanh, %ld rows per micro-batch, float32, 1 thread per process, median of "
                "%d steps in each of %d rounds (speed-up: the median of the rounds')\n",
                absl::GetFlag(FLAGS_schedule).c_str(), layers, width, width, rows,
                absl::GetFlag(FLAGS_steps), std::max(1, absl::GetFlag(FLAGS_rounds)));
    if (own_cpus != all_cpus) {
      std::printf("each process bound to its share of CPUs {%s} (rank 0: {%s})\n",
                  absl::StrJoin(all_cpus, ", ").c_str(), absl::StrJoin(own_cpus, ", ").c_str());
    }
    std::printf("%4s %12s %12s %9s %7s %9s | %18s %9s %9s\n", "m", "serial ms", "2 procs ms",
                "speed-up", "ideal", "of ideal", "1 proc, 2 parts ms", "speed-up", "of ideal");
  }
  for (int64_t m : {1, 2, 4, 8, 16, 32}) {
    if (m % 2 != 0 && interleaves()) continue;  // interleaved: m a multiple of n
    const std::function<void()> pipeline = pipeline_step(group, width, layers, rows, m);
    std::function<void()> serial_run, parts_run;
    if (rank0) {
      serial_run = serial_step(width, layers, rows, m);
      parts_run = partitions_step(alone, width, layers, rows, m);
    }
    // Note [Measuring in rounds]: the untimed steps in the first round only.
    std::vector<double> pipeds, serials, partss, speedups, parts_speedups;
    for (int r = 0; r < std::max(1, absl::GetFlag(FLAGS_rounds)); ++r) {
      const int warmup = r == 0 ? 2 : 0;
      pipeds.push_back(time_ms(pipeline, warmup));
      if (rank0) {
        // Alone on the host: unbound, so that these one-process runs may use every core.
        if (own_cpus != all_cpus) gpipe::distributed::bind_to_cpus(all_cpus);
        serials.push_back(time_ms(serial_run, warmup));
        partss.push_back(time_ms(parts_run, warmup));
        if (own_cpus != all_cpus) gpipe::distributed::bind_to_cpus(own_cpus);
        speedups.push_back(serials.back() / pipeds.back());
        parts_speedups.push_back(serials.back() / partss.back());
      }
      group->barrier()->wait();
    }
    if (!rank0) continue;
    const double piped = median(pipeds), serial = median(serials), parts = median(partss);
    const double speedup = median(speedups);
    // 2m/(m+1) for GPipe and 1F1B.
    const double ideal =
        2.0 * (1 - gpipe::simulate_schedule(
                       gpipe::make_schedule(gpipe::schedule_kind(absl::GetFlag(FLAGS_schedule)),
                                            2, m, virtual_stages(), microbatch_group(m)))
                       .bubble);
    const double parts_speedup = median(parts_speedups);
    std::printf("%4ld %12.2f %12.2f %8.2fx %6.2fx %8.0f%% | %18.2f %8.2fx %8.0f%%\n", m, serial,
                piped, speedup, ideal, 100 * speedup / ideal, parts, parts_speedup,
                100 * parts_speedup / ideal);
    speed_json.push_back(absl::StrFormat(
        "{\"m\": %d, \"serial_ms\": %.3f, \"pipeline_ms\": %.3f, \"speedup\": %.3f, "
        "\"ideal\": %.3f, \"one_process_partitions_ms\": %.3f, \"rounds\": [%s]}",
        m, serial, piped, speedup, ideal, parts, absl::StrJoin(speedups, ", ", [](std::string* o, double x) {
          absl::StrAppendFormat(o, "%.3f", x);
        })));
  }

  // One step drawn: both stages' timelines on the host's clock.
  if (!absl::GetFlag(FLAGS_svg).empty() || !absl::GetFlag(FLAGS_trace).empty()) {
    const int64_t traced = 8;
    const int64_t v = virtual_stages();
    PipelineStage stage(mlp(width, layers),
                        PipelineStageOptions(stage_balance(layers)).chunks(traced)
                            .checkpoint(gpipe::Checkpoint::kNever)
                            .schedule(gpipe::PipelineSchedule::of(
                                gpipe::schedule_kind(absl::GetFlag(FLAGS_schedule)),
                                v,
                                microbatch_group(traced)))
                            .shared_memory(absl::GetFlag(FLAGS_shared_memory)),
                        group);
    stage->record_timeline(true);
    const at::Tensor x = at::randn({rows * traced, width});
    const at::Tensor y = at::randn({rows * traced, width});
    for (int s = 0; s < 3; ++s) {  // the last of three steps
      stage->zero_grad();
      stage->step(stage->is_first() ? gpipe::Batch(x) : gpipe::distributed::no_input(),
                  stage->is_last() ? y : at::Tensor(), mse);
    }
    const auto events = stage->gather_timeline();
    const std::vector<c10::Device> devices(2 * v, c10::Device(c10::kCPU));
    if (rank0 && !absl::GetFlag(FLAGS_svg).empty()) {
      std::ofstream(absl::GetFlag(FLAGS_svg)) << gpipe::timeline_svg(events, devices);
    }
    if (rank0 && !absl::GetFlag(FLAGS_trace).empty()) {
      std::ofstream(absl::GetFlag(FLAGS_trace)) << gpipe::chrome_trace_json(events, devices);
    }
  }

  // Overhead per task: tiny layers, one-row micro-batches.
  const int64_t m = 32;
  const double piped = pipeline_ms(group, 16, 1, 1, m);
  double local = 0;
  if (rank0) {
    // Alone, as the serial baseline (unbound, as above).
    if (own_cpus != all_cpus) gpipe::distributed::bind_to_cpus(all_cpus);
    local = gpipe_ms(16, 1, 1, m);
  }
  group->barrier()->wait();
  if (!rank0) return 0;
  const double tasks = 2.0 * m;  // (micro-batch, stage) pairs, each with a forward and a backward
  std::printf("\noverhead: 2 stages of Linear(16, 16) + Tanh, %ld one-row micro-batches\n", m);
  std::printf("%-34s %10s %14s\n", "pipeline", "step ms", "us per task");
  std::printf("%-34s %10.3f %14.1f\n", "two processes (PipelineStage)", piped,
              1000 * piped / tasks);
  std::printf("%-34s %10.3f %14.1f\n", "one process (GPipe, 2 workers)", local,
              1000 * local / tasks);
  const std::string json = absl::StrCat(
      "{\"rank0_bound_cpus\": [",
      own_cpus != all_cpus ? absl::StrJoin(own_cpus, ", ") : std::string(), "], \"speed\": [",
      absl::StrJoin(speed_json, ", "), "], ",
      absl::StrFormat("\"overhead\": {\"m\": %d, \"two_processes_ms\": %.3f, "
                      "\"one_process_ms\": %.3f}}", m, piped, local));
  std::printf("%s\n", json.c_str());
  if (!absl::GetFlag(FLAGS_json_out).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_json_out)) << json << "\n";
  }
  return 0;
}
