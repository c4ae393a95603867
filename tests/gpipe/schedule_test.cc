// Tests of the clock-cycle schedule (gpipe/schedule.h).
#include "tests/catch.h"

#include <ostream>
#include <set>

#include <c10/util/Exception.h>

#include "gpipe/schedule.h"

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

}  // namespace
}  // namespace gpipe
