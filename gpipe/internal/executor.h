// The executor (internal, not API): runs a schedule's actions — forwards, backwards, input- and
// weight-gradient halves — for the partitions of a pipeline that this process owns, each lane of
// actions on a thread of its own, the partitions' neighbours reached through links (link.h). GPipe
// (in one process) and distributed::PipelineStage (across processes) both run their steps on it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <torch/nn/modules/container/sequential.h>

#include "gpipe/batchnorm.h"
#include "gpipe/checkpoint.h"
#include "gpipe/internal/link.h"
#include "gpipe/schedule.h"
#include "gpipe/skip_layout.h"
#include "gpipe/internal/stage_backward.h"
#include "gpipe/thread_state.h"
#include "gpipe/timeline.h"
#include "gpipe/worker.h"

namespace gpipe {
namespace internal {

// Note [One executor]
// ~~~~~~~~~~~~~~~~~~~
// A schedule (schedule.h) says, for each rank, the order of its actions. The executor gives each
// lane — a rank of the schedule in one process, a partition of this process's stage across
// processes, or all of its virtual stages when interleaved — a thread, and runs the lane's
// actions in order:
//   F i   receives micro-batch i's input from the partition's upstream (cut from the sender's
//         graph: Note [Partitions within a stage] in distributed/pipeline_stage.h), runs the layers
//         (checkpointed when i < the checkpoint stop), and sends the output downstream.
//   B i   receives the gradients of micro-batch i's outputs from downstream and runs the
//         backward of the partition's graph of micro-batch i — an engine call of its own, on the
//         lane's thread, so partitions overlap in backward as in forward — then sends the input
//         leaves' gradients upstream.
//   I i   the same, but computes only the gradients of the inputs (torch::autograd::grad with
//         retain_graph) and sends them upstream at once; the graph is kept for
//   W i   the parameters' gradients (a backward restricted to the partition's parameters).
//         Splitting a backward costs one more pass over the partition's graph (activation
//         gradients are computed twice on the parameters' path); a checkpointed micro-batch is not
//         split (its I runs the whole backward, its W nothing): its recomputation happens once.
// Sends and receives are the links' (in this process: queues; across processes: c10d, posted by
// the stage's courier), so the schedule's SEND/RECV actions need no lane of their own. Neighbouring
// partitions are joined by LocalLinks; partitions that are not neighbours (a stage's virtual
// stages across processes) come with links of their own (ExecutorSpec::upstreams).
// Activations live from a partition's F i to its B i (or W i): a 1F1B lane keeps at most its
// schedule's in-flight micro-batches, which is the point of the schedule. The last partition's
// downstream applies the loss (Note [Losses over micro-batches] in loss.h). The first error of any
// lane fails every link, so that no lane waits for a micro-batch that will not come; the step
// rethrows it once every lane has stopped.

// Note [forward() on the executor]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// GPipe::forward runs the forward actions of the GPipe schedule on the executor, each lane's in
// the clock-cycle order (clock_cycles in schedule.h), with links that keep the autograd graph
// (Note [Links that keep the graph] in link.h) and the mini-batch's micro-batches as they are:
// the caller's backward, torch::autograd::grad, create_graph and an input with history then work
// as on the plain model. What a step does by hand, this forward leaves to the autograd engine:
// the order of backward (Note [Backward order]), the recomputation of checkpointed micro-batches
// (their Checkpointing records it on the timeline), the skips' gradients (Note [Skips and
// checkpointing] in skip_tracker.h). With stage-local backward (Note [Stage-local backward in one
// process] in stage_backward.h) a Handoff stands in front of each partition instead of the
// fork/join edges, where a plain backward may cut the graph (a backward that does not cut runs in
// the engine's own order, with the same gradients). Which lane
// runs a partition is GPipe's choice (gpipe.cc): one per device, as the reference runs one worker
// per device, or one per partition (Note [Threads of forward()] in gpipe/worker.h).
//
// Note [Backward order]
// ~~~~~~~~~~~~~~~~~~~~~
// GPipe's backward visits, on each partition, the micro-batches in reverse order. A forward()
// runs no backward loop of its own; it adds edges to the autograd graph and lets the autograd
// engine find the order. After partition j's forward of micro-batch i-1, the lane forks that
// output's lane tensor (Batch::lane: the first floating-point tensor) and keeps the phony;
// partition j's forward of micro-batch i joins the phony into its input's lane (dependency.h).
// The fork's backward node then waits for the gradient of micro-batch i at partition j's input:
// partition j's backward for micro-batch i-1 starts only after the one for micro-batch i has
// finished. Across partitions the data edges (and the copies) already order everything. When
// micro-batch i-1 was checkpointed, its lane comes out of a RecomputeBackward node (on the CPU, of
// its CheckpointBackward when it stashed no skips) and the fork adds the phony to that node
// instead of making its own: the recomputation then also waits for micro-batch i. When micro-batch i is checkpointed, the phony becomes an extra next edge of its
// CheckpointBackward instead of being joined into its lane: two autograd nodes fewer per task.

/// One partition that this process runs.
struct ExecutorPartition {
  torch::nn::Sequential layers;
  c10::Device device{c10::kCPU};
  std::shared_ptr<BatchNormLayers> batch_norms;  // shared with checkpointed micro-batches' graphs
  std::shared_ptr<GradRecord> grad_record;
};

/// What one step of the executor needs.
struct ExecutorSpec {
  /// Who runs, for error messages ("gpipe::GPipe::step").
  std::string who;
  /// This process's partitions, in pipeline order; neighbours are joined by LocalLinks.
  std::vector<ExecutorPartition>* partitions = nullptr;
  /// Each lane's actions for `m` micro-batches; Action::stage indexes `partitions`.
  std::function<std::vector<std::vector<Action>>(int64_t m)> plan;
  /// Each lane's thread; null: the calling thread (at most one lane).
  std::vector<Worker*> workers;
  /// The first partition's upstream and the last's downstream.
  Upstream* upstream = nullptr;
  Downstream* downstream = nullptr;
  /// Instead, when this process's partitions are not neighbours in the pipeline (interleaving
  /// across processes: Note [Interleaving across processes] in distributed/pipeline_stage.h):
  /// each partition's own upstream and downstream. A null downstream and the next partition's
  /// null upstream: the two are neighbours, joined by a LocalLink (the V's turn on the last rank:
  /// Note [V-shaped placement] in gpipe/schedule.h).
  std::vector<Upstream*> upstreams;
  std::vector<Downstream*> downstreams;
  /// The number of micro-batches; 0: as the upstream's first activation says.
  int64_t microbatches = 0;
  /// With microbatches 0: the most micro-batches the upstream may announce (a stage's chunks),
  /// checked before anything is sized by the count; 0: no bound.
  int64_t max_microbatches = 0;
  /// Whether backward runs (grad mode on when the step began).
  bool grad_enabled = true;
  /// Micro-batches before checkpoint_stop(m) are checkpointed.
  std::function<int64_t(int64_t m)> checkpoint_stop;
  /// Identifies this step for current_microbatch().
  uint64_t run = 0;
  /// The thread state that checkpointed micro-batches are recomputed under.
  std::shared_ptr<const ThreadState> recompute_state;
  /// Where to record the lanes' actions; null to record nothing.
  std::shared_ptr<Timeline> timeline;
  /// Skips between `partitions`; null or empty when there are none.
  const SkipLayout* skip_layout = nullptr;
  /// Added to the partition index of the timeline's events.
  int64_t timeline_partition_offset = 0;
  /// Copy streams for `partitions` (Note [Links on copy streams] in link.h), at least as many
  /// per partition as micro-batches; null: the step takes them from the devices' pools.
  const CopyStreams* copy_streams = nullptr;
  /// A forward() (Note [forward() on the executor]): the plan has forwards only, the links keep
  /// the graph, and the upstream and downstream take the micro-batches as they are.
  bool keep_graph = false;
  /// With keep_graph: stage-local backward, null for one graph.
  std::shared_ptr<StageBackward> stage_backward;
};

/// Threads for `lanes` lanes (ExecutorSpec::workers): the calling thread (null) for the first,
/// then `pool`'s workers, started as needed.
std::vector<Worker*> lane_workers(std::vector<std::unique_ptr<Worker>>& pool, size_t lanes);

/// Runs one step: every lane's actions. Throws the first error of any lane after every lane has
/// stopped.
void run_schedule(const ExecutorSpec& spec);

/// Whether the last lane that runs partition `last` runs every forward before its first backward
/// (GPipe's order): the loss can then be applied to the whole mini-batch.
bool forwards_before_backwards(const std::vector<std::vector<Action>>& lanes, int64_t last);

}  // namespace internal
}  // namespace gpipe
