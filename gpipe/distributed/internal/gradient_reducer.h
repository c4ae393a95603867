// The gradient reducer: averages parameters' gradients over the replicas of a data-parallel run
// with bucketed all-reduces that start during backward, as soon as a bucket's gradients are final.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "gpipe/distributed/process_group.h"
#include "gpipe/distributed/reduction_stats.h"

namespace gpipe {
namespace distributed {
namespace internal {

// Note [Buckets that start during backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Parameters are put in buckets of about `bucket_bytes`, in reverse order of registration (the
// last layers' gradients are computed first) and by device and dtype. A post-hook on each
// parameter's gradient accumulator (AccumulateGrad) counts the accumulations; when a parameter
// has had as many as in the last backward, its gradient is final, and when all of a bucket's
// are, the bucket is flattened, divided by the world size and all-reduced (summed) asynchronously
// while backward goes on. Buckets start in index order on every rank, so that the collectives
// match. Counting is needed because a pipeline accumulates some gradients more than once per
// backward: once per checkpointed micro-batch (each recomputation runs its own backward) and once
// for the rest. The first backward has no counts yet, so its buckets all start at its end.
// At the end of every backward (a callback queued on the outermost backward when it starts: the
// wrapper's output node calls begin_backward()), the buckets not started yet are started, every
// all-reduce is waited for, and the averages are written into the gradients. The callback runs
// after every other end-of-backward callback (Note [The reduction's end] in gradient_reducer.cc),
// and a backward that fails before it leaves the reducer ready for the next (Note [A backward that
// fails on some replicas]).
//
// Note [Graphs that change between backwards]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The counts are those of the last backward, and a graph may change: a branch used now and not
// before, more micro-batches (a larger mini-batch), another checkpoint mode. A parameter then
// accumulates after its bucket started ("late"), and what was all-reduced misses some of it. Each
// rank marks its late buckets, and the last bucket, which always starts at the end of backward,
// carries every bucket's mark to every rank with its gradients; each bucket late on any rank is
// then all-reduced again from the final gradients, in index order on every rank, so that the
// collectives still pair. A graph that changes costs those extra all-reduces (ReductionStats::
// reduced_again) and that step's overlap; the counts are learned again at every backward. This
// is what PyTorch's DistributedDataParallel does without static_graph, by other means.
//
// Note [A backward that fails on some replicas]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A backward may fail on one replica (a hook, the user's loss, a layer) and succeed on the
// others. Left alone, the failed one would start fewer all-reduces than the others wait for: they
// would hang until the group's timeout, or pair their next step's all-reduces with this step's.
// So the failed rank, when the engine drops its end-of-backward callback, runs every collective
// the others run at their end (the buckets not started yet, the late ones again), with its
// failure marked in the last bucket (one flag per rank). The others then know at once: their
// backward throws "the backward failed on rank r of n", without writing averages; the failed
// rank's backward throws its own error. Every rank ran the same collectives, so the next step is
// clean on all of them: zero the gradients and go on. A rank that fails in forward, and so never
// runs a backward, does the same from the wrapper's forward (fail_forward(); Note [A forward that
// fails on some replicas] in data_parallel.h), its flag saying so: the others' backward throws
// "the forward failed on rank r of n".
//
// Note [Parameters that no replica used]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// In one process a parameter that backward did not reach keeps an undefined gradient, and an
// optimizer skips it: no momentum, no weight decay, no Adam step. Each bucket carries, beside the
// gradients, one flag per parameter: whether this rank has a gradient for it (reached now, or
// accumulated under no_sync). A parameter no rank has a gradient for keeps its undefined gradient
// on every rank; one that some ranks have gets the average on every rank, the others counting as
// zeros, as under DistributedDataParallel with find_unused_parameters.


class GradientReducer {
 public:
  /// Reduces the gradients of `parameters` (those that require grad) over `group`.
  GradientReducer(std::vector<at::Tensor> parameters, std::vector<std::string> names,
                  ProcessGroup group, int64_t bucket_bytes);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  /// Called from the outermost backward as it starts: arms the hooks and queues the end-of-
  /// backward callback on it.
  void begin_backward();

  /// Called by a rank whose forward failed, where the others' forward worked and their backward
  /// will reduce: runs the collectives they run at its end, this rank's failure marked, so that
  /// theirs throws naming it and the next step's collectives pair (Note [A backward that fails on
  /// some replicas]). Never throws: a collective that fails leaves the group broken, and the
  /// next one fails with the cause.
  void fail_forward();

  /// The number of buckets.
  size_t bucket_count() const;
  ReductionStats last_stats() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
