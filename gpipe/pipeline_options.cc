// The options GPipe and PipelineStage share; see pipeline_options.h.
#include "gpipe/pipeline_options.h"

#include <c10/util/Exception.h>

#include "gpipe/internal/partition.h"
#include "gpipe/skippable.h"

namespace gpipe {

std::string checkpoint_name(Checkpoint mode) {
  switch (mode) {
    case Checkpoint::kAlways: return "always";
    case Checkpoint::kExceptLast: return "except_last";
    case Checkpoint::kNever: return "never";
  }
  return "?";
}

Checkpoint checkpoint_from_name(const std::string& name) {
  if (name == "always") return Checkpoint::kAlways;
  if (name == "except_last") return Checkpoint::kExceptLast;
  if (name == "never") return Checkpoint::kNever;
  TORCH_CHECK(false, "unknown checkpoint mode '", name, "'; use always, except_last or never");
}

int64_t checkpoint_stop(Checkpoint mode, int64_t chunks) {
  switch (mode) {
    case Checkpoint::kAlways:
      return chunks;
    case Checkpoint::kExceptLast:
      return chunks - 1;
    case Checkpoint::kNever:
      return 0;
  }
  return 0;
}

namespace internal {

void check_shared_options(const PipelineOptionsCore& options, const torch::nn::Sequential& module,
                          size_t max_partitions, const std::string& who) {
  TORCH_CHECK(options.chunks() >= 1, who, ": chunks must be at least 1, got ", options.chunks());
  verify_module(module);
  verify_skippables(module);
  verify_balance(options.balance(), static_cast<int64_t>(module->size()), max_partitions);
}

}  // namespace internal
}  // namespace gpipe
