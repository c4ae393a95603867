// A multi-layer perceptron for 2-D points (the spirals of examples/train_mlp.cc).
#pragma once

#include <cstdint>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

namespace gpipe {
namespace models {

/// 9 layers: Linear(2, width), then three (ReLU, Linear(width, width)), ReLU, Linear(width, 2).
inline torch::nn::Sequential mlp(int64_t width = 64) {
  namespace nn = torch::nn;
  return nn::Sequential(nn::Linear(2, width), nn::ReLU(), nn::Linear(width, width), nn::ReLU(),
                        nn::Linear(width, width), nn::ReLU(), nn::Linear(width, width), nn::ReLU(),
                        nn::Linear(width, 2));
}

}  // namespace models
}  // namespace gpipe
