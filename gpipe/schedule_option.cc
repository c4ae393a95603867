// The schedule option and its check; see schedule_option.h.
#include "gpipe/schedule_option.h"

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "gpipe/schedule_check.h"
#include "gpipe/schedule_text.h"

namespace gpipe {

PipelineSchedule PipelineSchedule::interleaved(int64_t virtual_stages, int64_t microbatch_group) {
  TORCH_CHECK(virtual_stages >= 1, "PipelineSchedule::interleaved: virtual_stages must be at "
              "least 1, got ", virtual_stages);
  TORCH_CHECK(microbatch_group >= 0, "PipelineSchedule::interleaved: microbatch_group must be 0 "
              "(the number of ranks) or more, got ", microbatch_group);
  PipelineSchedule schedule(ScheduleKind::kInterleaved);
  schedule.virtual_stages_ = virtual_stages;
  schedule.microbatch_group_ = microbatch_group;
  return schedule;
}

PipelineSchedule PipelineSchedule::of(ScheduleKind kind, int64_t virtual_stages,
                                      int64_t microbatch_group) {
  TORCH_CHECK(!v_shaped(kind) || virtual_stages == 1 || virtual_stages == 2,
              "PipelineSchedule::of: the ", schedule_kind_name(kind),
              " schedule always has 2 "
              "stages per rank, but virtual_stages is ",
              virtual_stages, "; give 1 or 2");
  PipelineSchedule schedule(kind);
  schedule.virtual_stages_ = virtual_stages;
  schedule.microbatch_group_ = microbatch_group;
  return schedule;
}

PipelineSchedule PipelineSchedule::interleaved_zero_bubble(int64_t virtual_stages) {
  TORCH_CHECK(virtual_stages >= 1,
              "PipelineSchedule::interleaved_zero_bubble: virtual_stages "
              "must be at least 1, got ",
              virtual_stages);
  PipelineSchedule schedule(ScheduleKind::kInterleavedZeroBubble);
  schedule.virtual_stages_ = virtual_stages;
  return schedule;
}

PipelineSchedule PipelineSchedule::text(std::string text) {
  PipelineSchedule schedule;
  schedule.set_text(std::move(text));
  return schedule;
}

void PipelineSchedule::set_text(std::string text) {
  parsed_ = text.empty() ? nullptr : std::make_shared<const Schedule>(parse_schedule(text));
  text_ = std::move(text);
}

std::string PipelineSchedule::to_string() const {
  if (is_text()) return "text";
  std::string name = schedule_kind_name(kind_);
  if (takes_virtual_stages(kind_)) {
    absl::StrAppend(&name, " (v = ", virtual_stages_,
                    microbatch_group_ > 0 ? absl::StrCat(", group = ", microbatch_group_) : "",
                    ")");
  }
  return name;
}

namespace {

// A written schedule against the pipeline.
void check_text(const Schedule& parsed, int64_t partitions, int64_t chunks,
                const std::string& who) {
  TORCH_CHECK(parsed.stages == partitions, who, ": the schedule text has ", parsed.stages,
              " stages but the pipeline has ", partitions, " partitions; give one stage per "
              "partition");
  TORCH_CHECK(parsed.microbatches == chunks, who, ": the schedule text has ",
              parsed.microbatches, " micro-batches but chunks is ", chunks, "; write the "
              "schedule for chunks micro-batches");
  check_schedule(parsed);
}

}  // namespace

int64_t check_schedule_option(const PipelineSchedule& schedule, int64_t partitions, int64_t chunks,
                              const std::string& who) {
  const int64_t v = schedule.virtual_stages();
  const int64_t group = schedule.microbatch_group();
  const std::string kind = schedule_kind_name(schedule.kind());
  const bool v_shape = v_shaped(schedule.kind());
  TORCH_CHECK(!schedule.is_text() || (v == 1 && group == 0), who, ": the schedule is written as "
              "text, which sets its own order, but virtual_stages is ", v, " and "
              "microbatch_group ", group, "; leave them 1 and 0");
  if (schedule.is_text()) {
    check_text(*schedule.parsed(), partitions, chunks, who);
    return schedule.parsed()->num_ranks();
  }
  TORCH_CHECK(v >= 1, who, ": virtual_stages must be at least 1, got ", v);
  TORCH_CHECK(v == 1 || takes_virtual_stages(schedule.kind()) || v_shape, who,
              ": virtual_stages is ", v, " but the schedule is ", kind,
              "; virtual stages are "
              "for the interleaved schedules: PipelineSchedule::interleaved(",
              v,
              ") or "
              "PipelineSchedule::interleaved_zero_bubble(",
              v, ")");
  // (A V-shaped kind set to other virtual stages by the deprecated setter reads 2 anyway.)
  TORCH_CHECK(group >= 0, who, ": microbatch_group must be 0 (the number of ranks) or more, got ",
              group);
  TORCH_CHECK(group == 0 || (schedule.interleaves() && schedule.kind() == ScheduleKind::kInterleaved),
              who, ": microbatch_group is ", group, " but the schedule is ", kind, " with ", v,
              " virtual stage", v == 1 ? "" : "s", "; micro-batch groups are for the interleaved "
              "schedule with 2 or more virtual stages (PipelineSchedule::interleaved(v, group)) "
              "only");
  TORCH_CHECK(!v_shape || partitions % 2 == 0, who, ": the ", kind,
              " schedule puts two "
              "partitions on each rank (r and 2n - 1 - r), but there are ",
              partitions, "; give an even number");
  TORCH_CHECK(partitions % v == 0, who, ": virtual_stages ", v, " must divide the number of "
              "partitions (", partitions, "): each rank runs ", v, " of them");
  const int64_t ranks = partitions / v;
  if (ranks == 0) return 0;  // an empty pipeline runs no schedule
  if (group != 0) {
    TORCH_CHECK(group >= ranks && chunks % group == 0, who, ": microbatch_group is ", group,
                "; it must be at least the number of ranks (", ranks, ": ", partitions,
                " partitions, ", v, " virtual stages per rank) and divide chunks (", chunks,
                "), or be 0 for ", ranks);
  }
  return ranks;
}

Schedule make_schedule_for(const PipelineSchedule& schedule, int64_t partitions,
                           int64_t microbatches) {
  if (schedule.is_text()) return *schedule.parsed();
  const int64_t v = schedule.virtual_stages();
  return make_schedule(
      schedule.kind(), partitions / v, microbatches, v,
      schedule.kind() == ScheduleKind::kInterleaved ? schedule.microbatch_group() : 0);
}

}  // namespace gpipe
