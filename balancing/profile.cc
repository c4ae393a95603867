// Layer profiler; see profile.h.
#include "balancing/profile.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <memory>
#include <thread>

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/modules/container/any.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "balancing/internal/detail.h"
#include "gpipe/device.h"
#include "gpipe/microbatch.h"
#include "gpipe/internal/copy.h"
#include "gpipe/internal/partition.h"
#include "gpipe/internal/skip_tracker.h"
#include "gpipe/internal/stream.h"

namespace gpipe {
namespace {

using internal::elapsed_us;
using internal::median;

// Counts the bytes LibTorch's allocators report while installed (on this thread, and on the
// threads that inherit its debug info, as the autograd engine's device threads do): the CPU
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
  int64_t current() const {
    std::lock_guard<std::mutex> lock(mu_);
    return current_;
  }
  int64_t peak() const {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }

 private:
  // (Locked: on a GPU the backward's allocations are reported from the autograd engine's device
  // thread, which inherits the debug info, beside the caller's.)
  void count(int64_t bytes, c10::Device device) {
    if (device.type() == device_.type()) {
      std::lock_guard<std::mutex> lock(mu_);
      current_ += bytes;
      peak_ = std::max(peak_, current_);
    }
  }
  c10::Device device_;
  mutable std::mutex mu_;
  int64_t current_ = 0;
  int64_t peak_ = 0;
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
class ProfileSkipTracker : public internal::SkipTracker {
 public:
  void stash(const SkipKey& key, at::Tensor tensor) override {
    if (tensor.defined()) {
      at::Tensor leaf = tensor.detach();
      leaf.set_requires_grad(tensor.requires_grad());
      tensor = leaf;
    }
    stashed_[key] = std::move(tensor);
  }
  // Kept after a pop: the profiler runs each layer's forward several times.
  at::Tensor pop(const SkipKey& key) override {
    auto it = stashed_.find(key);
    TORCH_CHECK(it != stashed_.end(), "profile_layers: skip '", key.str(), "' was not stashed");
    return it->second;
  }

 private:
  std::map<SkipKey, at::Tensor> stashed_;
};

// A detached copy of `x` on `device` that needs a gradient when it is floating point and `grad`.
at::Tensor fresh_input(const at::Tensor& x, c10::Device device, bool grad) {
  at::Tensor y = x.detach().to(device);
  if (grad && y.is_floating_point()) {
    y.set_requires_grad(true);
  }
  return y;
}

// Deep copies of `module`'s layers on `device`, in training mode.
std::vector<torch::nn::AnyModule> training_copies(const torch::nn::Sequential& module,
                                                  c10::Device device) {
  const size_t n = module->size();
  std::vector<torch::nn::AnyModule> layers;
  layers.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const torch::nn::AnyModule& original = *(module->begin() + k);
    try {
      layers.push_back(original.clone(device));
    } catch (const c10::Error& e) {
      // LibTorch's Module::clone says so when a module does not implement it.
      const bool no_clone = e.msg().find("clone() has not been implemented") != std::string::npos;
      TORCH_CHECK(!no_clone, "profile_layers: cannot copy ", internal::describe_layer(module, k),
                  ": it must implement clone() (derive from torch::nn::Cloneable); ",
                  e.what_without_backtrace());
      TORCH_CHECK(false, "profile_layers: cannot copy ", internal::describe_layer(module, k),
                  " to ", device, ": ", e.what_without_backtrace());
    }
    layers.back().ptr()->train();
  }
  return layers;
}

// A profile of `module`'s layers before any pass: their names, types, parameter and buffer bytes.
LayerProfile unmeasured_profile(const torch::nn::Sequential& module, c10::Device device,
                                int64_t batch) {
  LayerProfile profile;
  profile.device = device;
  profile.batch = batch;
  profile.layers.resize(module->size());
  const auto children = module->named_children();
  for (size_t k = 0; k < profile.layers.size(); ++k) {
    LayerStats& stats = profile.layers[k];
    const auto& child = children[k];
    stats.name = child.key();
    stats.type = child.value()->name();
    count_parameters(*child.value(), stats);
  }
  return profile;
}

// One layer's times in one pass, microseconds.
struct LayerTimes {
  double forward_us = 0;
  double backward_us = 0;
  double nograd_us = 0;
  double input_us = 0;
  double weight_us = 0;
};

// Each layer's times over the timed passes: their median is the layer's time, so that a pass
// slowed by another process (a core taken for a while) does not move it.
struct PassTimes {
  explicit PassTimes(size_t layers)
      : forward(layers), backward(layers), nograd(layers), input(layers), weight(layers) {}

