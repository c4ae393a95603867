// The override of forward()'s threads that tests and benchmarks use: whether each partition runs
// on a thread of its own is the engine's decision (Note [Threads of forward()] in gpipe/worker.h,
// internal::own_threads_for_forward in partition.h).
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
};

/// For tests and benchmarks: `options` with forward()'s threads forced, a thread per partition
/// (`own`) or per device, whatever the engine would decide.
///
///   gpipe::GPipe model(seq, gpipe::internal::with_partition_threads(options, false));
inline GPipeOptions with_partition_threads(GPipeOptions options, bool own) {
  return PartitionThreads::forced(std::move(options), own);
}

}  // namespace internal
}  // namespace gpipe
