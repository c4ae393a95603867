// Dynamic loss scaling; see grad_scaler.h.
#include "gpipe/grad_scaler.h"

#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <mutex>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

namespace gpipe {
namespace {

// Whether ATen's fused unscale runs on `type` in this LibTorch (CUDA always; the CPU from
// PyTorch 2.x on): tried once per device type.
bool fused_unscale_available(c10::DeviceType type) {
  static std::map<c10::DeviceType, bool> known;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto found = known.find(type);
  if (found != known.end()) return found->second;
  bool ok = type == c10::kCUDA;
  if (!ok) {
    try {
      const auto options = at::TensorOptions(at::kFloat).device(type);
      std::vector<at::Tensor> one{at::zeros({1}, options)};
      at::Tensor inf = at::zeros({1}, options);
      at::_amp_foreach_non_finite_check_and_unscale_(one, inf, at::full({1}, 1.0, options));
      ok = true;
    } catch (const c10::Error&) {
      ok = false;
    }
  }
  known.emplace(type, ok);
  return ok;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)), scale_(options_.init_scale()) {
  TORCH_CHECK(options_.init_scale() > 0, "GradScaler: init_scale must be positive, got ",
              options_.init_scale());
  TORCH_CHECK(options_.growth_factor() > 1, "GradScaler: growth_factor must be above 1, got ",
              options_.growth_factor());
  TORCH_CHECK(options_.backoff_factor() > 0 && options_.backoff_factor() < 1,
              "GradScaler: backoff_factor must be in (0, 1), got ", options_.backoff_factor());
  TORCH_CHECK(options_.growth_interval() >= 1, "GradScaler: growth_interval must be at least 1, "
              "got ", options_.growth_interval());
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled()) return loss;
  // A float16 or bfloat16 loss is scaled in float32, as PyTorch's float32 scale tensor promotes
  // it: the scaled loss itself then stays finite (a float16 loss of 1 or more times the default
  // scale would not). Gradients flowing back into float16 still overflow above 65504, as in
  // PyTorch: the scaler backs off from such a scale.
  if (loss.scalar_type() == at::kHalf || loss.scalar_type() == at::kBFloat16) {
    return loss.to(at::kFloat) * scale_;
  }
  return loss * scale_;
}

bool GradScaler::unscale(const std::vector<at::Tensor>& params) {
  TORCH_CHECK(!unscaled_, "GradScaler::unscale was already called since the last update()");
  if (!options_.enabled()) {
    unscaled_ = true;
    found_ = 0;
    return false;
  }
  at::NoGradGuard no_grad;
  // Per device and dtype: one flag each, read together.
  // (Keyed by device type, index and dtype: c10::Device has no order.)
  std::map<std::tuple<int, int, int>, std::vector<at::Tensor>> groups;
  std::set<const void*> seen;  // a gradient listed twice is unscaled once
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined() || !seen.insert(g.unsafeGetTensorImpl()).second) continue;
    TORCH_CHECK(!g.is_sparse(), "GradScaler: sparse gradients are not supported");
    groups[{static_cast<int>(g.device().type()), g.device().index(),
            static_cast<int>(g.scalar_type())}]
        .push_back(g);
  }
  std::vector<at::Tensor> flags;
  for (auto& [key, grads] : groups) {
    const c10::Device device = grads[0].device();
    const auto options = at::TensorOptions(at::kFloat).device(device);
    if (fused_unscale_available(device.type()) && at::isFloatingType(grads[0].scalar_type())) {
      at::Tensor inf = at::zeros({1}, options);
      at::_amp_foreach_non_finite_check_and_unscale_(grads, inf,
                                                     at::full({1}, 1.0 / scale_, options));
      flags.push_back(inf);
    } else {
      std::vector<at::Tensor> bad;
      for (at::Tensor& g : grads) {
        bad.push_back(g.isfinite().all().logical_not());
        g.mul_(1.0 / scale_);
      }
      flags.push_back(at::stack(bad).any().to(at::kFloat).reshape({1}));
    }
  }
  // Read once every device's unscaling is queued: each read waits for its own device, while the
  // others go on (read in the loop, each device would start only after the one before had ended).
  double found = 0;
  for (const at::Tensor& flag : flags) found += flag.item<double>();
  found_ = found > 0 ? 1 : 0;
  unscaled_ = true;  // only once it is done: one that threw leaves the step to start again
  return found_ == 1;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& params,
                      const std::function<bool(bool)>& any_rank) {
  const bool unscaled_here = !unscaled_;
  if (unscaled_here) unscale(params);  // (exception-safe itself)
  try {
    bool found = found_ == 1;
    if (any_rank) found = any_rank(found);
    found_ = found ? 1 : 0;
    if (found) {
      ++skipped_;
      return false;
    }
    optimizer.step();
    return true;
  } catch (...) {
    // The step is over: the next one's gradients, from a new backward, are unscaled afresh
    // (kept unscaled, they would reach the optimizer multiplied by the scale).
    if (unscaled_here) {
      unscaled_ = false;
      found_ = -1;
    }
    throw;
  }
}

void GradScaler::update() {
  TORCH_CHECK(!options_.enabled() || unscaled_, "GradScaler::update: call step() (or unscale()) "
              "after the backward first");
  if (options_.enabled()) {
    if (found_ == 1) {
      scale_ *= options_.backoff_factor();
      growth_tracker_ = 0;
    } else if (++growth_tracker_ == options_.growth_interval()) {
      // Grown only while it stays finite in float32, the scale's type in PyTorch (a float32 loss
      // times an infinite scale would make every step skip).
      const double grown = scale_ * options_.growth_factor();
      if (grown <= std::numeric_limits<float>::max()) scale_ = grown;
      growth_tracker_ = 0;
    }
  }
  unscaled_ = false;
  found_ = -1;
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  TORCH_CHECK(!unscaled_, "GradScaler::save: this step was unscaled (step() or unscale()) but "
              "not ended; call update() first, or its finding (", found_ == 1 ? "an inf or NaN"
              : "clean", ") would be lost and the resumed scale would differ");
  archive.write("scale", at::tensor({scale_}, at::kDouble));
  archive.write("growth_tracker", at::tensor({growth_tracker_}, at::kLong));
  archive.write("skipped", at::tensor({skipped_}, at::kLong));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  at::Tensor scale, tracker, skipped;
  archive.read("scale", scale);
  archive.read("growth_tracker", tracker);
  archive.read("skipped", skipped);
  scale_ = scale.item<double>();
  growth_tracker_ = tracker.item<int64_t>();
  skipped_ = skipped.item<int64_t>();
  unscaled_ = false;
  found_ = -1;
}

}  // namespace gpipe