  // Adds layer k's times in one pass.
  void add(size_t k, const LayerTimes& t) {
    forward[k].push_back(t.forward_us);
    backward[k].push_back(t.backward_us);
    nograd[k].push_back(t.nograd_us);
    input[k].push_back(t.input_us);
    weight[k].push_back(t.weight_us);
  }

  // Sets each layer's times to its medians.
  void set_medians(std::vector<LayerStats>& layers) const {
    for (size_t k = 0; k < layers.size(); ++k) {
      layers[k].forward_us = median(forward[k]);
      layers[k].backward_us = median(backward[k]);
      layers[k].forward_nograd_us = median(nograd[k]);
      layers[k].backward_input_us = median(input[k]);
      layers[k].backward_weight_us = median(weight[k]);
    }
  }

  std::vector<std::vector<double>> forward, backward, nograd, input, weight;
};

// The layer being profiled: `module`'s layer k (errors name it), its copy on `device`.
struct ProfiledLayer {
  const torch::nn::Sequential& module;
  size_t k;
  torch::nn::AnyModule& copy;
  c10::Device device;
};

// The defined tensors of `tensors` that need a gradient.
std::vector<at::Tensor> requiring_grad(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.requires_grad()) out.push_back(t);
  }
  return out;
}

// The layer's forward with autograd on `input` (its tensors `values`), timed, with the bytes it
// keeps, its peak, and whether it keeps its input or its output; returns its outputs and sets
// `atomic` to whether they are one tensor.
std::vector<at::Tensor> forward_with_grad(const ProfiledLayer& layer, const Batch& input,
                                          const std::vector<at::Tensor>& values, bool& atomic,
                                          LayerStats& stats, LayerTimes& times) {
  auto counter = std::make_shared<AllocationCounter>(layer.device);
  std::vector<at::Tensor> outputs;
  // Who keeps the input: references to its storage that the forward adds (autograd's saved
  // tensors, a stash).
  std::vector<size_t> input_refs;
  for (const at::Tensor& v : values) {
    input_refs.push_back(v.defined() && v.has_storage() ? v.storage().use_count() : 0);
  }
  internal::synchronize(layer.device);
  const auto tick = std::chrono::steady_clock::now();
  {
    c10::DebugInfoGuard memory_guard(c10::DebugInfoKind::PROFILER_STATE, counter);
    auto forward = [&]() -> torch::nn::AnyValue {
      try {
        return layer.copy.any_forward(input.to_any());
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "profile_layers: the sample does not go through ",
                    internal::describe_layer(layer.module, layer.k), ": ",
                    e.what_without_backtrace());
      }
    };
    Batch result = Batch::from_any(forward(), internal::describe_layer(layer.module, layer.k));
    atomic = result.atomic();
    outputs = std::move(result.values());
    internal::synchronize(layer.device);
  }
  times.forward_us = internal::elapsed_us(tick);
  stats.held_bytes = counter->current();
  stats.forward_peak_bytes = counter->peak();
  bool saves_input = false, saves_output = false;
  for (size_t i = 0; i < values.size(); ++i) {
    saves_input = saves_input || (values[i].defined() && values[i].has_storage() &&
                                  values[i].storage().use_count() > input_refs[i]);
  }
  for (const at::Tensor& o : outputs) {
    saves_output = saves_output || (o.defined() && o.has_storage() && o.storage().use_count() > 1);
  }
  stats.saves_input = saves_input;
  stats.saves_output = saves_output;
  return outputs;
}

