// Tests of the schedule search (gpipe/schedule_search.h): on random per-stage costs and memory
// limits its schedule is valid, within the limits and never longer than the best generated one
// that fits; the per-stage simulation it searches on agrees with a step computed by hand.
#include "tests/catch.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "gpipe/schedule.h"
#include "gpipe/schedule_check.h"
#include "gpipe/schedule_search.h"
#include "gpipe/schedule_text.h"

namespace gpipe {
namespace {

using gpipe_test::contains;

CATCH_TEST_CASE("simulate_schedule with each stage's costs gives the step computed by hand",
                "[schedule][search]") {
  // 1F1B over 2 ranks, one micro-batch: F0, send, F1, B1 (I + W), send back, B0.
  const std::vector<ActionCosts> costs{{1, 2, 3, 0.5}, {4, 5, 6, 0.25}};
  const ScheduleSimulation sim = simulate_schedule(one_f_one_b_schedule(2, 1), costs);
  CATCH_CHECK(sim.makespan == 1 + 0.5 + 4 + (5 + 6) + 0.25 + (2 + 3));
  // Each transfer costs its sender's: rank 1's F starts after stage 0's F and its 0.5.
  CATCH_CHECK(sim.actions[1][0].start == 1 + 0.5);
  // Equal costs on every stage: the uniform simulation.
  const ActionCosts same{1, 1.5, 0.5, 0.1};
  const Schedule zb = zero_bubble_schedule(3, 6);
  CATCH_CHECK(simulate_schedule(zb, std::vector<ActionCosts>(3, same)).makespan ==
              simulate_schedule(zb, same).makespan);
  CATCH_CHECK_THROWS_WITH(simulate_schedule(zb, std::vector<ActionCosts>(2, same)),
                          contains("2 stage costs for the 3 stages of schedule 'zb'"));
  CATCH_CHECK_THROWS_WITH(
      simulate_schedule(zb, {same, same, {1, 0, 1, 0}}),
      contains("action costs must be positive (transfers: not negative), got stage 2's F 1, I 0"));
}

// `stages` stages' F, I and W drawn from [low, high) and transfers from [0, most_transfer).
std::vector<ActionCosts> random_costs(std::mt19937& gen, int64_t stages, double low, double high,
                                      double most_transfer) {
  std::uniform_real_distribution<double> time(low, high), transfer(0, most_transfer);
  std::vector<ActionCosts> out;
  for (int64_t s = 0; s < stages; ++s) {
    out.push_back({time(gen), time(gen), time(gen), transfer(gen)});
  }
  return out;
}

CATCH_TEST_CASE(
    "the searched schedule is valid within the memory limit and never longer than "
    "the best generated one that fits on random costs",
    "[schedule][search]") {
  const int seed = GENERATE(range(1, 41));
  CATCH_CAPTURE(seed);
  std::mt19937 gen(static_cast<unsigned>(seed));
  const int64_t n = std::uniform_int_distribution<int64_t>(1, 5)(gen);
  const int64_t m = std::uniform_int_distribution<int64_t>(1, 4 * n)(gen);
  ScheduleSearchOptions options;
  options.stage_costs = random_costs(gen, n, 0.5, 2.0, 0.3);
  // Limits from 1 (tighter than every generated schedule) to 2n.
  for (int64_t r = 0; r < n; ++r) {
    options.max_in_flight.push_back(std::uniform_int_distribution<int64_t>(1, 2 * n)(gen));
  }
  CATCH_CAPTURE(n, m);
  const SearchedSchedule found = search_schedule(m, options);
  CATCH_CAPTURE(found.origin);
  // Valid (simulate_schedule checks it first) and simulated as reported.
  const ScheduleSimulation again = simulate_schedule(found.schedule, options.stage_costs);
  CATCH_CHECK(again.makespan == found.simulation.makespan);
  CATCH_CHECK(found.schedule.stages == n);
  CATCH_CHECK(found.schedule.microbatches == m);
  for (int64_t r = 0; r < n; ++r) {
    CATCH_CHECK(again.peak_in_flight[r] <= options.max_in_flight[r]);
  }
  // Never longer than any generated schedule that fits, each simulated here on its own.
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZeroBubble}) {
    const ScheduleSimulation generated =
        simulate_schedule(make_schedule(kind, n, m), options.stage_costs);
    bool fits = true;
    for (int64_t r = 0; r < n; ++r) fits &= generated.peak_in_flight[r] <= options.max_in_flight[r];
    CATCH_CAPTURE(schedule_kind_name(kind), fits);
    if (fits) CATCH_CHECK(found.simulation.makespan <= generated.makespan);
  }
  // Its text runs as a schedule written by hand (GPipe's PipelineSchedule from text).
  CATCH_CHECK(parse_schedule(schedule_text(found.schedule)).ranks == found.schedule.ranks);
}

