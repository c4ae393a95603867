// Copies between devices and waits between streams, as autograd-aware operations: the same copy
// or wait happens in reverse for the gradients in backward.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

namespace gpipe {
namespace internal {

// Note [Copy streams]
// ~~~~~~~~~~~~~~~~~~~
// Activations move between partitions on copy streams, not on the compute streams, so a copy can
// overlap with computation on both devices. Each device has one copy stream per micro-batch index.
// The order of events for micro-batch i going from partition j-1 to partition j:
//
//   compute stream j-1 --(wait)--> copy stream [j-1][i] --copy--> copy stream [j][i]
//                                                                   --(wait)--> compute stream j
//
// Both sides of the copy record their stream on the tensors (record_stream), so the caching
// allocator keeps the memory until the copy has finished. In backward the gradients make the same
// trip in reverse. On CPU streams are no-ops, and a copy to the same device is no copy at all.

/// Copies `tensors` to `next`'s device with `prev` and `next` current; gradients are copied back
/// to `prev`'s device in backward. Tensors already on `next`'s device are passed through as they
/// are when neither stream is a real stream (CPU).
std::vector<at::Tensor> copy(std::vector<at::Tensor> tensors, const c10::Stream& prev,
                             const c10::Stream& next);

/// Makes `next` wait for `prev` and returns `tensors` unchanged; in backward `prev` waits for
/// `next` before the gradients go on. No-op (and no autograd node) between CPU streams.
std::vector<at::Tensor> wait(std::vector<at::Tensor> tensors, const c10::Stream& prev,
                             const c10::Stream& next);

/// `tensors` (detached, same data) behind one autograd node of their own that passes their
/// gradients through; tensors that need no gradient, and all without grad mode, are returned as
/// they are. For a hand-over between threads (Note [Links that keep the graph] in link.h).
std::vector<at::Tensor> pass(std::vector<at::Tensor> tensors);

}  // namespace internal
}  // namespace gpipe
