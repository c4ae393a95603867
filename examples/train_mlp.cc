// A small, complete GPipe training program: a multi-layer perceptron learns to classify points of
// two interleaved spirals, pipelined over the available devices (every CUDA device, else the CPU).
//
//   bazel run //examples:train_mlp -- --partitions=2 --chunks=4 --steps=300
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_join.h"
#include "examples/models/mlp.h"
#include "gpipe/gpipe.h"

ABSL_FLAG(int, partitions, 2, "number of pipeline partitions");
ABSL_FLAG(int, chunks, 4, "micro-batches per mini-batch");
ABSL_FLAG(int, steps, 300, "training steps");
ABSL_FLAG(int, batch, 256, "mini-batch size");
ABSL_FLAG(int, width, 64, "hidden layer width");
ABSL_FLAG(std::string, checkpoint, "except_last", "always, except_last or never");
ABSL_FLAG(std::string, device, "auto", "auto (every CUDA device, else CPU), cpu or cuda");

namespace {

// Points of two spirals, label 0 or 1, with a little noise.
std::pair<at::Tensor, at::Tensor> spirals(int64_t n) {
  at::Tensor t = at::rand({n}, at::kFloat) * 3 * M_PI + 0.5;
  at::Tensor label = at::randint(2, {n}, at::kLong);
  at::Tensor sign = label.to(at::kFloat) * 2 - 1;
  at::Tensor x = at::stack({t * at::cos(t) * sign, t * at::sin(t) * sign}, 1) / 10;
  return {x + at::randn_like(x) * 0.02, label};
}

gpipe::Checkpoint parse_checkpoint(const std::string& name) {
  if (name == "always") return gpipe::Checkpoint::kAlways;
  if (name == "never") return gpipe::Checkpoint::kNever;
  TORCH_CHECK(name == "except_last", "--checkpoint must be always, except_last or never, got '",
              name, "'");
  return gpipe::Checkpoint::kExceptLast;
}

}  // namespace

static int run(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int partitions = absl::GetFlag(FLAGS_partitions);
  const int width = absl::GetFlag(FLAGS_width);
  at::manual_seed(0);

  torch::nn::Sequential model = gpipe::models::mlp(width);
  TORCH_CHECK(partitions >= 1 && partitions <= static_cast<int>(model->size()),
              "--partitions must be between 1 and ", model->size(), ", got ", partitions);
  std::vector<int64_t> balance(partitions, model->size() / partitions);
  balance.back() += model->size() % partitions;

  std::vector<c10::Device> devices;
  const std::string device = absl::GetFlag(FLAGS_device);
  const bool cuda = device == "cuda" || (device == "auto" && torch::cuda::is_available());
  for (int j = 0; j < partitions; ++j) {
    devices.push_back(cuda ? c10::Device(c10::kCUDA, j % torch::cuda::device_count())
                           : c10::Device(c10::kCPU));
  }

  gpipe::GPipe pipe(model, gpipe::GPipeOptions(balance)
                               .devices(devices)
                               .chunks(absl::GetFlag(FLAGS_chunks))
                               .checkpoint(parse_checkpoint(absl::GetFlag(FLAGS_checkpoint))));
  std::printf("GPipe: balance {%s}, devices {%s}, %d micro-batches\n",
              absl::StrJoin(pipe->balance(), ", ").c_str(),
              absl::StrJoin(pipe->devices(), ", ",
                            [](std::string* s, const c10::Device& d) { s->append(d.str()); })
                  .c_str(),
              absl::GetFlag(FLAGS_chunks));

  torch::optim::Adam optimizer(pipe->parameters(), torch::optim::AdamOptions(3e-3));
  const c10::Device in = pipe->devices().front();
  const c10::Device out = pipe->devices().back();
  auto [test_x, test_y] = spirals(2000);
  for (int step = 1; step <= absl::GetFlag(FLAGS_steps); ++step) {
    pipe->train();
    auto [x, y] = spirals(absl::GetFlag(FLAGS_batch));
    optimizer.zero_grad();
    at::Tensor loss = torch::nn::functional::cross_entropy(pipe->forward(x.to(in)), y.to(out));
    loss.backward();
    optimizer.step();
    if (step % 50 == 0 || step == 1) {
      pipe->eval();
      at::NoGradGuard no_grad;
      const double accuracy =
          (pipe->forward(test_x.to(in)).argmax(1).cpu() == test_y).to(at::kFloat).mean().item<double>();
      std::printf("step %4d  loss %.4f  test accuracy %.3f\n", step, loss.item<double>(), accuracy);
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {  // the message, without LibTorch's backtrace
    std::fprintf(stderr, "train_mlp: %s\n", e.what_without_backtrace());
    return 2;
  }
}
