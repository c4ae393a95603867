// Copies between devices and waits between streams, as autograd-aware operations: the same copy
// or wait happens in reverse for the gradients in backward.
#pragma once

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

namespace gpipe {
namespace internal {

struct StreamPoint;  // internal/stream.h

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
//
// A copy between the CPU and a GPU does not block the thread that issues it, as LibTorch's
// blocking to() would (it waits for the copy, and so, from a GPU, for all the work queued before
// it there): the sender's lane in forward, the thread of the gradient's device in backward, which
// would otherwise issue nothing more until the copy had landed; for a GPU's lane or the autograd
// engine's thread of a GPU, that leaves the GPU idle. From the CPU, the source is staged in
// pinned memory (copy_to_device) and copied without blocking; the GPU's compute stream waits for
// the copy as above, and LibTorch's pinned-memory allocator keeps the staged block until the copy
// has run. To the CPU, the copy lands in pinned memory and whoever reads it waits on the host: in
// forward the receiving partition (copy()'s `landed`, which GraphLink hands over with the
// tensors); in backward a node of its own in front of the CPU tensors, which runs on the CPU's
// thread once the gradient's copy is issued and waits there for it to land. Under anomaly
// detection, which reads every node's outputs at once on the thread's current stream, the host
// waits for a gradient's copy either way. The same copies serve step()'s links (Note [Links on
// copy streams] in link.h).

/// Whether a CPU tensor bound for a GPU is staged in pinned memory first (default true); false
/// copies from pageable memory, as LibTorch's to() does. For benchmarks; not for use while steps
/// run.
void set_pinned_staging(bool enabled);

/// `t` (detached) copied to `to` on the current streams: with `non_blocking`, without blocking the
/// host wherever the caller may reuse `t` at once. A strided CPU tensor bound for a GPU is staged
/// in a pinned block of its own first (contiguous: a strided one would be made contiguous in
/// pageable memory by the copy; an already pinned one may be the caller's, written again once the
/// call returns); with set_pinned_staging(false), one in pageable memory is staged by the driver
/// and a pinned one copied blocking. A copy to the CPU lands in pinned memory, which the host may
/// read only once the source's stream is past the copy.
at::Tensor copy_to_device(const at::Tensor& t, c10::Device to, bool non_blocking);

/// Copies `tensors` to `next`'s device with `prev` and `next` current; gradients are copied back
/// to `prev`'s device in backward. Tensors already on `next`'s device are passed through as they
/// are when neither stream is a real stream (CPU). A copy from a GPU to the CPU blocks the caller
/// unless `landed` is given: then *landed is set to the point on the GPU that the host must reach
/// (synchronize_point) before it reads the copies (null when nothing is to wait for).
std::vector<at::Tensor> copy(std::vector<at::Tensor> tensors, const c10::Stream& prev,
                             const c10::Stream& next,
                             std::shared_ptr<const StreamPoint>* landed = nullptr);

/// Makes `next` wait for `prev` and returns `tensors` unchanged, recorded on `next` (the caching
/// allocator keeps their memory until its work is done); in backward `prev` waits for `next`
/// before the gradients go on, recorded on `prev`. No-op (and no autograd node) between CPU
/// streams.
std::vector<at::Tensor> wait(std::vector<at::Tensor> tensors, const c10::Stream& prev,
                             const c10::Stream& next);

/// `tensors` (detached, same data) behind one autograd node of their own that passes their
/// gradients through; tensors that need no gradient, and all without grad mode, are returned as
/// they are. For a hand-over between threads (Note [Links that keep the graph] in link.h).
std::vector<at::Tensor> pass(std::vector<at::Tensor> tensors);

}  // namespace internal
}  // namespace gpipe
