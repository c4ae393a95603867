// A model whose first and last layers use one weight (a dense token embedding and the output
// projection onto the vocabulary), for the tests of tied parameters in one process and across
// processes.
#pragma once

#include <cstdint>
#include <set>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

namespace gpipe {
namespace tied_test {

namespace nn = torch::nn;

constexpr int64_t kVocab = 6;
constexpr int64_t kWidth = 5;

// x [B, V] -> x W: a dense token embedding of W [V, D].
struct EmbedImpl : nn::Cloneable<EmbedImpl> {
  explicit EmbedImpl(const at::Tensor& w) { weight = register_parameter("weight", w); }
  void reset() override {
    weight = register_parameter("weight", at::empty({kVocab, kWidth}, at::kDouble));
  }
  at::Tensor forward(const at::Tensor& x) { return x.matmul(weight); }
  at::Tensor weight;
};
TORCH_MODULE(Embed);

// h [B, D] -> h W^T: the output projection onto the vocabulary.
struct ProjectImpl : nn::Cloneable<ProjectImpl> {
  explicit ProjectImpl(const at::Tensor& w) { weight = register_parameter("weight", w); }
  void reset() override {
    weight = register_parameter("weight", at::empty({kVocab, kWidth}, at::kDouble));
  }
  at::Tensor forward(const at::Tensor& h) { return h.matmul(weight.t()); }
  at::Tensor weight;
};
TORCH_MODULE(Project);

// Five layers whose first and last use one weight (`shared`), or two tensors with the same
// values (a tie to be named).
inline nn::Sequential tied_model(bool shared) {
  at::manual_seed(5);
  const at::Tensor w = at::randn({kVocab, kWidth}, at::kDouble);
  nn::Linear a(kWidth, kWidth), b(kWidth, kWidth);
  a->to(at::kDouble);
  b->to(at::kDouble);
  const at::Tensor last = shared ? w : at::randn({kVocab, kWidth}, at::kDouble);
  return nn::Sequential(Embed(w), a, nn::Tanh(), b, Project(last));
}

// Each tensor once (an optimizer must see a shared weight once): the oracle's own dedup.
inline std::vector<at::Tensor> each_once(const std::vector<at::Tensor>& all) {
  std::set<const void*> seen;
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : all) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

}  // namespace tied_test
}  // namespace gpipe
