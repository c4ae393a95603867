// The optimizer's step as the planner predicts it: what one update of each optimizer kind costs on
// a kind of device, per parameter tensor and per byte, measured at profile time, and what a plan's
// stages then cost to step (Note [The optimizer's step]).
#pragma once

#include <cstdint>
#include <vector>

#include <c10/core/Device.h>
#include <torch/nn/modules/container/sequential.h>

#include "balancing/memory.h"

namespace gpipe {

// Note [The optimizer's step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A training loop runs optimizer.step() after GPipe::step, on its own thread, over every
// parameter: torch::optim updates one parameter tensor after another, with a few elementwise
// kernels each (SGD one, momentum two, Adam about six, AdamW one more). That time is in every step
// a user sees but not in the step the simulation predicts, so the planner predicts it beside it
// (PipelinePlan::optimizer_us) from profile_optimizers' measurements: on the first device of each
// kind, one step of each optimizer kind over 64 tensors of 4 floats (the fixed cost of a tensor:
// its operators' dispatch, and on CUDA their launches), over one tensor of 16 MiB on the CPU and
// 256 MiB on a GPU (the cost of a byte: memory bandwidth; on an H100 Adam's kernels over 16 MiB
// take about as long as their launches), and, given the model, over each layer's own trainable
// parameters (copies), each the median of 5 steps after an untimed one, the layers' steps then
// scaled to sum to one step over all of their copies at once (alone, a layer's few tensors stay
// in the caches from one timed step to the next; a model's do not). In a training loop the
// forward and the backward pass between two steps and leave little of the optimizer's tensors
// and moments in the caches, so the large tensor's steps and the step over all layers start from
// cold caches: before each, a buffer larger than them (64 MiB on the CPU, 256 MiB on a GPU, past
// an H100's 50 MB or a B200's 126 MB of L2) is written. A layer's step is what a stage costs, where
// it was measured: a byte of a small tensor, updated by several operators in turn while it stays
// in the caches, costs less than one of 16 MiB (on the project's 2-vCPU VM AmoebaNet-D's Adam
// step was predicted 76% over from tensors and bytes alone, and 36% under from its layers alone,
// unscaled). profile_pipeline measures with the profile's threads, which the trainers' --plan
// sets for the whole process. A plan's step:
// - on the CPU, the tensors one after another: each CPU stage's layers' steps (or its
//   tensors x tensor_us plus its bytes / bytes_per_us), summed;
// - on CUDA, the host only launches each tensor's kernels, and every GPU runs its own queue: the
//   launches of all CUDA stages' tensors (tensors x tensor_us) or the busiest GPU's sum of its
//   stages' steps (or bytes / bytes_per_us), whichever is longer, after the CPU stages' part;
// - with a process per worker (PipelineStage), each process steps its own stages while the
//   others step theirs: the slowest worker's time. Replicas step at once, so they add nothing.
// The bytes stepped are each stage's trainable parameters', or their float32 master weights'
// where ParameterMemory::master_weights keeps them (4 bytes per narrow element; a layer's step,
// measured over its own dtypes, then adds the master weights' extra bytes at the cost of a byte
// of the large tensor). Profiles
// written before this note have no measurements, and their plans predict no optimizer time (0);
// so do profiles written before AdamW was a kind of its own, for AdamW (profile again).

/// What one step of `optimizer` costs on `device`: tensor_us per parameter tensor plus
/// bytes / bytes_per_us.
struct OptimizerStats {
  /// The device measured: the first of its kind among profile_optimizers' devices.
  c10::Device device = c10::Device(c10::kCPU);
  /// The optimizer measured.
  OptimizerKind optimizer = OptimizerKind::kMomentum;
  /// The fixed cost of updating one parameter tensor, microseconds.
  double tensor_us = 0;
  /// Bytes of parameters updated per microsecond, past that fixed cost.
  double bytes_per_us = 0;
  /// layer_us[k]: one step over layer k's own trainable parameters, microseconds (0 without
  /// any), scaled so that the layers sum to one step over all of them; empty where the model was
  /// not given (profiles before it: tensors and bytes).
  std::vector<double> layer_us;
  /// The predicted time of one step over `tensors` tensors of `bytes` in all.
  double time_us(int64_t tensors, int64_t bytes) const;
};

/// The measurement of `optimizer` on devices of `type` among `stats`, or nullptr where there is
/// none.
///
///   const gpipe::OptimizerStats* adam =
///       gpipe::find_optimizer_stats(profile.optimizers, gpipe::OptimizerKind::kAdam, c10::kCPU);
const OptimizerStats* find_optimizer_stats(const std::vector<OptimizerStats>& stats,
                                           OptimizerKind optimizer, c10::DeviceType type);

/// Measures one step of each optimizer kind (torch::optim::SGD without and with momentum, Adam,
/// AdamW) on the first device of each kind (CPU, CUDA) among `devices`, and over each layer of
/// `model` where one is given (Note [The optimizer's step]).
///
///   auto stats = gpipe::profile_optimizers({torch::kCPU, torch::Device("cuda:0")}, &model);
std::vector<OptimizerStats> profile_optimizers(const std::vector<c10::Device>& devices,
                                               const torch::nn::Sequential* model = nullptr);

/// The parameters one stage of a plan steps.
struct SteppedParameters {
  /// The stage's device.
  c10::Device device = c10::Device(c10::kCPU);
  /// The worker (process, with PipelineStage) that runs the stage.
  int64_t worker = 0;
  /// Its trainable parameter tensors.
  int64_t tensors = 0;
  /// Their bytes (the float32 master weights' where those are kept).
  int64_t bytes = 0;
  /// The stage's layers' own steps summed (OptimizerStats::layer_us on its kind of device), or
  /// less than 0 where they were not measured (tensors and bytes then).
  double measured_us = -1;
};

/// The time of one step of `optimizer` over `stages` (Note [The optimizer's step]); `processes`:
/// each worker in a process of its own. 0 where `stats` has no measurement of `optimizer` on a
/// kind of device that `stages` use.
///
///   double us = gpipe::optimizer_step_us(profile.optimizers, gpipe::OptimizerKind::kAdam,
///                                        {{torch::kCPU, 0, 12, 4 << 20}}, false);
double optimizer_step_us(const std::vector<OptimizerStats>& stats, OptimizerKind optimizer,
                         const std::vector<SteppedParameters>& stages, bool processes);

}  // namespace gpipe
