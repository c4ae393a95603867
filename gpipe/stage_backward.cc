// Stage-local backward for CPU partitions; see stage_backward.h and Note [Stage-local backward in
// one process].
#include "gpipe/internal/stage_backward.h"

#include <optional>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "gpipe/internal/end_of_backward.h"

namespace gpipe {
namespace internal {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

thread_local bool stage_job = false;

// The cut in front of a partition (or of a skip's popping partition): no next edges; its backward
// hands the gradients of its outputs to the earlier partition's backward of the micro-batch, which
// runs from `roots` (with those of the other Handoffs leading to it) on that partition's worker.
struct Handoff : Node {
  Handoff(std::shared_ptr<StageBackward> owner, std::vector<at::Tensor> roots, size_t partition,
          int64_t microbatch, int64_t id)
      : owner(std::move(owner)),
        roots(std::move(roots)),
        partition(partition),
        microbatch(microbatch),
        id(id) {}
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
    owner->arrive(id, partition, microbatch, roots, std::move(g));
    return {};
  }
  std::shared_ptr<StageBackward> owner;
  std::vector<at::Tensor> roots;
  size_t partition;
  int64_t microbatch;
  int64_t id;
};

}  // namespace

bool in_stage_backward() { return stage_job; }

int64_t StageBackward::add_handoff(const Key& target, const Key* reached_by) {
  absl::MutexLock lock(&mu_);
  ++expected_[target];
  const int64_t id = next_id_++;
  if (reached_by != nullptr) in_graph_of_[*reached_by].emplace_back(id, target);
  return id;
}

void StageBackward::hand_off(Batch& batch, size_t partition, int64_t microbatch, bool last) {
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
  // In front of partition + 1, whose backward of the micro-batch reaches it (the last one is
  // reached by the caller's backward instead).
  const Key next{partition + 1, microbatch};
  const int64_t id = add_handoff({partition, microbatch}, last ? nullptr : &next);
  auto node = std::shared_ptr<Handoff>(
      new Handoff(shared_from_this(), roots, partition, microbatch, id),
      torch::autograd::deleteNode);
  for (size_t k : where) {
    at::Tensor out = batch[k].detach();
    torch::autograd::set_history(out, node);
    batch[k] = std::move(out);
  }
}

at::Tensor StageBackward::hand_off_skip(const at::Tensor& tensor, size_t partition,
                                        int64_t microbatch, size_t popping) {
  const Key popper{popping, microbatch};
  const int64_t id = add_handoff({partition, microbatch}, &popper);
  auto node = std::shared_ptr<Handoff>(
      new Handoff(shared_from_this(), {tensor}, partition, microbatch, id),
      torch::autograd::deleteNode);
  at::Tensor out = tensor.detach();
  torch::autograd::set_history(out, node);
  return out;
}

void StageBackward::arrive(int64_t id, size_t partition, int64_t microbatch,
                           std::vector<at::Tensor> roots, std::vector<at::Tensor> grads) {
  Join ready;
  const Key key{partition, microbatch};
  {
    absl::MutexLock lock(&mu_);
    arrived_.insert(id);
    Join& join = joins_[key];
    for (size_t k = 0; k < roots.size(); ++k) {
      join.roots.push_back(std::move(roots[k]));
      join.grads.push_back(std::move(grads[k]));
    }
    if (++join.arrived + join.missed < expected_[key]) return;
    ready = std::move(join);
    joins_.erase(key);
  }
  start(key, std::move(ready));
}

std::vector<std::pair<StageBackward::Key, StageBackward::Join>> StageBackward::job_done(
    const Key& key) {
  std::vector<std::pair<Key, Join>> ready;
  absl::MutexLock lock(&mu_);
  auto handoffs = in_graph_of_.find(key);
  if (handoffs == in_graph_of_.end()) return ready;
  for (const auto& [id, target] : handoffs->second) {
    if (arrived_.count(id) > 0) continue;
    // Not reached by the only backward that could reach it: do not wait for it.
    Join& join = joins_[target];
    if (join.arrived + ++join.missed < expected_[target]) continue;
    if (join.arrived > 0) ready.emplace_back(target, std::move(join));
    joins_.erase(target);
  }
  return ready;
}

void StageBackward::start(const Key& key, Join join) {
  submit(key, [roots = std::move(join.roots), grads = std::move(join.grads)] {
    torch::autograd::backward(roots, grads);
  });
}

