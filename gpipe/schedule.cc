// The clock-cycle schedule; see Note [Clock-cycle schedule] in schedule.h.
#include "gpipe/schedule.h"

#include <algorithm>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace gpipe {

std::vector<std::vector<Task2D>> clock_cycles(int64_t microbatches, int64_t partitions) {
  TORCH_CHECK(microbatches >= 0, "clock_cycles: the number of micro-batches must be >= 0, got ",
              microbatches);
  TORCH_CHECK(partitions >= 0, "clock_cycles: the number of partitions must be >= 0, got ",
              partitions);
  std::vector<std::vector<Task2D>> ticks;
  if (microbatches == 0 || partitions == 0) {
    return ticks;
  }
  const int64_t m = microbatches;
  const int64_t n = partitions;
  ticks.reserve(m + n - 1);
  for (int64_t k = 0; k < m + n - 1; ++k) {
    std::vector<Task2D> tick;
    // j ranges over the partitions that have a micro-batch i = k - j in [0, m).
    for (int64_t j = std::max<int64_t>(1 + k - m, 0); j < std::min<int64_t>(1 + k, n); ++j) {
      tick.push_back(Task2D{k - j, j});
    }
    ticks.push_back(std::move(tick));
  }
  return ticks;
}

std::string schedule_to_string(const std::vector<std::vector<Task2D>>& schedule) {
  std::string out;
  for (size_t k = 0; k < schedule.size(); ++k) {
    absl::StrAppend(&out, k, ":");
    for (const Task2D& task : schedule[k]) {
      absl::StrAppendFormat(&out, " (%d,%d)", task.microbatch, task.partition);
    }
    out += "\n";
  }
  return out;
}

}  // namespace gpipe
