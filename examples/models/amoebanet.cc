// AmoebaNet-D; see amoebanet.h.
#include "examples/models/amoebanet.h"

#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>

namespace gpipe {
namespace models {
namespace {

namespace nn = torch::nn;

// The operations of the genotype, by the reference's names.
enum class Op { kNone, kAvgPool3x3, kMaxPool3x3, kMaxPool2x2, kConv1x1, kConv3x3, kConv1x7_7x1 };

// AmoebaNet-D's genotype (the TensorFlow implementation's, which the reference follows): pairs of
// (the state an operation reads, the operation); operations 2k and 2k+1 make state 2 + k.
const std::vector<std::pair<int64_t, Op>>& normal_operations() {
  static const std::vector<std::pair<int64_t, Op>> ops = {
      {1, Op::kConv1x1},     {1, Op::kMaxPool3x3},   {1, Op::kNone},       {0, Op::kConv1x7_7x1},
      {0, Op::kConv1x1},     {0, Op::kConv1x7_7x1},  {2, Op::kMaxPool3x3}, {2, Op::kNone},
      {1, Op::kAvgPool3x3},  {5, Op::kConv1x1},
  };
  return ops;
}
const std::vector<int64_t> kNormalConcat = {0, 3, 4, 6};

const std::vector<std::pair<int64_t, Op>>& reduction_operations() {
  static const std::vector<std::pair<int64_t, Op>> ops = {
      {0, Op::kMaxPool2x2},  {0, Op::kMaxPool3x3},   {2, Op::kNone},       {1, Op::kConv3x3},
      {2, Op::kConv1x7_7x1}, {2, Op::kMaxPool3x3},   {3, Op::kNone},       {1, Op::kMaxPool2x2},
      {2, Op::kAvgPool3x3},  {3, Op::kConv1x1},
  };
  return ops;
}
const std::vector<int64_t> kReductionConcat = {4, 5, 6};

nn::Conv2d conv2d(int64_t in, int64_t out, torch::ExpandingArray<2> kernel,
                  torch::ExpandingArray<2> stride, torch::ExpandingArray<2> padding) {
  return nn::Conv2d(
      nn::Conv2dOptions(in, out, kernel).stride(stride).padding(padding).bias(false));
}

// ReLU, a 1x1 convolution and batch norm.
nn::Sequential relu_conv_bn(int64_t in, int64_t out) {
  return nn::Sequential(nn::ReLU(), conv2d(in, out, 1, 1, 0), nn::BatchNorm2d(out));
}

nn::Sequential make_op(Op op, int64_t c, int64_t stride) {
  switch (op) {
    case Op::kNone:
      return stride == 1 ? nn::Sequential(nn::Identity()) : nn::Sequential(FactorizedReduce(c, c));
    case Op::kAvgPool3x3:
    case Op::kMaxPool3x3:  // an average pool in the reference too
      return nn::Sequential(nn::AvgPool2d(
          nn::AvgPool2dOptions(3).stride(stride).padding(1).count_include_pad(false)));
    case Op::kMaxPool2x2:
      // ceil_mode: the same as the reference's pool on even sizes (all of them for 224x224
      // inputs); on odd ones it gives ceil(H / 2), as the cell's other strided operations, so
      // that inputs such as 28x28 work too.
      return nn::Sequential(
          nn::MaxPool2d(nn::MaxPool2dOptions(2).stride(stride).padding(0).ceil_mode(true)));
    case Op::kConv1x1:
      return nn::Sequential(nn::ReLU(), conv2d(c, c, 1, stride, 0), nn::BatchNorm2d(c));
    case Op::kConv3x3:
      return nn::Sequential(nn::ReLU(), conv2d(c, c / 4, 1, 1, 0), nn::BatchNorm2d(c / 4),
                            nn::ReLU(), conv2d(c / 4, c / 4, 3, stride, 1), nn::BatchNorm2d(c / 4),
                            nn::ReLU(), conv2d(c / 4, c, 1, 1, 0), nn::BatchNorm2d(c));
    case Op::kConv1x7_7x1:
      return nn::Sequential(
          nn::ReLU(), conv2d(c, c / 4, 1, 1, 0), nn::BatchNorm2d(c / 4), nn::ReLU(),
          conv2d(c / 4, c / 4, {1, 7}, {1, stride}, {0, 3}), nn::BatchNorm2d(c / 4), nn::ReLU(),
          conv2d(c / 4, c / 4, {7, 1}, {stride, 1}, {3, 0}), nn::BatchNorm2d(c / 4), nn::ReLU(),
          conv2d(c / 4, c, 1, 1, 0), nn::BatchNorm2d(c));
  }
  TORCH_CHECK(false, "amoebanet: unknown operation");
}

}  // namespace

void FactorizedReduceImpl::reset() {
  conv1 = register_module("conv1", conv2d(in, out / 2, 1, 2, 0));
  conv2 = register_module("conv2", conv2d(in, out / 2, 1, 2, 0));
  bn = register_module("bn", nn::BatchNorm2d(out));
}

at::Tensor FactorizedReduceImpl::forward(const at::Tensor& input) {
  at::Tensor x = at::relu(input);
  // The second path sees the input shifted by one pixel, padded back at the bottom and right.
  at::Tensor shifted = at::constant_pad_nd(
      x.slice(2, 1).slice(3, 1), {0, 1, 0, 1}, 0);
  return bn(at::cat({conv1(x), conv2(shifted)}, 1));
}

void AmoebaStemImpl::reset() {
  conv = register_module("conv", models::conv2d(in_channels, channels, 3, 2, 1));
  bn = register_module("bn", nn::BatchNorm2d(channels));
}

std::vector<at::Tensor> AmoebaStemImpl::forward(const at::Tensor& x) {
  at::Tensor y = bn(conv(at::relu(x)));
  return {y, y};
}

void AmoebaCellImpl::reset() {
  reduce1 = register_module("reduce1", relu_conv_bn(channels_prev, channels));
  if (reduction_prev) {
    reduce2 = register_module("reduce2",
                              nn::Sequential(FactorizedReduce(channels_prev_prev, channels)));
  } else if (channels_prev_prev != channels) {
    reduce2 = register_module("reduce2", relu_conv_bn(channels_prev_prev, channels));
  } else {
    reduce2 = register_module("reduce2", nn::Sequential(nn::Identity()));
  }
  const auto& genotype = reduction ? reduction_operations() : normal_operations();
  concat = reduction ? kReductionConcat : kNormalConcat;
  indices.clear();
  operations = register_module("operations", nn::ModuleList());
  for (const auto& [index, op] : genotype) {
    // In a reduction cell, the operations on the cell's inputs (states 0 and 1) halve the size.
    const int64_t stride = reduction && index < 2 ? 2 : 1;
    indices.push_back(index);
    operations->push_back(make_op(op, channels, stride));
  }
}

std::vector<at::Tensor> AmoebaCellImpl::forward(std::vector<at::Tensor> input) {
  TORCH_CHECK(input.size() == 2, "AmoebaCell: expected the pair (current, previous), got ",
              input.size(), " tensors");
  std::vector<at::Tensor> states = {reduce1->forward(input[0]), reduce2->forward(input[1])};
  for (size_t k = 0; k + 1 < indices.size(); k += 2) {
    at::Tensor a = operations[k]->as<nn::Sequential>()->forward(states[indices[k]]);
    at::Tensor b = operations[k + 1]->as<nn::Sequential>()->forward(states[indices[k + 1]]);
    states.push_back(a + b);
  }
  std::vector<at::Tensor> selected;
  for (int64_t i : concat) {
    selected.push_back(states[i]);
  }
  return {at::cat(selected, 1), std::move(input[0])};
}

void AmoebaClassifyImpl::reset() { fc = register_module("fc", nn::Linear(channels_prev, classes)); }

at::Tensor AmoebaClassifyImpl::forward(std::vector<at::Tensor> states) {
  TORCH_CHECK(!states.empty(), "AmoebaClassify: expected the pair (current, previous)");
  return fc(at::adaptive_avg_pool2d(states[0], {1, 1}).flatten(1));
}

nn::Sequential amoebanet_d(int64_t layers, int64_t filters, int64_t classes,
                           int64_t in_channels) {
  TORCH_CHECK(layers >= 3 && layers % 3 == 0,
              "amoebanet_d: the number of normal cells must be a positive multiple of 3, got ",
              layers);
  TORCH_CHECK(filters >= 8,
              "amoebanet_d: the number of filters must be at least 8 (the cells divide it by 4, "
              "and their bottlenecks the doubled result by 4 again), got ", filters);
  TORCH_CHECK(classes >= 1, "amoebanet_d: classes must be positive, got ", classes);
  TORCH_CHECK(in_channels >= 1, "amoebanet_d: in_channels must be positive, got ", in_channels);
  const int64_t repeat = layers / 3;
  int64_t channels = filters / 4;
  int64_t channels_prev_prev = channels;
  int64_t channels_prev = channels;
  bool reduction_prev = false;
  nn::Sequential model;
  auto add_cells = [&](const std::string& name, bool reduction, int64_t scale, int64_t count) {
    channels *= scale;
    for (int64_t k = 0; k < count; ++k) {
      AmoebaCell cell(channels_prev_prev, channels_prev, channels, reduction, reduction_prev);
      channels_prev_prev = channels_prev;
      channels_prev = channels * cell->concat_size();
      reduction_prev = reduction;
      std::string layer_name = reduction ? name : name + std::to_string(k + 1);
      model->push_back(std::move(layer_name), cell);
    }
  };
  model->push_back("stem1", AmoebaStem(in_channels, channels));
  add_cells("stem2", true, 2, 1);
  add_cells("stem3", true, 2, 1);
  add_cells("cell1_normal", false, 1, repeat);
  add_cells("cell2_reduction", true, 2, 1);
  add_cells("cell3_normal", false, 1, repeat);
  add_cells("cell4_reduction", true, 2, 1);
  add_cells("cell5_normal", false, 1, repeat);
  model->push_back("classify", AmoebaClassify(channels_prev, classes));
  return model;
}

}  // namespace models
}  // namespace gpipe