// The backward from `roots` (the layer's outputs that need a gradient) with `grads`, timed (0
// without roots), with its peak.
void whole_backward(const ProfiledLayer& layer, const std::vector<at::Tensor>& roots,
                    const std::vector<at::Tensor>& grads, LayerStats& stats, LayerTimes& times) {
  auto backward_counter = std::make_shared<AllocationCounter>(layer.device);
  internal::synchronize(layer.device);  // (the gradients' fills are not the backward's)
  const auto tick = std::chrono::steady_clock::now();
  if (!roots.empty()) {
    c10::DebugInfoGuard memory_guard(c10::DebugInfoKind::PROFILER_STATE, backward_counter);
    torch::autograd::backward(roots, grads);
    internal::synchronize(layer.device);
  }
  times.backward_us = roots.empty() ? 0.0 : internal::elapsed_us(tick);
  stats.backward_peak_bytes = backward_counter->peak();
}

// The forward of a checkpointed micro-batch, without autograd, timed.
void forward_without_grad(const ProfiledLayer& layer, const Batch& input, LayerTimes& times) {
  internal::synchronize(layer.device);
  const auto tick = std::chrono::steady_clock::now();
  {
    at::NoGradGuard no_grad;
    layer.copy.any_forward(input.to_any());
    internal::synchronize(layer.device);
  }
  times.nograd_us = internal::elapsed_us(tick);
}

// The backward split in two (zero bubble's I and W), on a forward of its own, each half timed.
void split_backward(const ProfiledLayer& layer, const Batch& input,
                    const std::vector<at::Tensor>& values, LayerTimes& times) {
  std::vector<at::Tensor> again;
  Batch out = Batch::from_any(layer.copy.any_forward(input.to_any()),
                              internal::describe_layer(layer.module, layer.k));
  for (at::Tensor& o : out.values()) {
    if (o.defined() && o.requires_grad()) again.push_back(std::move(o));
  }
  std::vector<at::Tensor> grads;
  for (const at::Tensor& o : again) grads.push_back(at::ones_like(o));
  const std::vector<at::Tensor> leaves = requiring_grad(values);
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : layer.copy.ptr()->parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  internal::synchronize(layer.device);
  auto tick = std::chrono::steady_clock::now();
  if (!leaves.empty()) {
    torch::autograd::grad(again, leaves, grads, /*retain_graph=*/true,
                          /*create_graph=*/false, /*allow_unused=*/true);
    internal::synchronize(layer.device);
    times.input_us = internal::elapsed_us(tick);
  }
  tick = std::chrono::steady_clock::now();
  if (!params.empty()) {
    torch::autograd::backward(again, grads, /*retain_graph=*/false, /*create_graph=*/false,
                              params);
    internal::synchronize(layer.device);
    times.weight_us = internal::elapsed_us(tick);
  }
}

// Profiles the layer once on `values` (its input, one tensor when `atomic`): its times into
// `times`, its memory into `stats`; returns its outputs and sets `atomic` for them.
std::vector<at::Tensor> profile_layer(const ProfiledLayer& layer,
                                      const std::vector<at::Tensor>& values, bool& atomic,
                                      LayerStats& stats, LayerTimes& times) {
  const Batch input = atomic ? Batch(values[0]) : Batch(values);
  std::vector<at::Tensor> outputs = forward_with_grad(layer, input, values, atomic, stats, times);
  const std::vector<at::Tensor> differentiable = requiring_grad(outputs);
  std::vector<at::Tensor> output_grads;
  for (const at::Tensor& o : differentiable) output_grads.push_back(at::ones_like(o));
  whole_backward(layer, differentiable, output_grads, stats, times);
  forward_without_grad(layer, input, times);
  if (!differentiable.empty()) split_backward(layer, input, values, times);
  stats.input_bytes = bytes_of(input.values());
  stats.output_bytes = bytes_of(outputs);
  return outputs;
}

