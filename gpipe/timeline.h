// The timeline: what a GPipe forward did, task by task and copy by copy, with times, and a
// picture of it: the clock-cycle schedule as it ran.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace gpipe {

/// One thing the pipeline did during a forward.
struct TimelineEvent {
  enum class Kind {
    /// Task (microbatch, partition) ran its partition's layers.
    kCompute,
    /// The micro-batch's activations moved from partition `from` to `partition`.
    kCopy,
    /// `tensors` stashed skip tensors moved from partition `from` to `partition`.
    kSkipCopy,
    /// During backward: checkpointed task (microbatch, partition) ran its layers again.
    kRecompute,
    /// During backward: the backward of checkpointed task (microbatch, partition) through its
    /// recomputed layers. (Other tasks' backward is LibTorch's, node by node, and not recorded.)
    kBackward,
  };
  Kind kind;
  int64_t microbatch;
  int64_t partition;
  int64_t from = -1;
  int64_t tensors = 0;
  bool checkpointed = false;
  /// Microseconds since the forward started (host clock).
  double start_us = 0;
  double end_us = 0;
};

/// Collects the events of a forward and of its backward (recomputations); thread-safe.
class Timeline {
 public:
  Timeline() : start_(std::chrono::steady_clock::now()) {}
  /// Microseconds since construction.
  double now_us() const;
  void add(TimelineEvent event);
  std::vector<TimelineEvent> events() const;

 private:
  std::chrono::steady_clock::time_point start_;
  mutable std::mutex mu_;
  std::vector<TimelineEvent> events_;
};

/// Draws the compute events as the schedule they ran: one row per partition, one column per
/// clock tick, each cell the micro-batch computed ("3" or "3*" when checkpointed, "." when idle),
/// then each partition's busy time.
///
///   std::cout << gpipe::render_timeline(model->last_timeline());
///   // partition 0 | 0* 1* 2  .  |  120 us
///   // partition 1 | .  0* 1* 2  |  118 us
std::string render_timeline(const std::vector<TimelineEvent>& events);

}  // namespace gpipe
