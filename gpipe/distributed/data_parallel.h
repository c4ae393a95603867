// Data-parallel replicas: a module (a GPipe or any other) trained by several processes, each on its
// shard of every mini-batch, with gradients averaged over them on c10d as backward runs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "gpipe/distributed/process_group.h"
#include "gpipe/distributed/reduction_stats.h"
#include "gpipe/tied_parameters.h"

namespace gpipe {
namespace internal {
// How far a DataParallel forward's merge of batch norm statistics got (data_parallel.cc).
struct StatisticsMerge;
}  // namespace internal

namespace distributed {

namespace internal {
class GradientReducer;  // internal/gradient_reducer.h
}  // namespace internal

// Note [Replicas and batch norm]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Replicas must keep the same running statistics, or they drift apart in eval. A GPipe with
// deferred batch norm gathers each mini-batch's per-channel count, mean and sum of squared
// deviations before updating them; DataParallel installs a statistics combiner that all-gathers
// these from every replica and merges them (Chan's formula, in rank order, in float64), so every
// replica updates its running statistics exactly as one process would on the whole mini-batch,
// and all replicas identically. Any other module's buffers (a plain BatchNorm's, or a GPipe's
// without deferred batch norm) are broadcast from rank 0 before each training forward, as
// PyTorch's DistributedDataParallel does (broadcast_buffers): replicas then all use rank 0's.
//
// Note [A forward that fails on some replicas]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A forward may fail on one replica (a layer throws, a bad shard) and work on the others, which
// then wait in a collective that replica never joins: the batch norm statistics' all-gather
// (deferred batch norm), or their backward's all-reduces. Left alone they would wait for the
// group's timeout. So the failed replica, before it throws its own error, joins the collective
// the others are in: when they merge batch norm statistics and it failed before its own merge,
// the all-gather, its failure flagged there (every replica's forward then throws, the others'
// naming it: "the forward failed on rank r of n"; no replica updates its running statistics) —
// "before its own merge" meaning before its all-gather was posted, so a failure while it packed
// its statistics counts too;
// otherwise, when their forward will be followed by a reducing backward (grad mode on, outside
// no_sync), the all-reduces of the backward's end, with its failure marked (Note [A backward that
// fails on some replicas] in internal/gradient_reducer.h: their backward throws naming it). Either
// way every replica ran the same collectives, and the next step pairs: zero the gradients and go
// on. This assumes, as PyTorch's DDP does, that a training forward (train mode, grad on, outside
// no_sync) is followed by a backward on every replica; a forward in eval mode (validation, grad
// on or off) that fails joins nothing, as the others run no collective after theirs. A
// collective that fails itself (a peer died) leaves the group broken.

/// Options of a DataParallel.
///
///   gpipe::distributed::DataParallelOptions().bucket_bytes(int64_t{4} << 20)
struct DataParallelOptions {
  /// The size of a gradient bucket (Note [Buckets that start during backward]).
  TORCH_ARG(int64_t, bucket_bytes) = int64_t{25} << 20;
  /// Whether buffers are broadcast from rank 0 before each training forward (for modules whose
  /// statistics are not combined; see Note [Replicas and batch norm]).
  TORCH_ARG(bool, broadcast_buffers) = true;
};

/// A module replicated over the processes of `group`: rank 0's parameters and buffers are copied
/// to every replica at construction, and after each backward through its output every parameter's
/// gradient is the average of the replicas' (all-reduced in buckets that start during backward).
/// Each process feeds its own shard of the mini-batch. The replicas' configurations are compared
/// at construction (parameters, options, a GPipe's balance and chunks); a mismatch is refused.
///
///   auto group = gpipe::distributed::new_gloo_group(gpipe::distributed::options_from_env());
///   gpipe::GPipe pipe(seq, gpipe::GPipeOptions({2, 2}).chunks(4));
///   gpipe::distributed::DataParallel model(pipe, group);
///   torch::optim::SGD sgd(model->parameters(), 0.1);
///   loss_fn(model->forward(shard), target).backward();  // gradients averaged over the replicas
///   sgd.step();
class DataParallelImpl : public torch::nn::Module {
 public:
  /// Replicates `module` (a GPipe, a Sequential, any module holder whose forward takes a tensor).
  template <typename ModuleType>
  DataParallelImpl(torch::nn::ModuleHolder<ModuleType> module, ProcessGroup group,
                   DataParallelOptions options = {})
      : DataParallelImpl(module.ptr(),
                         [m = module.ptr()](const at::Tensor& x) -> at::Tensor {
                           return m->forward(x);
                         },
                         std::move(group), std::move(options)) {}
  /// Replicates `module`, run by `forward`.
  DataParallelImpl(std::shared_ptr<torch::nn::Module> module,
                   std::function<at::Tensor(const at::Tensor&)> forward, ProcessGroup group,
                   DataParallelOptions options = {});
  ~DataParallelImpl() override;

