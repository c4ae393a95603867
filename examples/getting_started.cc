// The program of docs/getting-started.md: a model balanced by time over two devices (two GPUs,
// else a GPU and the CPU, else the CPU twice), trained with step() under the 1F1B schedule with
// checkpointing, and a picture of its last step; with --distributed, the same model with a stage
// in each of two processes.
//
//   bazel run //examples:getting_started -- --steps=50 --svg=/tmp/step.svg
//   torchrun --no_python --nproc_per_node=2 bazel-bin/examples/getting_started --distributed
#include <cstdio>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_join.h"
#include "balancing/balance.h"
#include "gpipe/gpipe.h"
#if GPIPE_WITH_DISTRIBUTED
#include "gpipe/distributed/pipeline_stage.h"
#endif

ABSL_FLAG(int, steps, 50, "training steps");
ABSL_FLAG(std::string, svg, "", "where to draw the last step (empty: nowhere)");
ABSL_FLAG(bool, distributed, false,
          "a stage in each of two processes, launched by torchrun --nproc_per_node=2");

namespace {

// Two devices: two GPUs, else a GPU and the CPU, else the CPU twice.
std::vector<c10::Device> two_devices() {
  const size_t gpus = torch::cuda::device_count();
  if (gpus >= 2) return {c10::Device("cuda:0"), c10::Device("cuda:1")};
  if (gpus == 1) return {c10::Device("cuda:0"), c10::Device(c10::kCPU)};
  return {c10::Device(c10::kCPU), c10::Device(c10::kCPU)};
}

// The same model and steps with a stage in each of two processes (docs/getting-started.md, step
// 5): every process builds the same model and data from the same seed (each draws the same
// random numbers in the same order: the model's, the teacher's, then each step's inputs).
int train_across_processes(int steps) {
#if GPIPE_WITH_DISTRIBUTED
  at::manual_seed(0);
  // [guide_distributed]
  namespace nn = torch::nn;
  namespace dist = gpipe::distributed;
  nn::Sequential model(nn::Linear(64, 256), nn::ReLU(), nn::Linear(256, 256), nn::ReLU(),
                       nn::Linear(256, 256), nn::ReLU(), nn::Linear(256, 10));
  auto group = dist::new_gloo_group(dist::options_from_env());  // torchrun's rank and world
  // Each process keeps its stage; every process gives the same balance, one entry per process.
  dist::PipelineStage stage(model,
                            dist::PipelineStageOptions({3, 4})
                                .chunks(8)
                                .checkpoint(gpipe::Checkpoint::kExceptLast)
                                .schedule(gpipe::ScheduleKind::k1F1B),
                            group);
  torch::optim::SGD sgd(stage->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const gpipe::LossFunction loss = [](const gpipe::Batch& out, const at::Tensor& target) {
    return nn::functional::cross_entropy(out.tensor(), target);
  };
  nn::Linear teacher(64, 10);
  for (int step = 0; step < steps; ++step) {
    const at::Tensor x = at::randn({128, 64});
    const at::Tensor y = teacher(x).argmax(1);
    sgd.zero_grad();
    // The first stage takes the inputs, the last the targets, and returns the loss.
    const at::Tensor l = stage->is_first() ? stage->step(gpipe::Batch(x), {}, loss)
                                           : stage->step(dist::no_input(), y, loss);
    sgd.step();
    if (stage->is_last() && (step % 10 == 0 || step == steps - 1)) {
      std::printf("step %d: loss %.4f\n", step, l.item<double>());
    }
  }
  // [guide_distributed]
  std::printf("stage %lld of %lld: %lld layers\n", static_cast<long long>(stage->stage()),
              static_cast<long long>(stage->stages()),
              static_cast<long long>(stage->options().balance()[stage->stage()]));
  return 0;
#else
  (void)steps;
  std::fprintf(stderr, "getting_started: --distributed needs a LibTorch with c10d\n");
  return 2;
#endif
}

}  // namespace

static int run(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int steps = absl::GetFlag(FLAGS_steps);
  const std::string svg = absl::GetFlag(FLAGS_svg);
  if (absl::GetFlag(FLAGS_distributed)) return train_across_processes(steps);
  at::manual_seed(0);
  // [guide]
  namespace nn = torch::nn;
  nn::Sequential model(nn::Linear(64, 256), nn::ReLU(), nn::Linear(256, 256), nn::ReLU(),
                       nn::Linear(256, 256), nn::ReLU(), nn::Linear(256, 10));
  const std::vector<c10::Device> devices = two_devices();
  // Layers per partition such that both take about as long, measured on the first device.
  const std::vector<int64_t> balance = gpipe::balance_by_time(
      2, model, at::randn({128, 64}), gpipe::BalanceByTimeOptions().device(devices[0]));
  gpipe::GPipe pipe(model, gpipe::GPipeOptions(balance)
                               .devices(devices)
                               .chunks(8)  // micro-batches per mini-batch
                               .checkpoint(gpipe::Checkpoint::kExceptLast)
                               .schedule(gpipe::ScheduleKind::k1F1B));
  torch::optim::SGD sgd(pipe->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const gpipe::LossFunction loss = [](const gpipe::Batch& out, const at::Tensor& target) {
    return nn::functional::cross_entropy(out.tensor(), target);
  };
  nn::Linear teacher(64, 10);  // what the model learns: the teacher's labels of random inputs
  for (int step = 0; step < steps; ++step) {
    const at::Tensor x = at::randn({128, 64});
    const at::Tensor y = teacher(x).argmax(1);
    sgd.zero_grad();
    pipe->record_timeline(step == steps - 1);  // only the last step
    const at::Tensor l = pipe->step(x.to(devices.front()), y.to(devices.back()), loss);
    sgd.step();
    if (step % 10 == 0 || step == steps - 1) {
      std::printf("step %d: loss %.4f\n", step, l.item<double>());
    }
  }
  if (!svg.empty()) pipe->write_timeline_svg(svg);  // partitions over time, one row each
  // [guide]
  std::printf("balance {%s} on %s and %s\n", absl::StrJoin(balance, ", ").c_str(),
              devices[0].str().c_str(), devices[1].str().c_str());
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {  // the message, without LibTorch's backtrace
    std::fprintf(stderr, "getting_started: %s\n", e.what_without_backtrace());
    return 2;
  }
}
