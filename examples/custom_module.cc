// A model written the way C++ users write one — a residual CNN as one Module class with a
// hand-written forward() — cut at its CutPoints (Note [Cut points] in gpipe/cut_point.h),
// balanced by time over two devices, and trained with step() under 1F1B. A copy of the model
// trained plainly beside it shows the pipeline's losses are the model's own.
//
//   bazel run -c opt //examples:custom_module
#include <cstdio>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_join.h"
#include "balancing/balance.h"
#include "gpipe/cut_point.h"
#include "gpipe/gpipe.h"

ABSL_FLAG(int, steps, 20, "training steps");
ABSL_FLAG(int64_t, batch, 32, "images per mini-batch");
ABSL_FLAG(int, chunks, 4, "micro-batches per mini-batch");
ABSL_FLAG(int64_t, width, 16, "channels of the residual blocks");

namespace {

namespace nn = torch::nn;

// [custom_module_model]
// A stem, three residual blocks with a cut point after each, and a classifier head.
struct ResidualNetImpl : nn::Cloneable<ResidualNetImpl> {
  explicit ResidualNetImpl(int64_t width) : width(width) { reset(); }
  void reset() override {
    stem = register_module("stem", nn::Conv2d(nn::Conv2dOptions(1, width, 3).padding(1)));
    convs.clear();
    cuts.clear();
    for (int i = 0; i < 3; ++i) {
      const std::string n = std::to_string(i);
      convs.push_back(register_module("conv" + n + "a",
                                      nn::Conv2d(nn::Conv2dOptions(width, width, 3).padding(1))));
      convs.push_back(register_module("conv" + n + "b",
                                      nn::Conv2d(nn::Conv2dOptions(width, width, 3).padding(1))));
      cuts.push_back(register_module("cut" + n, gpipe::CutPoint()));
    }
    head = register_module("head", nn::Linear(width * 8 * 8, 10));
  }
  at::Tensor forward(at::Tensor x) {
    x = at::relu(stem(x));
    for (int i = 0; i < 3; ++i) {
      const at::Tensor y = at::relu(convs[2 * i](x));
      x = at::relu(x + convs[2 * i + 1](y));  // the residual stays inside its block
      if (i == 1) x = at::max_pool2d(x, 2);
      x = cuts[i](x);  // a pipeline may cut here
    }
    return head(x.view({x.size(0), -1}));
  }
  int64_t width;
  nn::Conv2d stem{nullptr};
  std::vector<nn::Conv2d> convs;
  std::vector<gpipe::CutPoint> cuts;
  nn::Linear head{nullptr};
};
TORCH_MODULE(ResidualNet);
// [custom_module_model]

// A batch of 1 x 16 x 16 images, each its class's fixed random pattern under noise, and the
// classes.
std::pair<at::Tensor, at::Tensor> batch(int64_t size, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto pattern_gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor patterns = at::randn({10, 1, 16, 16}, pattern_gen);
  const at::Tensor y = at::randint(10, {size}, gen, at::kLong);
  return {2 * patterns.index_select(0, y) + at::randn({size, 1, 16, 16}, gen), y};
}

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
  const std::vector<c10::Device> devices = two_devices();
  at::manual_seed(0);
  ResidualNet net(absl::GetFlag(FLAGS_width));
  ResidualNet plain(std::dynamic_pointer_cast<ResidualNetImpl>(net->clone()));
  const at::Tensor sample = batch(absl::GetFlag(FLAGS_batch), -1).first;
  // [custom_module]
  // One section per stretch between cut points, balanced by time, then cut there.
  const std::vector<int64_t> balance = gpipe::balance_by_time(2, gpipe::cut(net, sample), sample);
  gpipe::GPipe model(gpipe::cut(net, sample, balance), gpipe::GPipeOptions({1, 1})
                                                           .devices(devices)
                                                           .chunks(absl::GetFlag(FLAGS_chunks))
                                                           .schedule(gpipe::ScheduleKind::k1F1B));
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  const auto loss_fn = [](const gpipe::Batch& out, const at::Tensor& y) {
    return torch::nn::functional::cross_entropy(out.tensor(), y.to(out.tensor().device()));
  };
  // [custom_module]
  torch::optim::Adam plain_adam(plain->parameters(), torch::optim::AdamOptions(0.01));
  std::printf("balance over the 4 stretches {%s}, on {%s}\n", absl::StrJoin(balance, ", ").c_str(),
              absl::StrJoin(devices, ", ", [](std::string* s, const c10::Device& d) {
                s->append(d.str());
              }).c_str());
  for (int step = 0; step < absl::GetFlag(FLAGS_steps); ++step) {
    const auto [x, y] = batch(absl::GetFlag(FLAGS_batch), step);
    adam.zero_grad();
    const at::Tensor loss = model->step(x.to(devices[0]), y, loss_fn);
    adam.step();
    plain_adam.zero_grad();
    const at::Tensor want = torch::nn::functional::cross_entropy(plain->forward(x), y);
    want.backward();
    plain_adam.step();
    std::printf("step %d: loss %.6f (the model itself: %.6f)\n", step + 1, loss.item<double>(),
                want.item<double>());
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {  // the message, without LibTorch's backtrace
    std::fprintf(stderr, "custom_module: %s\n", e.what_without_backtrace());
    return 2;
  }
}
