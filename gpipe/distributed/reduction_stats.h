// What a data-parallel backward's reduction of gradients did: buckets, bytes, and how much of the
// all-reduce backward did not hide (DataParallel::last_reduction()).
#pragma once

#include <cstdint>

namespace gpipe {
namespace distributed {

/// What the last backward's reduction did.
struct ReductionStats {
  /// Buckets all-reduced.
  int64_t buckets = 0;
  /// Buckets whose all-reduce started while backward was still running.
  int64_t started_during_backward = 0;
  /// Bytes of gradients all-reduced.
  int64_t bytes = 0;
  /// Seconds between the end of backward's own work (the final callback) and the end of the
  /// reduction: the part of the all-reduce that backward did not hide.
  double exposed_seconds = 0;
  /// Buckets all-reduced a second time because a gradient came after they had started (Note
  /// [Graphs that change between backwards] in internal/gradient_reducer.h).
  int64_t reduced_again = 0;
};

}  // namespace distributed
}  // namespace gpipe
