// Shared checks for the bundled models' tests.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/nn/functional/loss.h>

#include "tests/gpipe/test_util.h"

namespace gpipe {
namespace testing {

inline int64_t parameter_count(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

/// A GPipe over `balance.size()` CPU partitions.
inline GPipeOptions cpu_options(const std::vector<int64_t>& balance, int64_t chunks,
                                Checkpoint mode) {
  return GPipeOptions(balance)
      .devices(std::vector<c10::Device>(balance.size(), at::kCPU))
      .chunks(chunks)
      .checkpoint(mode);
}

/// One training step (cross-entropy on `labels`, in training mode) of the plain model, built by
/// `make`, one micro-batch at a time (the split GPipe makes, so that batch norms see the same
/// batches), against a GPipe of an identical copy with `options`: same loss and parameter
/// gradients in float64.
template <typename Make>
void check_training_step(Make make, const at::Tensor& x, const at::Tensor& labels,
                         const GPipeOptions& options, double tol = 1e-10) {
  torch::nn::Sequential plain = build(make, 11);
  GPipe model(build(make, 11), options);
  plain->train();
  model->train();
  at::Tensor loss1 =
      at::cross_entropy_loss(plain_by_microbatch(plain, x, options.chunks()), labels);
  at::Tensor loss2 = at::cross_entropy_loss(model->forward(x), labels);
  CATCH_CHECK(std::abs(loss1.item<double>() - loss2.item<double>()) <= tol);
  loss1.backward();
  loss2.backward();
  check_same_grads(plain->parameters(), model->parameters(), tol);
}

}  // namespace testing
}  // namespace gpipe
