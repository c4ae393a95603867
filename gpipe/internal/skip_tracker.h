// Skip trackers: where stashed tensors wait for their pop. Outside a GPipe a thread-local map
// holds them; in a GPipe each micro-batch has its own tracker, which the pipeline also uses to
// move each stashed tensor to its popping partition's device in one copy.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include "gpipe/microbatch.h"
#include "gpipe/skip_layout.h"
#include "gpipe/skippable.h"

namespace gpipe {
namespace internal {

/// A tensor held on behalf of a skip connection, counted by live_skip_tensors() while defined.
class SkipTensor {
 public:
  SkipTensor() = default;
  explicit SkipTensor(at::Tensor t) { set(std::move(t)); }
  ~SkipTensor() { reset(); }
  SkipTensor(SkipTensor&& o) noexcept : tensor_(o.take()) { count(tensor_, +1); }
  SkipTensor& operator=(SkipTensor&& o) noexcept {
    set(o.take());
    return *this;
  }
  SkipTensor(const SkipTensor&) = delete;
  SkipTensor& operator=(const SkipTensor&) = delete;

  void set(at::Tensor t) {
    reset();
    tensor_ = std::move(t);
    count(tensor_, +1);
  }
  /// Gives the tensor up (the holder is then empty).
  at::Tensor take() {
    count(tensor_, -1);
    return std::move(tensor_);
  }
  void reset() { take(); }
  const at::Tensor& get() const { return tensor_; }

 private:
  static void count(const at::Tensor& t, int64_t delta);
  at::Tensor tensor_;
};

/// Where gpipe::stash puts tensors and gpipe::pop takes them from.
class SkipTracker {
 public:
  virtual ~SkipTracker() = default;
  virtual void stash(const SkipKey& key, at::Tensor tensor) = 0;
  virtual at::Tensor pop(const SkipKey& key) = 0;
};

/// A skip that crosses partitions, for one micro-batch.
struct SkipSlot {
  bool stashed = false;
  SkipTensor tensor;  // from the stash until the pop
  /// On a GPU, the fence's copy before the popping compute stream's wait, until the pop or the
  /// cut (Note [Skip copy streams] in skip_tracker.cc).
  at::Tensor copied;
};

// Note [Skips and checkpointing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A skip from partition a to partition b of micro-batch i is stashed during task (i, a), copied
// from a's device to b's by the fence of (i, b) on the two copy streams, and popped during task
// (i, b). The partitions in between never see it. When task (i, a) runs with autograd, the copy
// keeps the history, and the skip's gradient flows straight back to the stashing layer.
//
// Checkpointing breaks that in two places, and the tracker repairs both with the checkpoint's
// help (checkpoint.h, CheckpointFrame):
//  - A checkpointed pop side: task (i, b) runs without grad and is recomputed later. Each tensor
//    it pops becomes an extra input of the checkpoint: the recomputation pops a detached leaf
//    instead, and the checkpoint's backward returns the leaf's gradient along the popped tensor's
//    history.
//  - A checkpointed stash side: task (i, a) stashes a tensor without history, so nothing would
//    carry the skip's gradient back. When the plain model's stashed tensor would need a gradient
//    (the partition's GradRecord says so: Note [Autograd metadata of checkpointed micro-batches]),
//    the checkpoint makes the stashed tensor an extra output of its CheckpointBackward node once
//    the first forward is done. The skip's gradient then arrives at that node as an input, and
//    the autograd engine runs the node only when all of its inputs' gradients, the outputs' and
//    the skips', are there: no lane dependency is needed, even when the partitions' main path
//    carries no gradient. The recomputation of (i, a) stashes the tensor again, with history; the
//    checkpoint's backward runs backward through it with that gradient, together with the
//    partition's outputs.

/// The skips of one micro-batch in a GPipe.
class MicroBatchSkips : public SkipTracker {
 public:
  explicit MicroBatchSkips(const SkipLayout* layout);

  void stash(const SkipKey& key, at::Tensor tensor) override;
  at::Tensor pop(const SkipKey& key) override;

