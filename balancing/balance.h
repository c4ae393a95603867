// Balancers: choose a GPipe balance from measurements, by time (equal compute per partition) or
// by size (equal memory per partition).
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include "balancing/partition.h"
#include "balancing/profile.h"

namespace gpipe {

/// Options of balance_by_time.
struct BalanceByTimeOptions {
  /// How long to keep measuring (at least one pass over all layers).
  TORCH_ARG(std::chrono::duration<double>, timeout) = std::chrono::seconds(1);
  /// Where to measure: the device the partitions will run on.
  TORCH_ARG(c10::Device, device) = c10::Device(c10::kCPU);
};

/// Options of balance_by_size.
struct BalanceBySizeOptions {
  /// The number of micro-batches the GPipe will use: activations are held per micro-batch.
  TORCH_ARG(int64_t, chunks) = 1;
  /// Bytes per parameter byte that training keeps: 2 for SGD (weights and gradients) up to 4-5
  /// for Adam (two moments as well).
  TORCH_ARG(double, param_scale) = 2.0;
  /// Where to measure memory.
  TORCH_ARG(c10::Device, device) = c10::Device(c10::kCPU);
};

/// The balance whose largest partition time (forward + backward, measured per layer on copies of
/// `module`'s layers) is smallest.
///
///   auto balance = gpipe::balance_by_time(4, model, sample,
///       gpipe::BalanceByTimeOptions().timeout(std::chrono::seconds(1)).device(torch::kCPU));
///   gpipe::GPipe pipe(model, gpipe::GPipeOptions(balance).chunks(8));
///
/// `sample` is a typical mini-batch. Throws c10::Error when partitions < 1 or more than the
/// layers, when a parameter already has a gradient, or when the sample does not go through.
std::vector<int64_t> balance_by_time(int64_t partitions, const torch::nn::Sequential& module,
                                     const at::Tensor& sample,
                                     const BalanceByTimeOptions& options = {});

/// The balance whose largest partition memory is smallest: per layer, the bytes its forward holds
/// for backward, scaled to one micro-batch (`sample` being a mini-batch), plus its parameter bytes
/// times `param_scale`.
///
///   auto balance = gpipe::balance_by_size(4, model, sample,
///       gpipe::BalanceBySizeOptions().chunks(8).param_scale(2.0));
std::vector<int64_t> balance_by_size(int64_t partitions, const torch::nn::Sequential& module,
                                     const at::Tensor& sample,
                                     const BalanceBySizeOptions& options = {});

/// The per-layer costs balance_by_time uses: forward + backward microseconds.
std::vector<double> time_costs(const LayerProfile& profile);

/// The per-layer costs balance_by_size uses, in bytes.
std::vector<double> size_costs(const LayerProfile& profile, int64_t chunks, double param_scale);

/// Checks `partitions` against a module of `layers` layers.
void check_partitions(int64_t partitions, int64_t layers);

}  // namespace gpipe
