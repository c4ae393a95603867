// The sequential ResNet family; see resnet.h.
#include "examples/models/resnet.h"

#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

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
  conv = register_module("conv", imagenet ? models::conv(3, 64, 7, 2) : models::conv(3, 64, 3, 1));
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

nn::Sequential resnet(int64_t depth, int64_t classes, bool imagenet) {
  std::vector<int64_t> blocks;
  bool bottleneck = true;
  switch (depth) {
    case 18: blocks = {2, 2, 2, 2}; bottleneck = false; break;
    case 34: blocks = {3, 4, 6, 3}; bottleneck = false; break;
    case 50: blocks = {3, 4, 6, 3}; break;
    case 101: blocks = {3, 4, 23, 3}; break;
    case 152: blocks = {3, 8, 36, 3}; break;
    default:
      TORCH_CHECK(false, "resnet: depth must be 18, 34, 50, 101 or 152, got ", depth);
  }
  TORCH_CHECK(classes >= 1, "resnet: classes must be positive, got ", classes);
  const int64_t expansion = bottleneck ? BottleneckImpl::kExpansion : BasicBlockImpl::kExpansion;
  nn::Sequential model;
  model->push_back("stem", Stem(imagenet));
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

}  // namespace models
}  // namespace gpipe
