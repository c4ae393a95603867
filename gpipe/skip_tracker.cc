// Skip trackers; see skip_tracker.h, Note [Skips and checkpointing] in particular.
#include "gpipe/internal/skip_tracker.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "gpipe/checkpoint.h"
#include "gpipe/internal/copy.h"
#include "gpipe/internal/stream.h"

namespace gpipe {
namespace internal {
namespace {

std::atomic<int64_t> live_tensors{0};
std::atomic<uint64_t> last_run{0};

// The tracker of skippable layers outside a GPipe: a map per thread.
class PlainSkipTracker : public SkipTracker {
 public:
  void stash(const SkipKey& key, at::Tensor tensor) override {
    stashed_[key].set(std::move(tensor));
  }
  at::Tensor pop(const SkipKey& key) override {
    auto it = stashed_.find(key);
    TORCH_CHECK(it != stashed_.end(), "gpipe::pop: skip '", key.str(), "' was not stashed; a "
                "layer before this one must stash it in the same forward");
    at::Tensor tensor = it->second.take();
    stashed_.erase(it);
    return tensor;
  }

 private:
  std::map<SkipKey, SkipTensor> stashed_;
};

thread_local const TaskContext* current_context = nullptr;

// The backward half of gpipe::wait (copy.h): `waiting` waits for `source` before the gradient
// goes on (Note [Skip copy streams]).
struct SkipWaitBackward : torch::autograd::Node {
  SkipWaitBackward(c10::Stream waiting, c10::Stream source) : waiting(waiting), source(source) {}
  std::string name() const override { return "gpipe::SkipWaitBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    wait_stream(waiting, source);
    // (As WaitBackward: the gradients, made on `source`, are used on `waiting` next, so the
    // allocator must not hand their memory to `source` again before that use is done.)
    for (const at::Tensor& g : grads) record_stream(g, waiting);
    return std::move(grads);
  }
  c10::Stream waiting;
  c10::Stream source;
};

// Gives `tensor` (returned detached) a SkipWaitBackward, and makes no wait in forward. Returns
// `tensor` itself when no gradient can flow or the streams are not real streams.
at::Tensor wait_in_backward(at::Tensor tensor, const c10::Stream& waiting,
                            const c10::Stream& source) {
  if (!has_streams(waiting.device()) || !has_streams(source.device()) ||
      !at::GradMode::is_enabled() || !tensor.requires_grad()) {
    return tensor;
  }
  at::Tensor out = tensor.detach();
  auto node = std::shared_ptr<SkipWaitBackward>(new SkipWaitBackward(waiting, source),
                                                torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(tensor));
  {
    // The node's stream is the one current when its input is registered: `waiting`, where its
    // gradient is used next (what anomaly mode checks it on), not this lane's own.
    const c10::StreamGuard on_waiting(waiting);
    torch::autograd::set_history(out, node);
  }
  return out;
}

}  // namespace

void SkipTensor::count(const at::Tensor& t, int64_t delta) {
  if (t.defined()) {
    live_tensors.fetch_add(delta, std::memory_order_relaxed);
  }
}

uint64_t next_run_id() { return last_run.fetch_add(1) + 1; }

SkipTracker& current_skip_tracker() {
  if (current_context != nullptr && current_context->skips) {
    return *current_context->skips;
  }
  thread_local PlainSkipTracker plain;
  return plain;
}

TaskScope::TaskScope(const TaskContext& context) : previous_(current_context) {
  current_context = &context;
}

TaskScope::~TaskScope() { current_context = previous_; }

MicroBatchSkips::MicroBatchSkips(const SkipLayout* layout) : layout_(layout) {
  for (const SkipKey& key : layout_->crossing()) {
    slots_.emplace(key, std::make_shared<SkipSlot>());
  }
}

void MicroBatchSkips::stash(const SkipKey& key, at::Tensor tensor) {
  auto it = slots_.find(key);
  if (it == slots_.end()) {
    local_[key].set(std::move(tensor));
    return;
  }
  std::shared_ptr<SkipSlot> slot = it->second;
  CheckpointFrame* frame = CheckpointFrame::current();
  if (frame != nullptr && frame->recomputing()) {
    // The first forward's tensor has gone to the popping partition already; this one, with
    // history, takes the gradient caught there.
    frame->add_restashed(key, std::move(tensor));
    return;
  }
  if (frame != nullptr) {
    // A checkpoint's first forward: the tensor leaves without history; when the plain model's
    // would need a gradient, the checkpoint gives it its own history once the forward is done.
    tensor = frame->stash_first_forward(key, std::move(tensor),
                                        [slot](at::Tensor t) { slot->tensor.set(std::move(t)); });
  }
  slot->tensor.set(std::move(tensor));
  slot->stashed = true;
}

at::Tensor MicroBatchSkips::pop(const SkipKey& key) {
  auto it = slots_.find(key);
  if (it == slots_.end()) {
    auto local = local_.find(key);
    TORCH_CHECK(local != local_.end(), "gpipe::pop: skip '", key.str(), "' was not stashed; a "
                "layer before this one must stash it in the same forward");
    at::Tensor tensor = local->second.take();
    local_.erase(local);
    return tensor;
  }
  CheckpointFrame* frame = CheckpointFrame::current();
  if (frame != nullptr && frame->recomputing()) {
    return frame->popped_leaf(key);
  }
  SkipSlot& slot = *it->second;
  TORCH_CHECK(slot.stashed, "gpipe::pop: skip '", key.str(), "' was not stashed");
  slot.stashed = false;
  at::Tensor tensor = slot.tensor.take();
  slot.copied = at::Tensor();
  if (frame != nullptr) {
    frame->add_popped(key, tensor);
  }
  return tensor;
}

std::vector<MicroBatchSkips::Cut> MicroBatchSkips::cut(
    int64_t partition,
    const std::function<at::Tensor(int64_t from, const at::Tensor& tensor)>& replace) {
  std::vector<Cut> cuts;
  for (const auto& route : layout_->routes_into(partition)) {
    SkipSlot& slot = *slots_.at(route.first);
    TORCH_CHECK(slot.stashed, "gpipe: internal error: skip '", route.first.str(),
                "' reached partition ", partition, " unstashed");
    const at::Tensor& tensor = slot.tensor.get();
    if (!tensor.defined() || !tensor.requires_grad()) continue;
    Cut cut{route.second, tensor,
            replace ? replace(route.second, tensor) : tensor.detach().requires_grad_(true),
            std::move(slot.copied)};
    slot.copied = at::Tensor();
    slot.tensor.set(cut.leaf);
    cuts.push_back(std::move(cut));
  }
  return cuts;
}

void MicroBatchSkips::clear() {
  for (auto& slot : slots_) {
    slot.second->tensor.reset();
    slot.second->copied = at::Tensor();
    slot.second->stashed = false;
  }
  local_.clear();
}

// Note [Skip copy streams]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A skip stashed by task (i, a) and popped by task (i, b) is copied by the fence of (i, b), on the
// copy streams of micro-batch i: from copy stream [a][i] to copy stream [b][i]. By the time of that
// fence (clock tick i+b), compute stream a has also been given tasks (i+1, a) ... (i+b-a-1, a) of
// later micro-batches. Making copy stream [a][i] wait for compute stream a now, as the activation
// copy from partition b-1 does, would hold the skip, and so task (i, b), back until those later
// micro-batches have been computed on a's device: a dependency that the schedule does not have.
//
// Forward, the skip copy therefore waits only for what task (i, a) produced, and copy stream [a][i]
// already does: when the pipeline collected task (i, a), it made that stream wait for compute
// stream a as it was then (the wait after each task's output, Note [Copy streams]). That wait was
// issued in an earlier tick than this fence, so it precedes the copy on copy stream [a][i], and
// nothing issued to compute stream a after it is waited for. The reference's portal copy does the
// same: it copies between the two copy streams and relies on the stashing task's output wait. Then
// compute stream b waits for copy stream [b][i] before the pop, as it does for the activations.
//
// Backward keeps both waits, reversed: copy stream [b][i] waits for compute stream b before the
// gradient is copied back, and compute stream a waits for copy stream [a][i] before the stashing
// layers use the gradient. The latter has no forward half, so it is made by wait_in_backward, not
// gpipe::wait.
//
// Under step() partition b's backward of micro-batch i stops at the popped skip's leaf (Cut in
// skip_tracker.h), and partition a's backward of i later starts from the skip's chain. Started at
// the fence's last tensor, its first node would make copy stream [b][i] wait for compute stream b
// only then, by when b's lane may have queued later work there (1F1B's next forwards), which the
// gradient's copy would wait for too: a false dependency like the one the forward avoids. So on a
// GPU the cut keeps the tensor before the fence's wait (SkipSlot::copied), and a's backward starts
// from the copy (run_backward in executor_actions.cc). Copy stream [b][i] has waited for compute
// stream b by then, as soon as b's backward of i was queued: the link's send of that backward's
// input gradients waits so (Note [Links on copy streams] in link.h), and run_backward makes the
// wait itself too, so that the order does not depend on the link.

std::vector<int64_t> MicroBatchSkips::fence(int64_t microbatch, int64_t partition,
                                            const std::vector<c10::Stream>& compute_streams,
                                            const std::vector<std::vector<c10::Stream>>& copy_streams) {
  std::vector<int64_t> moved;
  for (const auto& route : layout_->routes_into(partition)) {
    SkipSlot& slot = *slots_.at(route.first);
    TORCH_CHECK(slot.stashed, "gpipe: internal error: skip '", route.first.str(),
                "' reached partition ", partition, " unstashed");
    at::Tensor tensor = slot.tensor.take();
    if (!tensor.defined()) {
      slot.tensor.set(std::move(tensor));  // an optional skip that was not given
      continue;
    }
    const c10::Stream& from = copy_streams[route.second][microbatch];
    const c10::Stream& to = copy_streams[partition][microbatch];
    // No forward wait on the stashing compute stream: `from` waits already for the stashing task
    // and must not wait for later ones (Note [Skip copy streams]).
    tensor = wait_in_backward(std::move(tensor), compute_streams[route.second], from);
    at::Tensor moved_tensor = copy({std::move(tensor)}, from, to)[0];
    slot.copied = has_streams(compute_streams[partition].device()) ? moved_tensor : at::Tensor();
    moved_tensor = wait({std::move(moved_tensor)}, to, compute_streams[partition])[0];
    moved.push_back(route.second);
    slot.tensor.set(std::move(moved_tensor));
  }
  return moved;
}

}  // namespace internal

// The public functions of skippable.h that read the tracker's state.
int64_t live_skip_tensors() { return internal::live_tensors.load(); }

MicroBatch current_microbatch() {
  const internal::TaskContext* context = internal::current_context;
  if (context == nullptr) return MicroBatch{};
  if (context->microbatch_asked != nullptr) *context->microbatch_asked = true;
  return context->microbatch;
}

}  // namespace gpipe
