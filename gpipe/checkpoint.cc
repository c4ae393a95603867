// Checkpointing; see Note [Checkpoint and recompute] in checkpoint.h.
#include "gpipe/checkpoint.h"
#include "gpipe/internal/checkpoint_state.h"

#include <tuple>

#include <ATen/core/grad_mode.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "gpipe/internal/dependency.h"
#include "gpipe/internal/skip_tracker.h"
#include "gpipe/internal/stream.h"
#include "gpipe/thread_state.h"

namespace gpipe {
namespace {

thread_local bool checkpointing_flag = false;
thread_local bool recomputing_flag = false;

// Sets a thread-local flag for a scope.
class FlagScope {
 public:
  explicit FlagScope(bool& flag) : flag_(flag), previous_(flag) { flag_ = true; }
  ~FlagScope() { flag_ = previous_; }

 private:
  bool& flag_;
  bool previous_;
};

// Restores the random generators to a saved state for a scope, then puts back the current state,
// so that the recomputation replays the first forward's random numbers without disturbing the
// random sequence of the rest of the program.
class RngReplay {
 public:
  explicit RngReplay(const internal::RngState& saved)
      : current_(saved.empty() ? internal::RngState{} : internal::get_rng_state(saved.device)) {
    internal::set_rng_state(saved);
  }
  ~RngReplay() { internal::set_rng_state(current_); }

 private:
  internal::RngState current_;
};

}  // namespace

bool is_checkpointing() { return checkpointing_flag; }
bool is_recomputing() { return recomputing_flag; }

std::shared_ptr<const GradRecord::Entry> GradRecord::find(uint64_t key) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : it->second;
}

void GradRecord::put(uint64_t key, std::shared_ptr<const Entry> entry) {
  absl::MutexLock lock(&mu_);
  entries_[key] = std::move(entry);
}

void GradRecord::drop(uint64_t key) {
  absl::MutexLock lock(&mu_);
  entries_.erase(key);
}

namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;
using State = CheckpointFrame::State;

// A detached stand-in for `x` that needs a gradient exactly when `x` does.
at::Tensor leaf_of(const at::Tensor& x) {
  if (!x.defined()) {
    return at::Tensor();
  }
  at::Tensor leaf = internal::detached(x);
  leaf.set_requires_grad(x.requires_grad());
  return leaf;
}

// Reruns the checkpointed function with autograd on detached inputs, as the first forward did
// (random state, thread state), and keeps the outputs and leaves for CheckpointBackward.
void recompute(State& st) {
  State* state = &st;
  state->popped_leaves.clear();  // (a recomputation that threw may have left some)
  state->restashed.clear();
  std::vector<at::Tensor> leaves;
  leaves.reserve(state->input.size());
  for (const at::Tensor& x : state->input.values()) {
    leaves.push_back(leaf_of(x));
  }
  for (const auto& popped : state->popped) {
    state->popped_leaves.emplace_back(leaf_of(popped.second.get()));
  }
  Batch leaf_batch = state->input.atomic() ? Batch(leaves[0]) : Batch(leaves);
  Batch out(std::vector<at::Tensor>{});
  const Timeline::Started started = state->start();
  {
    ThreadStateGuard thread_state(*state->thread_state);
    at::AutoGradMode grad(true);
    RngReplay replay(state->rng);
    FlagScope recomputing(recomputing_flag);
    CheckpointFrame frame(state, /*recomputing=*/true);
    try {
      out = state->function(leaf_batch);
    } catch (const std::exception&) {
      throw;
    } catch (...) {
      // The autograd engine carries only std::exceptions back to the caller of backward().
      TORCH_CHECK(false, "gpipe: a layer threw an exception that is not a std::exception while "
                  "a checkpointed micro-batch was recomputed in backward; throw a "
                  "std::exception (e.g. with TORCH_CHECK) to have it reach the caller");
    }
  }
  state->record_event(TimelineEvent::Kind::kRecompute, started);
  state->outputs = std::move(out.values());
  state->leaves = std::move(leaves);
  state->recomputed = true;
  // A layer that now gives an output history where the first forward's entry said none (or the
  // reverse) has changed its mind: learn the entry again next time.
  const std::vector<bool>& expected = state->entry().outputs;
  bool same = state->outputs.size() == expected.size();
  for (size_t k = 0; same && k < state->outputs.size(); ++k) {
    same = (state->outputs[k].defined() && state->outputs[k].requires_grad()) ==
           expected[k];
  }
  if (!same) {
    state->record->drop(state->key);
  }
}

