// The sequential ResNet family; see resnet.h.
#include "examples/models/resnet.h"

#include <vector>

#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

#include "absl/strings/str_cat.h"
#include "gpipe/skippable.h"

namespace gpipe {
namespace models {
namespace {

namespace nn = torch::nn;

nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  return nn::Conv2d(
      nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

// The projection shortcut when the block changes shape, else null.
nn::Sequential shortcut(int64_t in, int64_t out, int64_t stride) {
  if (stride == 1 && in == out) {
    return nn::Sequential(nullptr);
  }
  return nn::Sequential(conv(in, out, 1, stride), nn::BatchNorm2d(out));
}

}  // namespace

void StemImpl::reset() {
  conv = register_module("conv", imagenet ? models::conv(in_channels, 64, 7, 2)
                                          : models::conv(in_channels, 64, 3, 1));
  bn = register_module("bn", nn::BatchNorm2d(64));
}

at::Tensor StemImpl::forward(const at::Tensor& x) {
  at::Tensor y = at::relu(bn(conv(x)));
  return imagenet ? at::max_pool2d(y, {3, 3}, {2, 2}, {1, 1}) : y;
}

void BasicBlockImpl::reset() {
  conv1 = register_module("conv1", conv(in, planes, 3, stride));
  bn1 = register_module("bn1", nn::BatchNorm2d(planes));
  conv2 = register_module("conv2", conv(planes, planes, 3, 1));
  bn2 = register_module("bn2", nn::BatchNorm2d(planes));
  downsample = shortcut(in, planes * kExpansion, stride);
  if (downsample) register_module("downsample", downsample);
}

at::Tensor BasicBlockImpl::forward(const at::Tensor& x) {
  at::Tensor y = at::relu(bn1(conv1(x)));
  y = bn2(conv2(y));
  return at::relu(y + (downsample ? downsample->forward(x) : x));
}

void BottleneckImpl::reset() {
  conv1 = register_module("conv1", conv(in, planes, 1, 1));
  bn1 = register_module("bn1", nn::BatchNorm2d(planes));
  conv2 = register_module("conv2", conv(planes, planes, 3, stride));
  bn2 = register_module("bn2", nn::BatchNorm2d(planes));
  conv3 = register_module("conv3", conv(planes, planes * kExpansion, 1, 1));
  bn3 = register_module("bn3", nn::BatchNorm2d(planes * kExpansion));
  downsample = shortcut(in, planes * kExpansion, stride);
  if (downsample) register_module("downsample", downsample);
}

at::Tensor BottleneckImpl::forward(const at::Tensor& x) {
  at::Tensor y = at::relu(bn1(conv1(x)));
  y = at::relu(bn2(conv2(y)));
  y = bn3(conv3(y));
  return at::relu(y + (downsample ? downsample->forward(x) : x));
}

void HeadImpl::reset() { fc = register_module("fc", nn::Linear(features, classes)); }

at::Tensor HeadImpl::forward(const at::Tensor& x) {
  return fc(at::adaptive_avg_pool2d(x, {1, 1}).flatten(1));
}

namespace {

// The blocks per stage of ResNet-`depth`, and whether they are bottlenecks.
std::pair<std::vector<int64_t>, bool> resnet_blocks(const char* what, int64_t depth,
                                                   int64_t classes, int64_t in_channels) {
  TORCH_CHECK(classes >= 1, what, ": classes must be positive, got ", classes);
  TORCH_CHECK(in_channels >= 1, what, ": in_channels must be positive, got ", in_channels);
  switch (depth) {
    case 18: return {{2, 2, 2, 2}, false};
    case 34: return {{3, 4, 6, 3}, false};
    case 50: return {{3, 4, 6, 3}, true};
    case 101: return {{3, 4, 23, 3}, true};
    case 152: return {{3, 8, 36, 3}, true};
  }
  TORCH_CHECK(false, what, ": depth must be 18, 34, 50, 101 or 152, got ", depth,
              " (He et al.'s CIFAR ResNet-20/32/44/56/110 are resnet_cifar)");
}

}  // namespace

at::Tensor ShortcutImpl::forward(const at::Tensor& x) {
  gpipe::stash("identity", x);
  return x;
}

void ResidualImpl::reset() {
  downsample = shortcut(in, out, stride);
  if (downsample) register_module("downsample", downsample);
}

at::Tensor ResidualImpl::forward(const at::Tensor& x) {
  at::Tensor identity = gpipe::pop("identity");
  return x + (downsample ? downsample->forward(identity) : identity);
}

void CifarStemImpl::reset() {
  conv = register_module("conv", models::conv(in_channels, 16, 3, 1));
  bn = register_module("bn", nn::BatchNorm2d(16));
}

at::Tensor CifarStemImpl::forward(const at::Tensor& x) { return at::relu(bn(conv(x))); }

void CifarBlockImpl::reset() {
  conv1 = register_module("conv1", conv(in, planes, 3, stride));
  bn1 = register_module("bn1", nn::BatchNorm2d(planes));
  conv2 = register_module("conv2", conv(planes, planes, 3, 1));
  bn2 = register_module("bn2", nn::BatchNorm2d(planes));
}

at::Tensor CifarBlockImpl::forward(const at::Tensor& x) {
  at::Tensor y = bn2(conv2(at::relu(bn1(conv1(x)))));
  at::Tensor identity = x;
  if (stride != 1 || in != planes) {
    // He et al.'s option A: every other pixel, and the new channels zero.
    identity = x.slice(2, 0, c10::nullopt, stride).slice(3, 0, c10::nullopt, stride);
    const int64_t extra = planes - in;
    identity = at::constant_pad_nd(identity, {0, 0, 0, 0, extra / 2, extra - extra / 2}, 0);
  }
  return at::relu(y + identity);
}

nn::Sequential resnet(int64_t depth, int64_t classes, bool imagenet, int64_t in_channels) {
  const auto [blocks, bottleneck] = resnet_blocks("resnet", depth, classes, in_channels);
  const int64_t expansion = bottleneck ? BottleneckImpl::kExpansion : BasicBlockImpl::kExpansion;
  nn::Sequential model;
  model->push_back("stem", Stem(imagenet, in_channels));
  int64_t in = 64;
  for (size_t stage = 0; stage < blocks.size(); ++stage) {
    const int64_t planes = 64 << stage;
    for (int64_t b = 0; b < blocks[stage]; ++b) {
      const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
      const std::string name = "layer" + std::to_string(stage + 1) + "_" + std::to_string(b);
      if (bottleneck) {
        model->push_back(name, Bottleneck(in, planes, stride).ptr());
      } else {
        model->push_back(name, BasicBlock(in, planes, stride).ptr());
      }
      in = planes * expansion;
    }
  }
  model->push_back("head", Head(in, classes));
  return model;
}

nn::Sequential resnet_fine(int64_t depth, int64_t classes, bool imagenet, int64_t in_channels) {
  const auto [blocks, bottleneck] = resnet_blocks("resnet_fine", depth, classes, in_channels);
  const int64_t expansion = bottleneck ? BottleneckImpl::kExpansion : BasicBlockImpl::kExpansion;
  nn::Sequential model;
  model->push_back("conv1", imagenet ? conv(in_channels, 64, 7, 2) : conv(in_channels, 64, 3, 1));
  model->push_back("bn1", nn::BatchNorm2d(64));
  model->push_back("relu", nn::ReLU());
  if (imagenet) {
    model->push_back("maxpool", nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(2).padding(1)));
  }
  int64_t in = 64;
  for (size_t stage = 0; stage < blocks.size(); ++stage) {
    const int64_t planes = 64 << stage;
    for (int64_t b = 0; b < blocks[stage]; ++b) {
      const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
      const std::string prefix = absl::StrCat("layer", stage + 1, "_", b, "_");
      const int64_t out = planes * expansion;
      // The block's two skippable layers share a namespace, so every block can call its
      // shortcut "identity".
      gpipe::Namespace ns;
      auto identity = gpipe::skippable(Shortcut(), gpipe::SkippableOptions().stash({"identity"}));
      auto residual =
          gpipe::skippable(Residual(in, out, stride), gpipe::SkippableOptions().pop({"identity"}));
      identity->isolate(ns);
      residual->isolate(ns);
      model->push_back(prefix + "identity", identity);
      if (bottleneck) {
        model->push_back(prefix + "conv1", conv(in, planes, 1, 1));
        model->push_back(prefix + "bn1", nn::BatchNorm2d(planes));
        model->push_back(prefix + "relu1", nn::ReLU());
        model->push_back(prefix + "conv2", conv(planes, planes, 3, stride));
        model->push_back(prefix + "bn2", nn::BatchNorm2d(planes));
        model->push_back(prefix + "relu2", nn::ReLU());
        model->push_back(prefix + "conv3", conv(planes, out, 1, 1));
        model->push_back(prefix + "bn3", nn::BatchNorm2d(out));
        model->push_back(prefix + "residual", residual);
        model->push_back(prefix + "relu3", nn::ReLU());
      } else {
        model->push_back(prefix + "conv1", conv(in, planes, 3, stride));
        model->push_back(prefix + "bn1", nn::BatchNorm2d(planes));
        model->push_back(prefix + "relu1", nn::ReLU());
        model->push_back(prefix + "conv2", conv(planes, planes, 3, 1));
        model->push_back(prefix + "bn2", nn::BatchNorm2d(planes));
        model->push_back(prefix + "residual", residual);
        model->push_back(prefix + "relu2", nn::ReLU());
      }
      in = out;
    }
  }
  model->push_back("avgpool", nn::AdaptiveAvgPool2d(nn::AdaptiveAvgPool2dOptions({1, 1})));
  model->push_back("flat", nn::Flatten());
  model->push_back("fc", nn::Linear(in, classes));
  // The reference's initialisation (torchvision 0.4's).
  at::NoGradGuard no_grad;
  for (const auto& module : model->modules(/*include_self=*/false)) {
    if (auto* c = module->as<nn::Conv2d>()) {
      nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
    } else if (auto* bn = module->as<nn::BatchNorm2d>()) {
      nn::init::ones_(bn->weight);
      nn::init::zeros_(bn->bias);
    }
  }
  return model;
}

nn::Sequential resnet_cifar(int64_t depth, int64_t classes, int64_t in_channels) {
  TORCH_CHECK(depth >= 8 && (depth - 2) % 6 == 0,
              "resnet_cifar: depth must be 6n + 2 (20, 32, 44, 56, 110), got ", depth);
  TORCH_CHECK(classes >= 1, "resnet_cifar: classes must be positive, got ", classes);
  TORCH_CHECK(in_channels >= 1, "resnet_cifar: in_channels must be positive, got ", in_channels);
  const int64_t n = (depth - 2) / 6;
  nn::Sequential model;
  model->push_back("stem", CifarStem(in_channels));
  int64_t in = 16;
  for (int64_t stage = 0; stage < 3; ++stage) {
    const int64_t planes = 16 << stage;
    for (int64_t b = 0; b < n; ++b) {
      const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
      model->push_back(absl::StrCat("layer", stage + 1, "_", b), CifarBlock(in, planes, stride));
      in = planes;
    }
  }
  model->push_back("head", Head(in, classes));
  return model;
}

}  // namespace models
}  // namespace gpipe
