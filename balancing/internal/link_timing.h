// The timing that measure_gloo_link and measure_nccl_link share (internal, not API): two ranks'
// ping-pongs and all-reduces at two sizes, and the four numbers of Note [Costs between processes]
// fitted to their medians.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#include <ATen/ops/zeros.h>

#include "balancing/internal/detail.h"

namespace gpipe {
namespace internal {

/// What two ranks took, rank 0's times: times[size][0] one message, times[size][1] an
/// all-reduce.
using LinkTimes = std::vector<std::vector<std::vector<double>>>;

/// Rank `rank`'s half of a link's measurement on `group` (a c10d group of 2): for each of `sizes`
/// (bytes), ping-pongs (rank 0 sends, rank 1 sends back; half the round trip is one message) and
/// all-reduces of a tensor made with `options`, `repeats` timed rounds after an untimed one, each
/// operation's end when `landed()` returns after its work's wait(). Rank 0's times go to `times`.
template <typename Group, typename Landed>
void time_link_rank(const Group& group, int rank, const std::vector<int64_t>& sizes, int repeats,
                    const at::TensorOptions& options, const Landed& landed, LinkTimes& times) {
  using Clock = std::chrono::steady_clock;
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<at::Tensor> t{at::zeros({sizes[s] / 4}, options.dtype(at::kFloat))};
    for (int r = 0; r <= repeats; ++r) {
      landed();
      const auto start = Clock::now();
      if (rank == 0) {
        group->send(t, 1, 0)->wait();
        group->recv(t, 1, 0)->wait();
      } else {
        group->recv(t, 0, 0)->wait();
        group->send(t, 0, 0)->wait();
      }
      landed();
      const auto pinged = Clock::now();
      group->allreduce(t)->wait();
      landed();
      const auto reduced = Clock::now();
      if (rank != 0 || r == 0) continue;
      times[s][0].push_back(std::chrono::duration<double, std::micro>(pinged - start).count() / 2);
      times[s][1].push_back(std::chrono::duration<double, std::micro>(reduced - pinged).count());
    }
  }
}

/// Runs `rank(0)` and `rank(1)` on two threads, each a rank of a measurement, and rethrows the
/// error of the first to fail (rank 0's first).
template <typename Rank>
void on_two_ranks(const Rank& rank) {
  std::exception_ptr errors[2];
  std::thread other([&] {
    try {
      rank(1);
    } catch (...) {
      errors[1] = std::current_exception();
    }
  });
  try {
    rank(0);
  } catch (...) {
    errors[0] = std::current_exception();
  }
  other.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

/// A link's latency, bandwidth, all-reduce step and all-reduce bandwidth fitted to the medians of
/// `times` at 4 and `large_bytes` bytes (Note [Costs between processes]: two ranks' all-reduce is
/// 2 alpha + bytes / beta), into any struct with those four fields.
template <typename Stats>
Stats fit_link(const LinkTimes& times, int64_t large_bytes) {
  const double message_small = median(times[0][0]);
  const double message_large = median(times[1][0]);
  const double reduce_small = median(times[0][1]);
  const double reduce_large = median(times[1][1]);
  const double bytes = static_cast<double>(large_bytes - 4);
  Stats link;
  link.latency_us = message_small;
  link.bytes_per_us = bytes / std::max(message_large - message_small, 1e-3);
  link.allreduce_step_us = reduce_small / 2;
  link.allreduce_bytes_per_us = bytes / std::max(reduce_large - reduce_small, 1e-3);
  return link;
}

}  // namespace internal
}  // namespace gpipe
