// ResNets as flat torch::nn::Sequentials, in three forms:
// - resnet(): ResNet-18/34/50/101/152 (for ImageNet-sized and CIFAR-sized inputs) with one layer
//   per residual block, so every block boundary is a possible partition boundary; each block's
//   shortcut stays inside its layer. torchvision's architecture (ResNet v1.5: the stride on the 3x3
//   convolution) and parameter counts.
// - resnet_fine(): the same networks split into their convolutions, batch norms and ReLUs, as the
//   reference's benchmark model (ResNet-101 = 370 layers), so partitions can cut inside a block;
//   the shortcut is stashed by the block's first layer and popped by its residual layer
//   (gpipe::stash / gpipe::pop, one Namespace per block).
// - resnet_cifar(): He et al.'s CIFAR ResNet-20/32/44/56/110 (16/32/64 channels, parameter-free
//   shortcuts), one layer per block.
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
  explicit StemImpl(bool imagenet, int64_t in_channels = 3)
      : imagenet(imagenet), in_channels(in_channels) {
    reset();
  }
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  bool imagenet;
  int64_t in_channels;
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

/// The first layer of a block in resnet_fine(): stashes its input as the block's shortcut
/// ("identity") and returns it.
struct ShortcutImpl : torch::nn::Cloneable<ShortcutImpl> {
  void reset() override {}
  at::Tensor forward(const at::Tensor& x);
};
TORCH_MODULE(Shortcut);

/// The residual addition of a block in resnet_fine(): pops the shortcut, projects it when the
/// block changes shape (1x1 convolution and batch norm), and adds it.
struct ResidualImpl : torch::nn::Cloneable<ResidualImpl> {
  ResidualImpl(int64_t in, int64_t out, int64_t stride) : in(in), out(out), stride(stride) {
    reset();
  }
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t in, out, stride;
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(Residual);

/// The stem of He et al.'s CIFAR ResNets: a 3x3 convolution to 16 channels, batch norm, ReLU.
struct CifarStemImpl : torch::nn::Cloneable<CifarStemImpl> {
  explicit CifarStemImpl(int64_t in_channels) : in_channels(in_channels) { reset(); }
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t in_channels;
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(CifarStem);

/// A block of He et al.'s CIFAR ResNets: two 3x3 convolutions, and a parameter-free shortcut
/// (every other pixel, zero-padded channels) when the block changes shape.
struct CifarBlockImpl : torch::nn::Cloneable<CifarBlockImpl> {
  CifarBlockImpl(int64_t in, int64_t planes, int64_t stride)
      : in(in), planes(planes), stride(stride) {
    reset();
  }
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t in, planes, stride;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
};
TORCH_MODULE(CifarBlock);

/// ResNet-`depth` (18, 34, 50, 101 or 152) as a flat Sequential. `imagenet` chooses the 7x7
/// stride-2 stem with max pooling (224x224 inputs) or the 3x3 stride-1 stem (32x32 CIFAR inputs).
///
///   torch::nn::Sequential model = gpipe::models::resnet(101, /*classes=*/1000);
///   // model->size() == 1 + 33 + 1 layers
torch::nn::Sequential resnet(int64_t depth, int64_t classes = 1000, bool imagenet = true,
                             int64_t in_channels = 3);

/// resnet(depth, ...) split into single layers: per bottleneck Shortcut, conv1, bn1, relu1, conv2,
/// bn2, relu2, conv3, bn3, Residual, relu3 (per basic block Shortcut, conv1, bn1, relu1, conv2, bn2,
/// Residual, relu2); the stem's conv, bn, relu (and max pool), then average pool, flatten and fc.
/// Same parameters as resnet(); convolutions initialised as the reference (Kaiming normal, fan
/// out), batch norms to (1, 0).
///
///   torch::nn::Sequential model = gpipe::models::resnet_fine(101);  // 370 layers
torch::nn::Sequential resnet_fine(int64_t depth, int64_t classes = 1000, bool imagenet = true,
                                  int64_t in_channels = 3);

/// He et al.'s CIFAR ResNet-`depth` (depth = 6n + 2: 20, 32, 44, 56, 110): a 3x3 convolution with
/// 16 channels, three stages of n blocks with 16, 32 and 64 channels, global average pooling and
/// the classifier; n * 3 + 2 layers. ResNet-20 has 269,722 parameters with 10 classes.
///
///   torch::nn::Sequential model = gpipe::models::resnet_cifar(20, 10, /*in_channels=*/1);
torch::nn::Sequential resnet_cifar(int64_t depth, int64_t classes = 10, int64_t in_channels = 3);

}  // namespace models
}  // namespace gpipe
