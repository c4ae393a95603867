// Checking a schedule before it runs, adding its sends and receives, and simulating it: what a
// schedule costs in time (its bubble) and in memory (micro-batches in flight), before any run.
#pragma once

#include <cstdint>
#include <vector>

#include "gpipe/schedule.h"

namespace gpipe {

// Note [Checking a schedule]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// check_schedule refuses, naming the first bad action, a schedule that
//   - names a stage or micro-batch out of range, or a stage on a rank that does not hold it;
//   - runs an action twice, or misses one: every (stage, micro-batch) runs F once and either B
//     once or I and W once each;
//   - runs an action on a rank before one it needs there: F(s, i) after F(s-1, i) and
//     B(s, i) (or I) after B(s+1, i) where those stages are on the same rank; B or I after F;
//     W after I; a send after what it sends; a receive before what needs it;
//   - with sends and receives (any at all): misses one where neighbouring stages are on different
//     ranks, has one where they are not, or lets two ranks post theirs in different orders. Every
//     pair of ranks must post its transfers, both directions together, in one order both sides
//     agree on, as NCCL needs (Note [Point-to-point order] in distributed/process_group.h);
//   - deadlocks. The simulation runs each rank's actions in order; a send or receive is only
//     posted (the rank goes on); the k-th transfer between two ranks completes once both have
//     posted it and the (k-1)-th has completed; an action waits for what it needs (a received
//     tensor: its receive's completion). If ranks remain that all wait, the schedule deadlocks.
// A schedule without sends and receives is checked the same way with each transfer implied:
// an action then waits directly for what it needs on the other rank. with_communication adds
// them to such a schedule: each send right after the action that computed its tensor, each
// receive as late as possible, and every pair of ranks in the order of the sends in a simulated
// run (which both sides then agree on, and which cannot deadlock: everything a transfer waits for
// came earlier in that run).

/// Throws c10::Error naming the first bad action of `schedule` (Note [Checking a schedule]).
///
///   gpipe::check_schedule(gpipe::parse_schedule("0F0 0B0\n"));
void check_schedule(const Schedule& schedule);

/// Whether `schedule` has any send or receive.
bool has_communication(const Schedule& schedule);

/// `schedule` (checked first) with a send and a receive for each tensor that crosses between
/// ranks (Note [Checking a schedule]). A schedule that already has them is returned as it is.
Schedule with_communication(const Schedule& schedule);

/// The time each kind of action takes in simulate_schedule, in any unit. B costs I + W.
struct ActionCosts {
  /// An F's time.
  double forward = 1;
  /// An I's time (the input-gradient half of B).
  double backward_input = 1;
  /// A W's time (the weight-gradient half of B).
  double backward_weight = 1;
  /// One transfer between ranks (or, without sends and receives, each crossing dependency).
  double transfer = 0;
};

/// One action as simulated: on which rank, from when to when.
struct SimulatedAction {
  /// The action.
  Action action;
  /// The rank that ran it.
  int64_t rank = 0;
  /// When it started, on the simulated clock.
  double start = 0;
  /// When it ended.
  double end = 0;
};

/// What a schedule costs, simulated with ActionCosts (Note [Checking a schedule]).
struct ScheduleSimulation {
  /// When the last action ends.
  double makespan = 0;
  /// busy[r]: the time rank r computes.
  std::vector<double> busy;
  /// The idle fraction: 1 - sum(busy) / (ranks x makespan).
  double bubble = 0;
  /// peak_in_flight[r]: the most (stage, micro-batch) pairs held at once on rank r (F run, B or
  /// W not yet).
  std::vector<int64_t> peak_in_flight;
  /// The same for each stage.
  std::vector<int64_t> stage_peak_in_flight;
  /// Each rank's compute actions (F, B, I, W) in order, with their simulated times.
  std::vector<std::vector<SimulatedAction>> actions;
};

/// Runs `schedule` (checked first) on a simulated clock with `costs`.
///
///   auto sim = gpipe::simulate_schedule(gpipe::one_f_one_b_schedule(4, 8));
///   // sim.bubble == 3.0 / 11, sim.peak_in_flight == {4, 3, 2, 1}
ScheduleSimulation simulate_schedule(const Schedule& schedule, const ActionCosts& costs = {});

}  // namespace gpipe