// Takes phonies (dependency.h): the dependency of the next micro-batch's backward on this one
// (Note [Backward order] in executor.h), one input past the outputs and stashes, given nothing.
struct CheckpointBackward : Node, internal::TakesPhonies {
  explicit CheckpointBackward(std::shared_ptr<State> state) : state(std::move(state)) {}
  std::string name() const override { return "gpipe::CheckpointBackward"; }
  void release_variables() override { state.reset(); }
  bool takes_phonies() const override { return state && state->stash_inputs.empty(); }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(state, "gpipe: the backward of a checkpointed micro-batch ran twice; "
                "retain_graph is not supported with checkpointing");
    if (!state->recomputed) {
      // The recomputation hangs off the first floating-point output; when the loss does not
      // depend on that output, it has not run yet.
      recompute(*state);
    }
    std::vector<at::Tensor> outputs;
    std::vector<at::Tensor> output_grads;
    for (const auto k : c10::irange(state->outputs.size())) {
      const at::Tensor& out = state->outputs[k];
      if (out.defined() && out.requires_grad() && k < grads.size() && grads[k].defined()) {
        outputs.push_back(out);
        output_grads.push_back(grads[k]);
      }
    }
    // Skips stashed again by the recomputation take the gradients that reached the first
    // forward's stashes (the node's inputs after the outputs).
    for (size_t e = 0; e < state->stash_inputs.size(); ++e) {
      const size_t index = state->outputs_count + e;
      if (index >= grads.size() || !grads[index].defined()) {
        continue;
      }
      for (auto& restashed : state->restashed) {
        const at::Tensor& t = restashed.second.get();
        if (restashed.first == state->stash_inputs[e] && t.defined() && t.requires_grad()) {
          outputs.push_back(t);
          output_grads.push_back(grads[index]);
          break;
        }
      }
    }
    if (!outputs.empty()) {
      const Timeline::Started started = state->start();
      torch::autograd::backward(outputs, output_grads);
      state->record_event(TimelineEvent::Kind::kBackward, started);
    }
    auto grad_of = [](const at::Tensor& leaf) {
      return leaf.defined() && leaf.requires_grad() ? leaf.grad() : at::Tensor();
    };
    variable_list input_grads;
    input_grads.reserve(num_outputs());
    for (const at::Tensor& leaf : state->leaves) {
      input_grads.push_back(grad_of(leaf));
    }
    for (const internal::SkipTensor& leaf : state->popped_leaves) {
      input_grads.push_back(grad_of(leaf.get()));
    }
    if (state->has_dependency) {
      input_grads.emplace_back();  // nothing for the dependency's phony
    }
    TORCH_INTERNAL_ASSERT(input_grads.size() == num_outputs(), "gpipe: CheckpointBackward has ",
                          num_outputs(), " next edges but made ", input_grads.size(),
                          " gradients");
    state->release();
    state.reset();
    return input_grads;
  }

  std::shared_ptr<State> state;
};

// Passes the gradient of a checkpointed task's lane through, after recomputing the task (see Note
// [Checkpoint and recompute] in checkpoint.h). A PassBackward, so that the dependency on the next
// micro-batch (Note [Backward order] in executor.h) takes its phony from this node.
struct RecomputeBackward : internal::PassBackward {
  explicit RecomputeBackward(std::shared_ptr<State> state) : state(std::move(state)) {}
  std::string name() const override { return "gpipe::RecomputeBackward"; }
  void release_variables() override { state.reset(); }

 protected:
  void before_pass() override {
    TORCH_CHECK(state, "gpipe: a checkpointed micro-batch was recomputed twice; retain_graph is "
                "not supported with checkpointing");
    if (!state->recomputed) {
      recompute(*state);
    }
    state.reset();
  }

 public:
  std::shared_ptr<State> state;
};

}  // namespace

namespace {

// The key of a GradRecord entry: which inputs require grad, mixed with the parameters' key.
uint64_t record_key(const Batch& input, uint64_t params_key) {
  uint64_t bits = 0;
  for (size_t k = 0; k < input.size(); ++k) {
    if (input[k].defined() && input[k].requires_grad()) {
      bits |= uint64_t{1} << (k % 64);
    }
  }
  return bits ^ (params_key * 0x9E3779B97F4A7C15ull);
}

}  // namespace