void StageBackward::submit(const Key& key, std::function<void()> job) {
  const size_t partition = key.first;
  auto run = [self = shared_from_this(), job = std::move(job), key]() mutable {
    const bool outer = stage_job;
    stage_job = true;
    bool cancelled;
    std::shared_ptr<const internal::CoreShare> cores;
    {
      absl::MutexLock lock(&self->mu_);
      cancelled = self->cancelled_;
      cores = self->cores_;
    }
    try {
      std::optional<internal::CoreShare::Lane> lane;
      if (cores && !cancelled) lane.emplace(*cores);
      if (!cancelled) job();
    } catch (...) {
      absl::MutexLock lock(&self->mu_);
      if (!self->error_) self->error_ = std::current_exception();
    }
    // The job's roots hold this partition's autograd graph: drop them here, before the job counts
    // as done, so that backward() returns with no worker still holding (and later freeing, beside
    // the caller's next step) any of the graph.
    job = nullptr;
    // The share too, before the job counts as done: the last holder puts OpenBLAS's threads back,
    // which must happen before backward() returns, not beside the caller's next step.
    cores = nullptr;
    stage_job = outer;
    // Backwards that waited for a Handoff this job passed by start before this one counts as
    // done, so that the end-of-backward callback never sees nothing pending in between.
    for (auto& [next, join] : self->job_done(key)) self->start_or_record(next, std::move(join));
    absl::MutexLock lock(&self->mu_);
    --self->pending_;
  };
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return;  // the backward failed: job (and the graph it holds) is dropped
    if (workers_->runs_inline(partition)) {
      inline_jobs_.push_back(std::move(run));
      ++pending_;
      return;
    }
    ++pending_;
  }
  try {
    workers_->for_partition(partition).submit(std::move(run));
  } catch (...) {  // not queued (out of memory): it will not count itself done
    absl::MutexLock lock(&mu_);
    --pending_;
    throw;
  }
}

void StageBackward::start_or_record(const Key& key, Join join) {
  try {
    start(key, std::move(join));
  } catch (...) {
    absl::MutexLock lock(&mu_);
    if (!error_) error_ = std::current_exception();
  }
}

void StageBackward::queue_callback_once() {
  {
    absl::MutexLock lock(&mu_);
    if (callback_queued_) return;
    cores_ = std::make_shared<const internal::CoreShare>(partitions_);  // before: it may throw
    callback_queued_ = true;
  }
  auto self = shared_from_this();
  queue_end_of_backward([self] { self->finish(); }, [self] { self->cancel(); });
}

void StageBackward::cancel() {
  // What is dropped is destroyed after the lock is released: it holds graphs, whose Handoffs
  // hold this object (kept alive meanwhile by the dropped callback).
  std::deque<std::function<void()>> dropped_jobs;
  std::map<Key, Join> dropped_joins;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    dropped_jobs.swap(inline_jobs_);
    pending_ -= static_cast<int64_t>(dropped_jobs.size());
    // The workers' backwards that are running finish (any they hand off is dropped, by submit());
    // those still queued run nothing.
    mu_.Await(absl::Condition(
        +[](StageBackward* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return s->pending_ == 0; },
        this));
    dropped_joins.swap(joins_);  // partial joins, with what those backwards handed off meanwhile
    arrived_.clear();
    error_ = nullptr;  // the user's backward raises its own error
    callback_queued_ = false;
    cancelled_ = false;
    cores_ = nullptr;
  }
}

void StageBackward::finish() {
  // Runs the backwards of partitions that run on this (the calling) thread as they come, and
  // waits for the workers' (each may hand off more).
  for (;;) {
    std::function<void()> job;
    size_t partition = 0;
    int64_t partial_microbatch = 0;
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
        while (!joins_.empty() && std::prev(joins_.end())->second.arrived == 0) {
          joins_.erase(std::prev(joins_.end()));  // only missed Handoffs: no backward to run
        }
        if (joins_.empty() || error_) break;
        auto latest = std::prev(joins_.end());  // ordered by partition
        partition = latest->first.first;
        partial_microbatch = latest->first.second;
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
      start_or_record({partition, partial_microbatch}, std::move(partial));
    }
  }
  std::exception_ptr error;
  {
    absl::MutexLock lock(&mu_);
    error = error_;
    error_ = nullptr;
    callback_queued_ = false;
    cores_ = nullptr;  // the cores are the caller's again
    joins_.clear();  // after an error, backwards that will not run
    arrived_.clear();  // a backward with retain_graph may reach the Handoffs again
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace internal
}  // namespace gpipe
