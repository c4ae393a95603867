// Stage-local backward for CPU partitions; see stage_backward.h and Note [Stage-local backward in
// one process].
#include "gpipe/internal/stage_backward.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>

#include "gpipe/internal/end_of_backward.h"

namespace gpipe {
namespace internal {
namespace {

using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

// The StageBackward whose handed-off backward this thread runs (none: the user's thread).
thread_local const StageBackward* stage_job = nullptr;
std::atomic<int64_t> cuts{0};

// Whether the backward running on this thread is a plain one — backward() from roots, without
// inputs (an empty exec info: every node runs) and without create_graph (grad mode is off inside
// a backward unless it makes a graph) — which a Handoff may cut (Note [Stage-local backward in
// one process]).
bool plain_backward() {
  if (at::GradMode::is_enabled()) return false;
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  return exec_info == nullptr || exec_info->empty();
}

}  // namespace

// Where a micro-batch enters a partition (or a skip its popping partition), in front of the
// earlier partition's outputs `roots`: its next edges are theirs, so that the graph stays one.
// A plain backward that may cut (Note [Where a backward may cut]) takes every Handoff's edges
// away when it meets the first; each then hands the gradients it gets to the earlier
// partition's backward of the micro-batch, which runs from `roots` (with those of the other
// Handoffs leading to it) on that partition's worker. Any other backward passes through it.
struct Handoff : Node {
  using Key = std::pair<size_t, int64_t>;  // partition, micro-batch
  Handoff(std::shared_ptr<StageBackward> owner, std::vector<at::Tensor> roots, size_t partition,
          int64_t microbatch, int64_t id, std::optional<Key> reached_by)
      : Node(torch::autograd::collect_next_edges(roots)),
        owner(std::move(owner)),
        roots(std::move(roots)),
        target(partition, microbatch),
        reached_by(reached_by),
        id(id) {}
  ~Handoff() override { owner->forget(this); }
  edge_list take_edges() {
    edge_list edges = std::move(next_edges_);
    next_edges_.clear();
    return edges;
  }
  void give_edges(edge_list edges) { next_edges_ = std::move(edges); }
  std::string name() const override { return "gpipe::Handoff"; }
  void release_variables() override {
    released = true;
    roots.clear();
  }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(!released, "gpipe: a backward reached a partition's hand-off again after a "
                "backward that did not retain the graph; pass retain_graph=true to the first "
                "backward to run another through the same graph");
    if (!plain_backward()) return std::move(grads);  // the one graph
    // The user's backward decides, at the first Handoff it meets, whether it cuts (and takes the
    // edges away); a handed-off backward runs only where it did.
    if (stage_job != owner.get() && !owner->queue_callback_once(this)) return std::move(grads);
    TORCH_INTERNAL_ASSERT(next_edges_.empty(), "gpipe: a Handoff kept its edges in a cut");
    // The roots whose gradients are defined: where the one graph would pass an undefined
    // gradient on, nothing is run, and the parameters behind it keep no gradient.
    std::vector<at::Tensor> handed, g;
    for (size_t k = 0; k < roots.size() && k < grads.size(); ++k) {
      if (!grads[k].defined()) continue;
      handed.push_back(roots[k]);
      g.push_back(std::move(grads[k]));
    }
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
    // Without the graph kept, the roots go with the gradients: this node holds no graph any more.
    if (!keep_graph) roots.clear();
    owner->arrive(id, target.first, target.second, std::move(handed), std::move(g), keep_graph);
    return {};  // no next edges: this engine call stops here
  }

