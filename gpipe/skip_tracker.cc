// Skip trackers; see skip_tracker.h, Note [Skips and checkpointing] in particular.
#include "gpipe/skip_tracker.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "gpipe/checkpoint.h"
#include "gpipe/copy.h"
#include "gpipe/dependency.h"

namespace gpipe {
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

// Keeps the gradient of a skip whose stashing task was checkpointed, copied back to the stashing
// device, for the recomputation (Note [Skips and checkpointing]).
// It holds the slot weakly: the slot holds the tensor whose history is this node until the pop.
struct SkipGradCatcher : torch::autograd::Node {
  SkipGradCatcher(std::weak_ptr<SkipSlot> slot, c10::Stream here, c10::Stream back)
      : slot(std::move(slot)), here(here), back(back) {}
  std::string name() const override { return "gpipe::SkipGradCatcher"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::shared_ptr<SkipSlot> target = slot.lock();
    if (target && grads[0].defined()) {
      target->grad.set(copy({grads[0]}, here, back)[0]);
    }
    return {at::Tensor()};
  }
  std::weak_ptr<SkipSlot> slot;
  c10::Stream here;
  c10::Stream back;
};

}  // namespace

void SkipTensor::count(const at::Tensor& t, int64_t delta) {
  if (t.defined()) {
    live_tensors.fetch_add(delta, std::memory_order_relaxed);
  }
}

int64_t live_skip_tensors() { return live_tensors.load(); }

uint64_t next_run_id() { return last_run.fetch_add(1) + 1; }

MicroBatch current_microbatch() {
  return current_context != nullptr ? current_context->microbatch : MicroBatch{};
}

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
    frame->add_restashed(std::move(tensor), [slot] { return slot->grad.take(); });
    return;
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
  if (frame != nullptr) {
    frame->add_popped(key, tensor);
  }
  return tensor;
}

void MicroBatchSkips::clear() {
  for (auto& slot : slots_) {
    slot.second->tensor.reset();
    slot.second->grad.reset();
    slot.second->stashed = false;
  }
  local_.clear();
}

std::vector<int64_t> MicroBatchSkips::fence(int64_t microbatch, int64_t partition, Batch& batch,
                                            const std::vector<c10::Stream>& compute_streams,
                                            const std::vector<std::vector<c10::Stream>>& copy_streams,
                                            bool checkpointed) {
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
    // As for activations (Note [Copy streams]): the copy starts after the stashing compute, and
    // the popping compute starts after the copy; backward reverses both.
    tensor = wait({std::move(tensor)}, compute_streams[route.second], from)[0];
    at::Tensor moved_tensor = copy({std::move(tensor)}, from, to)[0];
    moved_tensor = wait({std::move(moved_tensor)}, to, compute_streams[partition])[0];
    moved.push_back(route.second);
    const int64_t lane = batch.lane();
    if (checkpointed && at::GradMode::is_enabled() && moved_tensor.is_floating_point() &&
        !moved_tensor.requires_grad() && lane >= 0 && batch[lane].requires_grad()) {
      auto forked = fork(batch[lane]);
      batch[lane] = std::move(forked.first);
      auto node = std::shared_ptr<SkipGradCatcher>(
          new SkipGradCatcher(slots_.at(route.first), to, from), torch::autograd::deleteNode);
      node->set_next_edges(torch::autograd::collect_next_edges(forked.second));
      moved_tensor = moved_tensor.detach();
      torch::autograd::set_history(moved_tensor, node);
    }
    slot.tensor.set(std::move(moved_tensor));
  }
  return moved;
}

}  // namespace gpipe
