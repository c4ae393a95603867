// Loss functions of a training step: what the last partition applies to the mini-batch's output,
// on the whole mini-batch or on each micro-batch, depending on the schedule.
#pragma once

#include <functional>

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

// Note [Losses over micro-batches]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A schedule that runs every forward before the first backward on the last partition (GPipe's)
// applies the loss once, to the whole mini-batch's output gathered from the micro-batches: any
// loss works, as for the plain model. Schedules that start backwards while forwards remain
// (1F1B, interleaved, zero bubble) need each micro-batch's output gradient before the others'
// outputs exist, so they apply the loss to each micro-batch i of n_i samples, with the target's
// rows of that micro-batch, and weight it by n_i / N (N the mini-batch's samples): for a loss that
// is a mean over samples, sum_i (n_i / N) mean_i = the mean over the mini-batch, so the loss and
// every gradient are the plain model's, also for an uneven last micro-batch. A loss that couples
// samples (a mean over the batch's statistics, a contrastive loss over all pairs, a sum
// reduction, which would need weight 1) is not split this way: use the GPipe schedule for it.
// The target must have the mini-batch's samples along its first dimension.

}  // namespace gpipe