  std::shared_ptr<StageBackward> owner;
  std::vector<at::Tensor> roots;
  const Key target;  // the backward it hands its gradients to
  const std::optional<Key> reached_by;  // the backward that reaches it; none: the user's
  const int64_t id;
  bool released = false;
};

int64_t cut_backwards() { return cuts.load(); }

int64_t StageBackward::add_handoff(const Key& target, const Key* reached_by) {
  absl::MutexLock lock(&mu_);
  ++expected_[target];
  const int64_t id = next_id_++;
  if (reached_by != nullptr) in_graph_of_[*reached_by].emplace_back(id, target);
  return id;
}

// Note [Where a backward may cut]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Cutting at the Handoffs gives each (partition, micro-batch) part of the graph — its segment,
// the nodes reachable from the Handoffs that lead to it without crossing another Handoff — its
// own engine call. That is exact only where every path into a segment passes through those
// Handoffs: a node that the user's backward reaches another way (a tensor from inside a
// partition used outside it, such as a loss a layer keeps; the first-order gradients a
// create_graph backward made, whose graph refers to the partitions' activations), or that two
// segments share (a tensor computed once and used by every micro-batch), would be run by two
// engine calls, or wait in one for a gradient that another has. So the first Handoff a plain
// backward meets checks the graph the engine found for it (every node reachable from its roots):
// each edge into a segment must come from that segment, or from a Handoff that leads to it; each
// edge into a Handoff from the segment that uses its tensors (from outside the pipeline, for
// those behind the last partition); a parameter (its AccumulateGrad node) may be reached from
// several segments, but not also from outside them (a weight's penalty in the loss), and so may a
// cast of parameters alone that one partition's micro-batches share (autocast caches a weight's
// cast for its region: it saves no tensor, so each micro-batch's engine call runs it with its
// share, as step()'s backward of each micro-batch does). Where that
// fails, this backward passes through every Handoff: the one graph, as
// LibTorch runs it. Not seen: the edges of the roots themselves, which the engine keeps apart: a
// backward of several roots, one of them the pipeline's output and one a tensor from inside a
// partition, cuts, and fails with LibTorch's "could not compute gradients for some functions"
// (partial gradients left, as after any failed backward); sum the roots instead. Also: a
// parameter's AccumulateGrad runs once per micro-batch that reaches it, not once with their sum
// (as for checkpointed micro-batches), so a hook on a parameter sees each micro-batch's share;
// and concurrent backwards through one forward's graph are not supported.

void StageBackward::forget(const Node* handoff) {
  absl::MutexLock lock(&mu_);
  handoffs_.erase(handoff);
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
      new Handoff(shared_from_this(), roots, partition, microbatch, id,
                  last ? std::nullopt : std::optional<Key>(next)),
      torch::autograd::deleteNode);
  remember(node.get());
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
      new Handoff(shared_from_this(), {tensor}, partition, microbatch, id, popper),
      torch::autograd::deleteNode);
  remember(node.get());
  at::Tensor out = tensor.detach();
  torch::autograd::set_history(out, node);
  return out;
}

