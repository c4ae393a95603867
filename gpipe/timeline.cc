// The timeline; see timeline.h.
#include "gpipe/timeline.h"

#include <algorithm>
#include <map>
#include <utility>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpipe/internal/stream.h"

namespace gpipe {

// Note [Device times]
// ~~~~~~~~~~~~~~~~~~~~
// On CUDA the host only issues work: a task's host times say when its kernels were queued, not
// when they ran. So on a CUDA device the timeline also records a timing event (StreamMark) on the
// work's stream before and after it — the partition's compute stream for a task, the current
// stream of the autograd engine's device thread for a recomputation and a checkpointed backward,
// the source's copy stream for an activation copy (where LibTorch runs a copy from a CUDA device;
// a copy from the CPU runs on the destination's copy stream). Device times of events on one
// device can be compared with each other only, so each device gets an origin: at construction the
// device is synchronised, an event is recorded on its current stream and waited for, and the host
// time right after is taken as the device time of that event. A device time is then the origin's
// host time plus the device's elapsed time from the origin, so host and device events share one
// clock, up to the few microseconds a synchronisation takes to return. Marks are read when the
// events are asked for (events() waits for them), never on the pipeline's threads. Skip copies
// have host times only.

Timeline::Timeline(const std::vector<c10::Device>& devices) : Timeline() {
  for (const c10::Device& device : devices) {
    if (!internal::has_streams(device) || origin(device) != nullptr) {
      continue;
    }
    internal::synchronize(device);
    std::shared_ptr<internal::StreamMark> mark =
        internal::mark_stream(internal::current_stream(device));
    (void)internal::elapsed_us(*mark, *mark);  // waits until the device has reached it
    const double host_us = now_us();
    origins_.push_back(Origin{internal::mark_device(*mark), std::move(mark), host_us});
  }
}

const Timeline::Origin* Timeline::origin(const c10::Device& device) const {
  for (const Origin& o : origins_) {
    if (o.device == device) {
      return &o;
    }
  }
  return nullptr;
}

std::shared_ptr<internal::StreamMark> Timeline::mark(const c10::Stream& stream) const {
  return origin(stream.device()) != nullptr ? internal::mark_stream(stream) : nullptr;
}

double Timeline::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start_)
      .count();
}

void Timeline::finish(TimelineEvent event, const Started& started, const c10::Stream& stream) {
  event.start_us = started.us;
  event.end_us = now_us();
  add(event, started.mark, started.mark ? mark(stream) : nullptr);
}

void Timeline::add(TimelineEvent event, std::shared_ptr<internal::StreamMark> device_start,
                   std::shared_ptr<internal::StreamMark> device_end) {
  std::lock_guard<std::mutex> lock(mu_);
  if (device_start != nullptr && device_end != nullptr) {
    // Both marks are on one stream's device, which has an origin (mark() made them).
    if (const Origin* o = origin(internal::mark_device(*device_start))) {
      pending_.push_back(Pending{events_.size(), o, std::move(device_start),
                                 std::move(device_end)});
    }
  }
  events_.push_back(event);
}

std::vector<TimelineEvent> Timeline::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Pending& p : pending_) {
    TimelineEvent& e = events_[p.event];
    e.device_start_us = p.origin->host_us + internal::elapsed_us(*p.origin->mark, *p.start);
    e.device_end_us = p.origin->host_us + internal::elapsed_us(*p.origin->mark, *p.end);
  }
  pending_.clear();
  return events_;
}

std::string render_timeline(const std::vector<TimelineEvent>& events) {
  int64_t partitions = 0;
  int64_t ticks = 0;
  for (const TimelineEvent& e : events) {
    if (e.kind == TimelineEvent::Kind::kCompute) {
      partitions = std::max(partitions, e.partition + 1);
      ticks = std::max(ticks, e.microbatch + e.partition + 1);
    }
  }
  std::vector<std::vector<std::string>> cells(partitions, std::vector<std::string>(ticks, "."));
  std::vector<double> busy(partitions, 0.0);
  size_t width = 1;
  for (const TimelineEvent& e : events) {
    if (e.kind != TimelineEvent::Kind::kCompute) {
      continue;
    }
    std::string cell = absl::StrCat(e.microbatch, e.checkpointed ? "*" : "");
    width = std::max(width, cell.size());
    cells[e.partition][e.microbatch + e.partition] = std::move(cell);
    busy[e.partition] += e.end_us - e.start_us;
  }
  std::string out;
  for (int64_t j = 0; j < partitions; ++j) {
    absl::StrAppend(&out, "partition ", j, " |");
    for (const std::string& cell : cells[j]) {
      absl::StrAppend(&out, " ", cell, std::string(width - cell.size(), ' '));
    }
    absl::StrAppendFormat(&out, " | %8.0f us\n", busy[j]);
  }
  return out;
}

namespace {

// The length of [from, to] covered by the union of `busy`.
double covered(double from, double to, std::vector<std::pair<double, double>> busy) {
  std::sort(busy.begin(), busy.end());
  double total = 0, reach = from;
  for (const auto& [start, end] : busy) {
    const double lo = std::max(start, reach), hi = std::min(end, to);
    if (hi > lo) total += hi - lo;
    reach = std::max(reach, std::min(end, to));
  }
  return total;
}

}  // namespace

CopyOverlap copy_overlap(const std::vector<TimelineEvent>& events,
                         const std::vector<c10::Device>& devices) {
  CopyOverlap o;
  const int64_t n = static_cast<int64_t>(devices.size());
  for (const TimelineEvent& e : events) {
    TORCH_CHECK(e.partition >= 0 && e.partition < n && (e.kind != TimelineEvent::Kind::kCopy ||
                                                        (e.from >= 0 && e.from < n)),
                "gpipe::copy_overlap: an event names partition ", e.partition, " (from ", e.from,
                ") but ", n, " devices were given; give the pipeline's devices()");
  }
  for (const TimelineEvent& copy : events) {
    if (copy.kind != TimelineEvent::Kind::kCopy || !copy.has_device_times()) continue;
    const c10::Device gpu =
        devices[copy.from].is_cuda() ? devices[copy.from] : devices[copy.partition];
    std::vector<std::pair<double, double>> busy;
    for (const TimelineEvent& work : events) {
      if (work.kind == TimelineEvent::Kind::kCopy || work.kind == TimelineEvent::Kind::kSkipCopy ||
          !work.has_device_times() || work.microbatch == copy.microbatch ||
          devices[work.partition] != gpu) {
        continue;
      }
      busy.emplace_back(work.device_start_us, work.device_end_us);
    }
    o.copy_us += copy.device_end_us - copy.device_start_us;
    o.overlapped_us += covered(copy.device_start_us, copy.device_end_us, std::move(busy));
  }
  return o;
}

}  // namespace gpipe
