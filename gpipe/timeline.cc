// The timeline; see timeline.h.
#include "gpipe/timeline.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace gpipe {

double Timeline::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start_)
      .count();
}

void Timeline::add(TimelineEvent event) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(event);
}

std::vector<TimelineEvent> Timeline::events() const {
  std::lock_guard<std::mutex> lock(mu_);
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

}  // namespace gpipe
