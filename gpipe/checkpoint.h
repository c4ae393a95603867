// Checkpointing: a partition's forward for one micro-batch runs without keeping activations, and
// is recomputed during backward, trading compute for memory.
#pragma once

#include <functional>
#include <memory>

#include <c10/core/Device.h>

#include "gpipe/microbatch.h"
#include "gpipe/skippable.h"

namespace gpipe {

/// True while a checkpointed partition runs its first, activation-free forward. Thread-local:
/// meant for layers with side effects.
///
///   if (!gpipe::is_checkpointing() && !gpipe::is_recomputing()) ++calls;
bool is_checkpointing();

/// True while a checkpointed partition is recomputed during backward. Thread-local: a layer can
/// skip side effects (counters, statistics) that already happened in the first forward.
bool is_recomputing();

// Note [Checkpoint and recompute]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpointed task runs its partition under no-grad (is_checkpointing() is true) and gives the
// outputs a CheckpointBackward node whose next edges are the inputs'. Only the inputs are kept.
// After the task, the main thread inserts a RecomputeBackward node beside the output's lane:
//
//   output --fork--> output' --join--> next partition
//             \--phony--> RecomputeBackward --phony--/
//
// In backward the join hands the gradient both to the fork and to RecomputeBackward; the fork's
// node (and so CheckpointBackward behind it) runs only after RecomputeBackward has run. So the
// recomputation starts as soon as the gradient reaches this partition, in parallel with the
// gradient's copy, and not when CheckpointBackward finally needs it (the Python reference's
// reason for not using a plain checkpoint function). RecomputeBackward reruns the partition with
// grad enabled on detached copies of the inputs, restoring the random generator state saved at
// the first forward (dropout masks are identical) and the caller's thread state (see Note
// [Thread-local state in workers]); CheckpointBackward then runs backward through the recomputed
// graph, which accumulates the parameters' gradients, and returns the inputs' gradients.

/// A checkpointed task's view of the skips that cross it (see Note [Skips and checkpointing] in
/// skip_tracker.h): present on the thread running a checkpoint's first forward or its
/// recomputation, null elsewhere.
class CheckpointFrame {
 public:
  /// The frame of the checkpoint running on this thread, or null.
  static CheckpointFrame* current();

  /// Whether this is the recomputation (else the first forward).
  bool recomputing() const { return recomputing_; }

  /// First forward: `tensor`, popped from another partition, becomes an extra input of the
  /// checkpoint.
  void add_popped(const SkipKey& key, at::Tensor tensor);

  /// Recomputation: the leaf standing for what the first forward popped under `key`.
  at::Tensor popped_leaf(const SkipKey& key);

  /// Recomputation: `tensor` was stashed again, with history; `grad` gives the gradient that the
  /// popping side caught for it (or an undefined tensor).
  void add_restashed(at::Tensor tensor, std::function<at::Tensor()> grad);

  struct State;
  CheckpointFrame(State* state, bool recomputing);
  ~CheckpointFrame();
  CheckpointFrame(const CheckpointFrame&) = delete;
  CheckpointFrame& operator=(const CheckpointFrame&) = delete;

 private:
  State* state_;
  bool recomputing_;
  CheckpointFrame* previous_;
};

/// Runs a function on a micro-batch with checkpointing; one object per (micro-batch, partition).
///
///   gpipe::Checkpointing cp(fn, batch, device);
///   gpipe::Batch out = cp.checkpoint();  // on the worker
///   cp.recompute(out);                   // on the main thread, after the task
class Checkpointing {
 public:
  using Function = std::function<Batch(const Batch&)>;

  Checkpointing(Function function, Batch input, c10::Device device);

  /// Runs the function without recording activations; the outputs carry CheckpointBackward.
  Batch checkpoint();

  /// Wires recomputation into the autograd graph beside `output`'s lane (see the Note).
  void recompute(Batch& output);

  using State = CheckpointFrame::State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace gpipe
