// How long the exact block partitioner takes for 1,000 layers and 64 partitions, on several cost
// shapes (the worst case is reported), and the memory-constrained variant beside it.
//
//   bazel run //benchmarks:partition -- --repeats=20
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "balancing/partition.h"
#include "benchmarks/timing.h"

ABSL_FLAG(int, layers, 1000, "number of layers");
ABSL_FLAG(int, partitions, 64, "number of partitions");
ABSL_FLAG(int, repeats, 20, "timed runs per case (the median is reported)");

namespace {

using gpipe_benchmarks::median_ms;


}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_layers);
  const int k = absl::GetFlag(FLAGS_partitions);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  std::mt19937 rng(1);
  std::vector<std::pair<std::string, std::vector<double>>> cases;
  {
    std::vector<double> c(n);
    std::uniform_real_distribution<double> u(0, 1);
    for (double& x : c) x = u(rng);
    cases.emplace_back("uniform random", c);
  }
  cases.emplace_back("all equal", std::vector<double>(n, 1.0));
  {
    std::vector<double> c(n);
    for (int i = 0; i < n; ++i) c[i] = i + 1;
    cases.emplace_back("increasing", c);
  }
  {
    std::vector<double> c(n, 1.0);
    c[n / 2] = 1e6;
    cases.emplace_back("one huge layer", c);
  }
  {
    std::vector<double> c(n);
    std::lognormal_distribution<double> heavy(0, 3);
    for (double& x : c) x = heavy(rng);
    cases.emplace_back("heavy-tailed", c);
  }
  std::printf("block_partition, %d layers into %d partitions, median of %d runs\n\n", n, k,
              repeats);
  std::printf("%-16s %10s %14s\n", "costs", "ms", "bottleneck");
  double worst = 0;
  for (const auto& [name, costs] : cases) {
    std::vector<int64_t> balance;
    const double ms = median_ms([&] { balance = gpipe::block_partition(costs, k); }, repeats);
    worst = std::max(worst, ms);
    std::printf("%-16s %10.3f %14.1f\n", name.c_str(), ms, gpipe::bottleneck(costs, balance));
  }
  std::printf("worst case: %.3f ms\n", worst);

  // The memory-constrained variant, O(partitions * layers^2).
  const std::vector<double>& times = cases[0].second;
  std::vector<double> memory(n, 1.0);
  std::vector<double> capacities(k, 2.0 * n / k);
  const double memory_ms = median_ms(
      [&] { gpipe::block_partition_with_memory(times, memory, capacities); }, std::max(1, repeats / 5));
  std::printf("\nblock_partition_with_memory, uniform random times, %d x %d: %.1f ms\n", n, k,
              memory_ms);
  return 0;
}
