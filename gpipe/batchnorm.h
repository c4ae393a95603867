// Batch norm in a pipeline: the BatchNorm layers of a partition, whose running statistics are
// kept out of the recomputation of checkpointed micro-batches and, with deferred batch norm,
// updated once per mini-batch as if the layers had seen the whole mini-batch at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
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
// BatchNorm objects and changes what they touch, only while a GPipe forward runs:
//
//  - At the start of a training forward, each BatchNorm that is itself in training mode gets its
//    `running_mean`, `running_var` and `num_batches_tracked` *members* pointed at scratch tensors
//    ("sinks"), so the layer's own per-micro-batch update lands there and is thrown away. The layer
//    normalises with the micro-batch's statistics, as BatchNorm does in training. A BatchNorm in
//    eval mode inside a training model (a frozen BatchNorm, as in fine-tuning) is left alone: it
//    normalises with its running statistics and is never updated, as in the plain model.
//  - A thread-local at::RecordFunction callback sees each `aten::batch_norm` call, recognises the
//    layer by its sink, and accumulates the input's per-channel count, mean and sum of squared
//    deviations (computed in the input's precision, float at least, and combined in float64 by
//    Chan's formula: only per-channel results are converted). The executor adds it around each
//    forward of a partition with BatchNorms while its run gathers (BatchNormLayers::gathering),
//    and only there: a callback that needs its operators' inputs makes the dispatcher box the
//    arguments of every operator it sees (a cost per operator, which matters most where kernel
//    launches dominate, as on a GPU), so the backward, the loss and partitions without
//    BatchNorms go unwatched. A recomputation (is_recomputing()) adds none: no operator of a
//    recomputation is observed.
//  - At the end of the forward the members point at the registered buffers again, so between
//    forwards the user's own Sequential, named_buffers(), torch::save and eval() all see the real
//    running statistics. Then the buffers are updated once, exactly as BatchNorm would on the
//    whole mini-batch: num_batches_tracked += 1, then running stats with the momentum read from
//    the layer's options at that moment (or the cumulative average when momentum is unset) and
//    the *unbiased* variance.
//
// Note [Statistics from the sinks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The kernel computes each call's batch mean and unbiased variance anyway, and its update of the
// running statistics writes them into the sinks as momentum x statistic + (1 - momentum) x sink.
// So the callback zeroes the sinks before the call and reads them after it, divided by the call's
// momentum (its argument: the module's, or 1 / count with momentum unset): the statistics, to a
// rounding or two, for two small fills and two small copies per call instead of another pass over
// the activations (var_mean cost ResNet-8's step at micro-batches of 8 about 20% on the project's
// VM). The sinks start every call from zero, so a non-finite call leaves nothing behind. The input
// is gathered from as before where the sinks cannot say: float16 or bfloat16 sinks (too narrow),
// a call with another running variance, and while a recomputation of the same layer runs on
// another thread (a backward beside a forward: it writes the same sinks), or began between the
// call's start and end (counted per layer under the redirection's lock). On CUDA that host-side
// check suffices because a partition's forwards and its recomputations queue their kernels on the
// same stream (the partition's compute stream; autograd runs a checkpoint's node on the stream
// its forward used): a recomputation's writes to the sinks cannot land between a call's zeroing
// and its reading.
//
// Note [Recomputation leaves running statistics alone]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpointed micro-batch runs its BatchNorms twice: in the forward and again in backward.
// Whether or not deferred batch norm is on, the recomputation points the members of the
// partition's training-mode BatchNorms at sinks while it runs, so running statistics are updated
// by forwards only, never a second time by a backward, and never by the backward of a GPipe that
// was destroyed in between. The redirection is counted per layer, so overlapping redirections
// (a forward and another thread's backward) restore the real buffers only when the last ends.

/// The deferred statistics of one BatchNorm layer over a mini-batch: the number of values seen
/// per channel, and per channel their mean and sum of squared deviations (float64, on the layer's
/// device). A layer that saw nothing has count 0 and zeros.
struct BatchNormStatistics {
  /// The number of values seen per channel.
  double count = 0;
  /// Their mean, per channel.
  at::Tensor mean;
  /// Their sum of squared deviations from the mean, per channel.
  at::Tensor m2;

  /// Adds `n` more values whose per-channel mean and sum of squared deviations are `mean` and
  /// `m2` (Chan et al.'s pairwise update; from nothing when count is 0).
  void merge(double n, const at::Tensor& mean, const at::Tensor& m2);
};

