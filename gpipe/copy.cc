// Copy and wait; see Note [Copy streams] in copy.h.
#include "gpipe/internal/copy.h"

#include <atomic>

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/irange.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "gpipe/internal/stream.h"

namespace gpipe {
namespace internal {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

std::atomic<bool>& pinned_staging() {
  static std::atomic<bool> enabled{true};
  return enabled;
}

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

// `tensors` (detached, same data) behind `node`, whose next edges become those of `tensors`.
std::vector<at::Tensor> behind(const std::shared_ptr<Node>& node,
                               const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(t.defined() ? t.detach() : at::Tensor());
  attach(node, tensors, out);
  return out;
}

// Tensors copied to another device (Note [Copy streams]): `values`, of which some are still on
// their way to the CPU where `to_host_pending` (the host must wait for the source's copy stream).
struct Copied {
  std::vector<at::Tensor> values;
  bool to_host_pending = false;
};

// Moves `tensors` onto `to`'s device with both streams current, without blocking the host (Note
// [Copy streams]), except to the CPU unless `host_waits` (whoever reads them waits for `from`
// first). The source is recorded on `from`, the result on the destination's current (compute)
// stream, which is where it will be used.
Copied copy_tensors(const std::vector<at::Tensor>& tensors, const c10::Stream& from,
                    const c10::Stream& to, bool host_waits) {
  // The stream that will use the result on the destination device: current before the guards.
  const c10::Stream to_compute = current_stream(to.device());
  c10::StreamGuard from_guard(from);
  c10::StreamGuard to_guard(to);
  const bool to_host = !has_streams(to.device());
  Copied out;
  out.values.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) {
      out.values.emplace_back();
      continue;
    }
    // To the CPU without blocking only from `from`'s own device: LibTorch copies from a GPU on
    // that GPU's current stream, so `from` orders nothing on another one, which is copied
    // blocking.
    const bool deferred = to_host && host_waits && t.is_cuda() && t.device() == from.device();
    out.to_host_pending = out.to_host_pending || deferred;
    at::Tensor y =
        copy_to_device(t, to.device(), /*non_blocking=*/!to_host || deferred).detach();
    record_stream(t, from);
    record_stream(y, to_compute);
    out.values.push_back(std::move(y));
  }
  return out;
}

struct CopyBackward : Node {
  // `host_waits`: the gradients go to the CPU, where a HostWaitBackward waits for them.
  CopyBackward(c10::Stream prev, c10::Stream next, bool host_waits)
      : prev(prev), next(next), host_waits(host_waits) {}
  std::string name() const override { return "gpipe::CopyBackward"; }
  variable_list apply(variable_list&& grads) override {
    // Anomaly mode reads each node's outputs for NaN as soon as it returns, on the thread's
    // current stream: before HostWaitBackward's wait, and, to a GPU, on a stream that does not
    // wait for the copy's. So there the host waits for the copies here.
    const bool anomaly = torch::autograd::AnomalyMode::is_enabled();
    variable_list out = copy_tensors(grads, next, prev, host_waits && !anomaly).values;
    if (anomaly) {
      if (const auto landed = record_point(prev)) synchronize_point(*landed);
    }
    return out;
  }
  c10::Stream prev;
  c10::Stream next;
  bool host_waits;
};

struct WaitBackward : Node {
  WaitBackward(c10::Stream prev, c10::Stream next) : prev(prev), next(next) {}
  std::string name() const override { return "gpipe::WaitBackward"; }
  variable_list apply(variable_list&& grads) override {
    wait_stream(prev, next);
    for (const at::Tensor& g : grads) record_stream(g, prev);  // as wait() does
    return std::move(grads);
  }
  c10::Stream prev;
  c10::Stream next;
};

// In front of a copy's CPU sources: in backward, on the CPU's thread, waits until the gradients'
// copies from the GPU, issued on `stream` by the copy's CopyBackward before this node runs, have
// landed (Note [Copy streams]). It waits for whatever else that stream (the copy stream of one
// partition and micro-batch) holds by then as well: that micro-batch's other copies.
struct HostWaitBackward : Node {
  explicit HostWaitBackward(c10::Stream stream) : stream(stream) {}
  std::string name() const override { return "gpipe::HostWaitBackward"; }
  variable_list apply(variable_list&& grads) override {
    if (const auto point = record_point(stream)) synchronize_point(*point);
    return std::move(grads);
  }
  c10::Stream stream;
};

