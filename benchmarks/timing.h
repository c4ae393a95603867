// Timing helpers shared by the benchmarks: medians of repeated runs, and the allocator setting
// that keeps CPU steps from paying page faults for memory glibc gave back.
#pragma once

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace gpipe_benchmarks {

/// The median of `values` (the upper one of an even count).
inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

/// Milliseconds since `start`.
inline double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

/// Runs `fn` `repeats` times (after one untimed run with `warmup`) and returns the median time
/// of a run in milliseconds.
inline double median_ms(const std::function<void()>& fn, int repeats, bool warmup = false) {
  if (warmup) fn();
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(ms_since(start));
  }
  return median(times);
}

// Note [Keeping freed memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// glibc returns freed blocks above 128 KiB to the system and takes them back with page faults at
// the next allocation: for the megabyte-sized activations and weight gradients of CPU training
// steps that made them 4 to 8 times slower, and noisy, on one thread and in a pipeline alike.
// The benchmarks and trainers keep freed memory instead.

/// Keeps freed memory in the process (Note [Keeping freed memory]).
inline void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

}  // namespace gpipe_benchmarks
