// The block partitioner against brute force: optimal bottleneck, deterministic ties, and the
// memory-constrained variant.
#include "tests/catch.h"

#include <functional>
#include <limits>
#include <random>
#include <vector>

#include <c10/util/Exception.h>

#include "balancing/partition.h"

namespace gpipe {
namespace {

// Every balance of n layers into k non-empty blocks, in lexicographic order.
void each_balance(int64_t n, int64_t k, const std::function<void(const std::vector<int64_t>&)>& fn) {
  std::vector<int64_t> balance;
  std::function<void(int64_t, int64_t)> rec = [&](int64_t left, int64_t blocks) {
    if (blocks == 1) {
      balance.push_back(left);
      fn(balance);
      balance.pop_back();
      return;
    }
    for (int64_t b = 1; b <= left - (blocks - 1); ++b) {
      balance.push_back(b);
      rec(left - b, blocks - 1);
      balance.pop_back();
    }
  };
  rec(n, k);
}

// The brute-force answer: the lexicographically first balance with the smallest bottleneck
// (optionally subject to memory capacities).
std::vector<int64_t> brute_force(const std::vector<double>& costs, int64_t k,
                                 const std::vector<double>* memory = nullptr,
                                 const std::vector<double>* capacities = nullptr) {
  double best = std::numeric_limits<double>::infinity();
  std::vector<int64_t> answer;
  each_balance(static_cast<int64_t>(costs.size()), k, [&](const std::vector<int64_t>& balance) {
    size_t next = 0;
    double worst = 0;
    for (size_t j = 0; j < balance.size(); ++j) {
      double time = 0, bytes = 0;
      for (int64_t l = 0; l < balance[j]; ++l, ++next) {
        time += costs[next];
        if (memory) bytes += (*memory)[next];
      }
      if (memory && bytes > (*capacities)[j]) return;
      worst = std::max(worst, time);
    }
    if (worst < best) {
      best = worst;
      answer = balance;
    }
  });
  return answer;
}

CATCH_TEST_CASE("block_partition equals brute force on thousands of random cases",
                "[balancing][partition]") {
  std::mt19937 rng(12345);
  int cases = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const int64_t n = 1 + rng() % 10;
    const int64_t k = 1 + rng() % n;
    // Small integer costs (exact in double), zeros included, so ties are frequent.
    std::vector<double> costs(n);
    for (double& c : costs) c = static_cast<double>(rng() % 6);
    const std::vector<int64_t> expected = brute_force(costs, k);
    const std::vector<int64_t> actual = block_partition(costs, k);
    CATCH_INFO("trial " << trial);
    CATCH_REQUIRE(actual == expected);
    ++cases;
  }
  CATCH_CHECK(cases == 4000);
}

CATCH_TEST_CASE("block_partition handles the reference's examples and equal costs",
                "[balancing][partition]") {
  CATCH_CHECK(block_partition(std::vector<double>{1, 2, 3, 4, 5, 6}, 2) ==
              std::vector<int64_t>{4, 2});
  CATCH_CHECK(bottleneck(std::vector<double>{1, 2, 3, 4, 5, 6}, std::vector<int64_t>{4, 2}) == 11);
  CATCH_CHECK(block_costs(std::vector<double>{1, 2, 3, 4, 5, 6}, std::vector<int64_t>{4, 2}) ==
              std::vector<double>{10, 11});
  // Ten equal layers in three blocks: bottleneck 4; the earliest blocks as short as possible.
  CATCH_CHECK(block_partition(std::vector<double>(10, 1.0), 3) == std::vector<int64_t>{2, 4, 4});
  CATCH_CHECK(block_partition(std::vector<double>{5}, 1) == std::vector<int64_t>{1});
  // The Barany-Grinberg heuristic of the Python reference is not optimal here; this is.
  const std::vector<double> costs{1, 1, 1, 1, 1, 10, 1, 1, 1, 1, 1};
  CATCH_CHECK(bottleneck(costs, block_partition(costs, 3)) == 10);
}

CATCH_TEST_CASE("block_partition refuses impossible requests", "[balancing][partition][errors]") {
  CATCH_CHECK_THROWS_WITH(block_partition(std::vector<double>{1, 2}, 0),
                          gpipe_test::contains("partitions must be at least 1, got 0"));
  CATCH_CHECK_THROWS_WITH(block_partition(std::vector<double>{1, 2}, 3),
                          gpipe_test::contains("cannot split 2 layers into 3"));
  CATCH_CHECK_THROWS_WITH(block_partition(std::vector<double>{1, -2}, 1),
                          gpipe_test::contains("layer 1 is -2"));
  CATCH_CHECK_THROWS_WITH(
      block_partition(std::vector<double>{1, std::numeric_limits<double>::quiet_NaN()}, 1),
      gpipe_test::contains("finite and non-negative"));
}

CATCH_TEST_CASE("the memory-constrained partition equals brute force", "[balancing][partition]") {
  std::mt19937 rng(777);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t n = 1 + rng() % 9;
    const int64_t k = 1 + rng() % n;
    std::vector<double> times(n), memory(n), capacities(k);
    for (double& t : times) t = static_cast<double>(rng() % 6);
    for (double& m : memory) m = static_cast<double>(1 + rng() % 5);
    for (double& c : capacities) c = static_cast<double>(3 + rng() % 10);
    const std::vector<int64_t> expected = brute_force(times, k, &memory, &capacities);
    CATCH_INFO("trial " << trial);
    if (expected.empty()) {
      CATCH_CHECK_THROWS_WITH(block_partition_with_memory(times, memory, capacities),
                              gpipe_test::contains("do not fit the memory capacities"));
    } else {
      CATCH_CHECK(block_partition_with_memory(times, memory, capacities) == expected);
    }
  }
}

CATCH_TEST_CASE("a model that only fits when balanced by memory", "[balancing][partition]") {
  // By time alone the heavy-memory layers 0-2 would share a partition; the capacities forbid it.
  const std::vector<double> times{1, 1, 1, 3, 3};
  const std::vector<double> memory{4, 4, 4, 1, 1};
  const std::vector<double> capacities{8, 8};
  CATCH_CHECK(block_partition(times, 2) == std::vector<int64_t>{3, 2});
  const auto balance = block_partition_with_memory(times, memory, capacities);
  CATCH_CHECK(balance == std::vector<int64_t>{2, 3});
  CATCH_CHECK_THROWS_WITH(block_partition_with_memory(times, memory, std::vector<double>{7, 7}),
                          gpipe_test::contains("do not fit"));
}

}  // namespace
}  // namespace gpipe