// One pass: each layer on a fresh copy of the previous layer's output; its stats into `stats`,
// and its times into `times` unless that is null.
void profile_pass(const torch::nn::Sequential& module, std::vector<torch::nn::AnyModule>& layers,
                  const std::vector<at::Tensor>& sample, c10::Device device,
                  std::vector<LayerStats>& stats, PassTimes* times) {
  internal::TaskContext context{std::make_shared<ProfileSkipTracker>(), MicroBatch{}, nullptr};
  internal::TaskScope skips(context);
  std::vector<at::Tensor> values;
  for (const at::Tensor& t : sample) {
    values.push_back(fresh_input(t, device, t.requires_grad()));
  }
  bool atomic = sample.size() == 1;
  for (size_t k = 0; k < layers.size(); ++k) {
    LayerTimes layer_times;
    const std::vector<at::Tensor> outputs =
        profile_layer(ProfiledLayer{module, k, layers[k], device}, values, atomic, stats[k],
                      layer_times);
    if (times != nullptr) times->add(k, layer_times);
    values.clear();
    for (const at::Tensor& o : outputs) values.push_back(fresh_input(o, device, true));
  }
  for (auto& layer : layers) layer.ptr()->zero_grad();
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
  std::vector<torch::nn::AnyModule> layers = training_copies(module, device);
  LayerProfile profile = unmeasured_profile(module, device, sample[0].size(0));

  const auto start = std::chrono::steady_clock::now();
  // The first pass is not timed: it pays one-time costs (the kernel libraries' initialisation,
  // first allocations) that would be charged to the first layers, and with a short timeout could
  // outweigh everything else (a 5-layer ResNet's stem came out as heavy as the four other layers
  // together, and its balance as {1, 4} instead of {2, 3}).
  bool warmup = true;
  PassTimes times(layers.size());
  do {
    profile_pass(module, layers, sample, device, profile.layers, warmup ? nullptr : &times);
    if (warmup) {
      warmup = false;
    } else {
      ++profile.passes;
    }
  } while (profile.passes == 0 ||
           std::chrono::duration<double>(std::chrono::steady_clock::now() - start) <
               options.timeout());
  times.set_medians(profile.layers);
  return profile;
}

LayerProfile profile_layers(const torch::nn::Sequential& module, const at::Tensor& sample,
                            const ProfileOptions& options) {
  return profile_layers(module, std::vector<at::Tensor>{sample}, options);
}

double cpu_capacity(const torch::nn::Sequential& module, const at::Tensor& sample, int64_t workers,
                    int threads, std::chrono::duration<double> budget) {
  TORCH_CHECK(workers >= 1 && threads >= 1, "cpu_capacity: workers and threads must be positive, got ",
              workers, " and ", threads);
  if (workers == 1) return 1.0;
  // One copy of the layers per worker: forwards in training mode update BatchNorm statistics.
  std::vector<std::vector<torch::nn::AnyModule>> copies(workers);
  for (auto& layers : copies) {
    for (const torch::nn::AnyModule& layer : *module) layers.push_back(layer.clone(c10::kCPU));
  }
  // A training pass: forward, then backward from the outputs (the mix a pipeline's workers run).
  auto pass = [&](std::vector<torch::nn::AnyModule>& layers) {
    internal::TaskContext context{std::make_shared<ProfileSkipTracker>(), MicroBatch{}, nullptr};
    internal::TaskScope skips(context);
    Batch x(sample.detach());
    const auto tick = std::chrono::steady_clock::now();
    for (auto& layer : layers) x = Batch::from_any(layer.any_forward(x.to_any()), "cpu_capacity");
    std::vector<at::Tensor> roots, grads;
    for (const at::Tensor& o : x.values()) {
      if (o.defined() && o.requires_grad()) {
        roots.push_back(o);
        grads.push_back(at::ones_like(o));
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    for (auto& layer : layers) layer.ptr()->zero_grad();
    return internal::elapsed_us(tick);
  };
  // Alone, then together, three times over (a machine whose speed drifts moves both sides of a
  // round alike); the median of the three ratios. Each side passes for about a sixth of the
  // budget, at least 3 passes.
  at::set_num_threads(threads);
  pass(copies[0]);  // warm-up
  std::vector<double> ratios;
  for (int round = 0; round < 3; ++round) {
    std::vector<double> alone;
    const auto start = std::chrono::steady_clock::now();
    do {
      alone.push_back(pass(copies[0]));
    } while (alone.size() < 3 || std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                               start) < budget / 6);
    const size_t count = alone.size();
    std::vector<std::vector<double>> together(workers);
    std::vector<std::thread> pool;
    std::atomic<int64_t> ready{0};
    for (int64_t w = 0; w < workers; ++w) {
      pool.emplace_back([&, w] {
        at::set_num_threads(threads);
        ++ready;
        while (ready.load() < workers) std::this_thread::yield();
        for (size_t k = 0; k < count; ++k) together[w].push_back(pass(copies[w]));
      });
    }
    for (std::thread& t : pool) t.join();
    std::vector<double> all;
    for (const auto& times : together) all.insert(all.end(), times.begin(), times.end());
    ratios.push_back(static_cast<double>(workers) * median(alone) / median(all));
  }
  return std::clamp(median(ratios), 1.0, static_cast<double>(workers));
}

double handoff_us(int rounds) {
  TORCH_CHECK(rounds >= 1, "handoff_us: rounds must be positive, got ", rounds);
  std::mutex mu;
  std::condition_variable cv;
  int64_t turn = 0;  // even: the main thread's, odd: the other's
  std::vector<double> times;
  std::chrono::steady_clock::time_point sent;
  std::thread other([&] {
    for (int r = 0; r < rounds; ++r) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return turn % 2 == 1; });
      times.push_back(std::chrono::duration<double, std::micro>(
                          std::chrono::steady_clock::now() - sent)
                          .count());
      ++turn;
      cv.notify_all();
    }
  });
  for (int r = 0; r < rounds; ++r) {
    std::unique_lock<std::mutex> lock(mu);
    sent = std::chrono::steady_clock::now();
    ++turn;
    cv.notify_all();
    cv.wait(lock, [&] { return turn % 2 == 0; });
  }
  other.join();
  return median(times);
}

