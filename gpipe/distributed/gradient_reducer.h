// The gradient reducer: averages parameters' gradients over the replicas of a data-parallel run
// with bucketed all-reduces that start during backward, as soon as a bucket's gradients are final.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "gpipe/distributed/process_group.h"

namespace gpipe {
namespace distributed {

// Note [Buckets that start during backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Parameters are put in buckets of about `bucket_bytes`, in reverse order of registration (the
// last layers' gradients are computed first) and by device and dtype. A post-hook on each
// parameter's gradient accumulator (AccumulateGrad) counts the accumulations; when a parameter
// has had as many as in the first backward, its gradient is final, and when all of a bucket's
// are, the bucket is flattened, divided by the world size and all-reduced (summed) asynchronously
// while backward goes on. Buckets start in index order on every rank, so that the collectives
// match. Counting is needed because a pipeline accumulates some gradients more than once per
// backward: once per checkpointed micro-batch (each recomputation runs its own backward) and once
// for the rest. The first backward learns the counts, so its buckets all start at its end.
// At the end of every backward (a callback queued on the outermost backward when it starts: the
// wrapper's output node calls begin_backward()), the buckets not started yet are started, every
// all-reduce is waited for, and the averages are written into the gradients. A parameter
// accumulated more often than counted after its bucket started is an error, not a silent wrong
// gradient. With no gradient on this rank, a parameter counts as zeros (and gets the average).
// The callback runs after every other end-of-backward callback (Note [The reduction's end] in
// gradient_reducer.cc), and a backward that fails before it leaves the reducer ready for the next.

/// What the last backward's reduction did.
struct ReductionStats {
  int64_t buckets = 0;
  /// Buckets whose all-reduce started while backward was still running.
  int64_t started_during_backward = 0;
  int64_t bytes = 0;
  /// Seconds between the end of backward's own work (the final callback) and the end of the
  /// reduction: the part of the all-reduce that backward did not hide.
  double exposed_seconds = 0;
};

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

  /// The number of buckets.
  size_t bucket_count() const;
  ReductionStats last_stats() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace distributed
}  // namespace gpipe