  /// Runs the replica on this process's shard; a backward through the result averages the
  /// gradients over the replicas (unless under no_sync()).
  at::Tensor forward(const at::Tensor& input);
  /// The same for a tuple: the shards of several tensors (the same samples of each), for a GPipe
  /// whose first layer takes them (GPipe::forward of a vector); its outputs, each of which a
  /// backward may go through.
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& inputs);

  /// While the returned guard lives, backward only accumulates this replica's gradients
  /// (gradient accumulation); the next backward outside it averages the accumulated gradients.
  ///
  ///   { auto local = model->no_sync(); loss(model->forward(a)).backward(); }
  ///   loss(model->forward(b)).backward();  // averages the gradients of a and b
  class NoSync {
   public:
    /// Takes over `other`'s region: it ends when this guard does.
    NoSync(NoSync&& other) noexcept : owner_(other.owner_) { other.owner_ = nullptr; }
    ~NoSync();

   private:
    friend class DataParallelImpl;
    explicit NoSync(DataParallelImpl* owner) : owner_(owner) {}
    DataParallelImpl* owner_;
  };
  /// A guard for backwards that only accumulate (see NoSync); guards may nest.
  NoSync no_sync();

  /// The parameters, each once (a tensor that several layers share, a GPipe's tie, is listed
  /// once); give these to an optimizer. (They hide torch::nn::Module's.)
  std::vector<at::Tensor> parameters(bool recurse = true) const;
  /// The same with their names, each under its first name.
  torch::OrderedDict<std::string, at::Tensor> named_parameters(bool recurse = true) const;

  /// The wrapped module.
  const std::shared_ptr<torch::nn::Module>& module() const { return module_ptr_; }
  /// The group of the replicas.
  const ProcessGroup& group() const { return group_; }
  /// What the last averaging backward's reduction did.
  ReductionStats last_reduction() const;
  /// The number of gradient buckets.
  size_t bucket_count() const;

 private:
  // This replica's device for collectives over NCCL (see data_parallel.cc).
  c10::Device device() const;
  void check_same_configuration();
  void broadcast_state(bool parameters, bool buffers);
  // Before a training forward: rank 0's buffers, where statistics are not combined.
  void before_forward();
  // `outputs`, each that needs a gradient behind one node whose backward starts the reduction.
  std::vector<at::Tensor> reducing(std::vector<at::Tensor> outputs);
  // The module's forward by `run`, between before_forward() and reducing(), and after a failure
  // the collectives the other replicas wait in (Note [A forward that fails on some replicas]).
  std::vector<at::Tensor> run_forward(const std::function<std::vector<at::Tensor>()>& run);
  void after_failed_forward();


  std::shared_ptr<torch::nn::Module> module_ptr_;
  std::function<at::Tensor(const at::Tensor&)> forward_;
  // A GPipe's forward of a tuple (null for other modules).
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward_tuple_;
  ProcessGroup group_;
  DataParallelOptions options_;
  bool combined_statistics_ = false;
  std::shared_ptr<gpipe::internal::StatisticsMerge> merge_;
  int no_sync_ = 0;
  std::shared_ptr<internal::GradientReducer> reducer_;
};

/// A DataParallel: a module holder of DataParallelImpl.
TORCH_MODULE(DataParallel);

}  // namespace distributed
}  // namespace gpipe