Checkpointing::Checkpointing(Function function, Batch input, c10::Device device,
                             std::shared_ptr<const ThreadState> thread_state,
                             std::shared_ptr<GradRecord> record, uint64_t params_key) {
  const uint64_t key = record_key(input, params_key);
  state_ = std::make_shared<State>(std::move(function), std::move(input), device,
                                   std::move(thread_state), std::move(record), key);
}

void Checkpointing::attach_dependency(const at::Tensor& phony) {
  std::shared_ptr<Node> node = state_->node.lock();
  if (node && phony.defined() && phony.requires_grad()) {
    node->add_next_edge(torch::autograd::impl::gradient_edge(phony));
    state_->has_dependency = true;
  }
}

void Checkpointing::record_to(std::shared_ptr<Timeline> timeline, int64_t microbatch,
                              int64_t partition) {
  state_->timeline = std::move(timeline);
  state_->microbatch = microbatch;
  state_->partition = partition;
}

Batch Checkpointing::checkpoint() {
  state_->rng = internal::get_rng_state(state_->device);
  state_->known = state_->record->find(state_->key);
  state_->learning = state_->known == nullptr;
  Batch out(std::vector<at::Tensor>{});
  {
    // Without grad, unless the autograd metadata is still to be learnt (Note [Autograd metadata
    // of checkpointed micro-batches]); never with cached casts (Note [Autocast regions in
    // workers and recomputation]).
    at::AutoGradMode grad_mode(state_->learning);
    AutocastCacheOff no_cast_cache;
    FlagScope checkpointing(checkpointing_flag);
    CheckpointFrame frame(state_.get(), /*recomputing=*/false);
    out = state_->function(state_->input);
  }
  if (internal::rng_unchanged(state_->rng)) {
    // The partition drew no random number (and no other thread did meanwhile): the recomputation
    // has nothing to replay, and saves and restores nothing.
    state_->rng = internal::RngState{};
  }
  if (state_->learning) {
    for (const at::Tensor& t : out.values()) {
      state_->learnt.outputs.push_back(t.defined() && t.requires_grad());
    }
    state_->known = std::make_shared<const GradRecord::Entry>(std::move(state_->learnt));
    state_->record->put(state_->key, state_->known);
    state_->learning = false;
  }
  auto node = std::shared_ptr<CheckpointBackward>(new CheckpointBackward(state_),
                                                  torch::autograd::deleteNode);
  // The edges of the inputs, then of the skips popped from other partitions.
  std::vector<at::Tensor> inputs = state_->input.values();
  for (const auto& popped : state_->popped) {
    inputs.push_back(popped.second.get());
  }
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  state_->node = node;
  for (const auto k : c10::irange(out.size())) {
    at::Tensor& t = out[k];
    const std::vector<bool>& needs = state_->entry().outputs;
    const bool needs_grad = k < needs.size() ? needs[k] : true;
    if (t.defined() && t.is_floating_point() && needs_grad) {
      t = internal::detached(t);
      torch::autograd::set_history(t, node);
    } else {
      t = internal::detached(t);
      node->add_input_metadata(Node::undefined_input());
    }
  }
  state_->outputs_count = out.size();
  for (auto& pending : state_->pending_stashes) {
    at::Tensor t = internal::detached(std::get<1>(pending));
    torch::autograd::set_history(t, node);
    state_->stash_inputs.push_back(std::get<0>(pending));
    std::get<2>(pending)(std::move(t));
  }
  state_->pending_stashes.clear();
  return out;
}

void Checkpointing::recompute(Batch& output) {
  // Nothing to overlap without streams: CheckpointBackward recomputes (Note [Checkpoint and
  // recompute] in checkpoint.h).
  if (!internal::has_streams(state_->device)) return;
  const int64_t lane = output.lane();
  if (lane < 0 || !output[lane].requires_grad()) {
    return;
  }
  auto node = std::shared_ptr<RecomputeBackward>(new RecomputeBackward(state_),
                                                 torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(output[lane]));
  at::Tensor lane_tensor = internal::detached(output[lane]);
  torch::autograd::set_history(lane_tensor, node);
  output[lane] = std::move(lane_tensor);
}

}  // namespace gpipe
