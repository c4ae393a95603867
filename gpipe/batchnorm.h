// Deferred batch norm: BatchNorm layers in a pipeline normalise each micro-batch with its own
// statistics, but update their running statistics once per mini-batch, as if they had seen the
// whole mini-batch at once.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/record_function.h>
#include <torch/nn/module.h>

namespace gpipe {

// Note [Deferred batch norm without replacing modules]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The Python reference swaps every BatchNorm for a DeferredBatchNorm module. In C++ that cannot
// work in general: a user's module calls its BatchNorm through its own member (`bn1->forward(x)`),
// which a replacement in the module registry does not reach. gpipe therefore keeps the user's
// BatchNorm objects and changes what they touch:
//
//  - In a training forward, each BatchNorm's `running_mean`, `running_var` and
//    `num_batches_tracked` *members* point at scratch tensors ("sinks"), so the layer's own
//    per-micro-batch update lands there and is thrown away. The registered buffers (what
//    `named_buffers()`, `torch::save` and eval mode use) are untouched. The layer normalises with
//    the micro-batch's statistics, as BatchNorm does in training.
//  - A thread-local at::RecordFunction callback, carried to the workers with the caller's thread
//    state, sees each `aten::batch_norm` call, recognises the layer by its sink, and accumulates
//    the input's per-channel count, mean and sum of squared deviations (Chan's parallel
//    combination, in float64). Calls made while recomputing a checkpoint are skipped, so every
//    micro-batch counts once.
//  - After the last micro-batch, commit() updates the real buffers once, exactly as BatchNorm would
//    on the whole mini-batch: num_batches_tracked += 1, then running stats with the momentum (or the
//    cumulative average when momentum is unset) and the *unbiased* variance.
//  - In eval mode the members point at the real buffers again.

/// The deferred-batch-norm state of one GPipe: every BatchNorm1d/2d/3d with running statistics
/// found in the given modules, nested ones included.
///
///   gpipe::DeferredBatchNorm dbn(sequential->modules());
///   dbn.set_training(true);
///   { auto scope = dbn.track(); /* run the micro-batches */ }
///   dbn.commit();
class DeferredBatchNorm {
 public:
  explicit DeferredBatchNorm(const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
  ~DeferredBatchNorm();
  DeferredBatchNorm(const DeferredBatchNorm&) = delete;
  DeferredBatchNorm& operator=(const DeferredBatchNorm&) = delete;

  /// The number of BatchNorm layers handled.
  size_t size() const { return layers_.size(); }

  /// Points the layers' running-statistics members at sinks (training) or at their registered
  /// buffers (eval); see the Note. Call before each forward.
  void set_training(bool training);

  /// Registers the statistics callback on the calling thread and clears the accumulators, until
  /// the returned object is destroyed. The callback must be in place before the caller's thread
  /// state is captured for the workers.
  class TrackingScope {
   public:
    explicit TrackingScope(at::CallbackHandle handle) : handle_(handle) {}
    ~TrackingScope();
    TrackingScope(const TrackingScope&) = delete;
    TrackingScope& operator=(const TrackingScope&) = delete;

   private:
    at::CallbackHandle handle_;
  };
  std::unique_ptr<TrackingScope> track();

  /// Updates every layer's running statistics from what was accumulated since track().
  void commit();

  struct Layer;

 private:
  std::vector<std::unique_ptr<Layer>> layers_;
  bool training_ = false;
};

}  // namespace gpipe
