// Layer profiler; see profile.h.
#include "balancing/profile.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/ones_like.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/modules/container/any.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gpipe/device.h"
#include "gpipe/microbatch.h"
#include "gpipe/partition.h"
#include "gpipe/skip_tracker.h"
#include "gpipe/stream.h"

namespace gpipe {
namespace {

// Counts the bytes LibTorch's allocators report on this thread while installed: the CPU
// allocator and CUDA's caching allocator both report to the profiler's debug info when memory
// profiling is on. Both reportMemoryUsage signatures are declared; the one this LibTorch has
// overrides (int64_t totals before 2.x, size_t after).
class AllocationCounter : public c10::MemoryReportingInfoBase {
 public:
  explicit AllocationCounter(c10::Device device) : device_(device) {}
  bool memoryProfilingEnabled() const override { return true; }
  void reportMemoryUsage(void*, int64_t alloc_size, int64_t, int64_t, c10::Device device) {
    count(alloc_size, device);
  }
  void reportMemoryUsage(void*, int64_t alloc_size, size_t, size_t, c10::Device device) {
    count(alloc_size, device);
  }
  void reportOutOfMemory(int64_t, int64_t, int64_t, c10::Device) {}
  void reportOutOfMemory(int64_t, size_t, size_t, c10::Device) {}
  int64_t current() const { return current_; }

 private:
  void count(int64_t bytes, c10::Device device) {
    if (device.type() == device_.type()) {
      current_ += bytes;
    }
  }
  c10::Device device_;
  int64_t current_ = 0;
};

int64_t bytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const at::Tensor& t : tensors) {
    if (t.defined()) total += static_cast<int64_t>(t.nbytes());
  }
  return total;
}

// Skips while profiling: each layer runs and goes backward on its own, so a popped tensor must
// not carry the stashing layer's (already used) autograd history. It comes back as a fresh leaf,
// like a layer input.
class ProfileSkipTracker : public SkipTracker {
 public:
  void stash(const SkipKey& key, at::Tensor tensor) override {
    if (tensor.defined()) {
      at::Tensor leaf = tensor.detach();
      leaf.set_requires_grad(tensor.requires_grad());
      tensor = leaf;
    }
    stashed_[key] = std::move(tensor);
  }
  at::Tensor pop(const SkipKey& key) override {
    auto it = stashed_.find(key);
    TORCH_CHECK(it != stashed_.end(), "profile_layers: skip '", key.str(), "' was not stashed");
    at::Tensor tensor = std::move(it->second);
    stashed_.erase(it);
    return tensor;
  }

 private:
  std::map<SkipKey, at::Tensor> stashed_;
};


// The median of `values` (not empty): the middle one, or the mean of the two middle ones.
double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t h = values.size() / 2;
  return values.size() % 2 == 1 ? values[h] : (values[h - 1] + values[h]) / 2;
}

double elapsed_us(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - since)
      .count();
}

// A detached copy of `x` on `device` that needs a gradient when it is floating point and `grad`.
at::Tensor fresh_input(const at::Tensor& x, c10::Device device, bool grad) {
  at::Tensor y = x.detach().to(device);
  if (grad && y.is_floating_point()) {
    y.set_requires_grad(true);
  }
  return y;
}

}  // namespace

