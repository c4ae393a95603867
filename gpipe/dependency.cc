// Fork and join; see dependency.h and Note [Backward order] in executor.h.
#include "gpipe/internal/dependency.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace gpipe {
namespace internal {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

// Backward of fork: the gradient of x' goes to x; the phony's gradient is dropped.
struct ForkBackward : PassBackward {
  std::string name() const override { return "gpipe::ForkBackward"; }
};

// Backward of join: the gradient goes to x, and nothing (an empty gradient) to the phony.
struct JoinBackward : Node {
  using Node::Node;
  std::string name() const override { return "gpipe::JoinBackward"; }
  variable_list apply(variable_list&& grads) override {
    return {std::move(grads[0]), at::Tensor()};
  }
};

}  // namespace

variable_list PassBackward::apply(variable_list&& grads) {
  before_pass();
  return {std::move(grads[0])};
}

at::Tensor make_phony(const at::TensorOptions& options) {
  // A fresh tensor object each time (Note [Phony]), made from one empty tensor per thread and
  // kind without the dispatcher's empty(): a shallow copy with a version counter of its own.
  thread_local at::Tensor empty;
  if (!empty.defined() || empty.device() != options.device() ||
      empty.dtype() != options.dtype() || empty.layout() != options.layout() ||
      empty.is_inference() != c10::InferenceMode::is_enabled()) {
    empty = at::empty({0}, options.requires_grad(false));
  }
  return at::Tensor(empty.unsafeGetTensorImpl()->shallow_copy_and_detach(
      c10::VariableVersion(0), /*allow_tensor_metadata_change=*/false));
}

at::Tensor detached(const at::Tensor& x) {
  if (!x.defined()) return x;
  const c10::TensorImpl* impl = x.unsafeGetTensorImpl();
  return at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(),
                                                  /*allow_tensor_metadata_change=*/false));
}

std::pair<at::Tensor, at::Tensor> fork(const at::Tensor& x) {
  at::Tensor phony = make_phony(x.options());
  if (!at::GradMode::is_enabled() || !x.requires_grad()) {
    return {x, std::move(phony)};
  }
  const torch::autograd::Edge edge = torch::autograd::impl::gradient_edge(x);
  Node* node_of_x = edge.function.get();
  const auto* pass = dynamic_cast<PassBackward*>(node_of_x);
  const auto* taker = dynamic_cast<const TakesPhonies*>(node_of_x);
  if ((pass != nullptr && edge.input_nr == 0 && pass->num_inputs() == 1) ||
      (taker != nullptr && taker->takes_phonies())) {
    torch::autograd::set_history(phony, edge.function);
    return {x, std::move(phony)};
  }
  auto node = std::shared_ptr<ForkBackward>(new ForkBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  at::Tensor out = detached(x);
  torch::autograd::set_history(out, node);
  torch::autograd::set_history(phony, node);
  return {std::move(out), std::move(phony)};
}

at::Tensor join(const at::Tensor& x, const at::Tensor& phony) {
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || phony.requires_grad())) {
    return x;
  }
  auto node = std::shared_ptr<JoinBackward>(new JoinBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x, phony));
  at::Tensor out = detached(x);
  torch::autograd::set_history(out, node);
  return out;
}

void depend(at::Tensor& before, at::Tensor& after) {
  auto forked = fork(before);
  before = std::move(forked.first);
  after = join(after, forked.second);
}

}  // namespace internal
}  // namespace gpipe
