// Dynamic loss scaling for float16 training: the loss scaled up so that small gradients survive
// float16, the gradients scaled back down on their own devices before the optimizer step, a step
// with an inf or NaN anywhere skipped, and the scale lowered then, raised after a run of clean
// steps — PyTorch's GradScaler, which LibTorch's C++ API lacks.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

namespace gpipe {

// Note [Loss scaling]
// ~~~~~~~~~~~~~~~~~~~~
// As torch.cuda.amp.GradScaler documents it: backward runs from loss * S; unscale multiplies every
// gradient by 1 / S and records whether any is inf or NaN; step() runs the optimizer only when
// none is; update() then sets S = S * backoff_factor after a step with one (and restarts the
// count), else counts the clean step and sets S = S * growth_factor after growth_interval clean
// steps in a row — unless S * growth_factor is not finite in float32 (PyTorch's scale is a float32
// tensor): S then stays. In a pipeline the gradients live on several devices: each device's are unscaled
// there (ATen's _amp_foreach_non_finite_check_and_unscale_, one kernel per device and dtype, where
// this LibTorch has it for the device — CUDA; elsewhere, as on the CPU in LibTorch 1.13, the same
// with isfinite and mul_), each device's finding is one flag, and one read on the host joins them.
// Across processes (PipelineStage, DataParallel) that flag must be the same on every rank, or
// the stages' optimizers would disagree: step() takes `any_rank`, which ORs it over the ranks
// (gpipe::distributed::any_rank in distributed/replication.h: one all-reduce of one number).
// The scale lives on the host, not in a device tensor as in _amp_update_scale_: the decision to
// skip must reach the host anyway, and the rule is the same.

/// Options of a GradScaler: PyTorch's defaults.
struct GradScalerOptions {
  /// The scale to start with (positive).
  TORCH_ARG(double, init_scale) = 65536.0;
  /// What update() multiplies the scale by after growth_interval clean steps in a row (above 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  /// What update() multiplies the scale by after a step with an inf or NaN (in (0, 1)).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// The clean steps in a row after which the scale grows (at least 1).
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// Disabled, scale() and unscaling do nothing and step() always steps: one code path for
  /// float32, bfloat16 (which has float32's range) and float16 runs.
  TORCH_ARG(bool, enabled) = true;
};

/// Dynamic loss scaling (Note [Loss scaling]).
///
///   gpipe::GradScaler scaler;
///   {
///     gpipe::Autocast autocast(c10::kCUDA, c10::kHalf);
///     loss = loss_fn(model->forward(x), y);
///   }
///   scaler.scale(loss).backward();
///   scaler.step(optimizer, model->parameters());  // skipped when a gradient is inf or NaN
///   scaler.update();
class GradScaler {
 public:
  /// A scaler at options.init_scale(). Throws c10::Error naming an option out of its range.
  explicit GradScaler(GradScalerOptions options = {});

  /// `loss` * the scale (as is when disabled). A float16 or bfloat16 loss is converted to float32
  /// first, as PyTorch's float32 scale promotes it: the scaled loss is finite at the default
  /// scale (gradients flowing back into float16 may still overflow; update() backs off then).
  at::Tensor scale(const at::Tensor& loss) const;
  /// The scale (1 when disabled).
  double scale_value() const { return options_.enabled() ? scale_ : 1.0; }
  /// Whether the scaler is enabled (GradScalerOptions::enabled).
  bool is_enabled() const { return options_.enabled(); }

  /// Divides the gradients of `params` by the scale, on their devices, and returns whether any
  /// is inf or NaN here (once per step: step() calls it unless it was called). A gradient listed
  /// twice is divided once.
  bool unscale(const std::vector<at::Tensor>& params);
  /// Unscales (unless done) and runs `optimizer`'s step unless a gradient is inf or NaN here or,
  /// with `any_rank`, on any rank (it maps this process's finding to everyone's). Returns whether
  /// it stepped. When `any_rank` or the optimizer throws, a step() that unscaled ends this step:
  /// zero the gradients and run the next backward as usual.
  bool step(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& params,
            const std::function<bool(bool)>& any_rank = nullptr);
  /// Adjusts the scale after a step (Note [Loss scaling]).
  void update();

  /// Steps skipped so far.
  int64_t skipped() const { return skipped_; }
  /// Clean steps since the scale last changed.
  int64_t growth_tracker() const { return growth_tracker_; }

  /// The state (scale, clean steps, skipped steps), for saving (gpipe::save_training takes a
  /// scaler); between step() and update() it throws c10::Error: call update() first.
  void save(torch::serialize::OutputArchive& archive) const;
  /// Restores the state that save() wrote.
  void load(torch::serialize::InputArchive& archive);

 private:
  GradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t skipped_ = 0;
  // This step's state: unscaled already, and whether an inf or NaN was found (-1: not yet known).
  bool unscaled_ = false;
  int found_ = -1;
};

}  // namespace gpipe
