// What training keeps on a device besides activations: each parameter, its gradient, float32
// master weights, the optimizer's moments by dtype, and autocast's weight cache. The planner adds
// it to each device's peak (plan.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include "balancing/profile.h"

namespace gpipe {

/// The optimizer a plan trains with: its state per parameter.
enum class OptimizerKind { kSGD, kMomentum, kAdam, kAdamW };

/// Every kind, in that order.
const std::vector<OptimizerKind>& optimizer_kinds();

// Note [Training memory]
// ~~~~~~~~~~~~~~~~~~~~~~
// A device holds, for each layer it runs, besides the activations in flight (simulate.h):
// - its parameters (param_bytes, frozen ones too) and buffers;
// - a gradient of each trainable parameter, in the parameter's dtype (trainable_param_bytes);
// - with master weights (mixed precision that keeps float32 copies of float16 or bfloat16
//   parameters and steps those, as Megatron and DeepSpeed do): for each element of the narrow
//   trainable parameters (narrow_param_elements), 4 bytes of master and 4 of the master's float32
//   gradient, which the optimizer over the masters reads (Megatron's main_grad);
// - the optimizer's moments: SGD none, momentum one, Adam and AdamW two, each as large as what it
//   steps: the parameter in its own dtype (PyTorch's optimizers make them with zeros_like), or
//   its float32 master;
// - under autocast to a lower dtype, its weight cache: each trainable float32 parameter cast once
//   per forward region and kept until the region ends (float32_param_elements at the autocast
//   dtype's size). Counted whole, as if every such parameter were cast in one region.
// With float32 parameters, no masters and no autocast this is (2 + moments) x parameter bytes,
// the planner's count before; with bfloat16 parameters, float32 masters and Adam it is 20 bytes
// per element (2 + 2 + 4 + 4 + 8) against 8 counted in the parameters' dtype alone.
// What a device holds beyond tensors (a CUDA context, the caching allocator's reserve, library
// workspaces) is not counted here.

/// How a model's parameters are trained, as far as their memory goes (Note [Training memory]).
///
///   gpipe::ParameterMemory{gpipe::OptimizerKind::kAdam, /*master_weights=*/true, at::kBFloat16}
struct ParameterMemory {
  /// The optimizer: its moments per parameter.
  OptimizerKind optimizer = OptimizerKind::kMomentum;
  /// Whether float32 master weights are kept for (and stepped instead of) the parameters narrower
  /// than float32.
  bool master_weights = false;
  /// The dtype autocast casts float32 parameters to, if the forward runs under autocast.
  c10::optional<c10::ScalarType> autocast;
};

/// The name of `kind`: "sgd", "momentum", "adam" or "adamw".
std::string optimizer_kind_name(OptimizerKind kind);
/// The kind named `name` (optimizer_kind_name's names); throws c10::Error naming the unknown name
/// and the known ones.
OptimizerKind optimizer_kind(const std::string& name);

/// The optimizer's moments per parameter: SGD 0, momentum 1, Adam and AdamW 2.
int64_t optimizer_moments(OptimizerKind kind);

/// The bytes training keeps for `layer`'s parameters and buffers (Note [Training memory]).
int64_t parameter_state_bytes(const LayerStats& layer, const ParameterMemory& memory);

}  // namespace gpipe
