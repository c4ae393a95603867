// The clock-cycle schedule: which (micro-batch, partition) tasks run together at each clock tick.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gpipe {

/// One task of the pipeline: micro-batch `microbatch` through partition `partition`.
struct Task2D {
  int64_t microbatch;
  int64_t partition;
  bool operator==(const Task2D& other) const {
    return microbatch == other.microbatch && partition == other.partition;
  }
};

// Note [Clock-cycle schedule]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// GPipe runs micro-batch i through partition j at clock tick k = i + j. At tick k every task with
// i + j = k runs at once, one per partition, so each partition works on a different micro-batch:
//
//          partition 0   partition 1   partition 2
//   k = 0    (0, 0)
//   k = 1    (1, 0)        (0, 1)
//   k = 2    (2, 0)        (1, 1)        (0, 2)
//   k = 3                  (2, 1)        (1, 2)
//   k = 4                                (2, 2)
//
// There are m + n - 1 ticks for m micro-batches and n partitions. Within a tick the tasks are
// ordered by ascending partition (descending micro-batch); the pipeline relies on that order when
// it inserts the dependencies and copies of a tick (see Note [Backward order] in pipeline.cc).
// With equal stage costs the idle fraction (the "bubble") is (n - 1) / (m + n - 1).

/// The clock-cycle schedule for `microbatches` micro-batches and `partitions` partitions: one
/// entry per clock tick, each the tasks of that tick ordered by ascending partition.
///
///   auto ticks = gpipe::clock_cycles(3, 2);
///   // {{(0,0)}, {(1,0),(0,1)}, {(2,0),(1,1)}, {(2,1)}}
///
/// Throws c10::Error if either count is negative. Zero of either gives no ticks.
std::vector<std::vector<Task2D>> clock_cycles(int64_t microbatches, int64_t partitions);

/// Renders a schedule as text, one line per tick, e.g. "0: (0,0)\n1: (1,0) (0,1)\n".
std::string schedule_to_string(const std::vector<std::vector<Task2D>>& schedule);

}  // namespace gpipe
