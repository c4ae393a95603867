// Gradient-norm clipping over several devices (clip_grad.h).
#include "gpipe/clip_grad.h"

#include <cmath>
#include <limits>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

namespace gpipe {
namespace internal {
namespace {

bool is_infinity(double norm_type) { return norm_type == std::numeric_limits<double>::infinity(); }

// The norm of order `norm_type` of `norms` (scalars on one device).
at::Tensor combine(const std::vector<at::Tensor>& norms, double norm_type) {
  if (norms.size() == 1) return norms[0];
  const at::Tensor stacked = at::stack(norms);
  return is_infinity(norm_type) ? stacked.max() : stacked.norm(norm_type);
}

}  // namespace

at::Tensor gradient_norm(const std::vector<at::Tensor>& parameters, double norm_type,
                         const char* who) {
  TORCH_CHECK(norm_type > 0 && !std::isnan(norm_type), who, ": norm_type must be positive (2 for "
              "the Euclidean norm) or infinity (the largest magnitude), got ", norm_type);
  // Per device, in order of first appearance: each gradient's norm, as LibTorch computes them.
  std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> per_device;
  for (const at::Tensor& p : parameters) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    auto it = per_device.begin();
    while (it != per_device.end() && it->first != g.device()) ++it;
    if (it == per_device.end()) it = per_device.insert(it, {g.device(), {}});
    it->second.push_back(is_infinity(norm_type) ? g.detach().abs().max()
                                                : g.detach().norm(norm_type));
  }
  if (per_device.empty()) return at::Tensor();
  const c10::Device first = per_device.front().first;
  std::vector<at::Tensor> partial;
  for (const auto& [device, norms] : per_device) {
    partial.push_back(combine(norms, norm_type).to(first));
  }
  return combine(partial, norm_type);
}

void scale_gradients_to(const std::vector<at::Tensor>& parameters, const at::Tensor& norm,
                        double max_norm) {
  const at::Tensor coefficient = at::clamp_max(max_norm / (norm + 1e-6), 1.0);
  std::vector<at::Tensor> on;  // the coefficient on each gradient's device, in its dtype
  for (const at::Tensor& p : parameters) {
    at::Tensor g = p.grad();
    if (!g.defined()) continue;
    auto it = on.begin();
    while (it != on.end() && (it->device() != g.device() || it->scalar_type() != g.scalar_type())) {
      ++it;
    }
    if (it == on.end()) it = on.insert(it, coefficient.to(g.device(), g.scalar_type()));
    g.detach().mul_(*it);
  }
}

}  // namespace internal

at::Tensor clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm,
                          double norm_type) {
  const char* who = "gpipe::clip_grad_norm";
  TORCH_CHECK(max_norm >= 0 && !std::isnan(max_norm), who, ": max_norm must be at least 0, got ",
              max_norm);
  const at::Tensor norm = internal::gradient_norm(parameters, norm_type, who);
  if (!norm.defined()) return at::zeros({});
  internal::scale_gradients_to(parameters, norm, max_norm);
  return norm;
}

}  // namespace gpipe
