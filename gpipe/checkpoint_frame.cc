// The frame of a checkpointed forward, where the skips that cross it stash and pop (Note [Skips
// and checkpointing] in skip_tracker.h); see checkpoint.h.
#include <string>
#include <utility>

#include <c10/util/Exception.h>

#include "gpipe/checkpoint.h"
#include "gpipe/internal/checkpoint_state.h"

namespace gpipe {

namespace {
thread_local CheckpointFrame* current_frame = nullptr;
}  // namespace

CheckpointFrame::CheckpointFrame(State* state, bool recomputing)
    : state_(state), recomputing_(recomputing), previous_(current_frame) {
  current_frame = this;
}

CheckpointFrame::~CheckpointFrame() { current_frame = previous_; }

CheckpointFrame* CheckpointFrame::current() { return current_frame; }

void CheckpointFrame::add_popped(const SkipKey& key, at::Tensor tensor) {
  state_->popped.emplace_back(key, internal::SkipTensor(std::move(tensor)));
}

at::Tensor CheckpointFrame::stash_first_forward(const SkipKey& key, at::Tensor tensor,
                                                std::function<void(at::Tensor)> rehome) {
  bool requires_grad;
  if (state_->learning) {
    requires_grad = tensor.defined() && tensor.requires_grad();
    state_->learnt.stashes[key] = requires_grad;
    if (tensor.defined()) {
      tensor = tensor.detach();
    }
  } else {
    const auto& stashes = state_->entry().stashes;
    auto it = stashes.find(key);
    requires_grad = it == stashes.end() || it->second;
  }
  requires_grad = requires_grad && tensor.defined() && tensor.is_floating_point();
  if (requires_grad) {
    state_->pending_stashes.emplace_back(key, tensor, std::move(rehome));
  }
  return tensor;
}

at::Tensor CheckpointFrame::popped_leaf(const SkipKey& key) {
  for (size_t k = 0; k < state_->popped.size(); ++k) {
    if (state_->popped[k].first == key) {
      return state_->popped_leaves[k].get();
    }
  }
  TORCH_CHECK(false, "gpipe: the recomputation of a checkpointed micro-batch popped skip '",
              key.str(), "', which its first forward did not pop; a layer's pops must not depend "
              "on whether it is recomputing");
}

void CheckpointFrame::add_restashed(const SkipKey& key, at::Tensor tensor) {
  state_->restashed.emplace_back(key, internal::SkipTensor(std::move(tensor)));
}

}  // namespace gpipe
