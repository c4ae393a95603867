// Stage-local backward for CPU partitions: each partition's backward of each micro-batch runs on
// that partition's own worker thread, so that CPU partitions overlap in backward as they do in
// forward.
#pragma once

#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "gpipe/microbatch.h"
#include "gpipe/worker.h"

namespace torch {
namespace autograd {
struct Edge;
struct Node;
}  // namespace autograd
}  // namespace torch

namespace gpipe {
namespace internal {

// Note [Stage-local backward in one process]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// LibTorch's autograd engine runs every CPU node of a backward on the thread that called
// backward(): the partitions of a CPU pipeline, which overlap in forward on their threads, would
// run their backward one after the other. So where every partition is on the CPU with a thread
// of its own (the engine's decision, Note [Threads of forward()] in worker.h), each runs its own
// backward there. Where a micro-batch enters a partition, and where it leaves the last one, the
// tensors that cross get a Handoff node whose next edges are those of the tensors it replaces:
// the graph stays one, and a backward that is not plain — torch::autograd::grad, backward() with
// inputs (both give the engine a non-empty exec info), create_graph (grad mode on inside the
// backward) — passes through every Handoff and runs as without them, on the calling thread,
// exactly as LibTorch runs any graph. A plain backward() cuts the graph at the Handoffs where
// that is exact (Note [Where a backward may cut] in stage_backward.cc): the first Handoff it
// meets takes every Handoff's next edges away, and each Handoff returns no gradient (the engine
// runs a node's next functions only through the gradients it returns) and hands the gradients it
// got to partition j's thread, which runs autograd's backward from partition j's outputs for
// micro-batch i — an engine call of its own, with the same retain_graph — and so meets the
// Handoff in front of partition j, and so on. With retain_graph the Handoffs get their edges back
// when the backward ends, so that the next backward, of either kind, finds the one graph again.
// Only defined gradients are handed on: where the one graph would pass an undefined gradient,
// nothing runs, and the parameters behind it keep no gradient. The first partition runs on the
// calling thread (Note [Workers and the calling thread]); its backwards run there too, in the
// callback below. Partition j's backward of micro-batch i then overlaps partition j+1's of
// micro-batch i-1, as in GPipe's schedule. The order within a partition is the order in which
// its gradients arrive (its thread's queue), so the pipeline adds no fork/join edges between
// micro-batches in this mode (Note [Backward order]): an edge into another micro-batch's graph
// would make one engine call run nodes that belong to another. The first Handoff the user's
// backward meets queues an end-of-backward callback that waits for every handed-off backward
// (running those of partitions that run on the calling thread itself) and rethrows the first
// error, so backward() returns with every gradient final, as without the mode. From that first
// Handoff to the callback the partitions' backwards share the cores as a step's lanes do (Note
// [Dividing the cores] in worker.h): without it each would start every core's worth of OpenBLAS
// threads, and they spun against each other (2.3-3.4x slower on two vCPUs, docs/benchmarks.md).
// The check walks the graph the user's backward found once, on the calling thread: a cost of
// the graph's size, as the engine's own walk, which a checkpointed micro-batch keeps small.
//
// A skip from partition a to a later partition b gets a Handoff too (MicroBatchSkips::cut, at b's
// fence): b pops the tensor behind a Handoff of its own. Partition a's backward of micro-batch i
// waits for every Handoff that leads to it — behind its outputs and behind each of its skips that
// needs a gradient — and then starts from all of them in one engine call, as the single graph
// would: a checkpointed stash's recomputation gets its outputs' and its skips' gradients at once.
// A Handoff that no gradient reaches (a skip the loss does not depend on) is not waited for: a
// Handoff in partition b's graph can be reached only by b's backward of its micro-batch, so when
// that has run without reaching it, the join stops waiting for it; and when nothing else is left,
// the end-of-backward callback starts what has arrived.
//
// Not for an input with a history (layers before the GPipe): the first partition's backward of
// each micro-batch would run into that graph, which runs only once; such a forward keeps the one
// graph without Handoffs, as does a forward in eval mode or without grad.
//
// Note [A failed backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// When the user's backward fails after it has handed gradients off (a hook or node of its own
// graph throws once the Handoffs behind the last partition have run), the engine raises the
// error without running the end-of-backward callback. Left alone, the handed-off backwards would
// go on on the workers beside the user's next steps (adding to gradients the user is zeroing),
// and the backwards waiting for the calling thread, and the partial joins, would hold their
// graphs — which hold the Handoffs, which hold this object — forever. So the callback is queued
// with queue_end_of_backward, and when the engine drops it, cancel() runs in its place (Note [A
// callback the failed backward drops] in end_of_backward.h: for a CPU graph, on the calling
// thread before the error reaches the user): queued and partial backwards are dropped, none
// starts any more, and it waits for those running on workers. So when backward() throws, no
// partition's backward runs or holds a graph any more. (Nodes of the failed backward that the
// engine had queued but not run stay in the calling thread's ready queue until its next
// backward, as for any graph.)

struct Handoff;

/// The handed-off backwards of one forward (one per GPipe forward in this mode).
class StageBackward : public std::enable_shared_from_this<StageBackward> {
 public:
  /// For the backwards of `partitions` CPU partitions, run on `workers`.
  StageBackward(std::shared_ptr<WorkerPool> workers, int64_t partitions)
      : workers_(std::move(workers)), partitions_(partitions) {}

