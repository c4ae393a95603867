// Data-parallel replicas; see data_parallel.h and Note [Replicas and batch norm].
#include "gpipe/distributed/data_parallel.h"

#include <atomic>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gpipe/distributed/internal/configuration.h"
#include "gpipe/distributed/internal/gradient_reducer.h"
#include "gpipe/distributed/replication.h"
#include "gpipe/gpipe.h"

namespace gpipe {
namespace distributed {
namespace {

// The first node of the outermost backward through the wrapper's output: starts the reduction.
struct BeginReduction : torch::autograd::Node {
  explicit BeginReduction(std::weak_ptr<internal::GradientReducer> reducer)
      : reducer(std::move(reducer)) {}
  std::string name() const override { return "gpipe::distributed::BeginReduction"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (auto r = reducer.lock()) {
      r->begin_backward();
    }
    return std::move(grads);
  }
  std::weak_ptr<internal::GradientReducer> reducer;
};

}  // namespace
}  // namespace distributed

namespace internal {
struct StatisticsMerge {
  std::atomic<bool> entered{false};
  std::atomic<bool> done{false};
};
}  // namespace internal

namespace distributed {
namespace {

// The statistics combiner a DataParallel installs on its GPipe (Note [Replicas and batch norm]);
// `owner` tells a DataParallel's destructor whether the combiner in place is still its own, and
// `merge` its forward how far the merge got (Note [A forward that fails on some replicas]).
struct ReplicaStatistics {
  void operator()(std::vector<BatchNormStatistics>& stats) const {
    // Entered once the all-gather is posted: a failure before it (packing the statistics) is
    // this replica's alone, which its failed forward then tells the others in their all-gather.
    const std::shared_ptr<gpipe::internal::StatisticsMerge> m = merge;
    combine_statistics(group, stats, device, nullptr, /*failed_here=*/false,
                       [m] { m->entered = true; });
    merge->done = true;
  }
  ProcessGroup group;
  c10::Device device;
  const DataParallelImpl* owner;
  std::shared_ptr<gpipe::internal::StatisticsMerge> merge;
};

// Whether `pipe` merges its statistics with ReplicaStatistics of `owner`.
bool merges_for(const GPipeImpl& pipe, const DataParallelImpl* owner) {
  const auto* mine = pipe.statistics_combiner().target<ReplicaStatistics>();
  return mine != nullptr && mine->owner == owner;
}

}  // namespace

DataParallelImpl::DataParallelImpl(std::shared_ptr<torch::nn::Module> module,
                                   std::function<at::Tensor(const at::Tensor&)> forward,
                                   ProcessGroup group, DataParallelOptions options)
    : module_ptr_(std::move(module)),
      forward_(std::move(forward)),
      group_(std::move(group)),
      options_(std::move(options)),
      merge_(std::make_shared<gpipe::internal::StatisticsMerge>()) {
  TORCH_CHECK(module_ptr_ != nullptr, "gpipe::DataParallel: the module is null");
  TORCH_CHECK(group_, "gpipe::DataParallel: the process group is null; make one with "
              "gpipe::distributed::new_gloo_group");
  TORCH_CHECK(options_.bucket_bytes() > 0, "gpipe::DataParallel: bucket_bytes must be positive, "
              "got ", options_.bucket_bytes());
  register_module("module", module_ptr_);
  if (auto pipe = std::dynamic_pointer_cast<GPipeImpl>(module_ptr_)) {
    // Its copies' gradients join their owners' at the end of the backward, after the buckets
    // holding the owners may have been reduced.
    TORCH_CHECK(!pipe->has_tied_copies(), "gpipe::DataParallel: the GPipe has copies of tied "
                "parameters (a tie across devices, or named in tied_parameters), which "
                "DataParallel cannot average yet; put the layers sharing a tensor on one device "
                "(they then share it, without copies), or replicate the stages of a pipeline "
                "across processes (PipelineStage with a replica group)");
    forward_tuple_ = [pipe](const std::vector<at::Tensor>& inputs) {
      return pipe->forward(inputs);
    };
    if (pipe->options().deferred_batch_norm()) {
      combined_statistics_ = true;
      pipe->set_statistics_combiner(ReplicaStatistics{group_, device(), this, merge_});
    }
  }
  check_same_configuration();
  broadcast_state(/*parameters=*/true, /*buffers=*/true);
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (const auto& item : unique_parameters(module_ptr_->named_parameters())) {
    names.push_back(item.key());
    params.push_back(item.value());
  }
  reducer_ = std::make_shared<internal::GradientReducer>(std::move(params), std::move(names),
                                                         group_, options_.bucket_bytes());
}

std::vector<at::Tensor> DataParallelImpl::parameters(bool recurse) const {
  return named_parameters(recurse).values();
}

torch::OrderedDict<std::string, at::Tensor> DataParallelImpl::named_parameters(
    bool recurse) const {
  return unique_parameters(torch::nn::Module::named_parameters(recurse));
}

c10::Device DataParallelImpl::device() const {
  // The first GPU among the module's parameters and buffers, else the CPU: where a group that
  // carries GPU tensors (NCCL) takes those on the CPU.
  for (const at::Tensor& t : module_ptr_->parameters()) {
    if (t.is_cuda()) return t.device();
  }
  for (const at::Tensor& t : module_ptr_->buffers()) {
    if (t.is_cuda()) return t.device();
  }
  return c10::Device(c10::kCPU);
}

DataParallelImpl::~DataParallelImpl() {
  // Only the combiner this wrapper installed: a newer DataParallel of the same GPipe may have put
  // its own in place, which must go on merging the replicas' statistics.
  if (combined_statistics_) {
    if (auto pipe = std::dynamic_pointer_cast<GPipeImpl>(module_ptr_)) {
      if (merges_for(*pipe, this)) pipe->set_statistics_combiner(nullptr);
    }
  }
}

ReductionStats DataParallelImpl::last_reduction() const { return reducer_->last_stats(); }

size_t DataParallelImpl::bucket_count() const { return reducer_->bucket_count(); }

void DataParallelImpl::check_same_configuration() {
  // What must agree, as numbers; compared with rank 0's.
  std::vector<std::pair<std::string, int64_t>> fields = internal::module_fields(*module_ptr_);
  fields.emplace_back("bucket_bytes", options_.bucket_bytes());
  fields.emplace_back("broadcast_buffers", options_.broadcast_buffers() ? 1 : 0);
  auto pipe = std::dynamic_pointer_cast<GPipeImpl>(module_ptr_);
  fields.emplace_back("a GPipe", pipe ? 1 : 0);
  fields.emplace_back("GPipe chunks", pipe ? pipe->chunks() : 0);
  fields.emplace_back(
      "GPipe balance (hash)",
      pipe ? static_cast<int64_t>(internal::fingerprint(absl::StrJoin(pipe->balance(), ","))) : 0);
  fields.emplace_back("GPipe checkpoint mode", pipe ? static_cast<int64_t>(pipe->checkpoint()) : 0);
  fields.emplace_back("GPipe deferred_batch_norm", combined_statistics_ ? 1 : 0);
  // Which parameters are frozen: the reducer buckets only those that require grad, so replicas
  // frozen differently would pair different all-reduces.
  std::string frozen;
  int64_t trained = 0;
  for (const auto& item : module_ptr_->named_parameters()) {
    if (item.value().requires_grad()) {
      ++trained;
    } else {
      absl::StrAppend(&frozen, item.key(), ";");
    }
  }
  fields.emplace_back("parameters that require grad", trained);
  fields.emplace_back("names of the frozen parameters (hash)",
                      static_cast<int64_t>(internal::fingerprint(frozen)));

  internal::check_same_fields(
      group_, fields, "gpipe::DataParallel", "replica",
      "Every process must wrap the same model with the same options (and freeze "
      "the same parameters)",
      device());
}

void DataParallelImpl::broadcast_state(bool parameters, bool buffers) {
  std::vector<at::Tensor> tensors;
  if (parameters) {
    for (const at::Tensor& p : module_ptr_->parameters()) tensors.push_back(p);
  }
  if (buffers) {
    for (const at::Tensor& b : module_ptr_->buffers()) tensors.push_back(b);
  }
  broadcast_from_rank0(group_, tensors, "rank 0's parameters and buffers", device());
}

void DataParallelImpl::before_forward() {
  if (is_training() && options_.broadcast_buffers() && !combined_statistics_) {
    broadcast_state(/*parameters=*/false, /*buffers=*/true);
  }
}

std::vector<at::Tensor> DataParallelImpl::reducing(std::vector<at::Tensor> outputs) {
  std::vector<at::Tensor> with_grad;
  for (const at::Tensor& out : outputs) {
    if (out.defined() && out.requires_grad()) with_grad.push_back(out);
  }
  if (!at::GradMode::is_enabled() || with_grad.empty() || no_sync_ > 0 ||
      group_->getSize() == 1) {
    return outputs;
  }
  // One node before every output that needs a gradient: whichever a backward goes through
  // first starts the reduction (once per backward: begin_backward ignores the others).
  auto node = std::shared_ptr<BeginReduction>(new BeginReduction(reducer_),
                                              torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(with_grad));
  for (at::Tensor& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    at::Tensor result = out.detach();
    torch::autograd::set_history(result, node);
    out = std::move(result);
  }
  return outputs;
}

std::vector<at::Tensor> DataParallelImpl::run_forward(
    const std::function<std::vector<at::Tensor>()>& run) {
  before_forward();
  merge_->entered = false;
  merge_->done = false;
  std::vector<at::Tensor> outputs;
  try {
    outputs = run();
  } catch (...) {
    after_failed_forward();
    throw;
  }
  return reducing(std::move(outputs));
}

void DataParallelImpl::after_failed_forward() {
  // Note [A forward that fails on some replicas].
  if (group_->getSize() == 1) return;
  try {
    auto pipe = std::dynamic_pointer_cast<GPipeImpl>(module_ptr_);
    // (This wrapper's combiner is there only for a GPipe with deferred batch norm.)
    if (pipe && pipe->is_training() && merges_for(*pipe, this) && !merge_->done) {
      // The merge itself failed (another replica's failure, or the group's): nothing to join.
      if (merge_->entered) return;
      // The others wait in the statistics' all-gather: this replica's failure goes there, with
      // statistics of the sizes they expect (zeros: it is not merged).
      std::vector<BatchNormStatistics> zeros;
      for (const torch::nn::Sequential& partition : pipe->partitions()) {
        for (BatchNormStatistics& s :
             BatchNormLayers(partition->modules(/*include_self=*/false)).statistics()) {
          zeros.push_back(std::move(s));
        }
      }
      combine_statistics(group_, zeros, device(), nullptr, /*failed_here=*/true);
      return;
    }
    // Only a training forward: an eval one (validation with grad on) is followed by no backward
    // on the others, who would leave this rank's all-reduces unpaired.
    if (module_ptr_->is_training() && at::GradMode::is_enabled() && no_sync_ == 0) {
      reducer_->fail_forward();
    }
  } catch (const std::exception&) {
    // The collective failed too (the other replicas' own failure, or a broken group): the
    // caller throws its own error either way.
  }
}

at::Tensor DataParallelImpl::forward(const at::Tensor& input) {
  return run_forward([&] { return std::vector<at::Tensor>{forward_(input)}; })[0];
}

std::vector<at::Tensor> DataParallelImpl::forward(const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(forward_tuple_, "gpipe::DataParallel: forward of ", inputs.size(), " tensors "
              "needs a module that takes a tuple (a GPipe); this one takes one tensor: call "
              "forward(tensor)");
  return run_forward([&] { return forward_tuple_(inputs); });
}

DataParallelImpl::NoSync DataParallelImpl::no_sync() {
  ++no_sync_;
  return NoSync(this);
}

DataParallelImpl::NoSync::~NoSync() {
  if (owner_ != nullptr) {
    --owner_->no_sync_;
  }
}

}  // namespace distributed
}  // namespace gpipe
