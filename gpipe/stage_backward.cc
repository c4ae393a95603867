// Stage-local backward for CPU partitions; see stage_backward.h and Note [Stage-local backward in
// one process].
#include "gpipe/stage_backward.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace gpipe {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

thread_local bool stage_job = false;

// The cut in front of a partition (or of a skip's popping partition): no next edges; its backward
// hands the gradients of its outputs to the earlier partition's backward of the micro-batch, which
// runs from `roots` (with those of the other Handoffs leading to it) on that partition's worker.
struct Handoff : Node {
  Handoff(std::shared_ptr<StageBackward> owner, std::vector<at::Tensor> roots, size_t partition,
          int64_t microbatch)
      : owner(std::move(owner)),
        roots(std::move(roots)),
        partition(partition),
        microbatch(microbatch) {}
  std::string name() const override { return "gpipe::Handoff"; }
  variable_list apply(variable_list&& grads) override {
    // Inside backward, grad mode is on only with create_graph.
    TORCH_CHECK(!at::GradMode::is_enabled(), "gpipe: a backward with create_graph (double "
                "backward) cannot cross partitions with stage-local backward; construct the GPipe "
                "with GPipeOptions::stage_local_backward(false)");
    std::vector<at::Tensor> g(roots.size());
    for (size_t k = 0; k < roots.size(); ++k) {
      g[k] = k < grads.size() && grads[k].defined() ? std::move(grads[k])
                                                    : at::zeros_like(roots[k]);
    }
    if (!in_stage_backward()) {
      owner->queue_callback_once();
    }
    owner->arrive(partition, microbatch, roots, std::move(g));
    return {};
  }
  std::shared_ptr<StageBackward> owner;
  std::vector<at::Tensor> roots;
  size_t partition;
  int64_t microbatch;
};

}  // namespace

bool in_stage_backward() { return stage_job; }

void StageBackward::hand_off(Batch& batch, size_t partition, int64_t microbatch) {
  std::vector<at::Tensor> roots;
  std::vector<size_t> where;
  for (size_t k = 0; k < batch.size(); ++k) {
    if (batch[k].defined() && batch[k].requires_grad()) {
      roots.push_back(batch[k]);
      where.push_back(k);
    }
  }
  if (roots.empty()) {
    return;
  }
  auto node = std::shared_ptr<Handoff>(
      new Handoff(shared_from_this(), roots, partition, microbatch), torch::autograd::deleteNode);
  {
    absl::MutexLock lock(&mu_);
    ++expected_[{partition, microbatch}];
  }
  for (size_t k : where) {
    at::Tensor out = batch[k].detach();
    torch::autograd::set_history(out, node);
    batch[k] = std::move(out);
  }
}

at::Tensor StageBackward::hand_off_skip(const at::Tensor& tensor, size_t partition,
                                        int64_t microbatch) {
  auto node = std::shared_ptr<Handoff>(
      new Handoff(shared_from_this(), {tensor}, partition, microbatch),
      torch::autograd::deleteNode);
  {
    absl::MutexLock lock(&mu_);
    ++expected_[{partition, microbatch}];
  }
  at::Tensor out = tensor.detach();
  torch::autograd::set_history(out, node);
  return out;
}

void StageBackward::arrive(size_t partition, int64_t microbatch, std::vector<at::Tensor> roots,
                           std::vector<at::Tensor> grads) {
  Join ready;
  {
    absl::MutexLock lock(&mu_);
    const Key key{partition, microbatch};
    Join& join = joins_[key];
    for (size_t k = 0; k < roots.size(); ++k) {
      join.roots.push_back(std::move(roots[k]));
      join.grads.push_back(std::move(grads[k]));
    }
    if (++join.arrived < expected_[key]) return;
    ready = std::move(join);
    joins_.erase(key);
  }
  start(partition, std::move(ready));
}

void StageBackward::start(size_t partition, Join join) {
  submit(partition, [roots = std::move(join.roots), grads = std::move(join.grads)] {
    torch::autograd::backward(roots, grads);
  });
}

void StageBackward::submit(size_t partition, std::function<void()> job) {
  auto run = [self = shared_from_this(), job = std::move(job)]() mutable {
    const bool outer = stage_job;
    stage_job = true;
    try {
      job();
    } catch (...) {
      absl::MutexLock lock(&self->mu_);
      if (!self->error_) self->error_ = std::current_exception();
    }
    // The job's roots hold this partition's autograd graph: drop them here, before the job counts
    // as done, so that backward() returns with no worker still holding (and later freeing, beside
    // the caller's next step) any of the graph.
    job = nullptr;
    stage_job = outer;
    absl::MutexLock lock(&self->mu_);
    --self->pending_;
  };
  {
    absl::MutexLock lock(&mu_);
    ++pending_;
    if (workers_->runs_inline(partition)) {
      inline_jobs_.push_back(std::move(run));
      return;
    }
  }
  workers_->for_partition(partition).submit(std::move(run));
}

void StageBackward::queue_callback_once() {
  {
    absl::MutexLock lock(&mu_);
    if (callback_queued_) return;
    callback_queued_ = true;
  }
  torch::autograd::Engine::get_default_engine().queue_callback(
      [self = shared_from_this()] { self->finish(); });
}

void StageBackward::finish() {
  // Runs the backwards of partitions that run on this (the calling) thread as they come, and
  // waits for the workers' (each may hand off more).
  for (;;) {
    std::function<void()> job;
    size_t partition = 0;
    Join partial;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](StageBackward* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
            return s->pending_ == 0 || !s->inline_jobs_.empty();
          },
          this));
      if (inline_jobs_.empty()) {
        // Nothing runs or waits to: a backward still missing a Handoff will not get it (no
        // gradient reaches that one); start the latest partition's with what has arrived.
        if (joins_.empty() || error_) break;
        auto latest = std::prev(joins_.end());  // ordered by partition
        partition = latest->first.first;
        partial = std::move(latest->second);
        joins_.erase(latest);
      } else {
        job = std::move(inline_jobs_.front());
        inline_jobs_.pop_front();
      }
    }
    if (job) {
      job();
    } else {
      start(partition, std::move(partial));
    }
  }
  std::exception_ptr error;
  {
    absl::MutexLock lock(&mu_);
    error = error_;
    error_ = nullptr;
    callback_queued_ = false;
    joins_.clear();  // after an error, backwards that will not run
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace gpipe
