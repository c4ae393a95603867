// Block partition; see Note [Optimal block partition] in partition.h.
#include "balancing/partition.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <c10/util/Exception.h>

namespace gpipe {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

void check_partition_costs(absl::Span<const double> costs, int64_t partitions, const char* what) {
  TORCH_CHECK(partitions >= 1, "block partition: partitions must be at least 1, got ",
              partitions);
  TORCH_CHECK(static_cast<int64_t>(costs.size()) >= partitions, "block partition: cannot split ",
              costs.size(), " layers into ", partitions, " non-empty partitions; use at most ",
              costs.size(), " partitions");
  for (size_t k = 0; k < costs.size(); ++k) {
    TORCH_CHECK(std::isfinite(costs[k]) && costs[k] >= 0, "block partition: ", what, " of layer ",
                k, " is ", costs[k], "; costs must be finite and non-negative");
  }
}

std::vector<double> prefix_sums(absl::Span<const double> costs) {
  std::vector<double> s(costs.size() + 1, 0.0);
  for (size_t k = 0; k < costs.size(); ++k) {
    s[k + 1] = s[k] + costs[k];
  }
  return s;
}

}  // namespace

std::vector<double> block_costs(absl::Span<const double> costs,
                                absl::Span<const int64_t> balance) {
  std::vector<double> sums;
  sums.reserve(balance.size());
  size_t next = 0;
  for (int64_t b : balance) {
    double sum = 0;
    for (int64_t k = 0; k < b; ++k) {
      sum += costs[next++];
    }
    sums.push_back(sum);
  }
  return sums;
}

double bottleneck(absl::Span<const double> costs, absl::Span<const int64_t> balance) {
  const std::vector<double> sums = block_costs(costs, balance);
  return sums.empty() ? 0.0 : *std::max_element(sums.begin(), sums.end());
}

std::vector<int64_t> block_partition(absl::Span<const double> costs, int64_t partitions) {
  check_partition_costs(costs, partitions, "the cost");
  const int64_t n = static_cast<int64_t>(costs.size());
  const int64_t k = partitions;
  const std::vector<double> s = prefix_sums(costs);

  // f[i]: best bottleneck of the first i layers in p blocks (p grows each round).
  std::vector<double> f(n + 1, kInf);
  for (int64_t i = 1; i <= n; ++i) {
    f[i] = s[i];
  }
  std::vector<double> g(n + 1, kInf);
  for (int64_t p = 2; p <= k; ++p) {
    std::fill(g.begin(), g.end(), kInf);
    for (int64_t i = p; i <= n; ++i) {
      // j in [p-1, i-1]: f[j] non-decreasing, s[i]-s[j] non-increasing. Find the first j where
      // f[j] >= s[i]-s[j]; the optimum is there or just before.
      int64_t lo = p - 1;
      int64_t hi = i - 1;
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (f[mid] >= s[i] - s[mid]) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      double best = std::max(f[lo], s[i] - s[lo]);
      if (lo > p - 1) {
        best = std::min(best, std::max(f[lo - 1], s[i] - s[lo - 1]));
      }
      g[i] = best;
    }
    std::swap(f, g);
  }
  const double optimum = f[n];

  // need[i]: the fewest blocks, each at most `optimum`, that cover layers i..n-1 (greedy: each
  // block as long as possible), with reach[i] the end of the first such block.
  std::vector<int64_t> need(n + 1, 0);
  int64_t end = n;
  for (int64_t i = n - 1; i >= 0; --i) {
    // The longest block starting at i: the largest e with s[e] - s[i] <= optimum.
    while (s[end] - s[i] > optimum) {
      --end;
    }
    need[i] = 1 + need[end];
  }

  // Left to right, each block as short as the rest allows.
  std::vector<int64_t> balance;
  int64_t start = 0;
  for (int64_t block = 0; block < k - 1; ++block) {
    const int64_t rest = k - 1 - block;
    int64_t b = 1;
    for (;; ++b) {
      const int64_t next = start + b;
      TORCH_CHECK(next <= n - rest && s[next] - s[start] <= optimum,
                  "block partition: internal error: no block fits the optimum ", optimum);
      if (need[next] <= rest) {
        break;
      }
    }
    balance.push_back(b);
    start += b;
  }
  balance.push_back(n - start);
  return balance;
}

std::vector<int64_t> block_partition_with_memory(absl::Span<const double> times,
                                                 absl::Span<const double> memory,
                                                 absl::Span<const double> capacities) {
  const int64_t k = static_cast<int64_t>(capacities.size());
  check_partition_costs(times, k, "the time");
  TORCH_CHECK(memory.size() == times.size(), "block partition: ", times.size(), " times but ",
              memory.size(), " memory sizes; give one of each per layer");
  check_partition_costs(memory, k, "the memory");
  const int64_t n = static_cast<int64_t>(times.size());
  const std::vector<double> t = prefix_sums(times);
  const std::vector<double> m = prefix_sums(memory);
  auto fits = [&](int64_t p, int64_t from, int64_t to) {  // layers [from, to) as block p
    return m[to] - m[from] <= capacities[p];
  };

  // ok[p][i]: layers i..n-1 split into blocks p..k-1 with each block's time <= bound and memory
  // within its capacity; computed for a given bound.
  auto suffix_table = [&](double bound) {
    std::vector<std::vector<char>> ok(k + 1, std::vector<char>(n + 1, 0));
    ok[k][n] = 1;
    for (int64_t p = k - 1; p >= 0; --p) {
      for (int64_t i = n - 1; i >= 0; --i) {
        for (int64_t e = i + 1; e <= n && t[e] - t[i] <= bound; ++e) {
          if (ok[p + 1][e] && fits(p, i, e)) {
            ok[p][i] = 1;
            break;
          }
        }
      }
    }
    return ok;
  };

  // f[p][i]: the best bottleneck of the first i layers in blocks 0..p-1.
  std::vector<std::vector<double>> f(k + 1, std::vector<double>(n + 1, kInf));
  f[0][0] = 0;
  for (int64_t p = 1; p <= k; ++p) {
    for (int64_t i = p; i <= n; ++i) {
      for (int64_t j = p - 1; j < i; ++j) {
        if (f[p - 1][j] < kInf && fits(p - 1, j, i)) {
          f[p][i] = std::min(f[p][i], std::max(f[p - 1][j], t[i] - t[j]));
        }
      }
    }
  }
  const double optimum = f[k][n];
  TORCH_CHECK(optimum < kInf, "block partition: the layers do not fit the memory capacities in ",
              k, " partitions; the largest layer needs ",
              *std::max_element(memory.begin(), memory.end()), " and the capacities add up to ",
              [&] {
                double c = 0;
                for (double x : capacities) c += x;
                return c;
              }());
  const auto ok = suffix_table(optimum);
  std::vector<int64_t> balance;
  int64_t start = 0;
  for (int64_t p = 0; p < k; ++p) {
    int64_t e = start + 1;
    while (!(ok[p + 1][e] && fits(p, start, e) && t[e] - t[start] <= optimum)) {
      ++e;
      TORCH_CHECK(e <= n, "block partition: internal error reconstructing the optimum");
    }
    balance.push_back(e - start);
    start = e;
  }
  return balance;
}

}  // namespace gpipe