  /// The fence of (microbatch, partition): copies every skip routed into `partition` from its
  /// stashing partition's copy stream to `partition`'s. Forward, the copy relies on the wait the
  /// pipeline made after the stashing task (stashing compute -> its copy stream) and waits for no
  /// later task; `partition`'s compute stream waits for the copy. Backward makes both waits, in
  /// reverse (Note [Skip copy streams] in skip_tracker.cc). Returns the stashing partition of
  /// each tensor moved.
  std::vector<int64_t> fence(int64_t microbatch, int64_t partition,
                             const std::vector<c10::Stream>& compute_streams,
                             const std::vector<std::vector<c10::Stream>>& copy_streams);

  /// A skip cut from its stashing partition's graph by cut().
  struct Cut {
    int64_t from = 0;  // the stashing partition
    at::Tensor tensor;  // as stashed (and moved by the fence), with its history
    at::Tensor leaf;    // what the popping partition pops instead
    /// Where the popping partition is on a GPU: `tensor` before the fence's wait, whose backward
    /// the popping partition's backward does itself (Note [Skip copy streams]); else undefined.
    at::Tensor copied;
  };
  /// Cuts every skip routed into `partition` (after its fence) that requires grad: the popping
  /// partition then pops `replace(stashing partition, tensor)` — by default a detached leaf, for a
  /// stage-local forward() a tensor behind a Handoff — so that its backward, run as an engine call
  /// of its own, stops there and leaves the gradient for the stashing partition's backward (Note
  /// [Partitions within a stage] in gpipe/distributed/pipeline_stage.h; Note [Stage-local
  /// backward in one process]).
  std::vector<Cut> cut(
      int64_t partition,
      const std::function<at::Tensor(int64_t from, const at::Tensor& tensor)>& replace = nullptr);

  /// Drops every tensor still held, after a forward failed: an unpopped skip of a checkpointed
  /// stash would otherwise keep its micro-batch's graph alive through a reference cycle.
  void clear();

 private:
  const SkipLayout* layout_;
  std::map<SkipKey, std::shared_ptr<SkipSlot>> slots_;  // crossing skips, made up front
  std::map<SkipKey, SkipTensor> local_;                 // skips within one partition
};

/// Which micro-batch a task computes and where its skips go; installed on the thread that runs
/// the task (and again for its recomputation).
struct TaskContext {
  std::shared_ptr<SkipTracker> skips;  // null: the thread's default tracker
  MicroBatch microbatch;
  // Set by current_microbatch() when given: a layer may keep tensors in its own map (Note
  // [current_microbatch and checkpointing]).
  std::shared_ptr<bool> microbatch_asked;
};

/// Installs a TaskContext for a scope.
class TaskScope {
 public:
  explicit TaskScope(const TaskContext& context);
  ~TaskScope();
  TaskScope(const TaskScope&) = delete;
  TaskScope& operator=(const TaskScope&) = delete;

 private:
  const TaskContext* previous_;
};

// Note [current_microbatch and checkpointing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// current_microbatch() names the micro-batch a layer is computing: the same key in a checkpointed
// micro-batch's first forward and in its recomputation, a new key in every GPipe forward. The
// Python reference had such a function and removed it because its map-keyed-by-micro-batch
// pattern ("saved[key] = x" in one layer, "x + saved[key]" in a later one) is wrong under
// checkpointing. That is still so: in a checkpointed micro-batch the first forward runs without
// autograd, so the tensor the later layer reads has no history and no gradient reaches the
// stashing layer; the recomputation stores a second tensor that nothing reads. The pattern gives
// the plain model's outputs and gradients when the stashing layer's micro-batch is not
// checkpointed: with Checkpoint::kNever, for the last micro-batch under kExceptLast, in eval mode
// and without grad. Everywhere else use gpipe::stash and gpipe::pop, which handle checkpointing
// (Note [Skips and checkpointing]). Layers can test is_checkpointing() and is_recomputing() to
// avoid storing twice.
//
// Under step() (and PipelineStage) each partition's input is cut from the graph before it, so the
// saved tensor must be read in the partition that saved it. A micro-batch whose forward asked for
// current_microbatch() is not split by layer for the zero-bubble schedules' weight gradients
// (Note [One executor]): a tensor saved inside one layer and read by a later one would tie their
// backwards together, as a skip does.

/// The tracker gpipe::stash and gpipe::pop use on this thread: the running task's, or else the
/// thread's default one (a plain map, for skippable layers outside a GPipe).
SkipTracker& current_skip_tracker();

/// The run id for a new GPipe forward (never 0).
uint64_t next_run_id();

}  // namespace internal
}  // namespace gpipe
