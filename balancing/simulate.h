// Simulating a pipeline step: a discrete-event run of a schedule's actions over profiled costs,
// with the engine's rules (one thread per worker, copies between devices, workers sharing a
// device's cores), predicting the step's time, each device's peak memory and its timeline.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "gpipe/schedule.h"
#include "gpipe/timeline.h"

namespace gpipe {

// Note [Simulating a step]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The simulation runs what the executor runs (Note [One executor] in gpipe/internal/executor.h):
// each worker (a rank of the schedule: a thread of its own) takes its actions in order, each when
// what it needs is done (internal::Plan::needs, the dependencies check_schedule uses):
//   F i  a stage's forward of micro-batch i: forward_nograd_us when i is checkpointed, else
//        forward_us; its output reaches the next stage copy_us later when that stage is on another
//        device (copies run beside compute, as on CUDA's copy streams), once the copies queued
//        before it on the same link are done: one direction of a pair of devices carries one copy
//        at a time (its bandwidth is shared by waiting in turn), and so does each pair of stages
//        in processes of their own on one device; a backward's gradient goes back alike;
//   B i  backward_us, after recompute_us (a forward with autograd) when i was checkpointed;
//   I, W backward_input_us and backward_weight_us; a checkpointed micro-batch is not split (its I
//        runs the whole backward after the recomputation, its W nothing), as in the executor.
// What a worker needs from another worker reaches it handoff_us after it is done (a thread woken
// by another: tens of microseconds on a quiet machine, more on a busy VM), plus the copy.
// Time: workers on one device share it. A device has `capacity` workers' worth of compute (a CPU:
// its cores divided by the intra-op threads of each worker; a GPU: 1, its kernels serialised on
// one device); k workers running on it each progress at min(1, capacity / k) (processor sharing).
// This is what makes three CPU workers on two cores slower than the schedule alone says.
// Where a device names `cores` and more workers run than that, they take turns as an operating
// system's scheduler gives them: `cores` of them run (each at capacity / cores), the others wait.
// Each worker counts the time it has run (its virtual runtime, as Linux's); a free core goes to
// the waiting worker furthest behind; a worker that held its core for slice_us gives it up to a
// waiting one behind it; a worker just woken (its inputs came while it slept) comes back at most
// sleeper_credit_us behind the least of the device's workers (a least that only grows, Linux's
// min_vruntime), and takes the core of the one furthest ahead at once when more than wakeup_us
// behind it; a worker going straight on to its next action on the same device keeps its core.
// A device's cores hold whole workers: capacity 1.5 takes turns two at a time, each at 0.75.
// So the workers that sleep often (those waiting on their neighbours) run first when they wake,
// and the busiest one, the pipeline's bottleneck, runs at a fraction of a core while the others
// have work. On the project's 2-vCPU VM, three workers of the MLP under zero bubble measured
// 20-27% slower than processor sharing predicted; turns close 4-6 points of that
// (benchmarks/plan_accuracy; docs/benchmarks.md, runs K-Q).
// Memory, per device: the static bytes (parameters, gradients, optimizer state, buffers, the
// mini-batch) plus, over time, what each (stage, micro-batch) in flight keeps: from the end of its
// F to the end of its B (or W) held_bytes (what autograd saved and the output), or
// checkpointed_bytes when checkpointed (its output, and its input where it was copied from another
// device); I keeps the gradients at the layers' outputs (grad_kept_bytes) for W. While
// an action runs, its device also holds its working memory: F forward_workspace_bytes, B and I
// backward_workspace_bytes (the profiled peaks of the layers' forwards and backwards over what
// they keep), a checkpointed B its recomputed held_bytes and the larger of the two. The peak is
// the largest sum at any action's start or end.
// What it leaves out: the loss (its forward and backward are counted in neither stage), the
// optimizer step, caches and fragmentation of the allocators, and the engine's own time per task
// (a few microseconds); copies on different links share nothing (a host's PCIe or memory
// bandwidth shared by several links is not modelled).
// Replicas: a worker's step ends allreduce_us of each of its stages after its last action (its
// gradients averaged over the replicas), beside the other workers' all-reduces (stages in
// processes of their own); or the whole step ends step_allreduce_us after the last worker's end
// (one process's pipeline, replicated).

/// One stage (partition) of a configuration: where it runs and what one micro-batch costs it.
struct StageCost {
  /// The worker (schedule rank) that runs it.
  int64_t lane = 0;
  /// The index of its device in PipelineCosts::capacity.
  int64_t device = 0;
  /// Microseconds per micro-batch (Note [Simulating a step]): a forward with autograd.
  double forward_us = 0;
  /// A forward without autograd (a checkpointed micro-batch's first forward).
  double forward_nograd_us = 0;
  /// A whole backward (B).
  double backward_us = 0;
  /// The input-gradient half of a split backward (I).
  double backward_input_us = 0;
  /// The weight-gradient half of a split backward (W).
  double backward_weight_us = 0;
  /// A forward with autograd again, before a checkpointed micro-batch's backward.
  double recompute_us = 0;
  /// Moving the stage's output to the next stage's device, and the gradient back (0 on one
  /// device).
  double copy_us = 0;
  /// Bytes per micro-batch (Note [Simulating a step]): what a micro-batch in flight keeps from
  /// its F to its B (or W), when not checkpointed.
  int64_t held_bytes = 0;
  /// What a checkpointed micro-batch keeps instead: its output, and its input where it was
  /// copied from another device.
  int64_t checkpointed_bytes = 0;
  /// What I keeps for W: the gradients at the layers' outputs.
  int64_t grad_kept_bytes = 0;
  /// Working memory above what the stage keeps while a forward runs.
  int64_t forward_workspace_bytes = 0;
  /// Working memory while a backward (or I) runs, above what it started with.
  int64_t backward_workspace_bytes = 0;
  /// Averaging the stage's gradients over data-parallel replicas after its worker's last action,
  /// microseconds (Note [Stages and replicas in the plan] in plan.h); 0 without replicas.
  double allreduce_us = 0;
};

/// A configuration's costs.
struct PipelineCosts {
  /// One entry per stage of the schedule, indexed by stage.
  std::vector<StageCost> stages;
  /// Per device: workers' worth of compute (Note [Simulating a step]).
  std::vector<double> capacity;
  /// Per device: the cores (of workers' intra-op threads) that its workers take turns on when
  /// more of them run than there are cores (Note [Simulating a step]); 0, or an empty vector:
  /// processor sharing (a GPU).
  std::vector<int64_t> cores;
  /// The operating system's turns (Note [Simulating a step]), microseconds: how long a worker
  /// holds a core before it yields to one behind it (`slice_us`, positive where `cores` are
  /// named), how far behind a woken worker must be to take a core at once (`wakeup_us`), and how
  /// much CPU time a worker that slept is credited at most (`sleeper_credit_us`).
  double slice_us = 0;
  /// How far behind a woken worker must be to take a core at once (see slice_us).
  double wakeup_us = 0;
  /// How much CPU time a worker that slept is credited at most (see slice_us).
  double sleeper_credit_us = 0;
  /// Per device: bytes held throughout (parameters, gradients, optimizer state, buffers, input).
  std::vector<int64_t> static_bytes;
  /// Micro-batches before this one are checkpointed.
  int64_t checkpoint_stop = 0;
  /// What a worker waits, beyond the data, for what another worker finished (a hand-over
  /// between threads: handoff_us in profile.h), microseconds.
  double handoff_us = 0;
  /// Averaging every stage's gradients over data-parallel replicas after the last worker's last
  /// action (one process's pipeline replicated: Note [Stages and replicas in the plan] in
  /// plan.h), microseconds; 0 without.
  double step_allreduce_us = 0;
};

/// A simulated step.
struct PipelineSimulation {
  /// When the last action ends, microseconds.
  double step_us = 0;
  /// Per device: the largest bytes held at once (static bytes included).
  std::vector<int64_t> peak_bytes;
  /// The step as a timeline (compute, recomputation, backward halves, copies), partition = stage:
  /// draw it with timeline_svg like a recorded step.
  std::vector<TimelineEvent> events;
};

/// Runs `schedule` (one rank per worker, its stages those of `costs`) over `costs`
/// (Note [Simulating a step]). Throws c10::Error when the schedule and the costs disagree (stage
/// counts, a stage on another lane than the schedule's) or a cost is negative.
///
///   gpipe::PipelineSimulation sim = gpipe::simulate_pipeline(gpipe::gpipe_schedule(2, 4), costs);
///   gpipe::write_file("predicted.svg", gpipe::timeline_svg(sim.events, devices));
PipelineSimulation simulate_pipeline(const Schedule& schedule, const PipelineCosts& costs);

}  // namespace gpipe
