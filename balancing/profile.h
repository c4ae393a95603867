// Layer profiler: what each layer of a Sequential costs, measured on copies of the layers: time
// forward and backward, memory it holds from forward to backward, and the sizes of its
// parameters, buffers, input and output. The balancers turn these into balances.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

namespace gpipe {

/// How to profile.
///
///   gpipe::ProfileOptions().timeout(std::chrono::milliseconds(500)).device(torch::kCPU)
struct ProfileOptions {
  /// Time passes over all layers are repeated until this much time has passed (at least one).
  TORCH_ARG(std::chrono::duration<double>, timeout) = std::chrono::seconds(1);
  /// Where the layer copies run.
  TORCH_ARG(c10::Device, device) = c10::Device(c10::kCPU);
};

/// One layer's measurements.
struct LayerStats {
  std::string name;  // the layer's name in the Sequential
  std::string type;  // e.g. torch::nn::Conv2dImpl
  /// Median wall time of forward and of backward over the timed passes (synchronised on CUDA),
  /// microseconds: a pass slowed by something else on the machine does not move it.
  double forward_us = 0;
  double backward_us = 0;
  /// Bytes allocated by forward and still held when it returns: the output and what autograd
  /// saved for backward. Measured through LibTorch's allocator reports, on CPU as on CUDA.
  int64_t held_bytes = 0;
  int64_t param_bytes = 0;
  int64_t buffer_bytes = 0;
  int64_t input_bytes = 0;
  int64_t output_bytes = 0;
};

/// A per-layer profile.
struct LayerProfile {
  std::vector<LayerStats> layers;
  c10::Device device = c10::Device(c10::kCPU);
  int64_t passes = 0;
  /// The sample's size in dimension 0.
  int64_t batch = 0;

  /// A fixed-width table, one row per layer.
  std::string table() const;
  /// The same as a JSON array of objects.
  std::string json() const;
};

/// Profiles every layer of `module` on `sample` (a tensor, or a vector of tensors for tuple
/// layers). Runs on deep copies (LibTorch's clone()), so the user's layers, gradients, BatchNorm
/// statistics and train/eval mode are untouched; the copies run in training mode.
///
///   auto profile = gpipe::profile_layers(model, at::randn({8, 3, 224, 224}), {});
///   std::cout << profile.table();
///
/// Throws c10::Error when a parameter already has a gradient, when a layer cannot be cloned, or
/// when the sample does not go through the model (naming the layer).
LayerProfile profile_layers(const torch::nn::Sequential& module,
                            const std::vector<at::Tensor>& sample, const ProfileOptions& options);
LayerProfile profile_layers(const torch::nn::Sequential& module, const at::Tensor& sample,
                            const ProfileOptions& options);

}  // namespace gpipe
