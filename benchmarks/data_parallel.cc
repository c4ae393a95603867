// Data-parallel replicas on loopback: how much of the gradient all-reduce the buckets hide behind
// backward. Each rank trains a GPipe replica (an MLP of 8 Linear(512, 512), two CPU partitions,
// 4 micro-batches, one intra-op thread) on its shard; the same steps run with small buckets
// (they start during backward) and with one bucket as large as all gradients (it starts when
// backward ends). What each step waits for after backward's own work is the exposed all-reduce;
// hidden = 1 - exposed(buckets) / exposed(one bucket). Run it under torchrun:
//
//   torchrun --no_python --nproc_per_node=2 bazel-bin/benchmarks/data_parallel --steps=20
//
// --stage_local_backward: each partition's backward on its worker, where its gradients become
// final and start their buckets.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "benchmarks/timing.h"
#include "gpipe/distributed/data_parallel.h"
#include "gpipe/gpipe.h"
#include "gpipe/internal/partition_threads.h"
#include "gpipe/worker.h"

ABSL_FLAG(int, steps, 20, "timed steps per configuration (after 3 untimed ones)");
ABSL_FLAG(int, batch, 64, "the mini-batch, split evenly over the ranks");
ABSL_FLAG(int64_t, bucket_kib, 1024, "bucket size of the bucketed configuration, in KiB");
ABSL_FLAG(std::string, json_out, "", "also write the results as JSON to this file (rank 0)");
ABSL_FLAG(bool, stage_local_backward, false,
          "each partition runs its own backward on its worker (Note [Stage-local backward in one "
          "process]; false: the one graph)");

namespace {

using gpipe_benchmarks::median;

namespace nn = torch::nn;
using gpipe::distributed::DataParallel;
using gpipe::distributed::DataParallelOptions;

struct Result {
  double step_ms = 0, exposed_ms = 0;
  double started_early = 0, buckets = 0, megabytes = 0;
};

Result run(const gpipe::distributed::ProcessGroup& group, int64_t bucket_bytes) {
  at::manual_seed(0);
  nn::Sequential seq;
  for (int k = 0; k < 8; ++k) {
    seq->push_back(nn::Linear(512, 512));
    seq->push_back(nn::Tanh());
  }
  gpipe::GPipe pipe(seq, gpipe::internal::with_stage_local_backward(
                             gpipe::GPipeOptions({8, 8})
                                 .chunks(4)
                                 .checkpoint(gpipe::Checkpoint::kNever)
                                 .devices({at::kCPU, at::kCPU}),
                             absl::GetFlag(FLAGS_stage_local_backward)));
  DataParallel model(pipe, group, DataParallelOptions().bucket_bytes(bucket_bytes));
  torch::optim::SGD sgd(model->parameters(), 0.01);
  const int64_t shard = absl::GetFlag(FLAGS_batch) / group->getSize();
  const at::Tensor x = at::randn({shard, 512});
  const at::Tensor y = at::randn({shard, 512});
  std::vector<double> step_ms, exposed_ms, early, buckets, megabytes;
  const int steps = absl::GetFlag(FLAGS_steps);
  for (int step = 0; step < steps + 3; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    sgd.zero_grad();
    torch::nn::functional::mse_loss(model->forward(x), y).backward();
    sgd.step();
    const double ms = gpipe_benchmarks::ms_since(t0);
    if (step < 3) continue;
    const auto stats = model->last_reduction();
    step_ms.push_back(ms);
    exposed_ms.push_back(1000 * stats.exposed_seconds);
    early.push_back(static_cast<double>(stats.started_during_backward));
    buckets.push_back(static_cast<double>(stats.buckets));
    megabytes.push_back(static_cast<double>(stats.bytes) / (1 << 20));
  }
  return Result{median(step_ms), median(exposed_ms), median(early), median(buckets),
                median(megabytes)};
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  gpipe_benchmarks::keep_freed_memory();
  gpipe::set_intra_op_threads(1);
  const auto group =
      gpipe::distributed::new_gloo_group(gpipe::distributed::options_from_env());
  const Result bucketed = run(group, absl::GetFlag(FLAGS_bucket_kib) << 10);
  const Result single = run(group, int64_t{1} << 40);
  if (group->getRank() != 0) return 0;
  const double hidden = 1.0 - bucketed.exposed_ms / single.exposed_ms;
  std::printf("data-parallel replicas: %d processes, %.1f MiB of gradients per step, median of "
              "%d steps%s\n",
              group->getSize(), bucketed.megabytes, absl::GetFlag(FLAGS_steps),
              absl::GetFlag(FLAGS_stage_local_backward) ? ", stage-local backward" : "");
  std::printf("%-28s %8s %8s %14s %12s\n", "configuration", "buckets", "early", "exposed ms",
              "step ms");
  std::printf("%-28s %8.0f %8.0f %14.2f %12.2f\n",
              absl::StrFormat("buckets of %d KiB", absl::GetFlag(FLAGS_bucket_kib)).c_str(),
              bucketed.buckets, bucketed.started_early, bucketed.exposed_ms, bucketed.step_ms);
  std::printf("%-28s %8.0f %8.0f %14.2f %12.2f\n", "one bucket (at the end)", single.buckets,
              single.started_early, single.exposed_ms, single.step_ms);
  std::printf("all-reduce hidden behind backward: %.0f%%\n", 100 * hidden);
  const std::string json = absl::StrFormat(
      "{\"processes\": %d, \"gradient_mib\": %.2f, \"bucketed\": {\"buckets\": %.0f, "
      "\"started_during_backward\": %.0f, \"exposed_ms\": %.3f, \"step_ms\": %.3f}, "
      "\"one_bucket\": {\"exposed_ms\": %.3f, \"step_ms\": %.3f}, \"hidden\": %.3f}",
      group->getSize(), bucketed.megabytes, bucketed.buckets, bucketed.started_early,
      bucketed.exposed_ms, bucketed.step_ms, single.exposed_ms, single.step_ms, hidden);
  std::printf("%s\n", json.c_str());
  if (!absl::GetFlag(FLAGS_json_out).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_json_out)) << json << "\n";
  }
  return 0;
}
