// The reference's benchmark U-Net; see unet_reference.h.
#include "examples/models/unet_reference.h"

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/functional/instancenorm.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/modules/upsampling.h>

#include "absl/strings/str_cat.h"
#include "gpipe/skippable.h"

namespace gpipe {
namespace models {
namespace {

namespace nn = torch::nn;

struct Channels {
  int64_t in, mid, out;
};

// conv, dropout, norm, relu blocks from `ch.in` to `ch.out` through `ch.mid`, as named layers.
void add_cell(nn::Sequential& model, const std::string& prefix, const Channels& ch,
              int64_t num_convs) {
  std::vector<std::pair<int64_t, int64_t>> convs;
  if (num_convs == 1) {
    convs.emplace_back(ch.in, ch.out);
  } else {
    convs.emplace_back(ch.in, ch.mid);
    for (int64_t k = 0; k < num_convs - 2; ++k) convs.emplace_back(ch.mid, ch.mid);
    convs.emplace_back(ch.mid, ch.out);
  }
  for (size_t k = 0; k < convs.size(); ++k) {
    const auto [in, out] = convs[k];
    const std::string name = absl::StrCat(prefix, k, "_");
    model->push_back(name + "conv",
                     nn::Conv2d(nn::Conv2dOptions(in, out, 3).padding(1).bias(false)));
    model->push_back(name + "dropout", nn::Dropout2d(0.1));
    model->push_back(name + "norm", nn::InstanceNorm2d(out));
    model->push_back(name + "relu", nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(1e-2)));
  }
}

}  // namespace

at::Tensor UNetStashImpl::forward(const at::Tensor& x) {
  gpipe::stash("skip", x);
  return x;
}

at::Tensor UNetPopCatImpl::forward(const at::Tensor& x) {
  at::Tensor skip = gpipe::pop("skip");
  at::Tensor input = x;
  if (input.sizes().slice(2) != skip.sizes().slice(2)) {
    input = at::constant_pad_nd(input, {0, skip.size(3) - input.size(3), 0,
                                        skip.size(2) - input.size(2)}, 0);
  }
  return at::cat({input, skip}, 1);
}

nn::Sequential unet_reference(int64_t depth, int64_t num_convs, int64_t base_channels,
                              int64_t input_channels, int64_t output_channels) {
  TORCH_CHECK(depth >= 1, "unet_reference: depth must be positive, got ", depth);
  TORCH_CHECK(num_convs >= 1, "unet_reference: num_convs must be positive, got ", num_convs);
  TORCH_CHECK(base_channels >= 2, "unet_reference: base_channels must be at least 2, got ",
              base_channels);
  const int64_t c = base_channels;
  auto power = [](int64_t e) { return int64_t{1} << e; };
  nn::Sequential model;
  std::vector<gpipe::Namespace> namespaces(depth);
  for (int64_t i = 0; i < depth; ++i) {
    const Channels ch{i == 0 ? input_channels : c * power(i - 1), c * power(i), c * power(i)};
    const std::string prefix = absl::StrCat("encoder_", i, "_");
    add_cell(model, prefix + "encode_", ch, num_convs);
    auto stash = gpipe::skippable(UNetStash(), gpipe::SkippableOptions().stash({"skip"}));
    stash->isolate(namespaces[i]);
    model->push_back(prefix + "skip", stash);
    model->push_back(prefix + "down", nn::MaxPool2d(nn::MaxPool2dOptions(2).stride(2)));
  }
  add_cell(model, "bottleneck_0_",
           Channels{c * power(depth - 1), c * power(depth), c * power(depth - 1)}, num_convs);
  for (int64_t k = 0; k < depth; ++k) {
    const int64_t i = depth - 1 - k;  // the encoder level whose features this level takes
    // int(C * 2 ** (i - 1)) in the reference: C / 2 at level 0.
    const int64_t out = i == 0 ? c / 2 : c * power(i - 1);
    const std::string prefix = absl::StrCat("decoder_", k, "_");
    model->push_back(prefix + "up",
                     nn::Upsample(nn::UpsampleOptions()
                                      .scale_factor(std::vector<double>{2.0, 2.0})
                                      .mode(torch::kNearest)));
    auto pop = gpipe::skippable(UNetPopCat(), gpipe::SkippableOptions().pop({"skip"}));
    pop->isolate(namespaces[i]);
    model->push_back(prefix + "skip", pop);
    add_cell(model, prefix + "decode_", Channels{c * power(i + 1), out, out}, num_convs);
  }
  model->push_back("segment", nn::Conv2d(nn::Conv2dOptions(c / 2, output_channels, 1).bias(false)));
  return model;
}

}  // namespace models
}  // namespace gpipe
