// The stages' timelines of a step, gathered onto one clock (PipelineStage::gather_timeline); see
// pipeline_stage.h.
#include <algorithm>
#include <limits>
#include <vector>

#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include "absl/strings/str_join.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/distributed/process_group.h"
#include "gpipe/timeline.h"

namespace gpipe {
namespace distributed {

std::vector<TimelineEvent> PipelineStageImpl::gather_timeline() {
  // Each stage's number of events (-1: it recorded none) and of partitions; then each event as 6
  // doubles: kind, micro-batch, checkpointed, start and end on the host's clock, partition within
  // its stage. A stage that recorded nothing still takes part, so that every stage throws.
  const std::vector<TimelineEvent> mine =
      timeline_ ? timeline_->events() : std::vector<TimelineEvent>{};
  const double origin = timeline_ ? timeline_->origin_us() : 0.0;
  const int size = group_->getSize();
  const char* what = "the gather of the stages' timelines";
  const int64_t count = timeline_ ? static_cast<int64_t>(mine.size()) : -1;
  const std::vector<at::Tensor> counts =
      all_gather(group_, at::tensor({count, partitions()}, at::kLong), local_, what);
  std::vector<int> without;
  for (int r = 0; r < size; ++r) {
    if (counts[r][0].item<int64_t>() < 0) without.push_back(r);
  }
  TORCH_CHECK(without.empty(), "gpipe::distributed::PipelineStage::gather_timeline: stage",
              without.size() == 1 ? " " : "s ", absl::StrJoin(without, ", "), " recorded no "
              "timeline; call record_timeline(true) on every stage and run a step first");
  int64_t most = 0;
  for (const at::Tensor& c : counts) most = std::max(most, c[0].item<int64_t>());
  at::Tensor packed = at::zeros({std::max<int64_t>(most, 1), 6}, at::kDouble);
  for (size_t k = 0; k < mine.size(); ++k) {
    const TimelineEvent& e = mine[k];
    at::Tensor row = packed[static_cast<int64_t>(k)];
    row[0] = static_cast<double>(e.kind);
    row[1] = static_cast<double>(e.microbatch);
    row[2] = e.checkpointed ? 1.0 : 0.0;
    row[3] = origin + e.start_us;
    row[4] = origin + e.end_us;
    row[5] = static_cast<double>(e.partition);
  }
  const std::vector<at::Tensor> all = all_gather(group_, packed, local_, what);
  std::vector<TimelineEvent> events;
  double earliest = std::numeric_limits<double>::infinity();
  int64_t first_partition = 0;  // of stage r, in the whole pipeline
  std::vector<std::vector<int64_t>> held_of(static_cast<size_t>(size));
  for (size_t k = 0; k < stage_ranks_.size(); ++k) {
    held_of[stage_ranks_[k]].push_back(static_cast<int64_t>(k));
  }
  for (int r = 0; r < size; ++r) {
    const int64_t n = counts[r][0].item<int64_t>();
    const at::Tensor rows = all[r];
    for (int64_t k = 0; k < n; ++k) {
      // With virtual stages, a stage's partition c is the c-th entry of balance it holds
      // (Note [Interleaving across processes]).
      const int64_t local = static_cast<int64_t>(rows[k][5].item<double>());
      TimelineEvent e{static_cast<TimelineEvent::Kind>(rows[k][0].item<double>()),
                      static_cast<int64_t>(rows[k][1].item<double>()),
                      holds_virtual_stages() ? held_of[r].at(local) : first_partition + local};
      e.checkpointed = rows[k][2].item<double>() != 0;
      e.start_us = rows[k][3].item<double>();
      e.end_us = rows[k][4].item<double>();
      earliest = std::min(earliest, e.start_us);
      events.push_back(e);
    }
    first_partition += counts[r][1].item<int64_t>();
  }
  for (TimelineEvent& e : events) {
    e.start_us -= earliest;
    e.end_us -= earliest;
  }
  return events;
}

}  // namespace distributed
}  // namespace gpipe
