// Configurations compared across ranks: every process of a distributed run must build the same
// model with the same options, and a difference is refused at construction, naming it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "gpipe/distributed/process_group.h"

namespace gpipe {
namespace distributed {
namespace internal {

/// A hash of `text` that is the same on every rank and build (FNV-1a; std::hash is not), for
/// comparing configurations with check_same_fields.
uint64_t fingerprint(const std::string& text);

/// Compares `fields` (name, value) across the ranks of `group` (all-gathered). When a rank's
/// differ from rank 0's, throws c10::Error on every rank: "<who>: rank 1's <noun> differs from
/// rank 0's: chunks: 4 (rank 0: 2). <advice>". `local`: this rank's device (wire_device).
void check_same_fields(const ProcessGroup& group,
                       const std::vector<std::pair<std::string, int64_t>>& fields,
                       const std::string& who, const std::string& noun,
                       const std::string& advice, c10::Device local = c10::Device(c10::kCPU));

/// The fields that say which model `module` is, for check_same_fields: its parameters' and
/// buffers' count, elements, and names, shapes and dtypes (hashed).
std::vector<std::pair<std::string, int64_t>> module_fields(const torch::nn::Module& module);

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
