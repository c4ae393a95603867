// Layer profiler: what each layer of a Sequential costs, measured on copies of the layers: time
// forward (with and without autograd) and backward (whole, and split into the input's and the
// weights' gradients), memory it holds from forward to backward, and the sizes of its parameters,
// buffers, input and output; and what a copy between two devices costs. The balancers turn these
// into balances, the planner (plan.h) into predicted steps. Profiles are saved as JSON.
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
  /// The layer's name in the Sequential.
  std::string name;
  /// The layer's type, e.g. torch::nn::Conv2dImpl.
  std::string type;
  /// Median wall time of forward and of backward over the timed passes (synchronised on CUDA),
  /// microseconds: a pass slowed by something else on the machine does not move it.
  double forward_us = 0;
  /// The same for backward (the gradients of the layer's input and parameters together).
  double backward_us = 0;
  /// Forward under no-grad mode (a checkpointed micro-batch's first forward; its recomputation
  /// is a forward with autograd, forward_us).
  double forward_nograd_us = 0;
  /// The backward split as the zero-bubble schedule splits it (Note [One executor]): the gradient
  /// of the layer's input only (0 where the input needs none: the first layer), and of its
  /// parameters only (0 without parameters).
  double backward_input_us = 0;
  /// The gradient of the layer's parameters only (0 without parameters); see backward_input_us.
  double backward_weight_us = 0;
  /// Bytes allocated by forward and still held when it returns: the output and what autograd
  /// saved for backward. Measured through LibTorch's allocator reports, on CPU as on CUDA.
  int64_t held_bytes = 0;
  /// Whether what the forward keeps for backward (or stashes) includes its input, and its
  /// output: in a chain of layers an output that neither it nor the next layer keeps is freed.
  bool saves_input = false;
  /// Whether it keeps its output (see saves_input).
  bool saves_output = false;
  /// The most bytes its forward had allocated at once (at least held_bytes), and its backward
  /// (from the backward's start: gradients made less saved tensors freed), on the same reports.
  int64_t forward_peak_bytes = 0;
  /// The most bytes its backward had allocated at once (see forward_peak_bytes).
  int64_t backward_peak_bytes = 0;
  /// The bytes of its parameters.
  int64_t param_bytes = 0;
  /// Of those, the bytes of the parameters that require grad: those with a gradient and optimizer
  /// state (Note [Training memory] in memory.h).
  int64_t trainable_param_bytes = 0;
  /// The number of those parameter tensors: each is one update of the optimizer's step (Note
  /// [The optimizer's step] in optimizer_cost.h).
  int64_t trainable_tensors = 0;
  /// The elements and bytes of the trainable floating-point parameters narrower than float32
  /// (float16, bfloat16): those that float32 master weights copy.
  int64_t narrow_param_elements = 0;
  /// The bytes of those (see narrow_param_elements).
  int64_t narrow_param_bytes = 0;
  /// The elements of the trainable float32 parameters: those that autocast's weight cache copies.
  int64_t float32_param_elements = 0;
  /// The bytes of its buffers (BatchNorm's running statistics, ...).
  int64_t buffer_bytes = 0;
  /// The bytes of its input at the profile's batch (every tensor of a tuple).
  int64_t input_bytes = 0;
  /// The bytes of its output at the profile's batch (every tensor of a tuple).
  int64_t output_bytes = 0;
};

/// Fills `stats`' parameter and buffer sizes (param_bytes, trainable_param_bytes and _tensors,
/// narrow_param_elements and _bytes, float32_param_elements, buffer_bytes) from `layer`'s tensors,
/// as profile_layers does for each layer.
void count_parameters(const torch::nn::Module& layer, LayerStats& stats);

/// A per-layer profile.
struct LayerProfile {
  /// One entry per layer of the Sequential, in order.
  std::vector<LayerStats> layers;
  /// Where the layers ran (ProfileOptions::device).
  c10::Device device = c10::Device(c10::kCPU);
  /// How many timed passes the medians are over (the first, untimed pass not counted).
  int64_t passes = 0;
  /// The sample's size in dimension 0.
  int64_t batch = 0;

  /// A fixed-width table, one row per layer.
  std::string table() const;
  /// The layers as a JSON array of objects (one per layer, the fields of LayerStats).
  std::string json() const;
  /// The whole profile as a JSON object: device, passes, batch and the layers; from_json reads it
  /// back.
  std::string to_json() const;
  /// Reads to_json's text. Throws c10::Error naming what is missing or malformed.
  static LayerProfile from_json(const std::string& text);
};

/// How much faster than one worker `workers` CPU workers together run `module`'s layers: each
/// worker (a thread with `threads` intra-op threads, on a copy of the layers) runs forwards and
/// backwards of `sample` for about `budget`, alone and then all at once, three times over;
/// the result is the median of workers x (the time of a pass alone) / (the median time of a pass
/// together), between 1 and `workers`. Two hyperthreads of one core, or memory-bound layers, give well under 2 for 2.
///
///   double capacity = gpipe::cpu_capacity(model, x, 2, 1, std::chrono::seconds(1));
double cpu_capacity(const torch::nn::Sequential& module, const at::Tensor& sample, int64_t workers,
                    int threads, std::chrono::duration<double> budget);

/// How long a thread waiting on a condition takes to run once another thread signals it: the
/// hand-over of a micro-batch between two workers of a pipeline in one process (a LocalLink's
/// queue). The median of one-way times over `rounds` ping-pongs, microseconds.
///
///   double us = gpipe::handoff_us();
double handoff_us(int rounds = 200);

/// What copying a tensor from one device to another costs: `latency_us + bytes / bandwidth`.
struct CopyStats {
  /// The device copied from.
  c10::Device from = c10::Device(c10::kCPU);
  /// The device copied to.
  c10::Device to = c10::Device(c10::kCPU);
  /// The fixed cost of a copy, microseconds: the time of a 4-byte tensor's copy.
  double latency_us = 0;
  /// Bytes per microsecond (= MB/s).
  double bytes_per_us = 0;
  /// The predicted time of copying `bytes`.
  double time_us(int64_t bytes) const {
    return bytes <= 0 ? 0.0 : latency_us + static_cast<double>(bytes) / bytes_per_us;
  }
};

/// Measures a copy between every ordered pair of distinct devices in `devices` (each pair once;
/// repeats of a device are one device): a 4-byte and a 64 MiB float tensor, the median of 5 copies
/// each, copied as the pipeline's links copy (to a GPU staged in pinned memory, from one into
/// pinned memory) and timed to when both devices are done. A device to itself costs nothing (the
/// pipeline does not copy), so CPU-only pipelines have no pairs.
///
///   auto copies = gpipe::profile_copies({torch::kCPU, torch::Device("cuda:0")});
std::vector<CopyStats> profile_copies(const std::vector<c10::Device>& devices);

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
/// The same for a one-tensor sample.
LayerProfile profile_layers(const torch::nn::Sequential& module, const at::Tensor& sample,
                            const ProfileOptions& options);

}  // namespace gpipe
