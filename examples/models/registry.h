// The bundled example models by name, with the shape of one input sample, for tools such as the
// balancing command line (//balancing:balance).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/modules/container/sequential.h>

namespace gpipe {
namespace models {

/// A model and the shape of one sample (without the batch dimension).
struct NamedModel {
  torch::nn::Sequential model;
  std::vector<int64_t> sample_shape;
};

/// The names make_model knows: resnet18 ... resnet152 (ImageNet, 224x224, 1000 classes),
/// resnet18_cifar ... resnet152_cifar (32x32, 10 classes), unet, mlp.
std::vector<std::string> model_names();

/// The model called `name`. Throws c10::Error listing the names for an unknown one.
NamedModel make_model(const std::string& name);

}  // namespace models
}  // namespace gpipe
