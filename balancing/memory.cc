// What training keeps per parameter; see memory.h.
#include "balancing/memory.h"

#include <c10/util/Exception.h>

namespace gpipe {

const std::vector<OptimizerKind>& optimizer_kinds() {
  static const std::vector<OptimizerKind> kinds = {OptimizerKind::kSGD, OptimizerKind::kMomentum,
                                                   OptimizerKind::kAdam, OptimizerKind::kAdamW};
  return kinds;
}

std::string optimizer_kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSGD:
      return "sgd";
    case OptimizerKind::kMomentum:
      return "momentum";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kAdamW:
      return "adamw";
  }
  return "unknown";
}

OptimizerKind optimizer_kind(const std::string& name) {
  for (OptimizerKind kind : optimizer_kinds()) {
    if (optimizer_kind_name(kind) == name) return kind;
  }
  TORCH_CHECK(false, "unknown optimizer '", name, "'; give sgd, momentum, adam or adamw");
}

int64_t optimizer_moments(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSGD:
      return 0;
    case OptimizerKind::kMomentum:
      return 1;
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return 2;
  }
  return 0;
}

int64_t parameter_state_bytes(const LayerStats& layer, const ParameterMemory& memory) {
  // A float32 master of each narrow parameter, and the master's float32 gradient.
  const int64_t masters = memory.master_weights ? 4 * layer.narrow_param_elements : 0;
  // A moment per element of what the optimizer steps: the parameter, or its float32 master.
  const int64_t moment = layer.trainable_param_bytes +
                         (memory.master_weights ? masters - layer.narrow_param_bytes : 0);
  const int64_t cache =
      memory.autocast && *memory.autocast != at::kFloat
          ? layer.float32_param_elements * static_cast<int64_t>(c10::elementSize(*memory.autocast))
          : 0;
  return layer.param_bytes + layer.trainable_param_bytes + 2 * masters +
         optimizer_moments(memory.optimizer) * moment + cache + layer.buffer_bytes;
}

}  // namespace gpipe
