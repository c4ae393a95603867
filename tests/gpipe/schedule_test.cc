// Tests of the schedules (gpipe/schedule.h): the clock-cycle ticks and the generators, each against
// its definition (orders, micro-batches in flight, bubble) simulated by gpipe/schedule_check.h.
#include "tests/catch.h"

#include <algorithm>
#include <ostream>
#include <utility>
#include <set>

#include <c10/util/Exception.h>

#include "gpipe/schedule.h"
#include "gpipe/schedule_check.h"
#include "gpipe/schedule_text.h"

namespace gpipe {

// How a failed comparison prints a task: "(micro-batch, partition)". (Also what a stream-printing
// vector needs when another header, such as glog's stl_logging.h that LibTorch 1.13 brings in with
// the CMake build's precompiled headers, makes vectors of tasks printable with operator<<.)
std::ostream& operator<<(std::ostream& out, const Task2D& task) {
  return out << "(" << task.microbatch << ", " << task.partition << ")";
}

namespace {

using Ticks = std::vector<std::vector<Task2D>>;

CATCH_TEST_CASE("clock_cycles(3, 3) is the GPipe diagonal schedule", "[schedule]") {
  const Ticks expected = {
      {{0, 0}},
      {{1, 0}, {0, 1}},
      {{2, 0}, {1, 1}, {0, 2}},
      {{2, 1}, {1, 2}},
      {{2, 2}},
  };
  CATCH_CHECK(clock_cycles(3, 3) == expected);
}

CATCH_TEST_CASE("clock_cycles(4, 2) keeps two partitions busy for three ticks", "[schedule]") {
  const Ticks expected = {{{0, 0}}, {{1, 0}, {0, 1}}, {{2, 0}, {1, 1}}, {{3, 0}, {2, 1}}, {{3, 1}}};
  CATCH_CHECK(clock_cycles(4, 2) == expected);
}

CATCH_TEST_CASE("clock_cycles(2, 4) with fewer micro-batches than partitions", "[schedule]") {
  const Ticks expected = {{{0, 0}}, {{1, 0}, {0, 1}}, {{1, 1}, {0, 2}}, {{1, 2}, {0, 3}}, {{1, 3}}};
  CATCH_CHECK(clock_cycles(2, 4) == expected);
}

CATCH_TEST_CASE("clock_cycles with one partition or one micro-batch is sequential", "[schedule]") {
  CATCH_CHECK(clock_cycles(3, 1) == Ticks{{{0, 0}}, {{1, 0}}, {{2, 0}}});
  CATCH_CHECK(clock_cycles(1, 3) == Ticks{{{0, 0}}, {{0, 1}}, {{0, 2}}});
  CATCH_CHECK(clock_cycles(1, 1) == Ticks{{{0, 0}}});
}

CATCH_TEST_CASE("clock_cycles with nothing to do has no ticks", "[schedule]") {
  CATCH_CHECK(clock_cycles(0, 3).empty());
  CATCH_CHECK(clock_cycles(3, 0).empty());
}

CATCH_TEST_CASE("clock_cycles rejects negative sizes with a clear error", "[schedule]") {
  CATCH_CHECK_THROWS_WITH(clock_cycles(-1, 2), gpipe_test::contains("micro-batches must be >= 0, got -1"));
  CATCH_CHECK_THROWS_WITH(clock_cycles(2, -3), gpipe_test::contains("partitions must be >= 0, got -3"));
}

CATCH_TEST_CASE("every task runs exactly once, at tick i + j, in partition order",
                "[schedule]") {
  const int64_t m = GENERATE(1, 2, 3, 5, 8);
  const int64_t n = GENERATE(1, 2, 3, 4, 7);
  const Ticks ticks = clock_cycles(m, n);
  CATCH_REQUIRE(static_cast<int64_t>(ticks.size()) == m + n - 1);
  std::set<std::pair<int64_t, int64_t>> seen;
  for (size_t k = 0; k < ticks.size(); ++k) {
    for (size_t t = 0; t < ticks[k].size(); ++t) {
      const Task2D task = ticks[k][t];
      CATCH_CHECK(task.microbatch + task.partition == static_cast<int64_t>(k));
      CATCH_CHECK(seen.insert({task.microbatch, task.partition}).second);
      if (t > 0) {
        CATCH_CHECK(ticks[k][t - 1].partition < task.partition);
      }
    }
  }
  CATCH_CHECK(static_cast<int64_t>(seen.size()) == m * n);
}

CATCH_TEST_CASE("schedule_to_string draws one line per tick", "[schedule]") {
  CATCH_CHECK(schedule_to_string(clock_cycles(2, 2)) == "0: (0,0)\n1: (1,0) (0,1)\n2: (1,1)\n");
}

// --- Generated schedules -------------------------------------------------------------------------

// The actions of one rank, as text.
std::string rank_text(const Schedule& schedule, int64_t rank) {
  Schedule one;
  one.ranks = {schedule.ranks.at(rank)};
  std::string text = schedule_text(one);
  return text.substr(0, text.size() - 1);
}

CATCH_TEST_CASE("gpipe_schedule runs every forward, then the backwards in reverse", "[schedule]") {
  const Schedule s = gpipe_schedule(2, 3);
  CATCH_CHECK(s.name == "gpipe");
  CATCH_CHECK(s.stage_ranks == std::vector<int64_t>{0, 1});
  CATCH_CHECK(rank_text(s, 0) == "0F0 0F1 0F2 0B2 0B1 0B0");
  CATCH_CHECK(rank_text(s, 1) == "1F0 1F1 1F2 1B2 1B1 1B0");
}

CATCH_TEST_CASE("one_f_one_b_schedule warms up with n - s - 1 forwards, then alternates",
                "[schedule]") {
  const Schedule s = one_f_one_b_schedule(3, 4);
  CATCH_CHECK(rank_text(s, 0) == "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3");
  CATCH_CHECK(rank_text(s, 1) == "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3");
  CATCH_CHECK(rank_text(s, 2) == "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3");
  // Fewer micro-batches than stages: the warm-up is cut to m.
  CATCH_CHECK(rank_text(one_f_one_b_schedule(3, 1), 0) == "0F0 0B0");
}

CATCH_TEST_CASE("interleaved_schedule follows Megatron-LM's order over the chunks", "[schedule]") {
  // n = 2, v = 2, m = 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3. Rank 0 warms up
  // with (n - 1) * 2 + (v - 1) * n = 4 forwards: micro-batches 0 and 1 through chunk 0, then
  // through chunk 1; rank 1 with 2.
  const Schedule s = interleaved_schedule(2, 2, 2);
  CATCH_CHECK(s.stages == 4);
  CATCH_CHECK(s.virtual_stages() == 2);
  CATCH_CHECK(s.stage_ranks == std::vector<int64_t>{0, 1, 0, 1});
  CATCH_CHECK(s.stages_of(1) == std::vector<int64_t>{1, 3});
  CATCH_CHECK(rank_text(s, 0) == "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1");
  CATCH_CHECK(rank_text(s, 1) == "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1");
  CATCH_CHECK_THROWS_WITH(interleaved_schedule(4, 6, 2),
                          gpipe_test::contains("micro-batches (6) must be a multiple of the "
                                               "number of partitions (4) with more than one "
                                               "virtual stage, e.g. 8"));
  CATCH_CHECK(schedule_text(interleaved_schedule(3, 5, 1)) ==
              schedule_text(one_f_one_b_schedule(3, 5)));
}

CATCH_TEST_CASE("zero_bubble_schedule splits backwards and lets stage s delay s weight gradients",
                "[schedule]") {
  const Schedule s = zero_bubble_schedule(3, 4);
  CATCH_CHECK(rank_text(s, 0) == "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3");
  CATCH_CHECK(rank_text(s, 1) == "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3");
  CATCH_CHECK(rank_text(s, 2) == "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3");
}

CATCH_TEST_CASE("generators refuse impossible sizes and unknown names", "[schedule]") {
  CATCH_CHECK_THROWS_WITH(gpipe_schedule(0, 4),
                          gpipe_test::contains("partitions must be at least 1, got 0"));
  CATCH_CHECK_THROWS_WITH(one_f_one_b_schedule(2, -1),
                          gpipe_test::contains("micro-batches must be at least 1, got -1"));
  CATCH_CHECK_THROWS_WITH(interleaved_schedule(2, 4, 0),
                          gpipe_test::contains("virtual stages (model chunks per rank) must be "
                                               "at least 1, got 0"));
  CATCH_CHECK_THROWS_WITH(schedule_kind("pipedream"),
                          gpipe_test::contains("unknown schedule 'pipedream': expected gpipe, "
                                               "1f1b, interleaved, zb, zbv, zb1p or "
                                               "dualpipev"));
  CATCH_CHECK_THROWS_WITH(make_schedule(ScheduleKind::k1F1B, 2, 4, 2),
                          gpipe_test::contains("only interleaved and zb1p take more than 1"));
  CATCH_CHECK_THROWS_WITH(interleaved_schedule(3, 6, 2, 2),
                          gpipe_test::contains("the micro-batch group (2) must be at least the "
                                               "number of partitions (3)"));
  CATCH_CHECK_THROWS_WITH(interleaved_schedule(2, 6, 2, 4),
                          gpipe_test::contains("micro-batches (6) must be a multiple of the "
                                               "micro-batch group (4) with more than one virtual "
                                               "stage, e.g. 8"));
  CATCH_CHECK_THROWS_WITH(make_schedule(ScheduleKind::kZeroBubble, 2, 4, 1, 4),
                          gpipe_test::contains("a micro-batch group of 4 given for the zb "
                                               "schedule; only interleaved takes one"));
  for (const char* name : {"gpipe", "1f1b", "interleaved", "zb", "zbv", "zb1p", "dualpipev"}) {
    CATCH_CHECK(schedule_kind_name(schedule_kind(name)) == name);
    CATCH_CHECK(make_schedule(schedule_kind(name), 2, 4).name == name);
  }
}

// Sweeps: every generated schedule is valid (with and without its transfers) and has the bubble
// and the micro-batches in flight of its definition (schedules.md), with F = I = W = 1 (B = 2).

CATCH_TEST_CASE("GPipe and 1F1B: bubble (n-1)/(m+n-1); in flight m and min(n-s, m)",
                "[schedule]") {
  const int64_t n = GENERATE(1, 2, 3, 4, 5);
  const int64_t m = GENERATE(1, 2, 3, 4, 7, 8, 16);
  CATCH_CAPTURE(n, m);
  const double bubble = static_cast<double>(n - 1) / (m + n - 1);
  const ScheduleSimulation gpipe = simulate_schedule(gpipe_schedule(n, m));
  const ScheduleSimulation f1b1 = simulate_schedule(one_f_one_b_schedule(n, m));
  CATCH_CHECK(gpipe.bubble == gpipe_test::Approx(bubble).margin(1e-12));
  CATCH_CHECK(f1b1.bubble == gpipe_test::Approx(bubble).margin(1e-12));
  CATCH_CHECK(gpipe.makespan == gpipe_test::Approx(3.0 * (m + n - 1)));
  CATCH_CHECK(f1b1.makespan == gpipe_test::Approx(gpipe.makespan));
  for (int64_t s = 0; s < n; ++s) {
    CATCH_CHECK(gpipe.peak_in_flight[s] == m);
    CATCH_CHECK(f1b1.peak_in_flight[s] == std::min(n - s, m));
  }
}

CATCH_TEST_CASE("interleaved 1F1B divides the bubble by v", "[schedule]") {
  const int64_t n = GENERATE(2, 3, 4);
  const int64_t v = GENERATE(2, 3);
  const int64_t groups = GENERATE(1, 2, 4);
  const int64_t m = n * groups;
  CATCH_CAPTURE(n, v, m);
  const Schedule s = interleaved_schedule(n, m, v);
  // Each chunk costs 1/v of a stage.
  ActionCosts chunk;
  chunk.forward = chunk.backward_input = chunk.backward_weight = 1.0 / v;
  const ScheduleSimulation sim = simulate_schedule(s, chunk);
  CATCH_CHECK(sim.makespan == gpipe_test::Approx(3.0 * m + 3.0 * (n - 1) / v));
  CATCH_CHECK(sim.bubble == gpipe_test::Approx(static_cast<double>(n - 1) / (v * m + n - 1)));
  for (int64_t r = 0; r < n; ++r) {
    CATCH_CHECK(sim.peak_in_flight[r] == std::min((n - r - 1) * 2 + (v - 1) * n + 1, v * m));
  }
}

CATCH_TEST_CASE("ZB-H1: bubble (n-1)(F+I-W), a third of 1F1B's, peak in flight at most n",
                "[schedule]") {
  const int64_t n = GENERATE(2, 3, 4, 5);
  const int64_t m = GENERATE(5, 8, 16);
  CATCH_CAPTURE(n, m);
  const ScheduleSimulation zb = simulate_schedule(zero_bubble_schedule(n, m));
  const ScheduleSimulation f1b1 = simulate_schedule(one_f_one_b_schedule(n, m));
  CATCH_CHECK(zb.makespan == gpipe_test::Approx(3.0 * m + (n - 1) * (1.0 + 1.0 - 1.0)));
  CATCH_CHECK(f1b1.makespan - 3.0 * m == gpipe_test::Approx(3 * (zb.makespan - 3.0 * m)));
  CATCH_CHECK(zb.bubble < f1b1.bubble);
  for (int64_t s = 0; s < n; ++s) {
    CATCH_CHECK(zb.peak_in_flight[s] <= n);
    CATCH_CHECK(zb.peak_in_flight[s] >= f1b1.peak_in_flight[s]);
  }
  CATCH_CHECK(zb.peak_in_flight[0] == n);
  // Uneven costs: W longer than F + I leaves no bubble to fill beyond what W can.
  ActionCosts costs;
  costs.backward_weight = 0.5;
  const ScheduleSimulation cheap_w = simulate_schedule(zero_bubble_schedule(n, m), costs);
  CATCH_CHECK(cheap_w.makespan == gpipe_test::Approx(2.5 * m + (n - 1) * (1.0 + 1.0 - 0.5)));
}

CATCH_TEST_CASE("a larger micro-batch group keeps interleaving's bubble, holds more in flight and "
                "hides slow hops",
                "[schedule]") {
  const int64_t n = GENERATE(2, 3, 4);
  const int64_t v = GENERATE(2, 3);
  const int64_t extra = GENERATE(0, 1, 3);  // the group: n + 1, 2n or 4n micro-batches
  const int64_t g = extra == 0 ? n + 1 : (extra + 1) * n;
  const int64_t m = 2 * g * n;  // a multiple of both groups
  CATCH_CAPTURE(n, v, g, m);
  const Schedule grouped = interleaved_schedule(n, m, v, g);
  const Schedule plain = interleaved_schedule(n, m, v);
  CATCH_REQUIRE_NOTHROW(check_schedule(grouped));
  CATCH_REQUIRE_NOTHROW(check_schedule(with_communication(grouped)));
  CATCH_CHECK(schedule_text(interleaved_schedule(n, m, v, n)) == schedule_text(plain));
  // Rank 0 warms up with (n - 1) * 2 + (v - 1) * g forwards, the first g micro-batches through
  // chunk 0 first.
  for (int64_t i = 0; i < g; ++i) CATCH_CHECK(grouped.ranks[0][i] == (Action{ActionType::kForward, 0, i}));
  CATCH_CHECK(grouped.ranks[0][g] == (Action{ActionType::kForward, n, 0}));
  ActionCosts chunk;
  chunk.forward = chunk.backward_input = chunk.backward_weight = 1.0 / v;
  const ScheduleSimulation sim = simulate_schedule(grouped, chunk);
  CATCH_CHECK(sim.bubble == gpipe_test::Approx(simulate_schedule(plain, chunk).bubble));
  for (int64_t r = 0; r < n; ++r) {
    CATCH_CHECK(sim.peak_in_flight[r] == std::min((n - r - 1) * 2 + (v - 1) * g + 1, v * m));
  }
  // A hop of a whole chunk's forward: the larger group's step is shorter (Note [Micro-batch
  // groups]).
  ActionCosts slow = chunk;
  slow.transfer = 1.0 / v;
  CATCH_CHECK(simulate_schedule(with_communication(grouped), slow).makespan <
              simulate_schedule(with_communication(plain), slow).makespan);
}

// The most (stage, micro-batch) pairs rank r holds at once, and the most W it keeps waiting
// (I run, W not yet), counted from its actions.
std::pair<int64_t, int64_t> held_by(const Schedule& s, int64_t r) {
  int64_t held = 0, peak = 0, waiting = 0, most_waiting = 0;
  for (const Action& a : s.ranks[r]) {
    held += a.type == ActionType::kForward                                             ? 1
            : a.type == ActionType::kBackward || a.type == ActionType::kBackwardWeight ? -1
                                                                                       : 0;
    waiting += a.type == ActionType::kBackwardInput    ? 1
               : a.type == ActionType::kBackwardWeight ? -1
                                                       : 0;
    peak = std::max(peak, held);
    most_waiting = std::max(most_waiting, waiting);
  }
  return {peak, most_waiting};
}

CATCH_TEST_CASE("zbv places stages in a V and holds 1F1B's peak with nearly no bubble",
                "[schedule]") {
  const int64_t n = GENERATE(1, 2, 3, 4, 5);
  const int64_t m = GENERATE(1, 2, 3, 5, 8, 9, 16);
  CATCH_CAPTURE(n, m);
  const Schedule s = zbv_schedule(n, m);
  CATCH_REQUIRE_NOTHROW(check_schedule(s));
  CATCH_REQUIRE_NOTHROW(check_schedule(with_communication(s)));
  CATCH_CHECK(s.stages == 2 * n);
  CATCH_CHECK(s.num_ranks() == n);
  for (int64_t r = 0; r < n; ++r) {
    CATCH_CHECK(s.stages_of(r) == (std::vector<int64_t>{r, 2 * n - 1 - r}));
    // In flight: at most 2n half-size stage-micro-batches (1F1B's n whole ones), counted from
    // the actions, and the simulation agrees.
    CATCH_CHECK(held_by(s, r).first <= std::min(2 * n, 2 * m));
    // The warm-up: 2(n - r) - 1 forwards of stage r first.
    for (int64_t k = 0; k < std::min(2 * (n - r) - 1, m); ++k) {
      CATCH_CHECK(s.ranks[r][k] == (Action{ActionType::kForward, r, k}));
    }
  }
  // Equal F, I and W, each stage half a rank's layers: shorter than ZB-H1 and 1F1B over the
  // same ranks, and the middle stages cross no rank.
  ActionCosts half;
  half.forward = half.backward_input = half.backward_weight = 0.5;
  const ScheduleSimulation zbv = simulate_schedule(s, half);
  CATCH_CHECK(zbv.peak_in_flight[0] == held_by(s, 0).first);
  if (m >= 2 * n && n >= 2) {
    CATCH_CHECK(held_by(s, 0).first == 2 * n);
    CATCH_CHECK(zbv.makespan < simulate_schedule(zero_bubble_schedule(n, m)).makespan);
    CATCH_CHECK(zbv.bubble < simulate_schedule(one_f_one_b_schedule(n, m)).bubble / 2);
  }
  const Schedule wired = with_communication(s);
  for (const Action& a : wired.ranks[n - 1]) {
    CATCH_CHECK(!(a.type == ActionType::kSendForward && a.stage == n - 1));
  }
}

CATCH_TEST_CASE(
    "dualpipev runs DeepSeek's eight steps on the V, with one stage-micro-batch more "
    "than zbv in flight",
    "[schedule]") {
  const int64_t n = GENERATE(1, 2, 3, 4, 5);
  const int64_t m = GENERATE(1, 2, 3, 5, 8, 9, 16);
  CATCH_CAPTURE(n, m);
  const Schedule s = dualpipev_schedule(n, m);
  CATCH_REQUIRE_NOTHROW(check_schedule(s));
  CATCH_REQUIRE_NOTHROW(check_schedule(with_communication(s)));
  CATCH_CHECK(s.stage_ranks == zbv_schedule(n, m).stage_ranks);
  if (m < 2 * n - 1) {
    // No main step: zbv's order.
    CATCH_CHECK(s.ranks == zbv_schedule(n, m).ranks);
    return;
  }
  for (int64_t r = 0; r < n; ++r) {
    const int64_t down = r, up = 2 * n - 1 - r;
    const std::vector<Action>& a = s.ranks[r];
    // Steps 1 and 2: 2(n - r - 1) forwards of stage r, then r + 1 pairs (F of r, F of 2n-1-r).
    size_t k = 0;
    for (int64_t i = 0; i < 2 * (n - r - 1); ++i) {
      CATCH_CHECK(a[k++] == (Action{ActionType::kForward, down, i}));
    }
    for (int64_t i = 0; i < r + 1; ++i) {
      CATCH_CHECK(a[k++] == (Action{ActionType::kForward, down, 2 * (n - r - 1) + i}));
      CATCH_CHECK(a[k++] == (Action{ActionType::kForward, up, i}));
    }
    // Step 3's first triple: I, W, F of the up stage.
    if (n - r - 1 > 0) {
      CATCH_CHECK(a[k] == (Action{ActionType::kBackwardInput, up, 0}));
      CATCH_CHECK(a[k + 1] == (Action{ActionType::kBackwardWeight, up, 0}));
    }
    // The main step's backwards are whole: two per round, m - 2n + r + 1 rounds.
    int64_t whole = 0;
    for (const Action& x : a) whole += x.type == ActionType::kBackward;
    CATCH_CHECK(whole >= 2 * (m - 2 * n + r + 1));
    // In flight: zbv's 2n plus one.
    CATCH_CHECK(held_by(s, r).first <= 2 * n + 1);
  }
  ActionCosts half;
  half.forward = half.backward_input = half.backward_weight = 0.5;
  const ScheduleSimulation sim = simulate_schedule(s, half);
  if (n >= 2) CATCH_CHECK(sim.bubble < simulate_schedule(one_f_one_b_schedule(n, m)).bubble / 2);
}

CATCH_TEST_CASE("dualpipev over 2 ranks and 6 micro-batches is DeepSeek's eight steps",
                "[schedule]") {
  // Written out by hand from the steps (Note [V-shaped placement]), chunk 0 = stage r, chunk 1 =
  // stage 3 - r. Rank 0: 1 nF0 (2), 2 nF0F1 (1), 3 nB1W1F1 (1), 4 nF0B1F1B0 (3), 5 nB1F1B0 (1),
  // 6 nB1B0 (1: B1 whole, B0 split), 7 nWB0 (1), 8 nW (1).
  const Schedule s = dualpipev_schedule(2, 6);
  CATCH_CHECK(rank_text(s, 0) ==
              "0F0 0F1 "
              "0F2 3F0 "
              "3I0 3W0 3F1 "
              "0F3 3B1 3F2 0B0 0F4 3B2 3F3 0B1 0F5 3B3 3F4 0B2 "
              "3B4 3F5 0B3 "
              "3B5 0I4 "
              "0W4 0I5 "
              "0W5");
  // Rank 1 (odd: step 6 splits from chunk 1's second backward): 2 nF0F1 (2), 4 (4), 6 (2), 8 (2).
  CATCH_CHECK(rank_text(s, 1) ==
              "1F0 2F0 1F1 2F1 "
              "1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 1F4 2B2 2F4 1B2 1F5 2B3 2F5 1B3 "
              "2B4 1B4 2I5 1I5 "
              "2W5 1W5");
}

CATCH_TEST_CASE(
    "zb1p is interleaved 1F1B with backwards split and rank r keeping up to r W "
    "waiting",
    "[schedule]") {
  const int64_t n = GENERATE(2, 3, 4);
  const int64_t v = GENERATE(1, 2, 3);
  const int64_t m = n * GENERATE(1, 2, 4);
  CATCH_CAPTURE(n, v, m);
  const Schedule zb1p = interleaved_zero_bubble_schedule(n, m, v);
  const Schedule interleaved = interleaved_schedule(n, m, v);
  CATCH_REQUIRE_NOTHROW(check_schedule(zb1p));
  CATCH_CHECK(zb1p.stage_ranks == interleaved.stage_ranks);
  for (int64_t r = 0; r < n; ++r) {
    // Without its W, each rank's order is interleaved 1F1B's with I for B.
    std::vector<Action> without_w;
    for (Action a : zb1p.ranks[r]) {
      if (a.type == ActionType::kBackwardWeight) continue;
      if (a.type == ActionType::kBackwardInput) a.type = ActionType::kBackward;
      without_w.push_back(a);
    }
    CATCH_CHECK(without_w == interleaved.ranks[r]);
    // Up to r W wait at once (one more right after an I, before the oldest runs).
    CATCH_CHECK(held_by(zb1p, r).second <= std::min(r + 1, v * m));
    CATCH_CHECK(held_by(zb1p, r).first <= held_by(interleaved, r).first + r);
  }
  // Equal F, I and W per chunk: a smaller bubble than interleaved 1F1B's.
  ActionCosts chunk;
  chunk.forward = chunk.backward_input = chunk.backward_weight = 1.0 / v;
  CATCH_CHECK(simulate_schedule(zb1p, chunk).makespan <
              simulate_schedule(interleaved, chunk).makespan);
  if (v == 1) CATCH_CHECK(schedule_text(zb1p) == schedule_text(zero_bubble_schedule(n, m)));
}

CATCH_TEST_CASE("A V-shaped schedule round-trips through text, and zbv is known by name",
                "[schedule]") {
  const Schedule s = zbv_schedule(3, 6);
  const Schedule parsed = parse_schedule(schedule_text(s));
  CATCH_CHECK(parsed.stage_ranks == s.stage_ranks);
  CATCH_CHECK(parsed.ranks == s.ranks);
  CATCH_CHECK(schedule_kind("zbv") == ScheduleKind::kZeroBubbleV);
  CATCH_CHECK(schedule_kind("zb1p") == ScheduleKind::kInterleavedZeroBubble);
  CATCH_CHECK(schedule_kind_name(ScheduleKind::kZeroBubbleV) == "zbv");
  CATCH_CHECK(make_schedule(ScheduleKind::kZeroBubbleV, 3, 6, 2).ranks == s.ranks);
  CATCH_CHECK_THROWS_WITH(make_schedule(ScheduleKind::kZeroBubbleV, 3, 6, 3),
                          gpipe_test::contains("zbv always has 2"));
  CATCH_CHECK_THROWS_WITH(make_schedule(ScheduleKind::kDualPipeV, 3, 6, 3),
                          gpipe_test::contains("dualpipev always has 2"));
  CATCH_CHECK_THROWS_WITH(interleaved_zero_bubble_schedule(2, 3, 2),
                          gpipe_test::contains("interleaved_zero_bubble_schedule: the number of "
                                               "micro-batches (3) must be a multiple of the "
                                               "number of partitions (2)"));
  CATCH_CHECK(schedule_kind("dualpipev") == ScheduleKind::kDualPipeV);
  CATCH_CHECK_THROWS_WITH(make_schedule(ScheduleKind::kZeroBubble, 3, 6, 2),
                          gpipe_test::contains("only interleaved and zb1p take more than 1"));
}

CATCH_TEST_CASE("stage_rank gives every generated schedule's placement: a V for zbv and "
                "dualpipev, round robin for the others",
                "[schedule]") {
  const ScheduleKind kind = GENERATE(
      ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
      ScheduleKind::kZeroBubble, ScheduleKind::kZeroBubbleV, ScheduleKind::kInterleavedZeroBubble,
      ScheduleKind::kDualPipeV);
  const int64_t n = GENERATE(1, 2, 3);
  CATCH_CAPTURE(schedule_kind_name(kind), n);
  const int64_t virtual_stages = takes_virtual_stages(kind) ? 2 : v_shaped(kind) ? 2 : 1;
  const Schedule s = make_schedule(kind, n, 6, virtual_stages);
  for (int64_t stage = 0; stage < s.stages; ++stage) {
    CATCH_CHECK(stage_rank(kind, stage, n) == s.stage_ranks[stage]);
  }
  // The same placements written out: rank r holds r and 2n - 1 - r on a V, r, r + n, ... else.
  std::vector<int64_t> expected;
  for (int64_t stage = 0; stage < s.stages; ++stage) {
    expected.push_back(!v_shaped(kind) ? stage % n : stage < n ? stage : 2 * n - 1 - stage);
  }
  CATCH_CHECK(s.stage_ranks == expected);
}

CATCH_TEST_CASE("stage_rank refuses a stage a V over that many ranks does not have", "[schedule]") {
  CATCH_CHECK(stage_rank(ScheduleKind::kZeroBubbleV, 5, 3) == 0);
  CATCH_CHECK_THROWS_WITH(stage_rank(ScheduleKind::kZeroBubbleV, 6, 3),
                          gpipe_test::contains("stage 6 over 3 ranks is not a stage of zbv"));
  CATCH_CHECK_THROWS_WITH(stage_rank(ScheduleKind::k1F1B, -1, 3),
                          gpipe_test::contains("stage -1 over 3 ranks"));
  CATCH_CHECK_THROWS_WITH(stage_rank(ScheduleKind::kGPipe, 0, 0),
                          gpipe_test::contains("stage 0 over 0 ranks"));
}

CATCH_TEST_CASE("every generated schedule checks, with its transfers too, at the same cost",
                "[schedule]") {
  const auto kind = GENERATE(ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                             ScheduleKind::kZeroBubble, ScheduleKind::kZeroBubbleV,
                             ScheduleKind::kInterleavedZeroBubble, ScheduleKind::kDualPipeV);
  const int64_t n = GENERATE(1, 2, 3, 4);
  const int64_t m = GENERATE(1, 2, 4, 5, 8);
  const int64_t v = takes_virtual_stages(kind) && m % n == 0 ? GENERATE(1, 2, 3) : 1;
  CATCH_CAPTURE(schedule_kind_name(kind), n, m, v);
  const Schedule s = make_schedule(kind, n, m, v);
  CATCH_REQUIRE_NOTHROW(check_schedule(s));
  CATCH_CHECK_FALSE(has_communication(s));
  const Schedule wired = with_communication(s);
  CATCH_CHECK(has_communication(wired) == (n > 1));
  // Every action of the schedule is kept, in the same order on each rank.
  for (int64_t r = 0; r < n; ++r) {
    std::vector<Action> compute;
    for (const Action& a : wired.ranks[r]) {
      if (!is_communication(a.type)) compute.push_back(a);
    }
    CATCH_CHECK(compute == s.ranks[r]);
  }
  // The transfers add no waiting.
  CATCH_CHECK(simulate_schedule(wired).makespan ==
              gpipe_test::Approx(simulate_schedule(s).makespan));
  ActionCosts slow_wire;
  slow_wire.transfer = 0.25;
  CATCH_CHECK(simulate_schedule(wired, slow_wire).makespan >= simulate_schedule(s).makespan);
  CATCH_CHECK(with_communication(wired).ranks == wired.ranks);
}

}  // namespace
}  // namespace gpipe
