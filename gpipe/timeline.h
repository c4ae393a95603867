// The timeline: what a GPipe forward did, task by task and copy by copy, with times, and a
// picture of it: the clock-cycle schedule as it ran.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

namespace gpipe {

namespace internal {
struct StreamMark;  // a point in a stream a timeline reads device times at (internal/stream.h)
}  // namespace internal

/// One thing the pipeline did during a forward.
struct TimelineEvent {
  /// What the pipeline did.
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
    /// A step's input-gradient half of a split backward (zero bubble's I; internal/executor.h).
    kBackwardInput,
    /// A step's weight-gradient half of a split backward (zero bubble's W).
    kBackwardWeight,
  };
  /// What the pipeline did.
  Kind kind;
  /// The micro-batch's index.
  int64_t microbatch;
  /// The partition that did it (a copy's destination).
  int64_t partition;
  /// A copy's source partition; -1 for other kinds.
  int64_t from = -1;
  /// How many tensors a copy moved; 0 for other kinds.
  int64_t tensors = 0;
  /// Whether the task's micro-batch is checkpointed (kCompute).
  bool checkpointed = false;
  /// Microseconds since the forward started (host clock): when the host issued the work.
  double start_us = 0;
  /// When the host was done with it (on the CPU: had run it; on CUDA: had queued it), on the
  /// same clock.
  double end_us = 0;
  /// When the device ran it, on the same clock (Note [Device times]): set for work on CUDA
  /// devices (tasks, recomputations, checkpointed backward, activation copies); -1 elsewhere.
  double device_start_us = -1;
  /// When the device finished it (see device_start_us); -1 where not measured.
  double device_end_us = -1;
  /// Whether the device times are set.
  bool has_device_times() const { return device_start_us >= 0; }
};

/// Collects the events of a forward and of its backward (recomputations); thread-safe.
class Timeline {
 public:
  /// A timeline of host times only.
  Timeline() : start_(std::chrono::steady_clock::now()) {}
  /// A timeline that also measures device times on the CUDA ones among `devices`; each of those is
  /// synchronised once here, to align its clock with the host's (Note [Device times]).
  explicit Timeline(const std::vector<c10::Device>& devices);

  /// Microseconds since construction.
  double now_us() const;
  /// When the timeline started, in microseconds of the steady clock: the same clock in every
  /// process of a host (CLOCK_MONOTONIC), so that timelines of processes can be drawn together.
  double origin_us() const {
    return std::chrono::duration<double, std::micro>(start_.time_since_epoch()).count();
  }
  /// A timing mark recorded on `stream` now, if its device's times are measured (else null).
  std::shared_ptr<internal::StreamMark> mark(const c10::Stream& stream) const;
  /// Adds `event`; with marks, the event's device times are read from them by events().
  void add(TimelineEvent event, std::shared_ptr<internal::StreamMark> device_start = nullptr,
           std::shared_ptr<internal::StreamMark> device_end = nullptr);

  /// When a piece of work started: the host time and, where the device's times are measured, a
  /// mark on its stream.
  struct Started {
    /// The host time, as now_us().
    double us = 0;
    /// The mark on the work's stream; null where device times are not measured.
    std::shared_ptr<internal::StreamMark> mark;
  };
  /// Starts timing work on `stream`.
  ///
  ///   const gpipe::Timeline::Started started = timeline->start(stream);
  ///   run();
  ///   timeline->finish({gpipe::TimelineEvent::Kind::kCompute, i, j}, started, stream);
  Started start(const c10::Stream& stream) const { return Started{now_us(), mark(stream)}; }
  /// Adds `event`, which began at `started` and ends now on `stream`.
  void finish(TimelineEvent event, const Started& started, const c10::Stream& stream);
  /// The events so far; waits for the devices to reach the marks of those with device times.
  std::vector<TimelineEvent> events() const;

 private:
  struct Origin {
    c10::Device device;
    std::shared_ptr<internal::StreamMark> mark;
    double host_us;  // the host time at which the device reached `mark`
  };
  struct Pending {
    size_t event;
    const Origin* origin;
    std::shared_ptr<internal::StreamMark> start, end;
  };
  const Origin* origin(const c10::Device& device) const;

  std::chrono::steady_clock::time_point start_;
  std::vector<Origin> origins_;  // fixed after construction
  mutable std::mutex mu_;
  mutable std::vector<TimelineEvent> events_;
  mutable std::vector<Pending> pending_;  // device times not read yet
};

/// Draws the compute events as the schedule they ran: one row per partition, one column per
/// clock tick, each cell the micro-batch computed ("3" or "3*" when checkpointed, "." when idle),
/// then each partition's busy time.
///
///   std::cout << gpipe::render_timeline(model->last_timeline());
///   // partition 0 | 0* 1* 2  .  |  120 us
///   // partition 1 | .  0* 1* 2  |  118 us
std::string render_timeline(const std::vector<TimelineEvent>& events);

/// How much of a recorded pipeline's activation copies ran while the GPU that issued each copy
/// computed another micro-batch: what copy streams are for (Note [Links on copy streams]).
struct CopyOverlap {
  /// The copies' device time, in microseconds (copies with device times only: on a GPU).
  double copy_us = 0;
  /// Of which the copying GPU computed another micro-batch at the same time.
  double overlapped_us = 0;
};

/// The copy overlap of `events`, recorded by a pipeline on `devices`. A copy is issued by the
/// sender's GPU, or by the receiver's when the sender is the CPU; its time counts as overlapped
/// where any compute, backward or recomputation of another micro-batch on that GPU ran.
///
///   gpipe::CopyOverlap o = gpipe::copy_overlap(model->last_timeline(), model->devices());
///   std::printf("%.0f%% of the copies overlapped\n", 100 * o.overlapped_us / o.copy_us);
CopyOverlap copy_overlap(const std::vector<TimelineEvent>& events,
                         const std::vector<c10::Device>& devices);

}  // namespace gpipe
