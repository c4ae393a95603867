// Keeping replicas equal: copying rank 0's tensors to every rank, averaging gradients and merging
// deferred batch norm statistics over the ranks, for the replicas of a pipeline stage and of a
// DataParallel module.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "gpipe/batchnorm.h"
#include "gpipe/distributed/process_group.h"

namespace gpipe {
namespace distributed {

// `local` below: this rank's device, where a group that carries GPU tensors (NCCL) takes those
// that are on the CPU (wire_device).

/// Copies rank 0's values of `tensors` into every rank's, in place (one broadcast per tensor).
/// `what` names the tensors in errors ("rank 0's parameters and buffers").
void broadcast_from_rank0(const ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                          const std::string& what, c10::Device local = c10::Device(c10::kCPU));

/// The gradients of `params` flattened into one tensor on `wire` for an all-reduce: each
/// parameter's gradient (zeros where it has none), then one flag each (1: it has one; Note
/// [Parameters that no replica used] in internal/gradient_reducer.h), then `extra`, in the first
/// parameter's dtype.
at::Tensor pack_gradients(const std::vector<at::Tensor>& params, c10::Device wire,
                          const std::vector<double>& extra = {});
/// Writes the averages in `flat` (pack_gradients' layout, all-reduced and divided by the ranks)
/// into the gradients of `params`, except for the parameters no rank had a gradient for, which
/// keep theirs undefined.
void unpack_averages(const std::vector<at::Tensor>& params, const at::Tensor& flat);

/// Replaces the gradient of each parameter that requires grad by its average over the ranks of
/// `group`: one all-reduce per dtype of the gradients flattened together (through the CPU, or on
/// `local` for NCCL). A parameter without a gradient on some ranks counts as zeros there and gets
/// the average; one without a gradient on any rank keeps it undefined (Note [Parameters that no
/// replica used] in internal/gradient_reducer.h).
/// `check` (if given) is called while the all-reduce is waited for and may throw to stop waiting
/// (another replica's failure heard: the all-reduce is then left to the broken group).
void average_gradients(const ProcessGroup& group, const std::vector<at::Tensor>& params,
                       c10::Device local = c10::Device(c10::kCPU),
                       const std::function<void()>& check = nullptr);

/// Sums `tensors` over the ranks of `group` in place (one all-reduce), calling `check` (if given)
/// while it waits, so that a failure heard elsewhere can end the wait; check_collective's errors
/// name `what`.
void all_reduce_sum(const ProcessGroup& group, std::vector<at::Tensor>& tensors,
                    const std::string& what, const std::function<void()>& check = nullptr);

/// Whether `mine` holds on any rank of `group`: one all-reduce of one number. GradScaler::step's
/// `any_rank` across processes (Note [Loss scaling] in gpipe/grad_scaler.h): over a pipeline's
/// group, then its replica group, it reaches every rank of S x R. `local` is the device the
/// number travels from on NCCL, which carries only GPU tensors: the stage's own.
///
///   scaler.step(adam, stage->parameters(), [&](bool found) {
///     found = gpipe::distributed::any_rank(stage->group(), found, stage->device());
///     return stage->replica_group()
///                ? gpipe::distributed::any_rank(stage->replica_group(), found, stage->device())
///                : found;
///   });
bool any_rank(const ProcessGroup& group, bool mine, c10::Device local = c10::Device(c10::kCPU));

/// Merges every rank's deferred batch norm statistics (one entry per BatchNorm layer, the same
/// layers in every rank) into `stats`, in place: per layer, the counts, means and sums of squared
/// deviations of all ranks combined by Chan's formula, in rank order, in float64 (Note [Replicas
/// and batch norm] in data_parallel.h). A layer no rank saw stays as it is. `check` (if given) is
/// called while the all-gather is waited for and may throw to stop waiting. A rank whose forward
/// failed before its statistics were complete passes `failed_here` (and any statistics of the
/// right sizes): every rank then throws, the others naming it, and none merges anything (Note
/// [A forward that fails on some replicas] in data_parallel.h). `posted` (if given) is called
/// once the all-gather is posted (all_gather's).
void combine_statistics(const ProcessGroup& group, std::vector<BatchNormStatistics>& stats,
                        c10::Device local = c10::Device(c10::kCPU),
                        const std::function<void()>& check = nullptr, bool failed_here = false,
                        const std::function<void()>& posted = nullptr);

}  // namespace distributed
}  // namespace gpipe
