// A sequential ResNet family (ResNet-18/34/50/101/152, for ImageNet-sized and CIFAR-sized
// inputs) as one flat torch::nn::Sequential: the stem, each residual block, and the head are its
// layers, so every block boundary is a possible partition boundary. Each block's shortcut stays
// inside the block's layer. The ImageNet variants have torchvision's architecture (ResNet v1.5:
// the stride on the 3x3 convolution) and parameter counts.
#pragma once

#include <cstdint>
#include <string>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

namespace gpipe {
namespace models {

/// Convolution, batch norm and ReLU at the input; for ImageNet also a 3x3 max pool.
struct StemImpl : torch::nn::Cloneable<StemImpl> {
  explicit StemImpl(bool imagenet) : imagenet(imagenet) { reset(); }
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  bool imagenet;
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(Stem);

/// Two 3x3 convolutions with a shortcut (ResNet-18/34).
struct BasicBlockImpl : torch::nn::Cloneable<BasicBlockImpl> {
  static constexpr int64_t kExpansion = 1;
  BasicBlockImpl(int64_t in, int64_t planes, int64_t stride)
      : in(in), planes(planes), stride(stride) {
    reset();
  }
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t in, planes, stride;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(BasicBlock);

/// 1x1, 3x3 (strided), 1x1 convolutions with a shortcut (ResNet-50/101/152).
struct BottleneckImpl : torch::nn::Cloneable<BottleneckImpl> {
  static constexpr int64_t kExpansion = 4;
  BottleneckImpl(int64_t in, int64_t planes, int64_t stride)
      : in(in), planes(planes), stride(stride) {
    reset();
  }
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t in, planes, stride;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(Bottleneck);

/// Global average pooling and the classifier.
struct HeadImpl : torch::nn::Cloneable<HeadImpl> {
  HeadImpl(int64_t features, int64_t classes) : features(features), classes(classes) { reset(); }
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t features, classes;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Head);

/// ResNet-`depth` (18, 34, 50, 101 or 152) as a flat Sequential. `imagenet` chooses the 7x7
/// stride-2 stem with max pooling (224x224 inputs) or the 3x3 stride-1 stem (32x32 CIFAR inputs).
///
///   torch::nn::Sequential model = gpipe::models::resnet(101, /*classes=*/1000);
///   // model->size() == 1 + 33 + 1 layers
torch::nn::Sequential resnet(int64_t depth, int64_t classes = 1000, bool imagenet = true);

}  // namespace models
}  // namespace gpipe
