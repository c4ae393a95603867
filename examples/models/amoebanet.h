// AmoebaNet-D (L, D) as one flat torch::nn::Sequential, exactly as the reference's benchmark model
// (torchgpipe's benchmarks/models/amoebanet, after the TensorFlow implementation GPipe used): a
// stem, two reduction cells, L/3 normal cells, a reduction cell, L/3 normal cells, a reduction
// cell, L/3 normal cells and the classifier, L + 6 layers. Every cell takes and returns the pair
// (current, previous) as a vector of two tensors, so only tensor pairs cross partitions. Same
// genotype, operations and channel arithmetic as the reference, including its quirk that the
// operation called max_pool_3x3 is an average pool. Two changes let small inputs (28x28, 32x32)
// work too, and change nothing for the reference's 224x224 inputs: the classifier pools globally
// (the reference's 7x7 average pool), and max_pool_2x2 rounds odd sizes up, as the cells' other
// strided operations do.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

namespace gpipe {
namespace models {

/// ReLU, then two 1x1 stride-2 convolutions on the input and on the input shifted by one pixel,
/// concatenated, then batch norm: halves the size with `out` channels.
struct FactorizedReduceImpl : torch::nn::Cloneable<FactorizedReduceImpl> {
  FactorizedReduceImpl(int64_t in, int64_t out) : in(in), out(out) { reset(); }
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t in, out;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(FactorizedReduce);

/// ReLU, a 3x3 stride-2 convolution and batch norm; returns the pair (x, x).
struct AmoebaStemImpl : torch::nn::Cloneable<AmoebaStemImpl> {
  AmoebaStemImpl(int64_t in_channels, int64_t channels)
      : in_channels(in_channels), channels(channels) {
    reset();
  }
  void reset() override;
  std::vector<at::Tensor> forward(const at::Tensor& x);
  int64_t in_channels, channels;
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(AmoebaStem);

/// A normal or reduction cell: takes (current, previous), returns (its output, current).
struct AmoebaCellImpl : torch::nn::Cloneable<AmoebaCellImpl> {
  AmoebaCellImpl(int64_t channels_prev_prev, int64_t channels_prev, int64_t channels,
                 bool reduction, bool reduction_prev)
      : channels_prev_prev(channels_prev_prev),
        channels_prev(channels_prev),
        channels(channels),
        reduction(reduction),
        reduction_prev(reduction_prev) {
    reset();
  }
  void reset() override;
  std::vector<at::Tensor> forward(std::vector<at::Tensor> states);
  /// The number of states concatenated into the output (its channels are this times `channels`).
  int64_t concat_size() const { return static_cast<int64_t>(concat.size()); }

  int64_t channels_prev_prev, channels_prev, channels;
  bool reduction, reduction_prev;
  torch::nn::Sequential reduce1{nullptr}, reduce2{nullptr};
  torch::nn::ModuleList operations{nullptr};
  std::vector<int64_t> indices;  // the state each operation reads
  std::vector<int64_t> concat;   // the states concatenated into the output
};
TORCH_MODULE(AmoebaCell);

/// Global average pooling of `current` and the classifier.
struct AmoebaClassifyImpl : torch::nn::Cloneable<AmoebaClassifyImpl> {
  AmoebaClassifyImpl(int64_t channels_prev, int64_t classes)
      : channels_prev(channels_prev), classes(classes) {
    reset();
  }
  void reset() override;
  at::Tensor forward(std::vector<at::Tensor> states);
  int64_t channels_prev, classes;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(AmoebaClassify);

/// AmoebaNet-D with `layers` normal cells (a multiple of 3) and `filters` filters, as a flat
/// Sequential of layers + 6 layers.
///
///   torch::nn::Sequential model = gpipe::models::amoebanet_d(18, 256);  // 24 layers
///   // 122,470,120 parameters with 1,000 classes
torch::nn::Sequential amoebanet_d(int64_t layers, int64_t filters, int64_t classes = 1000,
                                  int64_t in_channels = 3);

}  // namespace models
}  // namespace gpipe
