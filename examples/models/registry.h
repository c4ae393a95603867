// The bundled example models by name, with the shape of one input sample, for tools such as the
// balancing command line (//balancing:balance) and the trainers (//examples:resnet, :amoebanet).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

namespace gpipe {
namespace models {

/// A model and the shape of one sample (without the batch dimension).
struct NamedModel {
  torch::nn::Sequential model;
  std::vector<int64_t> sample_shape;
  /// > 0: a sample is token ids in [0, vocabulary) (int64), not a float tensor.
  int64_t vocabulary = 0;
};

/// A batch of `batch` samples for `named`: random token ids for a language model, else normal
/// floats.
at::Tensor sample_batch(const NamedModel& named, int64_t batch);

/// What the data gives a model: channels and size of its images, number of classes (0 for the
/// model's own: 1000 for ImageNet models, 10 for CIFAR ones).
struct ModelInput {
  int64_t channels = 3;
  int64_t size = 0;  // 0: the model's own (224 for ImageNet models, 32 for CIFAR ones)
  int64_t classes = 0;
};

/// The names make_model knows:
/// - resnet18 ... resnet152: one layer per block (ImageNet, 224x224, 1000 classes);
///   resnet18_cifar ... resnet152_cifar: the same with a 3x3 stem (32x32, 10 classes);
/// - resnet18_fine ... resnet152_fine: split into single layers (resnet101_fine has 370);
/// - resnet8_cifar, resnet20_cifar, resnet32_cifar, resnet44_cifar, resnet56_cifar,
///   resnet110_cifar: He et al.'s (resnet8_cifar is the ResNet trainer's default);
/// - amoebanet_d_<L>_<D>: AmoebaNet-D with L normal cells (a multiple of 3) and D filters, e.g.
///   amoebanet_d_18_256 (224x224, 1000 classes);
/// - unet_<B>_<C>: the reference's benchmark U-Net (depth 5) with B convolutions per level and C
///   base channels, e.g. unet_5_64 (3 x 192 x 192 in, 1 channel out);
/// - unet (a small U-Net for 1 x 16 x 16), mlp;
/// - gpt_<L>_<D>: a GPT (examples/models/gpt.h) of L blocks of width D (D / 64 heads, at least
///   1), byte-level (vocabulary 256, context 256), e.g. gpt_4_128; gpt2_small and gpt2_medium
///   with GPT-2's shapes (vocabulary 50,257, context 1,024; samples of 1,024 tokens).
std::vector<std::string> model_names();

/// The model called `name`, for `input` (channels, image size and classes; the model's own where
/// zero). Throws c10::Error listing the names for an unknown one.
NamedModel make_model(const std::string& name, const ModelInput& input = {});

}  // namespace models
}  // namespace gpipe
