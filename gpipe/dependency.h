// Dependencies: fork and join add an edge to the autograd graph between two otherwise unrelated
// tensors, so that backward runs in the order GPipe needs without a hand-written backward loop.
#pragma once

#include <utility>

#include <ATen/core/Tensor.h>

namespace gpipe {

// Note [Phony]
// ~~~~~~~~~~~~
// A phony is an empty tensor (no elements, no memory) that exists only to carry an autograd edge.
// Each phony is a fresh tensor object: autograd history is attached to the tensor object, so a
// shared cached one could not be used.

/// An empty tensor on `options`' device to carry an autograd edge; see Note [Phony].
at::Tensor make_phony(const at::TensorOptions& options);

/// Returns `(x', phony)`: `x'` is `x` (detached, same data) and `phony` an empty tensor, both
/// produced by one autograd node. The node runs in backward only after both outputs have their
/// gradients, so whatever `phony` is joined into must finish its backward first.
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

}  // namespace gpipe