/// Combines a mini-batch's deferred statistics, one entry per BatchNorm layer in partition order,
/// with those of other processes before the running statistics are updated from them (see
/// GPipeImpl::set_statistics_combiner).
using StatisticsCombiner = std::function<void(std::vector<BatchNormStatistics>&)>;

/// The BatchNorm1d/2d/3d layers with running statistics found in some modules, nested ones
/// included (see the Notes). Shared by a GPipe and the autograd graphs of its forwards.
///
///   auto layers = std::make_shared<gpipe::BatchNormLayers>(partition->modules());
///   { auto redirected = layers->redirect(); /* run layers without updating statistics */ }
class BatchNormLayers {
 public:
  explicit BatchNormLayers(const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
  ~BatchNormLayers();
  BatchNormLayers(const BatchNormLayers&) = delete;
  BatchNormLayers& operator=(const BatchNormLayers&) = delete;

  /// The number of BatchNorm layers found.
  size_t size() const { return layers_.size(); }

  struct Layer;

  /// Points the running-statistics members of the layers that are in training mode at sinks for
  /// its lifetime, then back at what they were.
  class Redirect {
   public:
    Redirect(Redirect&&) = default;
    ~Redirect();
    /// Whether no layer was redirected (none in training mode).
    bool empty() const { return layers_.empty(); }

   private:
    friend class BatchNormLayers;
    Redirect() = default;
    std::vector<Layer*> layers_;
    bool recomputation_ = false;
  };
  /// `recomputation`: for a checkpointed micro-batch's recomputation, which a forward gathering
  /// at the same time must not read from the sinks (Note [Statistics from the sinks]).
  Redirect redirect(bool recomputation = false);

  /// Clears the deferred statistics of every layer.
  void reset_statistics();

  /// Whether a DeferredBatchNormRun gathers these layers' statistics now: their partition's
  /// forwards observe their batch_norm calls (DeferredStatisticsScope), its recomputations not.
  bool gathering() const { return gathering_.load(std::memory_order_acquire); }

  /// What each layer accumulated since reset_statistics(), in layer order.
  std::vector<BatchNormStatistics> statistics() const;

  /// Updates the running statistics of every layer from what was accumulated since
  /// reset_statistics() (see Note [Deferred batch norm without replacing modules]), or from
  /// `statistics` (one entry per layer, as statistics() returned them, perhaps combined with other
  /// processes') when given; then clears what was accumulated.
  void commit(const std::vector<BatchNormStatistics>* statistics = nullptr);

 private:
  friend class DeferredBatchNormRun;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::atomic<bool> gathering_{false};
};

/// Registers the deferred-batch-norm statistics callback on the calling thread for its lifetime:
/// the executor's forward of a partition whose BatchNormLayers are gathering.
class DeferredStatisticsScope {
 public:
  DeferredStatisticsScope();
  ~DeferredStatisticsScope();
  DeferredStatisticsScope(const DeferredStatisticsScope&) = delete;
  DeferredStatisticsScope& operator=(const DeferredStatisticsScope&) = delete;

 private:
  at::CallbackHandle handle_;
};

/// Deferred batch norm over one run of some partitions (a GPipe's forward or step, a pipeline
/// stage's step), when `on`: for its lifetime the training-mode BatchNorms of every partition
/// write their updates to sinks and gather their statistics (cleared first; gathering());
/// commit_deferred() then updates the running statistics. Off, it does nothing.
class DeferredBatchNormRun {
 public:
  DeferredBatchNormRun(const std::vector<std::shared_ptr<BatchNormLayers>>& partitions, bool on);
  ~DeferredBatchNormRun();
  DeferredBatchNormRun(const DeferredBatchNormRun&) = delete;
  DeferredBatchNormRun& operator=(const DeferredBatchNormRun&) = delete;

 private:
  std::vector<std::shared_ptr<BatchNormLayers>> gathering_;
  std::vector<BatchNormLayers::Redirect> redirects_;
};

/// Updates every partition's running statistics from what a DeferredBatchNormRun gathered, after
/// `combine` (when given) merged them, one entry per layer in partition order, with other
/// processes'. Throws c10::Error when `combine` changes the number of entries.
void commit_deferred(const std::vector<std::shared_ptr<BatchNormLayers>>& partitions,
                     const StatisticsCombiner& combine = nullptr);

}  // namespace gpipe
