// The overrides of forward()'s threads that tests and benchmarks use: whether each partition runs
// on a thread of its own, and its backward there, is the engine's decision (Note [Threads of
// forward()] in gpipe/worker.h, internal::own_threads_for_forward in partition.h; Note
// [Stage-local backward in one process] in stage_backward.h).
#pragma once

#include <optional>
#include <utility>

#include "gpipe/gpipe.h"

namespace gpipe {
namespace internal {

/// Reads and sets GPipeOptions' override of the decision.
struct PartitionThreads {
  static GPipeOptions forced(GPipeOptions options, bool own) {
    options.partition_threads_ = own;
    return options;
  }
  static std::optional<bool> chosen(const GPipeOptions& options) {
    return options.partition_threads_;
  }
  static GPipeOptions forced_stage_local(GPipeOptions options, bool on) {
    options.stage_local_ = on;
    return options;
  }
  static std::optional<bool> chosen_stage_local(const GPipeOptions& options) {
    return options.stage_local_;
  }
};

/// For tests and benchmarks: `options` with forward()'s threads forced, a thread per partition
/// (`own`) or per device, whatever the engine would decide.
///
///   gpipe::GPipe model(seq, gpipe::internal::with_partition_threads(options, false));
inline GPipeOptions with_partition_threads(GPipeOptions options, bool own) {
  return PartitionThreads::forced(std::move(options), own);
}

/// For tests and benchmarks: `options` with stage-local backward (Note [Stage-local backward in
/// one process] in stage_backward.h) forced on (every partition on the CPU, each on its thread)
/// or off (the one graph, run by the thread that calls backward()).
///
///   gpipe::GPipe model(seq, gpipe::internal::with_stage_local_backward(options, false));
inline GPipeOptions with_stage_local_backward(GPipeOptions options, bool on) {
  return PartitionThreads::forced_stage_local(std::move(options), on);
}

}  // namespace internal
}  // namespace gpipe
