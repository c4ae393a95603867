// Skip connections in a pipeline: a small U-Net that learns to denoise images, built as one flat
// Sequential whose encoder levels stash their features and whose decoder levels pop them. Each
// level's pair is isolated in its own gpipe::Namespace, so one Down and one Up class serve every
// level. docs/skip-connections.md walks through this file.
//
//   bazel run //examples:unet_skips -- --partitions=3 --chunks=4 --steps=60
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/functional/upsampling.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/optim/adam.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "gpipe/gpipe.h"

ABSL_FLAG(int, partitions, 3, "number of pipeline partitions (1 to 7)");
ABSL_FLAG(int, chunks, 4, "micro-batches per mini-batch");
ABSL_FLAG(int, steps, 60, "training steps");
ABSL_FLAG(bool, timeline, true, "print the schedule of the last step");

namespace nn = torch::nn;
namespace F = torch::nn::functional;

// [down]
// An encoder level: convolve, keep the features for the decoder (stash), then halve the size.
struct DownImpl : nn::Module {
  DownImpl(int64_t in, int64_t out)
      : conv(register_module("conv", nn::Conv2d(nn::Conv2dOptions(in, out, 3).padding(1)))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor features = at::relu(conv(x));
    gpipe::stash("skip", features);
    return F::max_pool2d(features, F::MaxPool2dFuncOptions(2));
  }
  nn::Conv2d conv;
};
TORCH_MODULE(Down);
// [down]

// [up]
// A decoder level: double the size, take the encoder's features back (pop), convolve both.
struct UpImpl : nn::Module {
  UpImpl(int64_t in, int64_t skip, int64_t out)
      : conv(register_module("conv", nn::Conv2d(nn::Conv2dOptions(in + skip, out, 3).padding(1)))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor up = F::interpolate(
        x, F::InterpolateFuncOptions().scale_factor(std::vector<double>{2, 2}).mode(torch::kNearest));
    at::Tensor features = gpipe::pop("skip");
    return at::relu(conv(at::cat({up, features}, 1)));
  }
  nn::Conv2d conv;
};
TORCH_MODULE(Up);
// [up]

// [unet]
// Two levels, each a Down/Up pair in its own namespace: the same name "skip" pairs the outer
// Down with the outer Up and the inner Down with the inner Up.
nn::Sequential unet() {
  gpipe::Namespace outer, inner;
  auto down1 = gpipe::skippable(Down(1, 8), gpipe::SkippableOptions().stash({"skip"}));
  auto down2 = gpipe::skippable(Down(8, 16), gpipe::SkippableOptions().stash({"skip"}));
  auto up2 = gpipe::skippable(Up(16, 16, 16), gpipe::SkippableOptions().pop({"skip"}));
  auto up1 = gpipe::skippable(Up(16, 8, 8), gpipe::SkippableOptions().pop({"skip"}));
  down1->isolate(outer);
  up1->isolate(outer);
  down2->isolate(inner);
  up2->isolate(inner);
  return nn::Sequential(down1, down2,
                        nn::Conv2d(nn::Conv2dOptions(16, 16, 3).padding(1)), nn::ReLU(),
                        up2, up1, nn::Conv2d(nn::Conv2dOptions(8, 1, 1)));
}
// [unet]

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  at::manual_seed(0);
  nn::Sequential model = unet();
  const int partitions = absl::GetFlag(FLAGS_partitions);
  TORCH_CHECK(partitions >= 1 && partitions <= static_cast<int>(model->size()),
              "--partitions must be between 1 and ", model->size(), ", got ", partitions);
  std::vector<int64_t> balance(partitions, model->size() / partitions);
  balance.back() += model->size() % partitions;

  // [gpipe]
  // Skips cross partitions directly: the outer "skip" goes from the first partition to the last
  // without passing through the ones in between.
  gpipe::GPipe pipe(model, gpipe::GPipeOptions(balance)
                               .devices(std::vector<c10::Device>(partitions, at::kCPU))
                               .chunks(absl::GetFlag(FLAGS_chunks))
                               .record_timeline(absl::GetFlag(FLAGS_timeline)));
  // [gpipe]
  for (const auto& key : pipe->skip_layout().crossing()) {
    std::printf("skip '%s' crosses partitions\n", key.str().c_str());
  }

  torch::optim::Adam optimizer(pipe->parameters(), torch::optim::AdamOptions(3e-3));
  for (int step = 1; step <= absl::GetFlag(FLAGS_steps); ++step) {
    // Blurry squares; the model learns to remove the noise.
    at::Tensor clean = at::zeros({16, 1, 16, 16});
    for (int64_t k = 0; k < 16; ++k) {
      const int64_t r = at::randint(0, 10, {1}).item<int64_t>();
      const int64_t c = at::randint(0, 10, {1}).item<int64_t>();
      clean[k][0].slice(0, r, r + 6).slice(1, c, c + 6).fill_(1.0);
    }
    at::Tensor noisy = clean + at::randn_like(clean) * 0.3;
    optimizer.zero_grad();
    at::Tensor loss = (pipe->forward(noisy) - clean).pow(2).mean();
    loss.backward();
    optimizer.step();
    if (step == 1 || step % 10 == 0) {
      std::printf("step %3d  loss %.4f\n", step, loss.item<double>());
    }
  }
  if (absl::GetFlag(FLAGS_timeline)) {
    std::printf("\nthe last step's forward (micro-batch per clock tick, * = checkpointed):\n%s",
                gpipe::render_timeline(pipe->last_timeline()).c_str());
  }
  return 0;
}
