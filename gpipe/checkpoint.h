// Checkpointing: a partition's forward for one micro-batch runs without keeping activations, and
// is recomputed during backward, trading compute for memory.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include <c10/core/Device.h>

#include "absl/synchronization/mutex.h"
#include "gpipe/microbatch.h"
#include "gpipe/skippable.h"
#include "gpipe/thread_state.h"
#include "gpipe/timeline.h"

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
// After the task, the main thread puts a RecomputeBackward node on the output's lane, after the
// stream wait and before the copy to the next partition:
//
//   CheckpointBackward <- output <- RecomputeBackward <- output' -> (copy) -> next partition
//
// In backward the lane's gradient reaches RecomputeBackward first; it reruns the partition and
// then passes the gradient on, so CheckpointBackward always finds the recomputed graph. The
// recomputation starts as soon as the gradient reaches this partition: on CUDA its kernels are
// queued on the compute stream before the wait for the gradient's copy, so they overlap the copy
// (the Python reference's reason for not using a plain checkpoint function; it puts the node on a
// fork and a join of the lane instead — two more autograd nodes per task for the same order, which
// cost 5–7 µs per task on the CPU, see docs/journal/2026-11-23-benchmarks.md, "checkpointing
// with four autograd nodes fewer per task"). RecomputeBackward reruns the partition
// with grad enabled on detached copies of the inputs, restoring the random generator state saved
// at the first forward (dropout masks are identical) and the caller's thread state (see Note
// [Thread-local state in workers]); CheckpointBackward then runs backward through the recomputed
// graph, which accumulates the parameters' gradients, and returns the inputs' gradients. When the
// loss does not depend on the lane, CheckpointBackward recomputes by itself. On a device without
// streams (the CPU) there is no copy to overlap, and the recomputation runs on the thread that
// runs the backward either way: recompute() adds no node there, CheckpointBackward recomputes when
// it runs, and the dependency on the next micro-batch (Note [Backward order] in executor.h) is one
// more input of CheckpointBackward (TakesPhonies in dependency.h) — one node fewer per task.

// Note [Autograd metadata of checkpointed micro-batches]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Without grad, a checkpointed forward cannot tell which outputs the plain model would give a
// gradient: a layer that detaches (or a frozen first partition) yields outputs that need none,
// and giving them the checkpoint's history anyway makes the model's output require grad where the
// plain model's does not (loss.backward() then silently does nothing instead of failing). So each
// partition keeps a GradRecord: for a key made of which inputs require grad and how many of the
// partition's parameters do, which outputs and which stashed skips require grad. When the key is
// not known yet, the checkpointed forward runs once with grad on (and its graph is dropped right
// after: the peak is one micro-batch's activations of one partition, as in its recomputation) and
// learns the entry; afterwards checkpointed forwards run without grad and give history only where
// the entry says so. A recomputation that finds otherwise (a layer that changed its mind) drops
// the entry, so the next forward learns it again.

/// What a partition's outputs and stashes need in autograd, by key (see Note [Autograd metadata
/// of checkpointed micro-batches]). Thread-safe.
class GradRecord {
 public:
  struct Entry {
    std::vector<bool> outputs;
    std::map<SkipKey, bool> stashes;
  };
  /// The entry for `key`, or null when there is none. Entries are shared, never changed.
  std::shared_ptr<const Entry> find(uint64_t key) const;
  void put(uint64_t key, std::shared_ptr<const Entry> entry);
  void drop(uint64_t key);

 private:
  mutable absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<const Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

/// A checkpointed task's view of the skips that cross it (see Note [Skips and checkpointing] in
/// internal/skip_tracker.h): present on the thread running a checkpoint's first forward or its
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

  /// First forward: `tensor` is stashed under `key`; returns it without history. When the plain
  /// model's tensor would require grad, the tensor becomes an extra output of the checkpoint once
  /// the forward is done, and `rehome` is called with that version (see Note [Skips and
  /// checkpointing] in internal/skip_tracker.h).
  at::Tensor stash_first_forward(const SkipKey& key, at::Tensor tensor,
                                 std::function<void(at::Tensor)> rehome);

  /// Recomputation: the leaf standing for what the first forward popped under `key`.
  at::Tensor popped_leaf(const SkipKey& key);

  /// Recomputation: `tensor` was stashed again under `key`, with history; it takes the gradient
  /// that reached the first forward's stash.
  void add_restashed(const SkipKey& key, at::Tensor tensor);

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
///   gpipe::Checkpointing cp(fn, batch, device, thread_state, record, params_key);
///   gpipe::Batch out = cp.checkpoint();  // on the worker
///   cp.recompute(out);                   // on the main thread, after the task
class Checkpointing {
 public:
  using Function = std::function<Batch(const Batch&)>;

  /// `thread_state` is the caller's, for the recomputation; `record` is the partition's and
  /// `params_key` says which of its parameters require grad (see Note [Autograd metadata of
  /// checkpointed micro-batches]).
  Checkpointing(Function function, Batch input, c10::Device device,
                std::shared_ptr<const ThreadState> thread_state, std::shared_ptr<GradRecord> record,
                uint64_t params_key);

  /// Makes this task's backward a dependency of `phony`'s node (a fork's phony, Note [Backward
  /// order] in internal/executor.h): CheckpointBackward gets the phony's edge, and no join is
  /// needed. After checkpoint() and before the outputs get nodes of their own (LibTorch 2.x refuses
  /// new edges on a node that already has a parent), on the thread that made the phony's node: an
  /// edge writes to its target (Node::topological_nr; Note [Links that keep the graph] in
  /// internal/link.h).
  void attach_dependency(const at::Tensor& phony);

  /// Records the recomputation and the backward of this task, (microbatch, partition), in
  /// `timeline` (TimelineEvent::Kind::kRecompute, kBackward).
  void record_to(std::shared_ptr<Timeline> timeline, int64_t microbatch, int64_t partition);

  /// Runs the function without recording activations; the outputs carry CheckpointBackward.
  Batch checkpoint();

  /// Wires recomputation into the autograd graph beside `output`'s lane (see the Note).
  void recompute(Batch& output);

  using State = CheckpointFrame::State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace gpipe
