// The optimizer's step as the planner predicts it; see optimizer_cost.h.
#include "balancing/optimizer_cost.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <numeric>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/empty.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "balancing/internal/detail.h"
#include "gpipe/device.h"
#include "gpipe/internal/stream.h"

namespace gpipe {
namespace {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(OptimizerKind kind,
                                                        const std::vector<at::Tensor>& params) {
  switch (kind) {
    case OptimizerKind::kSGD:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(1e-3));
    case OptimizerKind::kMomentum:
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(1e-3).momentum(0.9));
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  }
  TORCH_CHECK(false, "profile_optimizers: unknown optimizer kind ", static_cast<int>(kind));
}

// Writes a buffer larger than the device's caches (CPU: 64 MiB, past a socket's last-level cache;
// CUDA: 256 MiB, past an H100's 50 MB of L2 or a B200's 126 MB), so that the next step reads its
// tensors from memory, as a training loop's optimizer does after a forward and a backward (Note
// [The optimizer's step]).
class CacheFlush {
 public:
  explicit CacheFlush(c10::Device device)
      : buffer_(at::empty({(device.is_cuda() ? int64_t{64} : int64_t{16}) << 20},
                          at::TensorOptions().device(device))) {}
  void operator()() { buffer_.fill_(static_cast<double>(++writes_)); }

 private:
  at::Tensor buffer_;
  int64_t writes_ = 0;
};

// The median time of 5 steps of `kind` over `params` (each given a gradient), after an untimed
// one (which makes the optimizer's state); with `flush`, each from cold caches.
double timed_step_us(OptimizerKind kind, c10::Device device, const std::vector<at::Tensor>& params,
                     CacheFlush* flush = nullptr) {
  for (const at::Tensor& p : params) p.mutable_grad() = at::full_like(p, 1e-3);
  const std::unique_ptr<torch::optim::Optimizer> optimizer = make_optimizer(kind, params);
  std::vector<double> times;
  for (int k = 0; k < 6; ++k) {
    if (flush != nullptr) (*flush)();
    internal::synchronize(device);
    const auto tick = std::chrono::steady_clock::now();
    optimizer->step();
    internal::synchronize(device);
    if (k > 0) times.push_back(internal::elapsed_us(tick));
  }
  return internal::median(times);
}

std::vector<at::Tensor> floats(c10::Device device, int64_t count, int64_t numel) {
  std::vector<at::Tensor> params;
  for (int64_t k = 0; k < count; ++k) {
    params.push_back(at::zeros({numel}, at::TensorOptions().device(device)).requires_grad_());
  }
  return params;
}

// Copies of `layer`'s trainable parameters on `device`.
std::vector<at::Tensor> trainable_copies(const torch::nn::Module& layer, c10::Device device) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : layer.parameters()) {
    if (p.requires_grad()) out.push_back(p.detach().to(device, /*non_blocking=*/false, true));
  }
  for (at::Tensor& p : out) p.requires_grad_();
  return out;
}

// One process's step over its stages (Note [The optimizer's step]); -1 where a kind of device is
// not measured.
double process_step_us(const std::vector<OptimizerStats>& stats, OptimizerKind optimizer,
                       const std::vector<SteppedParameters>& stages) {
  double cpu_us = 0;
  double launches_us = 0;
  std::map<c10::DeviceIndex, double> gpu_bytes_us;  // by GPU
  for (const SteppedParameters& s : stages) {
    const OptimizerStats* measured = find_optimizer_stats(stats, optimizer, s.device.type());
    if (measured == nullptr) return -1;
    if (!s.device.is_cuda()) {
      cpu_us += s.measured_us >= 0 ? s.measured_us : measured->time_us(s.tensors, s.bytes);
      continue;
    }
    launches_us += static_cast<double>(s.tensors) * measured->tensor_us;
    gpu_bytes_us[s.device.index()] +=
        s.measured_us >= 0 ? s.measured_us : measured->time_us(0, s.bytes);
  }
  double busiest_gpu_us = 0;
  for (const auto& [gpu, us] : gpu_bytes_us) busiest_gpu_us = std::max(busiest_gpu_us, us);
  return cpu_us + std::max(launches_us, busiest_gpu_us);
}

