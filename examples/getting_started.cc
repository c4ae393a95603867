// The program of docs/getting-started.md: a model balanced by time over two devices (two GPUs,
// else a GPU and the CPU, else the CPU twice), trained with step() under the 1F1B schedule with
// checkpointing, and a picture of its last step.
//
//   bazel run //examples:getting_started -- --steps=50 --svg=/tmp/step.svg
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

ABSL_FLAG(int, steps, 50, "training steps");
ABSL_FLAG(std::string, svg, "", "where to draw the last step (empty: nowhere)");

namespace {

// Two devices: two GPUs, else a GPU and the CPU, else the CPU twice.
std::vector<c10::Device> two_devices() {
  const size_t gpus = torch::cuda::device_count();
  if (gpus >= 2) return {c10::Device("cuda:0"), c10::Device("cuda:1")};
  if (gpus == 1) return {c10::Device("cuda:0"), c10::Device(c10::kCPU)};
  return {c10::Device(c10::kCPU), c10::Device(c10::kCPU)};
}

}  // namespace

static int run(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int steps = absl::GetFlag(FLAGS_steps);
  const std::string svg = absl::GetFlag(FLAGS_svg);
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