void StageBackward::arrive(int64_t id, size_t partition, int64_t microbatch,
                           std::vector<at::Tensor> roots, std::vector<at::Tensor> grads,
                           bool keep_graph) {
  Join ready;
  const Key key{partition, microbatch};
  {
    absl::MutexLock lock(&mu_);
    TORCH_CHECK(arrived_.insert(id).second, "gpipe: a backward reached partition ", partition + 1,
                "'s input of micro-batch ", microbatch, " twice, from two of its roots; call "
                "backward on one tensor (e.g. the sum of the roots), so that the pipeline's "
                "backward runs as one graph where it must (Note [Where a backward may cut])");
    Join& join = joins_[key];
    join.keep_graph |= keep_graph;
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
  if (join.roots.empty()) {
    // Only undefined gradients arrived: no backward to run, and the Handoffs it would have
    // reached will not be.
    for (auto& [next, ready] : job_done(key)) start(next, std::move(ready));
    return;
  }
  submit(key, [roots = std::move(join.roots), grads = std::move(join.grads),
               keep_graph = join.keep_graph] {
    torch::autograd::backward(roots, grads, keep_graph);
  });
}

void StageBackward::submit(const Key& key, std::function<void()> job) {
  const size_t partition = key.first;
  auto run = [self = shared_from_this(), job = std::move(job), key]() mutable {
    const StageBackward* const outer = stage_job;
    stage_job = self.get();
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
  const std::shared_ptr<WorkerPool> workers = workers_.lock();
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return;  // the backward failed: job (and the graph it holds) is dropped
    if (workers == nullptr || workers->runs_inline(partition)) {
      inline_jobs_.push_back(std::move(run));
      ++pending_;
      return;
    }
    ++pending_;
  }
  try {
    workers->for_partition(partition).submit(std::move(run));
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

void StageBackward::remember(Handoff* handoff) {
  absl::MutexLock lock(&mu_);
  handoffs_[handoff] = handoff;
}

namespace {

using Segment = std::pair<size_t, int64_t>;  // partition, micro-batch
constexpr Segment kOutside{~size_t{0}, -1};

// (typeid, not dynamic_cast: the check asks it of every edge twice, and a dynamic_cast was 40%
// of the check's instructions.)
bool is_parameter(const Node* node) {
  return typeid(*node) == typeid(torch::autograd::AccumulateGrad);
}

// A cast of a parameter (autocast's cached weight cast, which every micro-batch of a partition
// shares): it saves no tensor and is linear, so running it once per micro-batch's share is exact.
bool is_parameter_cast(const Node* node) {
  if (node->name() != "ToCopyBackward0") return false;
  for (const auto& edge : node->next_edges()) {
    if (edge.function != nullptr && !is_parameter(edge.function.get())) return false;
  }
  return true;
}

}  // namespace

bool StageBackward::cuts_safely(const Node* meeting) const {
  const std::unordered_set<Node*>* graph = torch::autograd::get_current_graph_task_nodes_in_graph();
  // A graph that does not hold the Handoff that meets it is not the whole graph: no cut.
  if (graph == nullptr || graph->count(const_cast<Node*>(meeting)) == 0) return false;
  // Note [Where a backward may cut]: label every segment's nodes, then check every edge.
  std::unordered_map<const Node*, Segment> segment;
  segment.reserve(graph->size());
  std::unordered_set<const Node*> inside_parameters;
  std::unordered_map<const Node*, size_t> casts;  // parameter casts shared, by partition
  std::vector<const Node*> stack;
  for (const auto& [node, handoff] : handoffs_) {
    if (graph->count(const_cast<Node*>(node)) == 0) continue;
    stack.push_back(node);
    while (!stack.empty()) {
      const Node* at = stack.back();
      stack.pop_back();
      for (const auto& edge : at->next_edges()) {
        const Node* next = edge.function.get();
        if (next == nullptr || handoffs_.count(next) > 0) continue;
        if (is_parameter(next)) {
          inside_parameters.insert(next);
          continue;
        }
        if (const auto cast = casts.find(next); cast != casts.end()) {
          if (cast->second != handoff->target.first) return false;
          continue;
        }
        auto [it, added] = segment.emplace(next, handoff->target);
        if (added) {
          stack.push_back(next);
        } else if (it->second != handoff->target) {  // shared by two segments
          // One partition's micro-batches may share a cast of parameters; nothing else.
          if (it->second.first != handoff->target.first || !is_parameter_cast(next)) return false;
          casts.emplace(next, it->second.first);
          segment.erase(it);
        }
      }
    }
  }
  auto segment_of = [&](const Node* node) {
    auto it = segment.find(node);
    return it == segment.end() ? kOutside : it->second;
  };
  for (const Node* node : *graph) {
    if (casts.count(node) > 0) continue;  // its edges lead to parameters only
    // What reaches through this node's edges: a Handoff's target, else the node's own segment.
    const auto handoff = handoffs_.find(node);
    const Segment from = handoff != handoffs_.end() ? handoff->second->target : segment_of(node);
    for (const auto& edge : node->next_edges()) {
      const Node* next = edge.function.get();
      if (next == nullptr) continue;
      if (is_parameter(next)) {
        if (from == kOutside && inside_parameters.count(next) > 0) return false;
      } else if (const auto cast = casts.find(next); cast != casts.end()) {
        if (from.first != cast->second) return false;  // kOutside's partition is no partition
      } else if (const auto into = handoffs_.find(next); into != handoffs_.end()) {
        if (into->second->reached_by.value_or(kOutside) != from) return false;
      } else if (segment_of(next) != from && segment_of(next) != kOutside) {
        return false;
      }
    }
  }
  return true;
}

bool StageBackward::queue_callback_once(const Node* meeting) {
  {
    absl::MutexLock lock(&mu_);
    if (callback_queued_) return cut_;
    callback_queued_ = true;
  }
  auto self = shared_from_this();
  try {
    queue_end_of_backward([self] { self->finish(); }, [self] { self->cancel(); });
  } catch (...) {
    absl::MutexLock lock(&mu_);
    callback_queued_ = false;
    throw;
  }
  std::vector<edge_list> dropped;  // freed unlocked: they may hold graphs, and so Handoffs
  const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
  absl::MutexLock lock(&mu_);
  cut_ = cuts_safely(meeting);
  if (!cut_) return false;  // the whole backward on this thread, with the caller's cores
  ++cuts;
  cores_ = std::make_shared<const internal::CoreShare>(partitions_);
  // Every Handoff's edges go, so that each engine call stops at the Handoffs (the engine runs a
  // node's next functions only through the gradients it returns, and walks its edges when it
  // starts); with the graph kept they come back when the backward ends.
  for (const auto& [node, handoff] : handoffs_) {
    edge_list edges = handoff->take_edges();
    if (keep_graph) {
      cut_edges_.emplace_back(handoff->shared_from_this(), std::move(edges));
    } else {
      dropped.push_back(std::move(edges));
    }
  }
  return true;
}

void StageBackward::restore_edges(CutEdges cut) {
  for (auto& [node, edges] : cut) static_cast<Handoff*>(node.get())->give_edges(std::move(edges));
}

void StageBackward::cancel() {
  // What is dropped is destroyed after the lock is released: it holds graphs, whose Handoffs
  // hold this object (kept alive meanwhile by the dropped callback).
  std::deque<std::function<void()>> dropped_jobs;
  std::map<Key, Join> dropped_joins;
  CutEdges cut;
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
    cut.swap(cut_edges_);
    arrived_.clear();
    error_ = nullptr;  // the user's backward raises its own error
    callback_queued_ = false;
    cancelled_ = false;
    cores_ = nullptr;
  }
  restore_edges(std::move(cut));
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
  CutEdges cut;
  std::map<Key, Join> left;
  {
    absl::MutexLock lock(&mu_);
    cut.swap(cut_edges_);
    error = error_;
    error_ = nullptr;
    callback_queued_ = false;
    cores_ = nullptr;  // the cores are the caller's again
    left.swap(joins_);  // after an error, backwards that will not run (freed unlocked: they hold
                        // graphs, whose Handoffs forget themselves here)
    arrived_.clear();  // a backward with retain_graph may reach the Handoffs again
  }
  restore_edges(std::move(cut));
  if (error) std::rethrow_exception(error);
}

}  // namespace internal
}  // namespace gpipe
