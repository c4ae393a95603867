// A schedule searched from measured costs: per-stage F, I, W and transfer times and a per-rank
// memory limit in, a schedule no longer in simulation than the best generated one out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpipe/schedule.h"
#include "gpipe/schedule_check.h"

namespace gpipe {

// Note [Searching a schedule]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The zero-bubble paper (Qi et al., 2023) finds its schedules from measured F, B, W times and a
// memory limit, with an ILP or a greedy heuristic in Python; none of the pipeline libraries ships
// a search. search_schedule is that search in C++, on the cost model of simulate_schedule (the
// one the generators' bubbles and the planner use), with each stage's own costs:
//   1. Seeds: the generated schedules of one stage per rank (gpipe, 1f1b, zb) whose peak
//      micro-batches in flight fit the limit.
//   2. Construction: a list scheduler on the simulated clock. Each rank, when free, runs the
//      first of: the next I whose gradient has arrived; a W waiting beyond its keep (keep 0: each
//      W right after its I, as a whole B); the next F whose activation has arrived, while fewer
//      than its warm-up cap are ahead of the I's and the memory limit allows; any waiting W
//      rather than idling. It is run for every warm-up cap (1F1B's n - r plus 0 to the limit) and
//      keep (0, r, all): each gives a schedule.
//   3. Local improvement: from the best few, moves that swap two neighbouring actions of
//      different kinds on a rank (or carry a W up to 3 places later) are kept while they shorten
//      the simulated step within the limit, up to a budget of simulations. Each kind keeps its
//      micro-batch order.
// The result is the shortest of all of them, so never longer than the best generated schedule
// that fits; ties keep the generated one. In-flight counts F run and W (or B) not yet, as
// simulate_schedule's peak_in_flight, so the limit is in micro-batches of a stage's activations
// (the planner converts bytes).
// With several stages per rank the seeds are the generated schedules of that placement, and local
// improvement also swaps neighbouring actions of one kind on two of a rank's stages: on a V
// (ScheduleSearchOptions::v_shape: 2n stages, rank r holding r and 2n - 1 - r, Note [V-shaped
// placement]) zbv and, from 2n - 1 micro-batches, dualpipev; interleaved
// (ScheduleSearchOptions::virtual_stages v: vn stages, rank r holding r, r + n, ...) interleaved
// 1F1B and zb1p, m a multiple of n as theirs. The list scheduler of step 2 is for one stage per
// rank.

/// Per-stage costs and limits for search_schedule.
struct ScheduleSearchOptions {
  /// stage_costs[s]: stage s's F, I and W times and the transfer of what it sends.
  std::vector<ActionCosts> stage_costs;
  /// Whether the stages sit in a V: 2n of them on n ranks, rank r holding r and 2n - 1 - r.
  bool v_shape = false;
  /// Else the stages each rank holds interleaved: vn of them on n ranks, rank r holding r,
  /// r + n, ... (as interleaved and zb1p place them); 1: one stage per rank.
  int64_t virtual_stages = 1;
  /// max_in_flight[r]: the most (stage, micro-batch) pairs rank r may hold (F run, W not yet);
  /// empty: every micro-batch of its stages.
  std::vector<int64_t> max_in_flight;
  /// The most simulations local improvement may run.
  int64_t budget = 4000;
};

/// What search_schedule found.
struct SearchedSchedule {
  /// The schedule (name "searched", or a generated one's when none was shorter).
  Schedule schedule;
  /// Its simulation on the options' costs.
  ScheduleSimulation simulation;
  /// Where it came from: a generated schedule's name, or "greedy (cap +c, keep k)", with the
  /// moves local improvement kept.
  std::string origin;
  /// The shortest generated schedule within the limit, simulated the same way.
  ScheduleSimulation best_generated;
  /// Its name (gpipe, 1f1b or zb; zbv or dualpipev on a V; interleaved or zb1p interleaved);
  /// empty where none fits.
  std::string best_generated_name;
};

/// Searches a schedule of `microbatches` micro-batches over `stage_costs.size()` ranks, one stage
/// each, or over half as many in a V, or a v-th as many interleaved (Note [Searching a schedule]).
///
///   gpipe::ScheduleSearchOptions options;
///   options.stage_costs = {{1, 1, 1, 0.1}, {1, 1, 1, 0.1}, {1.5, 1.5, 1, 0.1}, {1, 2, 1, 0}};
///   options.max_in_flight = {4, 4, 4, 4};
///   gpipe::SearchedSchedule found = gpipe::search_schedule(16, options);
///   // found.simulation.makespan <= found.best_generated.makespan
SearchedSchedule search_schedule(int64_t microbatches, const ScheduleSearchOptions& options);

/// simulate_schedule with each stage's own costs (stage_costs[s]; a transfer costs its sending
/// stage's).
ScheduleSimulation simulate_schedule(const Schedule& schedule,
                                     const std::vector<ActionCosts>& stage_costs);

}  // namespace gpipe