struct HandOverBackward : Node {
  std::string name() const override { return "gpipe::HandOverBackward"; }
  variable_list apply(variable_list&& grads) override { return std::move(grads); }
};

}  // namespace

void set_pinned_staging(bool enabled) { pinned_staging() = enabled; }

at::Tensor copy_to_device(const at::Tensor& t, c10::Device to, bool non_blocking) {
  at::Tensor source = t.detach();
  if (non_blocking && source.is_cpu() && to.is_cuda()) {
    if (pinned_staging() && source.layout() == at::kStrided && !source.is_quantized()) {
      // Into a block of its own, contiguous, so that the copy reads the pinned block itself (a
      // strided one would be made contiguous in pageable memory by the copy). Pinned tensors too:
      // one may be the caller's, written again once the call returns.
      at::Tensor pinned = at::empty(source.sizes(), source.options().pinned_memory(true));
      source = pinned.copy_(source);
    } else if (source.is_pinned()) {
      non_blocking = false;  // (without staging) perhaps the caller's
    }
  }
  return source.to(to, non_blocking, /*copy=*/false);
}

std::vector<at::Tensor> copy(std::vector<at::Tensor> tensors, const c10::Stream& prev,
                             const c10::Stream& next, std::shared_ptr<const StreamPoint>* landed) {
  if (landed != nullptr) *landed = nullptr;
  if (!has_streams(prev.device()) && !has_streams(next.device())) {
    bool all_there = true;
    for (const at::Tensor& t : tensors) {
      all_there = all_there && (!t.defined() || t.device() == next.device());
    }
    if (all_there) {
      return tensors;
    }
  }
  const bool grad = at::GradMode::is_enabled() && any_requires_grad(tensors);
  // Gradients from a GPU to the CPU: a node in front of the CPU tensors waits for their copies
  // on the CPU's thread (Note [Copy streams]). Not where a tensor that requires grad is on a
  // GPU: the node would then run on that GPU's thread.
  bool host_waits = grad && !has_streams(prev.device()) && has_streams(next.device());
  for (const at::Tensor& t : tensors) {
    host_waits = host_waits && (!t.defined() || !t.requires_grad() || t.is_cpu());
  }
  if (host_waits) {
    tensors = behind(std::shared_ptr<HostWaitBackward>(new HostWaitBackward(next),
                                                       torch::autograd::deleteNode),
                     tensors);
  }
  Copied out;
  {
    at::NoGradGuard no_grad;
    out = copy_tensors(tensors, prev, next, /*host_waits=*/landed != nullptr);
  }
  if (landed != nullptr && out.to_host_pending) *landed = record_point(prev);
  if (grad) {
    auto node = std::shared_ptr<CopyBackward>(new CopyBackward(prev, next, host_waits),
                                              torch::autograd::deleteNode);
    attach(node, tensors, out.values);
  }
  return std::move(out.values);
}

std::vector<at::Tensor> wait(std::vector<at::Tensor> tensors, const c10::Stream& prev,
                             const c10::Stream& next) {
  if (!has_streams(prev.device()) || !has_streams(next.device())) {
    return tensors;
  }
  wait_stream(next, prev);
  // `next` uses them: their memory stays theirs until it is done (the copy recorded its result on
  // the stream current on the copying thread, which on another thread than the receiver's is not
  // the caller's stream).
  for (const at::Tensor& t : tensors) record_stream(t, next);
  if (!at::GradMode::is_enabled() || !any_requires_grad(tensors)) {
    return tensors;
  }
  return behind(
      std::shared_ptr<WaitBackward>(new WaitBackward(prev, next), torch::autograd::deleteNode),
      tensors);
}

std::vector<at::Tensor> pass(std::vector<at::Tensor> tensors) {
  if (!at::GradMode::is_enabled() || !any_requires_grad(tensors)) return tensors;
  return behind(
      std::shared_ptr<HandOverBackward>(new HandOverBackward(), torch::autograd::deleteNode),
      tensors);
}

}  // namespace internal
}  // namespace gpipe
