// The pipeline: runs micro-batches through partitions by the clock-cycle schedule, one worker per
// device, and wires the autograd graph so that backward runs in GPipe's order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include "gpipe/checkpoint.h"
#include "gpipe/microbatch.h"
#include "gpipe/thread_state.h"
#include "gpipe/skip_layout.h"
#include "gpipe/stage_backward.h"
#include "gpipe/timeline.h"
#include "gpipe/worker.h"

namespace gpipe {

/// What one forward of the pipeline needs.
struct PipelineSpec {
  /// stages[j] runs partition j on a micro-batch (on the calling worker thread). Each must own
  /// what it uses: a checkpointed task keeps a copy to recompute during backward, after the
  /// forward has returned.
  std::vector<std::function<Batch(const Batch& input)>> stages;
  /// The partitions' devices.
  std::vector<c10::Device> devices;
  /// The compute stream of each partition's device.
  std::vector<c10::Stream> compute_streams;
  /// copy_streams[j][i]: the copy stream of partition j for micro-batch i.
  const std::vector<std::vector<c10::Stream>>* copy_streams = nullptr;
  /// Micro-batches i < checkpoint_stop are checkpointed.
  int64_t checkpoint_stop = 0;
  /// With checkpointing: the thread state recomputations run under, each partition's
  /// GradRecord and parameters' key (see Checkpointing).
  std::shared_ptr<const ThreadState> recompute_state;
  std::vector<std::shared_ptr<GradRecord>> grad_records;
  std::vector<uint64_t> params_keys;
  WorkerPool* workers = nullptr;
  /// Where the skips go; null or empty when the model has no skippable layer.
  const SkipLayout* skip_layout = nullptr;
  /// Identifies this forward for current_microbatch().
  uint64_t run = 0;
  /// Where to record what happened, also in backward; null to record nothing.
  std::shared_ptr<Timeline> timeline;
  /// Stage-local backward (Note [Stage-local backward in one process]): cuts the graph in front of
  /// each partition and adds no fork/join edges between micro-batches. Null: one graph.
  std::shared_ptr<StageBackward> stage_backward;
};

/// Runs every micro-batch of `batches` (on the first device) through every partition, replacing
/// each by its output (on the last device). The first exception of a clock tick is re-thrown after
/// the tick's other tasks finished; later ticks do not run.
///
///   gpipe::run_pipeline(spec, batches);
void run_pipeline(const PipelineSpec& spec, std::vector<Batch>& batches);

}  // namespace gpipe