// Each layer's step over its own parameters, scaled so that they sum to one step over all of
// them at once from cold caches (Note [The optimizer's step]: alone, a layer's few tensors stay in
// the caches from one timed step to the next, as a whole model's do not).
std::vector<double> layer_steps_us(OptimizerKind kind, c10::Device device,
                                   const torch::nn::Sequential& model, CacheFlush& flush) {
  std::vector<double> out;
  std::vector<at::Tensor> all;
  for (const auto& layer : model->children()) {
    const std::vector<at::Tensor> params = trainable_copies(*layer, device);
    out.push_back(params.empty() ? 0.0 : timed_step_us(kind, device, params));
    all.insert(all.end(), params.begin(), params.end());
  }
  const double alone = std::accumulate(out.begin(), out.end(), 0.0);
  if (all.empty() || alone <= 0) return out;
  const double together = timed_step_us(kind, device, all, &flush);
  for (double& us : out) us *= together / alone;
  return out;
}

}  // namespace

const OptimizerStats* find_optimizer_stats(const std::vector<OptimizerStats>& stats,
                                           OptimizerKind optimizer, c10::DeviceType type) {
  for (const OptimizerStats& s : stats) {
    if (s.optimizer == optimizer && s.device.type() == type) return &s;
  }
  return nullptr;
}

double OptimizerStats::time_us(int64_t tensors, int64_t bytes) const {
  const double per_bytes = bytes <= 0 ? 0.0 : static_cast<double>(bytes) / bytes_per_us;
  return static_cast<double>(std::max<int64_t>(tensors, 0)) * tensor_us + per_bytes;
}

std::vector<OptimizerStats> profile_optimizers(const std::vector<c10::Device>& devices,
                                               const torch::nn::Sequential* model) {
  std::vector<OptimizerStats> out;
  std::vector<c10::DeviceType> measured;
  constexpr int64_t kSmall = 64;
  for (const c10::Device& device : devices) {
    if (std::find(measured.begin(), measured.end(), device.type()) != measured.end()) continue;
    check_device_available(device, "profile_optimizers");
    measured.push_back(device.type());
    // Large enough that its bytes outweigh its launches: 16 MiB on the CPU, 256 MiB on a GPU
    // (whose Adam steps 16 MiB in about the time its host launches the kernels).
    const int64_t large_floats = (device.is_cuda() ? int64_t{64} : int64_t{4}) << 20;
    CacheFlush flush(device);
    for (OptimizerKind kind : optimizer_kinds()) {
      OptimizerStats s;
      s.device = device;
      s.optimizer = kind;
      s.tensor_us = timed_step_us(kind, device, floats(device, kSmall, 4)) / kSmall;
      const double large_us = timed_step_us(kind, device, floats(device, 1, large_floats), &flush);
      s.bytes_per_us =
          static_cast<double>(large_floats * 4) / std::max(1e-3, large_us - s.tensor_us);
      if (model != nullptr) s.layer_us = layer_steps_us(kind, device, *model, flush);
      out.push_back(s);
    }
  }
  return out;
}

double optimizer_step_us(const std::vector<OptimizerStats>& stats, OptimizerKind optimizer,
                         const std::vector<SteppedParameters>& stages, bool processes) {
  if (!processes) return std::max(0.0, process_step_us(stats, optimizer, stages));
  std::map<int64_t, std::vector<SteppedParameters>> by_worker;
  for (const SteppedParameters& s : stages) by_worker[s.worker].push_back(s);
  double slowest = 0;
  for (const auto& [worker, own] : by_worker) {
    const double us = process_step_us(stats, optimizer, own);
    if (us < 0) return 0;
    slowest = std::max(slowest, us);
  }
  return slowest;
}

}  // namespace gpipe
