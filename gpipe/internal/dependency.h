// Dependencies: fork and join add an edge to the autograd graph between two otherwise unrelated
// tensors, so that backward runs in the order GPipe needs without a hand-written backward loop.
#pragma once

#include <utility>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

namespace gpipe {
namespace internal {

// Note [Phony]
// ~~~~~~~~~~~~
// A phony is an empty tensor (no elements, no memory) that exists only to carry an autograd edge.
// Each phony is a fresh tensor object: autograd history is attached to the tensor object, so a
// shared cached one could not be used.

/// An empty tensor on `options`' device to carry an autograd edge; see Note [Phony].
at::Tensor make_phony(const at::TensorOptions& options);

// Note [Detaching without the dispatcher]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The engine's plumbing cuts a tensor from its history on every task: fork and join, a
// checkpoint's outputs, its recomputation's leaves. Tensor::detach() makes a shallow copy of the
// tensor's implementation that shares its storage and version counter, has no autograd metadata
// and refuses metadata changes (resize_, set_) — but it gets there through the dispatcher: the
// autograd kernel's RecordFunction, the ADInplaceOrView kernel, which wraps the native kernel's
// shallow copy in a second one. detached() makes that one copy directly, with the same
// properties: about a fifth of detach()'s instructions (benchmarks/overhead, counted under
// callgrind), a tenth of a checkpointed task's overhead. What it does not do is what the plumbing
// does not want: a profiler sees no aten::detach, and a tensor subclass that intercepts detach
// (a Python mode, functionalization) is not asked; the layers' own code keeps detach().

/// `x` without autograd history: what `x.detach()` returns (same storage and version counter,
/// metadata changes refused), made without the dispatcher; see Note [Detaching without the
/// dispatcher]. Undefined for an undefined `x`.
at::Tensor detached(const at::Tensor& x);

/// An autograd node that passes its first input's gradient through unchanged, after `before_pass`,
/// and gives its other inputs (phonies) nothing. fork() of a tensor that such a node produced, as
/// its only output so far, adds the phony to that node instead of making a node of its own: one
/// node less per task when a checkpointed task's RecomputeBackward is followed by a dependency
/// (Note [Backward order] in executor.h).
struct PassBackward : torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;

 protected:
  /// Runs once all inputs have their gradients, before the first one is passed on.
  virtual void before_pass() {}
};

/// An autograd node whose backward gives nothing to the inputs added after it was made, and
/// waits for them: fork() of one of its outputs adds the phony to it as one more input instead of
/// making a ForkBackward. A checkpointed task's CheckpointBackward on a device without streams
/// (Note [Checkpoint and recompute] in checkpoint.h): one node fewer per task.
class TakesPhonies {
 public:
  virtual ~TakesPhonies() = default;
  /// Whether it takes them now. No for a node that other threads make edges to (a checkpoint whose
  /// stashed skips later partitions pop): the edge from the next micro-batch would write to it
  /// beside them (Node::topological_nr; Note [Links that keep the graph] in link.h).
  virtual bool takes_phonies() const = 0;
};

/// Returns `(x', phony)`: `x'` is `x` (detached, same data) and `phony` an empty tensor, both
/// produced by one autograd node (`x` itself and a phony added to its node when that node is a
/// PassBackward with one output, or TakesPhonies). The node runs in backward only after both
/// outputs have their gradients, so whatever `phony` is joined into must finish its backward
/// first.
/// Without grad mode, or when `x` needs no gradient, returns `x` itself and a phony with no
/// history.
std::pair<at::Tensor, at::Tensor> fork(const at::Tensor& x);

/// Returns `x` (detached, same data) made to depend on `phony`: in backward, the gradient of the
/// result flows to `x` and an (empty) gradient to `phony`. Without grad mode, or when neither
/// needs a gradient, returns `x` itself.
at::Tensor join(const at::Tensor& x, const at::Tensor& phony);

/// Makes the backward of `before` wait until `after`'s backward reached this point:
/// `before = fork(before); after = join(after, phony)`. Used for the micro-batch order of backward.
void depend(at::Tensor& before, at::Tensor& after);

}  // namespace internal
}  // namespace gpipe
