// Block partition: split a sequence of per-layer costs into contiguous blocks, one per device,
// so that the largest block cost (the pipeline's bottleneck) is as small as possible.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace gpipe {

// Note [Optimal block partition]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The Python reference uses the Barany-Grinberg heuristic, which is not always optimal. gpipe
// solves the problem exactly. With prefix sums S, f[p][i] (the best bottleneck of the first i
// layers in p blocks) is min over j of max(f[p-1][j], S[i] - S[j]); f[p-1][j] grows with j and
// S[i] - S[j] shrinks, so the best j is found by binary search: O(partitions * n log n). Among the
// balances with the optimal bottleneck, the lexicographically smallest is returned (earlier blocks
// as short as possible), which makes ties deterministic; it is built left to right with a table of
// how few blocks each suffix needs at that bottleneck.

/// Splits `costs` (non-negative, one per layer) into `partitions` non-empty contiguous blocks
/// minimising the largest block sum, and returns the number of layers in each block.
///
///   gpipe::block_partition({1, 2, 3, 4, 5, 6}, 2);  // {4, 2}: 10 and 11
///
/// Throws c10::Error when partitions < 1, partitions > costs.size(), or a cost is negative or not
/// finite.
std::vector<int64_t> block_partition(absl::Span<const double> costs, int64_t partitions);

/// The sum of `costs` over each block of `balance`.
///
///   gpipe::block_costs({1, 2, 3, 4, 5, 6}, {4, 2});  // {10, 11}
std::vector<double> block_costs(absl::Span<const double> costs, absl::Span<const int64_t> balance);

/// The largest block sum of `balance` over `costs`.
double bottleneck(absl::Span<const double> costs, absl::Span<const int64_t> balance);

/// Like block_partition on `times`, subject to block j's summed `memory` being at most
/// `capacities[j]` (one per partition): for a model that only fits when balanced by memory.
/// Exact, by dynamic programming over (partition, layer): O(partitions * n^2). Returns the
/// lexicographically smallest optimal balance; throws c10::Error when no split fits.
///
///   gpipe::block_partition_with_memory(times, bytes, {16e9, 16e9, 16e9, 16e9});
std::vector<int64_t> block_partition_with_memory(absl::Span<const double> times,
                                                 absl::Span<const double> memory,
                                                 absl::Span<const double> capacities);

}  // namespace gpipe
