// Checkpointing; see Note [Checkpoint and recompute] in checkpoint.h.
#include "gpipe/checkpoint.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "gpipe/dependency.h"
#include "gpipe/stream.h"
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
  explicit RngReplay(const RngState& saved) : current_(get_rng_state(saved.device)) {
    set_rng_state(saved);
  }
  ~RngReplay() { set_rng_state(current_); }

 private:
  RngState current_;
};

}  // namespace

bool is_checkpointing() { return checkpointing_flag; }
bool is_recomputing() { return recomputing_flag; }

struct Checkpointing::State {
  State(Function function, Batch input, c10::Device device)
      : function(std::move(function)), input(std::move(input)), device(device) {}

  Function function;
  Batch input;
  c10::Device device;
  RngState rng;
  std::unique_ptr<ThreadState> thread_state;

  // Set by RecomputeBackward, used by CheckpointBackward.
  bool recomputed = false;
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> leaves;

  void release() {
    input = Batch(std::vector<at::Tensor>{});
    outputs.clear();
    leaves.clear();
  }
};

namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;
using State = Checkpointing::State;

struct CheckpointBackward : Node {
  explicit CheckpointBackward(std::shared_ptr<State> state) : state(std::move(state)) {}
  std::string name() const override { return "gpipe::CheckpointBackward"; }
  void release_variables() override { state.reset(); }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(state, "gpipe: the backward of a checkpointed micro-batch ran twice; "
                "retain_graph is not supported with checkpointing");
    TORCH_CHECK(state->recomputed, "gpipe: internal error: a checkpointed micro-batch reached its "
                "backward before it was recomputed");
    std::vector<at::Tensor> outputs;
    std::vector<at::Tensor> output_grads;
    for (const auto k : c10::irange(state->outputs.size())) {
      const at::Tensor& out = state->outputs[k];
      if (out.defined() && out.requires_grad() && k < grads.size() && grads[k].defined()) {
        outputs.push_back(out);
        output_grads.push_back(grads[k]);
      }
    }
    if (!outputs.empty()) {
      torch::autograd::backward(outputs, output_grads);
    }
    variable_list input_grads;
    input_grads.reserve(state->leaves.size());
    for (const at::Tensor& leaf : state->leaves) {
      input_grads.push_back(leaf.defined() && leaf.requires_grad() ? leaf.grad() : at::Tensor());
    }
    state->release();
    state.reset();
    return input_grads;
  }

  std::shared_ptr<State> state;
};

struct RecomputeBackward : Node {
  explicit RecomputeBackward(std::shared_ptr<State> state) : state(std::move(state)) {}
  std::string name() const override { return "gpipe::RecomputeBackward"; }
  void release_variables() override { state.reset(); }

  variable_list apply(variable_list&& /*grads*/) override {
    TORCH_CHECK(state, "gpipe: a checkpointed micro-batch was recomputed twice; retain_graph is "
                "not supported with checkpointing");
    std::vector<at::Tensor> leaves;
    leaves.reserve(state->input.size());
    for (const at::Tensor& x : state->input.values()) {
      if (!x.defined()) {
        leaves.emplace_back();
        continue;
      }
      at::Tensor leaf = x.detach();
      leaf.set_requires_grad(x.requires_grad());
      leaves.push_back(std::move(leaf));
    }
    Batch leaf_batch = state->input.atomic() ? Batch(leaves[0]) : Batch(leaves);
    Batch out(std::vector<at::Tensor>{});
    {
      ThreadStateGuard thread_state(*state->thread_state);
      at::AutoGradMode grad(true);
      RngReplay replay(state->rng);
      FlagScope recomputing(recomputing_flag);
      out = state->function(leaf_batch);
    }
    state->outputs = std::move(out.values());
    state->leaves = std::move(leaves);
    state->recomputed = true;
    state.reset();
    return {at::Tensor()};
  }

  std::shared_ptr<State> state;
};

}  // namespace

Checkpointing::Checkpointing(Function function, Batch input, c10::Device device)
    : state_(std::make_shared<State>(std::move(function), std::move(input), device)) {}

Batch Checkpointing::checkpoint() {
  state_->rng = get_rng_state(state_->device);
  state_->thread_state = std::make_unique<ThreadState>();
  Batch out(std::vector<at::Tensor>{});
  {
    at::NoGradGuard no_grad;
    FlagScope checkpointing(checkpointing_flag);
    out = state_->function(state_->input);
  }
  auto node = std::shared_ptr<CheckpointBackward>(new CheckpointBackward(state_),
                                                  torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(state_->input.values()));
  for (at::Tensor& t : out.values()) {
    if (t.defined() && t.is_floating_point()) {
      t = t.detach();
      torch::autograd::set_history(t, node);
    } else {
      node->add_input_metadata(Node::undefined_input());
    }
  }
  return out;
}

void Checkpointing::recompute(Batch& output) {
  const int64_t lane = output.lane();
  if (lane < 0 || !output[lane].requires_grad()) {
    return;
  }
  auto forked = fork(output[lane]);
  auto node = std::shared_ptr<RecomputeBackward>(new RecomputeBackward(state_),
                                                 torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(forked.second));
  at::Tensor phony = make_phony(output[lane].options());
  torch::autograd::set_history(phony, node);
  output[lane] = join(forked.first, phony);
}

}  // namespace gpipe