LayerProfile profile_layers(const torch::nn::Sequential& module,
                            const std::vector<at::Tensor>& sample, const ProfileOptions& options) {
  TORCH_CHECK(!sample.empty() && sample[0].defined() && sample[0].dim() > 0,
              "profile_layers: the sample must be a tensor with a batch dimension");
  for (const auto& p : module->named_parameters()) {
    TORCH_CHECK(!p.value().grad().defined(), "profile_layers: parameter '", p.key(),
                "' already has a gradient; profiling needs a model without gradients (call "
                "zero_grad with set_to_none, or profile before training)");
  }
  const c10::Device device = options.device();
  check_device_available(device, "profile_layers: the profiling device");
  const size_t n = module->size();

  // Deep copies of the layers on the device, in training mode.
  std::vector<torch::nn::AnyModule> layers;
  layers.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const torch::nn::AnyModule& original = *(module->begin() + k);
    try {
      layers.push_back(original.clone(device));
    } catch (const c10::Error& e) {
      // LibTorch's Module::clone says so when a module does not implement it.
      const bool no_clone = e.msg().find("clone() has not been implemented") != std::string::npos;
      TORCH_CHECK(!no_clone, "profile_layers: cannot copy ", describe_layer(module, k),
                  ": it must implement clone() (derive from torch::nn::Cloneable); ",
                  e.what_without_backtrace());
      TORCH_CHECK(false, "profile_layers: cannot copy ", describe_layer(module, k), " to ", device,
                  ": ", e.what_without_backtrace());
    }
    layers.back().ptr()->train();
  }

  LayerProfile profile;
  profile.device = device;
  profile.batch = sample[0].size(0);
  profile.layers.resize(n);
  const auto children = module->named_children();
  for (size_t k = 0; k < n; ++k) {
    LayerStats& stats = profile.layers[k];
    const auto& child = children[k];
    stats.name = child.key();
    stats.type = child.value()->name();
    for (const auto& p : child.value()->parameters()) stats.param_bytes += p.nbytes();
    for (const auto& b : child.value()->buffers()) stats.buffer_bytes += b.nbytes();
  }

  const auto start = std::chrono::steady_clock::now();
  const bool atomic = sample.size() == 1;
  // The first pass is not timed: it pays one-time costs (the kernel libraries' initialisation,
  // first allocations) that would be charged to the first layers, and with a short timeout could
  // outweigh everything else (a 5-layer ResNet's stem came out as heavy as the four other layers
  // together, and its balance as {1, 4} instead of {2, 3}).
  bool warmup = true;
  // Each layer's times over the timed passes: their median is the layer's time, so that a pass
  // slowed by another process (a core taken for a while) does not move it.
  std::vector<std::vector<double>> forward_times(n), backward_times(n);
  do {
    // One pass: each layer on a fresh copy of the previous layer's output.
    TaskContext context{std::make_shared<ProfileSkipTracker>(), MicroBatch{}};
    TaskScope skips(context);
    std::vector<at::Tensor> values;
    for (const at::Tensor& t : sample) {
      values.push_back(fresh_input(t, device, t.requires_grad()));
    }
    bool values_atomic = atomic;
    for (size_t k = 0; k < n; ++k) {
      LayerStats& stats = profile.layers[k];
      const Batch input = values_atomic ? Batch(values[0]) : Batch(values);
      auto counter = std::make_shared<AllocationCounter>(device);
      std::vector<at::Tensor> outputs;
      synchronize(device);
      auto tick = std::chrono::steady_clock::now();
      {
        c10::DebugInfoGuard memory_guard(c10::DebugInfoKind::PROFILER_STATE, counter);
        auto forward = [&]() -> torch::nn::AnyValue {
          try {
            return layers[k].any_forward(input.to_any());
          } catch (const c10::Error& e) {
            TORCH_CHECK(false, "profile_layers: the sample does not go through ",
                        describe_layer(module, k), ": ", e.what_without_backtrace());
          }
        };
        Batch result = Batch::from_any(forward(), describe_layer(module, k));
        values_atomic = result.atomic();
        outputs = std::move(result.values());
        synchronize(device);
      }
      const double forward_us = elapsed_us(tick);
      const int64_t held = counter->current();

      std::vector<at::Tensor> differentiable;
      for (const at::Tensor& o : outputs) {
        if (o.defined() && o.requires_grad()) differentiable.push_back(o);
      }
      tick = std::chrono::steady_clock::now();
      if (!differentiable.empty()) {
        std::vector<at::Tensor> grads;
        for (const at::Tensor& o : differentiable) grads.push_back(at::ones_like(o));
        torch::autograd::backward(differentiable, grads);
        synchronize(device);
      }
      const double backward_us = differentiable.empty() ? 0.0 : elapsed_us(tick);

      if (!warmup) {
        forward_times[k].push_back(forward_us);
        backward_times[k].push_back(backward_us);
      }
      stats.held_bytes = held;
      stats.input_bytes = bytes_of(input.values());
      stats.output_bytes = bytes_of(outputs);

      values.clear();
      for (const at::Tensor& o : outputs) values.push_back(fresh_input(o, device, true));
    }
    for (auto& layer : layers) layer.ptr()->zero_grad();
    if (warmup) {
      warmup = false;
    } else {
      ++profile.passes;
    }
  } while (profile.passes == 0 ||
           std::chrono::duration<double>(std::chrono::steady_clock::now() - start) <
               options.timeout());
  for (size_t k = 0; k < n; ++k) {
    profile.layers[k].forward_us = median(forward_times[k]);
    profile.layers[k].backward_us = median(backward_times[k]);
  }
  return profile;
}

LayerProfile profile_layers(const torch::nn::Sequential& module, const at::Tensor& sample,
                            const ProfileOptions& options) {
  return profile_layers(module, std::vector<at::Tensor>{sample}, options);
}

std::string LayerProfile::table() const {
  std::string out = absl::StrFormat("%-6s %-10s %-34s %11s %11s %12s %12s %12s %12s\n", "layer",
                                    "name", "type", "forward us", "backward us", "held bytes",
                                    "param bytes", "input bytes", "output bytes");
  for (size_t k = 0; k < layers.size(); ++k) {
    const LayerStats& s = layers[k];
    std::string type = s.type;
    if (type.size() > 34) type = "..." + type.substr(type.size() - 31);
    absl::StrAppendFormat(&out, "%-6d %-10s %-34s %11.1f %11.1f %12d %12d %12d %12d\n", k,
                          s.name.substr(0, 10), type, s.forward_us, s.backward_us, s.held_bytes,
                          s.param_bytes, s.input_bytes, s.output_bytes);
  }
  return out;
}

std::string LayerProfile::json() const {
  std::vector<std::string> rows;
  for (const LayerStats& s : layers) {
    rows.push_back(absl::StrFormat(
        "{\"name\": \"%s\", \"type\": \"%s\", \"forward_us\": %.2f, \"backward_us\": %.2f, "
        "\"held_bytes\": %d, \"param_bytes\": %d, \"buffer_bytes\": %d, \"input_bytes\": %d, "
        "\"output_bytes\": %d}",
        s.name, s.type, s.forward_us, s.backward_us, s.held_bytes, s.param_bytes, s.buffer_bytes,
        s.input_bytes, s.output_bytes));
  }
  return absl::StrCat("[", absl::StrJoin(rows, ", "), "]");
}

}  // namespace gpipe
