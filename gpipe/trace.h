// The timeline written out: as a Chrome trace (JSON, for Perfetto or chrome://tracing) and as SVG
// pictures of the schedule, the one that ran and the ideal clock-cycle one. No dependency beyond
// the standard library and Abseil.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "gpipe/schedule.h"
#include "gpipe/schedule_check.h"
#include "gpipe/timeline.h"

namespace gpipe {

/// The events as Chrome-trace JSON: a complete event ("ph": "X", host microseconds) per compute
/// task, recomputation, checkpointed backward and copy, on one track (tid) per partition, named
/// "partition j (device)" from `devices` (which may be empty), in process 0 ("gpipe (host
/// time)"). Events with device times (CUDA) appear again at those times in process 1 ("gpipe
/// (device time)"), on the same tracks. Each event's args hold its micro-batch, partition and
/// kind.
///
///   std::ofstream("step.json") << gpipe::chrome_trace_json(model->last_timeline(),
///                                                          model->devices());
std::string chrome_trace_json(const std::vector<TimelineEvent>& events,
                              const std::vector<c10::Device>& devices);

/// An SVG picture of the events at their real times (device times where measured, else host
/// times): one row per partition, a box per task
/// (labelled with its micro-batch; checkpointed tasks hatched), recomputation and checkpointed
/// backward, copies as thin bars, and a time axis.
std::string timeline_svg(const std::vector<TimelineEvent>& events,
                         const std::vector<c10::Device>& devices);

/// An SVG picture of the ideal clock-cycle schedule of `microbatches` over `partitions`: the
/// forward (tick k runs the tasks (i, j) with i + j = k) then the backward in reverse, with the
/// micro-batches below `checkpoint_stop` checkpointed (recomputed before their backward).
std::string schedule_svg(int64_t microbatches, int64_t partitions, int64_t checkpoint_stop = 0);

/// An SVG picture of any schedule (schedule.h) as simulate_schedule runs it with `costs`: one row
/// per rank, a box per action at its simulated time, labelled with its micro-batch (and, with
/// several stages per rank, its stage); F blue, B green, I teal, W purple; the title gives the
/// simulated bubble and each rank's peak of micro-batches in flight.
///
///   gpipe::write_file("1f1b.svg", gpipe::schedule_svg(gpipe::one_f_one_b_schedule(4, 8)));
std::string schedule_svg(const Schedule& schedule, const ActionCosts& costs = {});

/// Writes `text` to `path`; throws c10::Error naming the path when it cannot.
void write_file(const std::string& path, const std::string& text);

}  // namespace gpipe