  /// Puts a Handoff in front of `batch` (micro-batch `microbatch`, just computed by partition
  /// `partition`) for the next partition, or, with `last`, for the caller's own backward: its
  /// tensors that require grad become outputs of the node, whose backward hands their gradients
  /// to `partition`'s worker.
  void hand_off(Batch& batch, size_t partition, int64_t microbatch, bool last = false);
  /// The same for a skip that `partition` stashed for micro-batch `microbatch`, at the fence of
  /// its popping partition `popping`: returns what that partition pops instead of `tensor`
  /// (detached, behind a Handoff whose gradient joins `partition`'s backward of the micro-batch).
  at::Tensor hand_off_skip(const at::Tensor& tensor, size_t partition, int64_t microbatch,
                           size_t popping);

  // For the Handoff node `id`: the gradients of `roots`, for `partition`'s backward of
  // `microbatch`, which starts once every Handoff leading to it has arrived or cannot (and keeps
  // its graph where a backward that handed off did).
  void arrive(int64_t id, size_t partition, int64_t microbatch, std::vector<at::Tensor> roots,
              std::vector<at::Tensor> grads, bool keep_graph);
  // Queues the end-of-backward callback, once per backward; returns whether this backward cuts
  // at the Handoffs (Note [Where a backward may cut] in stage_backward.cc), which `meeting`, the
  // first Handoff it reached, decides.
  bool queue_callback_once(const torch::autograd::Node* meeting);
  // For a Handoff that is destroyed.
  void forget(const torch::autograd::Node* handoff);

 private:
  using Key = std::pair<size_t, int64_t>;  // partition, micro-batch
  // Handoffs and the edges a cut took from them, while a backward that keeps its graph runs.
  using CutEdges = std::vector<
      std::pair<std::shared_ptr<torch::autograd::Node>, std::vector<torch::autograd::Edge>>>;
  // The roots and gradients that have arrived for one backward of a partition.
  struct Join {
    int64_t arrived = 0;
    int64_t missed = 0;  // Handoffs that this backward's jobs passed by
    std::vector<at::Tensor> roots, grads;
    bool keep_graph = false;  // retain_graph
  };
  int64_t add_handoff(const Key& target, const Key* reached_by);
  void remember(Handoff* handoff);
  bool cuts_safely(const torch::autograd::Node* meeting) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void restore_edges(CutEdges cut);
  // The joins that the end of job `key` completes (its Handoffs that did not arrive will not).
  std::vector<std::pair<Key, Join>> job_done(const Key& key);
  void submit(const Key& key, std::function<void()> job);
  void start(const Key& key, Join join);
  void start_or_record(const Key& key, Join join);  // an error that start() raises goes to error_
  void finish();  // the end-of-backward callback
  void cancel();  // the end of a backward that failed before its callback ran

  // The GPipe's, not held: its threads end with it (a worker that held the last reference would
  // have its pool destroyed on another thread, later). A backward after the GPipe is gone, or
  // while it is destroyed, runs what is left on the calling thread.
  std::weak_ptr<WorkerPool> workers_;
  const int64_t partitions_;
  absl::Mutex mu_;
  // The cores divided among the partitions while a backward runs (Note [Dividing the cores] in
  // worker.h): from the first Handoff the caller's backward meets to the end-of-backward callback
  // (or the cancellation that replaces it). Each job runs as one lane of it.
  std::shared_ptr<const internal::CoreShare> cores_ ABSL_GUARDED_BY(mu_);
  int64_t pending_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::function<void()>> inline_jobs_ ABSL_GUARDED_BY(mu_);
  std::exception_ptr error_ ABSL_GUARDED_BY(mu_);
  bool callback_queued_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // while cancel() waits: start nothing
  std::map<Key, int64_t> expected_ ABSL_GUARDED_BY(mu_);  // Handoffs leading to each backward
  std::map<Key, Join> joins_ ABSL_GUARDED_BY(mu_);        // those that have arrived
  // The Handoffs in each job's graph (id, the backward each leads to), and those that arrived in
  // this backward.
  std::map<Key, std::vector<std::pair<int64_t, Key>>> in_graph_of_ ABSL_GUARDED_BY(mu_);
  std::set<int64_t> arrived_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  // This forward's Handoffs that are alive, whether the running backward cuts at them, and what
  // the cut took from them where the graph is kept (they get it back when the backward ends).
  std::unordered_map<const torch::autograd::Node*, Handoff*> handoffs_ ABSL_GUARDED_BY(mu_);
  bool cut_ ABSL_GUARDED_BY(mu_) = true;
  CutEdges cut_edges_ ABSL_GUARDED_BY(mu_);
};

/// For tests: how many backwards in this process have cut at the Handoffs.
int64_t cut_backwards();

}  // namespace internal
}  // namespace gpipe
