// A small U-Net for 1-channel images, as one flat Sequential whose encoder levels stash their
// features and whose decoder levels pop them; each level's pair lives in its own
// gpipe::Namespace, so one Down and one Up class serve every level. Used by examples/unet_skips.cc
// and walked through in docs/skip-connections.md.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/functional/upsampling.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>

#include "gpipe/skippable.h"

namespace gpipe {
namespace models {

// [down]
// An encoder level: convolve, keep the features for the decoder (stash), then halve the size.
struct DownImpl : torch::nn::Cloneable<DownImpl> {
  DownImpl(int64_t in, int64_t out) : in(in), out(out) { reset(); }
  void reset() override {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor features = at::relu(conv(x));
    gpipe::stash("skip", features);
    return at::max_pool2d(features, {2, 2});
  }
  int64_t in, out;
  torch::nn::Conv2d conv{nullptr};
};
TORCH_MODULE(Down);
// [down]

// [up]
// A decoder level: double the size, take the encoder's features back (pop), convolve both.
struct UpImpl : torch::nn::Cloneable<UpImpl> {
  UpImpl(int64_t in, int64_t skip, int64_t out) : in(in), skip(skip), out(out) { reset(); }
  void reset() override {
    conv = register_module(
        "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in + skip, out, 3).padding(1)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor up = at::upsample_nearest2d(x, {x.size(2) * 2, x.size(3) * 2});
    at::Tensor features = gpipe::pop("skip");
    return at::relu(conv(at::cat({up, features}, 1)));
  }
  int64_t in, skip, out;
  torch::nn::Conv2d conv{nullptr};
};
TORCH_MODULE(Up);
// [up]

// [unet]
// Two levels, each a Down/Up pair in its own namespace: the same name "skip" pairs the outer
// Down with the outer Up and the inner Down with the inner Up.
inline torch::nn::Sequential unet() {
  gpipe::Namespace outer, inner;
  auto down1 = gpipe::skippable(Down(1, 8), gpipe::SkippableOptions().stash({"skip"}));
  auto down2 = gpipe::skippable(Down(8, 16), gpipe::SkippableOptions().stash({"skip"}));
  auto up2 = gpipe::skippable(Up(16, 16, 16), gpipe::SkippableOptions().pop({"skip"}));
  auto up1 = gpipe::skippable(Up(16, 8, 8), gpipe::SkippableOptions().pop({"skip"}));
  down1->isolate(outer);
  up1->isolate(outer);
  down2->isolate(inner);
  up2->isolate(inner);
  return torch::nn::Sequential(
      down1, down2, torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 16, 3).padding(1)),
      torch::nn::ReLU(), up2, up1, torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 1, 1)));
}
// [unet]

}  // namespace models
}  // namespace gpipe
