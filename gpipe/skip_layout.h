// Skip layout: where each skip is stashed and popped among the partitions, so the pipeline can
// move each stashed tensor straight from its stashing partition to its popping partition.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include <torch/nn/modules/container/sequential.h>

#include "gpipe/skippable.h"

namespace gpipe {

/// The routes of all skips of a partitioned model.
///
///   gpipe::SkipLayout layout(partitions);
///   for (const auto& [key, from] : layout.routes_into(2)) { ... }
class SkipLayout {
 public:
  SkipLayout() = default;
  /// Walks the partitions' layers in order. Assumes verify_skippables passed.
  explicit SkipLayout(const std::vector<torch::nn::Sequential>& partitions);

  /// Whether the model has any skippable layer.
  bool empty() const { return stash_partition_.empty(); }

  /// The skips popped in partition `partition` but stashed in an earlier one, with the stashing
  /// partition, ordered by (stashing partition, key).
  const std::vector<std::pair<SkipKey, int64_t>>& routes_into(int64_t partition) const;

  /// All skips that cross partitions.
  std::vector<SkipKey> crossing() const;

  /// Whether `key` is stashed and popped in different partitions.
  bool crosses(const SkipKey& key) const;

 private:
  std::map<SkipKey, int64_t> stash_partition_;
  std::map<SkipKey, int64_t> pop_partition_;
  std::vector<std::vector<std::pair<SkipKey, int64_t>>> routes_into_;
};

}  // namespace gpipe
