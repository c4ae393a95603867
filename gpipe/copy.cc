// Copy and wait; see Note [Copy streams] in copy.h.
#include "gpipe/internal/copy.h"

#include <c10/core/StreamGuard.h>
#include <c10/util/irange.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "gpipe/internal/stream.h"

namespace gpipe {
namespace internal {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

bool any_requires_grad(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.requires_grad()) {
      return true;
    }
  }
  return false;
}

// Gives `outputs` (fresh detached tensors) the history of `node`, whose next edges are those of
// `inputs`. Tensors that need no gradient stay without history.
void attach(const std::shared_ptr<Node>& node, const std::vector<at::Tensor>& inputs,
            std::vector<at::Tensor>& outputs) {
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (const auto i : c10::irange(outputs.size())) {
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      torch::autograd::set_history(outputs[i], node);
    } else {
      // Keep the input/output positions aligned with the node's edges.
      node->add_input_metadata(Node::undefined_input());
    }
  }
}

// Moves `tensors` onto `to`'s device with both streams current. The source is recorded on
// `from`, the result on the destination's current (compute) stream, which is where it will be
// used (see Note [Copy streams]).
std::vector<at::Tensor> copy_tensors(const std::vector<at::Tensor>& tensors,
                                     const c10::Stream& from, const c10::Stream& to) {
  // The stream that will use the result on the destination device: current before the guards.
  const c10::Stream to_compute = current_stream(to.device());
  c10::StreamGuard from_guard(from);
  c10::StreamGuard to_guard(to);
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) {
      out.emplace_back();
      continue;
    }
    at::Tensor y = t.to(to.device(), /*non_blocking=*/false, /*copy=*/false).detach();
    record_stream(t, from);
    record_stream(y, to_compute);
    out.push_back(std::move(y));
  }
  return out;
}

struct CopyBackward : Node {
  CopyBackward(c10::Stream prev, c10::Stream next) : prev(prev), next(next) {}
  std::string name() const override { return "gpipe::CopyBackward"; }
  variable_list apply(variable_list&& grads) override {
    return copy_tensors(grads, next, prev);
  }
  c10::Stream prev;
  c10::Stream next;
};

struct WaitBackward : Node {
  WaitBackward(c10::Stream prev, c10::Stream next) : prev(prev), next(next) {}
  std::string name() const override { return "gpipe::WaitBackward"; }
  variable_list apply(variable_list&& grads) override {
    wait_stream(prev, next);
    return std::move(grads);
  }
  c10::Stream prev;
  c10::Stream next;
};

struct HandOverBackward : Node {
  std::string name() const override { return "gpipe::HandOverBackward"; }
  variable_list apply(variable_list&& grads) override { return std::move(grads); }
};

}  // namespace

std::vector<at::Tensor> copy(std::vector<at::Tensor> tensors, const c10::Stream& prev,
                             const c10::Stream& next) {
  if (!has_streams(prev.device()) && !has_streams(next.device())) {
    bool all_there = true;
    for (const at::Tensor& t : tensors) {
      all_there = all_there && (!t.defined() || t.device() == next.device());
    }
    if (all_there) {
      return tensors;
    }
  }
  std::vector<at::Tensor> out;
  {
    at::NoGradGuard no_grad;
    out = copy_tensors(tensors, prev, next);
  }
  if (at::GradMode::is_enabled() && any_requires_grad(tensors)) {
    auto node =
        std::shared_ptr<CopyBackward>(new CopyBackward(prev, next), torch::autograd::deleteNode);
    attach(node, tensors, out);
  }
  return out;
}

std::vector<at::Tensor> wait(std::vector<at::Tensor> tensors, const c10::Stream& prev,
                             const c10::Stream& next) {
  if (!has_streams(prev.device()) || !has_streams(next.device())) {
    return tensors;
  }
  wait_stream(next, prev);
  if (!at::GradMode::is_enabled() || !any_requires_grad(tensors)) {
    return tensors;
  }
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    out.push_back(t.defined() ? t.detach() : at::Tensor());
  }
  auto node =
      std::shared_ptr<WaitBackward>(new WaitBackward(prev, next), torch::autograd::deleteNode);
  attach(node, tensors, out);
  return out;
}

std::vector<at::Tensor> pass(std::vector<at::Tensor> tensors) {
  if (!at::GradMode::is_enabled() || !any_requires_grad(tensors)) return tensors;
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(t.defined() ? t.detach() : at::Tensor());
  auto node =
      std::shared_ptr<HandOverBackward>(new HandOverBackward(), torch::autograd::deleteNode);
  attach(node, tensors, out);
  return out;
}

}  // namespace internal
}  // namespace gpipe
