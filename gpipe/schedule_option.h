// The schedule of a training step as one option value: a kind of schedule with its parameters
// (virtual stages, micro-batch group), or a schedule written as text; and the one check that
// GPipe and distributed::PipelineStage make of it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "gpipe/schedule.h"

namespace gpipe {

// Note [One schedule option]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// What step() runs was four options (schedule, virtual_stages, microbatch_group, schedule_text)
// that only meant something together, with the same cross-checks written in GPipe and in
// PipelineStage. A PipelineSchedule holds them as one value, made so that only meaningful
// combinations can be written: a kind converts to it, the interleaved schedule takes its virtual
// stages and group, a text is a schedule of its own. What depends on the pipeline (the group
// against the ranks and chunks, a text's stages against the partitions) is checked by
// check_schedule_option, once, for both classes. The deprecated setters (GPipeOptions::
// virtual_stages, ...) change one field of the value, whatever their order with schedule(kind).

/// The schedule of step(): a kind (GPipe's fill-drain, 1F1B, interleaved 1F1B, zero bubble),
/// interleaved 1F1B with its virtual stages, or a schedule written as text (docs/schedules.md).
///
///   gpipe::GPipeOptions({2, 2}).chunks(8).schedule(gpipe::ScheduleKind::k1F1B);
///   gpipe::GPipeOptions({1, 1, 1, 1}).chunks(8)
///       .schedule(gpipe::PipelineSchedule::interleaved(/*virtual_stages=*/2));
///   gpipe::GPipeOptions({1, 1}).chunks(2)
///       .schedule(gpipe::PipelineSchedule::text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n"));
class PipelineSchedule {
 public:
  /// A kind with its defaults (one virtual stage; interleaved 1F1B with one virtual stage is
  /// 1F1B).
  /* implicit */ PipelineSchedule(ScheduleKind kind = ScheduleKind::kGPipe) : kind_(kind) {}

  /// Interleaved 1F1B: `virtual_stages` (v ≥ 1) partitions per rank, rank r running partitions
  /// r, r + n, ...; the balance has n * v entries and chunks must be a multiple of n.
  /// `microbatch_group` (Megatron-LM's microbatch_group_size_per_vp_stage, v ≥ 2 only): the
  /// micro-batches that go through a partition before the rank's next one starts, at least n and
  /// a divisor of chunks; 0 means n (Note [Micro-batch groups] in schedule.h).
  static PipelineSchedule interleaved(int64_t virtual_stages, int64_t microbatch_group = 0);

  /// Interleaved zero bubble (ZB1P): interleaved 1F1B's placement and order with each backward
  /// split into I and W (interleaved_zero_bubble_schedule); `virtual_stages` as interleaved's.
  static PipelineSchedule interleaved_zero_bubble(int64_t virtual_stages);

  /// A kind with its parameters as a program's flags give them (kind, virtual stages, group),
  /// checked where the model is built: virtual stages and a group only with kInterleaved.
  ///
  ///   gpipe::PipelineSchedule::of(gpipe::schedule_kind(flag), virtual_stages, group)
  /// zbv and dualpipev take 1 or 2 (they always have 2 per rank).
  static PipelineSchedule of(ScheduleKind kind, int64_t virtual_stages = 1,
                             int64_t microbatch_group = 0);

  /// A schedule written as text (gpipe::parse_schedule's format: one line per rank, stages =
  /// partitions, micro-batches = chunks), parsed and checked here.
  static PipelineSchedule text(std::string text);

  /// The kind (kGPipe for a written schedule).
  ScheduleKind kind() const { return kind_; }
  /// Stages per rank: the virtual stages of interleaved 1F1B and ZB1P, 2 for ZBV and DualPipeV
  /// (in a V), 1 otherwise.
  int64_t virtual_stages() const { return v_shaped(kind_) ? 2 : virtual_stages_; }
  /// Interleaved 1F1B's micro-batch group (Note [Micro-batch groups]); 0: the default.
  int64_t microbatch_group() const { return microbatch_group_; }
  /// The text of a written schedule; empty for a kind.
  const std::string& text() const { return text_; }
  /// Whether it is a written schedule.
  bool is_text() const { return parsed_ != nullptr; }
  /// The written schedule, parsed; null for a kind.
  const std::shared_ptr<const Schedule>& parsed() const { return parsed_; }
  /// Whether each rank holds two or more stages placed in a loop (rank r: r, r + n, ...):
  /// interleaved 1F1B or ZB1P with two or more virtual stages.
  bool interleaves() const { return takes_virtual_stages(kind_) && virtual_stages_ > 1; }

  /// For the deprecated setters (Note [One schedule option]): one field each, checked later.
  void set_kind(ScheduleKind kind) { kind_ = kind; }
  /// Sets virtual_stages() alone.
  void set_virtual_stages(int64_t v) { virtual_stages_ = v; }
  /// Sets microbatch_group() alone.
  void set_microbatch_group(int64_t group) { microbatch_group_ = group; }
  /// Makes it a written schedule of `text`, parsed and checked here.
  void set_text(std::string text);

  /// "gpipe", "1f1b", "interleaved (v = 2)", "interleaved (v = 2, group = 4)", "zb", "zbv",
  /// "zb1p (v = 2)" or "text".
  std::string to_string() const;

 private:
  ScheduleKind kind_ = ScheduleKind::kGPipe;
  int64_t virtual_stages_ = 1;
  int64_t microbatch_group_ = 0;
  std::string text_;
  std::shared_ptr<const Schedule> parsed_;
};

/// Checks `schedule` for a pipeline of `partitions` partitions and `chunks` micro-batches, and
/// throws c10::Error naming `who` ("gpipe::GPipe"), the wrong value and what would be right:
/// virtual stages at least 1, dividing the partitions, only with the interleaved schedule; a
/// micro-batch group only with two or more virtual stages, at least the ranks and dividing
/// chunks; a text with one stage per partition,
/// written for `chunks` micro-batches, and valid (check_schedule). Returns the number of ranks
/// (partitions / virtual stages).
int64_t check_schedule_option(const PipelineSchedule& schedule, int64_t partitions, int64_t chunks,
                              const std::string& who);

/// The action table of `schedule` (a kind's, or the parsed text) for a pipeline of `partitions`
/// partitions (ranks = partitions / virtual stages) and `microbatches` micro-batches.
Schedule make_schedule_for(const PipelineSchedule& schedule, int64_t partitions,
                           int64_t microbatches);

}  // namespace gpipe