CATCH_TEST_CASE(
    "with several stages per rank (a V, interleaved) the searched schedule is valid within the "
    "memory limit and never longer than its placement's generated schedules where they fit, on "
    "random costs",
    "[schedule][search][v_shape][interleaved]") {
  const int64_t v = GENERATE(0, 2, 3);  // 0: a V
  const int seed = GENERATE(range(1, 21));
  CATCH_CAPTURE(v, seed);
  std::mt19937 gen(static_cast<unsigned>(seed));
  const int64_t n = std::uniform_int_distribution<int64_t>(v == 0 ? 1 : 2, 4)(gen);
  const int64_t per_rank = v == 0 ? 2 : v;
  // (Interleaved runs multiples of n.)
  const int64_t m = (v == 0 ? 1 : n) * std::uniform_int_distribution<int64_t>(1, 4)(gen);
  ScheduleSearchOptions options;
  options.v_shape = v == 0;
  options.virtual_stages = v == 0 ? 1 : v;
  options.stage_costs = random_costs(gen, per_rank * n, 0.5, 2.0, 0.3);
  // Limits from 1 (tighter than any generated one) to 2 x per_rank x n (stage, micro-batch) pairs.
  for (int64_t r = 0; r < n; ++r) {
    const int64_t most = 2 * per_rank * n;
    options.max_in_flight.push_back(std::uniform_int_distribution<int64_t>(1, most)(gen));
  }
  CATCH_CAPTURE(n, m);
  const std::vector<ScheduleKind> kinds =
      v == 0 ? std::vector<ScheduleKind>{ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV}
             : std::vector<ScheduleKind>{ScheduleKind::kInterleaved,
                                         ScheduleKind::kInterleavedZeroBubble};
  std::vector<ScheduleSimulation> fitting;  // the generated ones that fit
  for (ScheduleKind kind : kinds) {
    const ScheduleSimulation generated =
        simulate_schedule(make_schedule(kind, n, m, per_rank), options.stage_costs);
    bool fits = true;
    for (int64_t r = 0; r < n; ++r) fits &= generated.peak_in_flight[r] <= options.max_in_flight[r];
    if (fits) fitting.push_back(generated);
  }
  if (fitting.empty()) {
    CATCH_CHECK_THROWS_WITH(search_schedule(m, options), contains("no schedule fits"));
    return;
  }
  const SearchedSchedule found = search_schedule(m, options);
  CATCH_CAPTURE(found.origin);
  const ScheduleSimulation again = simulate_schedule(found.schedule, options.stage_costs);
  CATCH_CHECK(again.makespan == found.simulation.makespan);
  CATCH_CHECK(found.schedule.stages == per_rank * n);
  CATCH_CHECK(found.schedule.num_ranks() == n);
  for (int64_t s = 0; s < per_rank * n; ++s) {
    CATCH_CHECK(found.schedule.stage_ranks[s] == (v != 0 ? s % n : s < n ? s : 2 * n - 1 - s));
  }
  for (int64_t r = 0; r < n; ++r) {
    CATCH_CHECK(again.peak_in_flight[r] <= options.max_in_flight[r]);
  }
  for (const ScheduleSimulation& g : fitting) CATCH_CHECK(found.simulation.makespan <= g.makespan);
  CATCH_CHECK(parse_schedule(schedule_text(found.schedule)).ranks == found.schedule.ranks);
}