void count_parameters(const torch::nn::Module& layer, LayerStats& stats) {
  stats.param_bytes = stats.trainable_param_bytes = stats.trainable_tensors = 0;
  stats.buffer_bytes = 0;
  stats.narrow_param_elements = stats.narrow_param_bytes = stats.float32_param_elements = 0;
  for (const at::Tensor& p : layer.parameters()) {
    const auto bytes = static_cast<int64_t>(p.nbytes());
    stats.param_bytes += bytes;
    if (!p.requires_grad()) continue;
    stats.trainable_param_bytes += bytes;
    ++stats.trainable_tensors;
    if (p.scalar_type() == at::kFloat) stats.float32_param_elements += p.numel();
    if (p.is_floating_point() && p.element_size() < 4) {
      stats.narrow_param_elements += p.numel();
      stats.narrow_param_bytes += bytes;
    }
  }
  for (const at::Tensor& b : layer.buffers())
    stats.buffer_bytes += static_cast<int64_t>(b.nbytes());
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

namespace {

nlohmann::json layers_json(const std::vector<LayerStats>& layers) {
  nlohmann::json rows = nlohmann::json::array();
  for (const LayerStats& s : layers) {
    rows.push_back({{"name", s.name},
                    {"type", s.type},
                    {"forward_us", s.forward_us},
                    {"backward_us", s.backward_us},
                    {"forward_nograd_us", s.forward_nograd_us},
                    {"backward_input_us", s.backward_input_us},
                    {"backward_weight_us", s.backward_weight_us},
                    {"held_bytes", s.held_bytes},
                    {"saves_input", s.saves_input},
                    {"saves_output", s.saves_output},
                    {"forward_peak_bytes", s.forward_peak_bytes},
                    {"backward_peak_bytes", s.backward_peak_bytes},
                    {"param_bytes", s.param_bytes},
                    {"trainable_param_bytes", s.trainable_param_bytes},
                    {"trainable_tensors", s.trainable_tensors},
                    {"narrow_param_elements", s.narrow_param_elements},
                    {"narrow_param_bytes", s.narrow_param_bytes},
                    {"float32_param_elements", s.float32_param_elements},
                    {"buffer_bytes", s.buffer_bytes},
                    {"input_bytes", s.input_bytes},
                    {"output_bytes", s.output_bytes}});
  }
  return rows;
}

}  // namespace

std::string LayerProfile::json() const { return layers_json(layers).dump(); }

std::string LayerProfile::to_json() const { return internal::layer_profile_json(*this).dump(1); }

LayerProfile LayerProfile::from_json(const std::string& text) {
  const std::string who = "LayerProfile::from_json";
  return internal::layer_profile_from_json(internal::parse_json(text, who), who);
}

namespace internal {

nlohmann::json layer_profile_json(const LayerProfile& profile) {
  return nlohmann::json{{"device", profile.device.str()},
                        {"passes", profile.passes},
                        {"batch", profile.batch},
                        {"layers", layers_json(profile.layers)}};
}

LayerProfile layer_profile_from_json(const nlohmann::json& j, const std::string& what) {
  LayerProfile profile;
  profile.device = c10::Device(json_field<std::string>(j, "device", what));
  profile.passes = json_field<int64_t>(j, "passes", what);
  profile.batch = json_field<int64_t>(j, "batch", what);
  TORCH_CHECK(j.contains("layers") && j["layers"].is_array(), what,
              ": \"layers\" must be an array of layers");
  for (const nlohmann::json& row : j["layers"]) {
    LayerStats s;
    const std::string at = absl::StrCat(what, ": layer ", profile.layers.size());
    s.name = json_field<std::string>(row, "name", at);
    s.type = json_field<std::string>(row, "type", at);
    s.forward_us = json_field<double>(row, "forward_us", at);
    s.backward_us = json_field<double>(row, "backward_us", at);
    s.forward_nograd_us = json_field<double>(row, "forward_nograd_us", at);
    s.backward_input_us = json_field<double>(row, "backward_input_us", at);
    s.backward_weight_us = json_field<double>(row, "backward_weight_us", at);
    s.held_bytes = json_field<int64_t>(row, "held_bytes", at);
    s.saves_input = json_field<bool>(row, "saves_input", at);
    s.saves_output = json_field<bool>(row, "saves_output", at);
    s.forward_peak_bytes = json_field<int64_t>(row, "forward_peak_bytes", at);
    s.backward_peak_bytes = json_field<int64_t>(row, "backward_peak_bytes", at);
    s.param_bytes = json_field<int64_t>(row, "param_bytes", at);
    // (Profiles written before these: every parameter trainable and float32.)
    const auto or_else = [&row, &at](const char* key, int64_t otherwise) {
      return row.contains(key) ? json_field<int64_t>(row, key, at) : otherwise;
    };
    s.trainable_param_bytes = or_else("trainable_param_bytes", s.param_bytes);
    s.trainable_tensors = or_else("trainable_tensors", 0);
    s.narrow_param_elements = or_else("narrow_param_elements", 0);
    s.narrow_param_bytes = or_else("narrow_param_bytes", 0);
    s.float32_param_elements = or_else("float32_param_elements", s.param_bytes / 4);
    s.buffer_bytes = json_field<int64_t>(row, "buffer_bytes", at);
    s.input_bytes = json_field<int64_t>(row, "input_bytes", at);
    s.output_bytes = json_field<int64_t>(row, "output_bytes", at);
    profile.layers.push_back(std::move(s));
  }
  return profile;
}

std::vector<c10::Device> distinct_devices(const std::vector<c10::Device>& devices) {
  std::vector<c10::Device> out;
  for (const c10::Device& d : devices) {
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  }
  return out;
}

}  // namespace internal

std::vector<CopyStats> profile_copies(const std::vector<c10::Device>& devices) {
  for (const c10::Device& d : devices) check_device_available(d, "profile_copies");
  const std::vector<c10::Device> distinct = internal::distinct_devices(devices);
  auto copy_us = [](const at::Tensor& x, c10::Device to) {
    std::vector<double> times;
    for (int k = 0; k < 6; ++k) {
      internal::synchronize(x.device());
      internal::synchronize(to);
      const auto tick = std::chrono::steady_clock::now();
      // As the pipeline's links copy: to a GPU staged in pinned memory, from one into pinned
      // memory, without blocking; then both ends synchronised.
      at::Tensor y = internal::copy_to_device(x, to, /*non_blocking=*/true);
      internal::synchronize(x.device());
      internal::synchronize(to);
      if (k > 0) times.push_back(internal::elapsed_us(tick));  // the first pays allocations
    }
    return median(times);
  };
  std::vector<CopyStats> out;
  for (const c10::Device& from : distinct) {
    for (const c10::Device& to : distinct) {
      if (from == to) continue;
      const at::Tensor small = at::zeros({1}, at::TensorOptions().device(from));
      const at::Tensor large = at::zeros({16 << 20}, at::TensorOptions().device(from));
      CopyStats c;
      c.from = from;
      c.to = to;
      c.latency_us = copy_us(small, to);
      const double large_us = copy_us(large, to);
      c.bytes_per_us = static_cast<double>(large.nbytes()) / std::max(1e-3, large_us - c.latency_us);
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace gpipe
