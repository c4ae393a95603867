// Partitions: a GPipe splits the user's Sequential into contiguous blocks of layers, one block per
// device, by the balance (the number of layers in each block).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>
#include <torch/nn/modules/container/sequential.h>

#include "gpipe/microbatch.h"

namespace gpipe {
namespace internal {

/// Checks that `module` can be partitioned: no module object appears twice. Throws c10::Error
/// naming the layers. (Layers may share parameters: Note [Tied parameters] in tied_parameters.h.)
void verify_module(const torch::nn::Sequential& module);

/// Checks `balance` against a module of `layers` layers and the available `devices`. Throws
/// c10::Error naming the wrong value and suggesting gpipe::balance_by_time.
void verify_balance(const std::vector<int64_t>& balance, int64_t layers, size_t devices);

/// Splits `module` into `balance.size()` Sequentials holding the same layer objects under their
/// original names, and moves partition j to `devices[j]`.
///
///   auto parts = gpipe::internal::split_module(seq, {2, 3}, {torch::kCPU, torch::kCPU});
std::vector<torch::nn::Sequential> split_module(const torch::nn::Sequential& module,
                                                const std::vector<int64_t>& balance,
                                                const std::vector<c10::Device>& devices);

/// The device of each layer of a Sequential split by `balance` over `devices` (partition j's
/// layers on devices[j]).
std::vector<c10::Device> layer_devices(const std::vector<int64_t>& balance,
                                       const std::vector<c10::Device>& devices);

/// "layer 3 ('conv', torch::nn::Conv2dImpl)": layer `index` of `module`, for error messages.
std::string describe_layer(const torch::nn::Sequential& module, size_t index);

// Note [Random numbers in concurrent partitions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Partitions on one device draw from that device's one generator. When such partitions run at
// the same time on threads of their own (GPipe::step's lanes, a PipelineStage's partitions, a
// GPipe's forward() where the user forces a thread per partition), the order of their draws
// depends on thread timing, so a checkpointed micro-batch's recomputation may not see the numbers
// its forward drew (checkpoint.h restores the generator's state, but another thread may draw in
// between). That matters only where checkpointing is on and a partition that shares its device
// with a partition of another thread holds a layer that draws random numbers (dropout, RReLU).
// There, one check (check_concurrent_generators), made for every path that runs partitions
// concurrently, refuses on a GPU — a GPU's partitions gain little from running on two threads,
// and each partition can have a GPU of its own — and warns on the CPU, where concurrent
// partitions are the point, naming the layer. Partitions on different devices never share a
// generator. forward()'s own decision (Note [Threads of forward()] in gpipe/worker.h) never runs
// such partitions concurrently; stage-local backward, which needs a thread per partition, does.

/// Applies Note [Random numbers in concurrent partitions] to `partitions` on `devices`, where
/// partition j runs on thread `threads[j]` (partitions of one thread run one at a time) and
/// `checkpointing` says whether any micro-batch can be checkpointed: throws c10::Error where
/// partitions of different threads share a GPU, or warns where they share the CPU, and one of them
/// holds a module (at any depth) that draws random numbers in training. Recognised by type name:
/// every dropout (a name containing "Dropout") and RReLU; a custom layer that draws random
/// numbers under another name is not seen. `who` starts the message ("GPipe::step").
void check_concurrent_generators(const std::string& who,
                                 const std::vector<torch::nn::Sequential>& partitions,
                                 const std::vector<c10::Device>& devices,
                                 const std::vector<int64_t>& threads, bool checkpointing);

/// The decision of Note [Threads of forward()]: `chosen` when set; else a thread per partition
/// when `stage_local` (stage-local backward runs each partition's backward on its thread), or
/// when at least two partitions are all on the CPU and none holds a layer that draws random
/// numbers; else one per device.
bool own_threads_for_forward(const std::vector<torch::nn::Sequential>& partitions,
                             const std::vector<c10::Device>& devices, std::optional<bool> chosen,
                             bool stage_local);

/// Runs the layers of `partition` on `input` in order. Throws c10::Error naming the layer when a
/// layer returns something other than a tensor or a vector of tensors. With `layer_outputs`, also
/// gives each layer's output tensors that require grad (one entry per layer that ran; Note [One
/// executor] splits weight gradients by layer with them).
Batch run_partition(const torch::nn::Sequential& partition, const Batch& input,
                    std::vector<std::vector<at::Tensor>>* layer_outputs = nullptr);

/// Which of a partition's parameters require grad, as a number: the `params_key` of its
/// Checkpointing (Note [Autograd metadata of checkpointed micro-batches] in checkpoint.h).
uint64_t requires_grad_key(const torch::nn::Sequential& partition);

}  // namespace internal
}  // namespace gpipe
