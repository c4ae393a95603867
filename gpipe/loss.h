// Loss functions of a training step: what the last partition applies to the mini-batch's output,
// on the whole mini-batch or on each micro-batch, depending on the schedule; and what a loss
// averages over, so that its per-micro-batch parts add up to the plain model's loss.
#pragma once

#include <cstdint>
#include <functional>
#include <type_traits>
#include <utility>

#include <ATen/core/Tensor.h>

#include "gpipe/microbatch.h"

namespace gpipe {

/// A loss function: the output of the model for some samples and their targets, to a scalar
/// that is a mean over the samples (torch::nn::functional's default reduction).
///
///   gpipe::LossFunction loss = [](const gpipe::Batch& out, const at::Tensor& target) {
///     return torch::nn::functional::cross_entropy(out.tensor(), target);
///   };
using LossFunction = std::function<at::Tensor(const Batch& output, const at::Tensor& target)>;

/// What a loss function's mean is over, given some of the target's rows: how many terms it
/// averages there (a scalar tensor), e.g. the tokens that are not padding. See
/// count_targets_except.
using LossCount = std::function<at::Tensor(const at::Tensor& target)>;

/// A loss function with what it averages over (Note [Losses over micro-batches]). Without a
/// count it is a mean over the samples, the first dimension of the target; any callable that
/// makes a LossFunction converts to a Loss, so `step(x, y, lambda)` takes one as it is. Give a
/// count for a mean over something else, such as a token-level loss that ignores padding:
///
///   namespace F = torch::nn::functional;
///   gpipe::Loss loss(
///       [](const gpipe::Batch& out, const at::Tensor& y) {  // y: [batch, tokens], -1 = padding
///         return F::cross_entropy(out.tensor().flatten(0, 1), y.flatten(),
///                                 F::CrossEntropyFuncOptions().ignore_index(-1));
///       },
///       gpipe::count_targets_except(-1));
///   at::Tensor l = model->step(x, y, loss);  // the plain model's loss, under every schedule
class Loss {
 public:
  /// No loss function (a forward-only step, or the deprecated PipelineStageOptions::loss where
  /// it applies).
  Loss() = default;
  /// A mean over the samples: `function` converted to a LossFunction (a lambda, a function
  /// pointer, a LossFunction, nullptr).
  template <typename F, typename = std::enable_if_t<
                            !std::is_same<std::decay_t<F>, Loss>::value &&
                            std::is_constructible<LossFunction, F>::value>>
  Loss(F&& function) : function_(std::forward<F>(function)) {}  // NOLINT: implicit by design
  /// A mean over what `count` counts in the target's rows (empty `count`: the samples).
  Loss(LossFunction function, LossCount count)
      : function_(std::move(function)), count_(std::move(count)) {}

  /// The loss function (empty: none).
  const LossFunction& function() const { return function_; }
  /// What it averages over (empty: the samples).
  const LossCount& count() const { return count_; }
  /// Whether there is a loss function.
  explicit operator bool() const { return static_cast<bool>(function_); }

 private:
  LossFunction function_;
  LossCount count_;
};

/// The count of a token-level loss that skips targets equal to `ignore_index` (as
/// cross_entropy's ignore_index does): the number of the other target entries.
///
///   gpipe::Loss loss(token_cross_entropy, gpipe::count_targets_except(-100));
LossCount count_targets_except(int64_t ignore_index);

// Note [Losses over micro-batches]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A schedule that runs every forward before the first backward on the last partition (GPipe's)
// applies the loss once, to the whole mini-batch's output gathered from the micro-batches: any
// loss works, as for the plain model. Schedules that start backwards while forwards remain
// (1F1B, interleaved, zero bubble) need each micro-batch's output gradient before the others'
// outputs exist, so they apply the loss to each micro-batch i and weight it by c_i / C, where c_i
// is what the loss averages over in micro-batch i's target rows and C the same over the whole
// target: for a loss that is a mean over those terms, sum_i (c_i / C) mean_i = the mean over the
// mini-batch, so the loss and every gradient are the plain model's. The target is whole on the
// last partition from the start, so C is known before the first micro-batch's loss, whatever
// the order. By default the terms are the samples (c_i = n_i rows, C = N), right for
// torch::nn::functional's mean reductions, also for an uneven last micro-batch; a Loss with a
// count (count_targets_except) says otherwise — a token-level loss whose padding differs per
// micro-batch would get the wrong weights from the rows. A micro-batch with no terms (c_i = 0:
// only padding) adds nothing, although its own mean is NaN; this is chosen on the device
// (at::where), without waiting for the count. A loss that couples samples (a mean over the
// batch's statistics, a contrastive loss over all pairs, a sum reduction) is not split this
// way: use the GPipe schedule for it. The target must have the mini-batch's samples along its
// first dimension.

}  // namespace gpipe