CATCH_TEST_CASE(
    "with several stages per rank (a V, interleaved) the search shortens the best generated step "
    "on some uneven costs",
    "[schedule][search][v_shape][interleaved]") {
  // Uneven stages with transfers and no memory limit, 2 or 3 ranks: where local improvement finds
  // an order of its own it is strictly shorter than the placement's generated schedules.
  const int64_t v = GENERATE(0, 2);  // 0: a V
  CATCH_CAPTURE(v);
  int improved = 0;
  for (unsigned seed = 1; seed <= 20; ++seed) {
    std::mt19937 gen(seed);
    const int64_t n = 2 + seed % 2;
    ScheduleSearchOptions options;
    options.v_shape = v == 0;
    options.virtual_stages = v == 0 ? 1 : v;
    options.stage_costs = random_costs(gen, 2 * n, 0.3, 3.0, 0.5);
    const SearchedSchedule found = search_schedule(2 * n, options);
    CATCH_CHECK(found.simulation.makespan <= found.best_generated.makespan);
    if (found.schedule.name == "searched") {
      CATCH_CHECK(found.simulation.makespan < found.best_generated.makespan);
      ++improved;
    }
  }
  CATCH_CAPTURE(improved);
  CATCH_CHECK(improved >= 1);
}

CATCH_TEST_CASE(
    "within 1F1B's memory the search shortens the step below every generated "
    "schedule that fits",
    "[schedule][search]") {
  // Four equal stages with transfers, each rank holding what 1F1B holds (n - r): ZB-H1 does not
  // fit (it holds n on every rank), and the search splits backwards within 1F1B's memory.
  // [search]
  gpipe::ScheduleSearchOptions options;
  options.stage_costs = std::vector<gpipe::ActionCosts>(4, gpipe::ActionCosts{1, 1, 1, 0.3});
  options.max_in_flight = {4, 3, 2, 1};  // 1F1B's memory
  const gpipe::SearchedSchedule found = gpipe::search_schedule(16, options);
  const std::string text = gpipe::schedule_text(found.schedule);  // GPipe runs it as text
  // [search]
  CATCH_CAPTURE(found.origin);
  CATCH_CHECK(parse_schedule(text).ranks == found.schedule.ranks);
  CATCH_CHECK(found.best_generated_name == "1f1b");
  CATCH_CHECK(found.simulation.makespan < 0.9 * found.best_generated.makespan);
  CATCH_CHECK(found.schedule.name == "searched");
}

CATCH_TEST_CASE("search_schedule refuses bad options naming them", "[schedule][search][errors]") {
  ScheduleSearchOptions options;
  CATCH_CHECK_THROWS_WITH(search_schedule(4, options),
                          contains("stage_costs is empty; give one entry per stage"));
  options.stage_costs = {{}, {}};
  CATCH_CHECK_THROWS_WITH(search_schedule(0, options),
                          contains("the number of micro-batches must be at least 1, got 0"));
  options.max_in_flight = {2};
  CATCH_CHECK_THROWS_WITH(search_schedule(4, options),
                          contains("max_in_flight has 1 entries for 2 ranks"));
  options.max_in_flight = {2, 0};
  CATCH_CHECK_THROWS_WITH(search_schedule(4, options),
                          contains("max_in_flight[1] is 0; a rank must hold at least 1"));
  options.v_shape = true;
  options.max_in_flight = {};
  options.stage_costs = {{}, {}, {}};
  CATCH_CHECK_THROWS_WITH(search_schedule(4, options),
                          contains("a V has 2 stages per rank, but stage_costs has 3 entries; give "
                                   "an even number"));
  options.virtual_stages = 2;
  CATCH_CHECK_THROWS_WITH(search_schedule(4, options),
                          contains("virtual_stages is 2 with v_shape; a V has its own 2 stages per "
                                   "rank, give 1"));
  options.v_shape = false;
  CATCH_CHECK_THROWS_WITH(search_schedule(4, options),
                          contains("interleaved over ranks of 2 stages each, but stage_costs has 3 "
                                   "entries; give a multiple of 2 (at least 2 ranks)"));
  options.stage_costs = {{}, {}, {}, {}, {}, {}};
  CATCH_CHECK_THROWS_WITH(search_schedule(4, options),
                          contains("interleaved over 3 ranks runs a multiple of 3 micro-batches (as "
                                   "interleaved and zb1p do), got 4"));
  options.virtual_stages = 0;
  CATCH_CHECK_THROWS_WITH(search_schedule(4, options),
                          contains("virtual_stages is 0; give 1 (one stage per rank) or more"));
}

}  // namespace
}  // namespace gpipe
