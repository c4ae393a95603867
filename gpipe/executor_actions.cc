// The executor's compute actions F, B (I) and W; see executor_step.h and Note [One executor].
#include "gpipe/internal/executor_step.h"

#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gpipe/internal/copy.h"
#include "gpipe/internal/dependency.h"
#include "gpipe/internal/partition.h"
#include "gpipe/internal/skip_tracker.h"
#include "gpipe/internal/stream.h"

namespace gpipe {
namespace internal {

namespace {

// Micro-batch i's skips routed into partition p: moved onto its device by the fence, and cut from
// their stashing partitions' graphs where those run their backward apart — a step's partitions,
// a stage-local forward()'s skips behind a Handoff (Note [Stage-local backward in one process] in
// stage_backward.h).
// Returns the cuts of a step, whose backward gives their gradients back by hand.
std::vector<MicroBatchSkips::Cut> receive_skips(Step& st, int64_t p, int64_t i, TaskContext& task) {
  const ExecutorSpec& spec = st.spec;
  std::vector<MicroBatchSkips::Cut> cut;
  if (spec.skip_layout == nullptr || spec.skip_layout->empty()) return cut;
  std::shared_ptr<MicroBatchSkips> shared = st.skips_of(i);
  if (!spec.skip_layout->routes_into(p).empty()) {
    // The skips from earlier partitions move to this one's device on the copy streams (their
    // stashing partitions' copy streams waited for them after their forwards).
    // forward()'s timeline shows the skips' copies (a step's shows its activations' copies
    // between devices only).
    Timeline* timeline = spec.keep_graph ? spec.timeline.get() : nullptr;
    const Timeline::Started started{timeline ? timeline->now_us() : 0, nullptr};
    for (int64_t from : shared->fence(i, p, st.compute_streams, *st.copy_streams)) {
      if (!timeline) continue;
      const int64_t offset = spec.timeline_partition_offset;
      timeline->finish({Kind::kSkipCopy, i, offset + p, offset + from, 1}, started,
                       (*st.copy_streams)[p][i]);
    }
  }
  if (spec.keep_graph && spec.stage_backward) {
    shared->cut(p, [&spec, i, p](int64_t from, const at::Tensor& tensor) {
      return spec.stage_backward->hand_off_skip(tensor, static_cast<size_t>(from), i,
                                                static_cast<size_t>(p));
    });
  } else if (!spec.keep_graph && spec.grad_enabled) {
    cut = shared->cut(p);
  }
  task.skips = std::move(shared);
  return cut;
}

// Partition p's layers (`run_layers`) on micro-batch i's input: checkpointed when i is before the
// stop; in a forward() with one graph, behind the previous micro-batch in backward (Note
// [Backward order] in executor.h).
template <typename RunLayers>
Batch compute(Step& st, int64_t p, int64_t i, const Batch& input, const RunLayers& run_layers) {
  const ExecutorSpec& spec = st.spec;
  PartitionState& s = st.states[p];
  const bool order = spec.keep_graph && spec.grad_enabled && !spec.stage_backward;
  const at::Tensor phony = std::move(s.phony);
  s.phony = at::Tensor();
  // A forward()'s output for the next partition: its copy stream waits for this computation
  // (Note [Links that keep the graph]), before a checkpoint's recomputation is wired beside it, so
  // that in backward the recomputation is queued before the compute stream waits for the
  // gradient's copy (Note [Checkpoint and recompute] in checkpoint.h).
  const auto ready_for_copy = [&](Batch& b) {
    if (!spec.keep_graph || p + 1 >= static_cast<int64_t>(st.states.size())) return;
    b.values() = wait(std::move(b.values()), st.compute_streams[p], (*st.copy_streams)[p][i]);
  };
  Batch out{std::vector<at::Tensor>{}};
  if (i < st.stop) {
    Checkpointing checkpointing(run_layers, input, s.part->device, spec.recompute_state,
                                s.part->grad_record, s.params_key);
    if (spec.keep_graph && spec.timeline) {
      checkpointing.record_to(spec.timeline, i, spec.timeline_partition_offset + p);
    }
    out = checkpointing.checkpoint();
    if (phony.defined()) checkpointing.attach_dependency(phony);
    ready_for_copy(out);
    checkpointing.recompute(out);
  } else if (phony.defined() && input.lane() >= 0) {
    Batch joined = input;
    joined[joined.lane()] = join(joined[joined.lane()], phony);
    out = run_layers(joined);
    ready_for_copy(out);
  } else {
    out = run_layers(input);
    ready_for_copy(out);
  }
  const int64_t lane = out.lane();
  if (order && i + 1 < st.m && lane >= 0) {
    std::pair<at::Tensor, at::Tensor> forked = fork(out[lane]);
    out[lane] = std::move(forked.first);
    s.phony = std::move(forked.second);
  }
  return out;
}

// Under step() each partition's graph starts at its cut inputs: one that reaches another
// partition's parameter got a tensor past the links, from the layers' own map (Note
// [current_microbatch and checkpointing]), whose gradient the cut would lose. Walked only where
// a layer asked for current_microbatch().
void check_graph_is_own(const Step& st, int64_t p, int64_t i, const Batch& out) {
  std::unordered_map<const c10::TensorImpl*, int64_t> others;
  for (int64_t q = 0; q < static_cast<int64_t>(st.states.size()); ++q) {
    if (q == p) continue;
    for (const at::Tensor& t : st.states[q].params) others.emplace(t.unsafeGetTensorImpl(), q);
  }
  // A tensor this partition holds too (a tie on one device) is its own.
  for (const at::Tensor& t : st.states[p].params) others.erase(t.unsafeGetTensorImpl());
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const at::Tensor& t : out.values()) {
    if (t.defined() && t.grad_fn()) stack.push_back(t.grad_fn().get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* leaf = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const auto found = others.find(leaf->variable.unsafeGetTensorImpl());
      if (found == others.end()) continue;
      std::string name = "?";
      for (const auto& item : st.states[found->second].part->layers->named_parameters()) {
        if (item.value().unsafeGetTensorImpl() == found->first) name = item.key();
      }
      TORCH_CHECK(false, st.spec.who, ": partition ", p, "'s output of micro-batch ", i,
                  " has autograd history into partition ", found->second, " (its parameter '",
                  name, "'), not through its input: a tensor kept in the layers' own map by "
                  "current_microbatch() and read in a later partition. step() cuts the graph "
                  "between partitions, so its gradient would be lost; read it in the partition "
                  "that saved it, or pass it with gpipe::stash and gpipe::pop");
    }
    for (const torch::autograd::Edge& e : node->next_edges()) {
      if (e.function) stack.push_back(e.function.get());
    }
  }
}

}  // namespace

void run_forward(Step& st, int64_t p, int64_t i) {
  const ExecutorSpec& spec = st.spec;
  PartitionState& s = st.states[p];
  ExecutorPartition& part = *s.part;
  TORCH_CHECK(i == s.next_forward, spec.who, ": partition ", p, " would run the forward of "
              "micro-batch ", i, " before that of micro-batch ", s.next_forward, "; each "
              "partition's forwards must run in order");
  ++s.next_forward;
  Activation a;
  if (p == 0 && st.first) {
    a = std::move(*st.first);
    st.first.reset();
  } else {
    a = s.up->receive();
  }
  TORCH_CHECK(a.grad_enabled == spec.grad_enabled, spec.who, ": micro-batch ", i, " reached "
              "partition ", p, " from a sender that runs ", a.grad_enabled ? "with" : "without",
              " grad, but this step runs ", spec.grad_enabled ? "with" : "without", " it; call "
              "step() under the same grad mode (torch::NoGradGuard for inference) on every stage");
  const c10::Stream stream = st.compute_streams[p];  // current: the action's guard made it so
  TaskContext task;
  task.microbatch = MicroBatch{spec.run, i};
  std::vector<MicroBatchSkips::Cut> cut = receive_skips(st, p, i, task);
  const Timeline::Started started = st.start(stream);  // after the skips' copies are queued
  if (spec.stage_backward && p > 0) {
    // Partition p-1's backward of this micro-batch runs on its own thread.
    spec.stage_backward->hand_off(a.batch, static_cast<size_t>(p - 1), i);
  }
  std::vector<std::vector<at::Tensor>>* layer_outputs =
      s.by_layer && spec.grad_enabled && i >= st.stop ? &s.layer_outputs[i] : nullptr;
  const bool own_graph = spec.grad_enabled && !spec.keep_graph;  // step(): cut from the last
  if (own_graph) task.microbatch_asked = std::make_shared<bool>(false);
  auto run_layers = [layers = part.layers, batch_norms = part.batch_norms, task,
                     layer_outputs](const Batch& b) {
    TaskScope scope(task);
    if (batch_norms->size() > 0 && is_recomputing()) {
      // Note [Recomputation leaves running statistics alone] in batchnorm.h.
      BatchNormLayers::Redirect redirect = batch_norms->redirect(/*recomputation=*/true);
      return run_partition(layers, b);
    }
    // Note [Deferred batch norm without replacing modules]: this forward's batch_norm calls.
    std::optional<DeferredStatisticsScope> observe;
    if (batch_norms->size() > 0 && batch_norms->gathering()) observe.emplace();
    return run_partition(layers, b, layer_outputs);
  };
  Batch out = compute(st, p, i, a.batch, run_layers);
  // A layer's own map may tie layers' backwards together (Note [current_microbatch and
  // checkpointing]): this micro-batch's weight gradients are then not split by layer.
  if (own_graph && *task.microbatch_asked) {
    if (layer_outputs != nullptr) layer_outputs->clear();
    check_graph_is_own(st, p, i, out);
  }
  st.record(Kind::kCompute, i, p, started, stream);
  if (spec.skip_layout != nullptr && !spec.skip_layout->empty()) {
    // What this forward stashed for later partitions is ready for their fences' copies (Note
    // [Skip copy streams] in skip_tracker.cc).
    wait_stream((*st.copy_streams)[p][i], stream);
  }
  s.down->send(st.m, i, out, spec.grad_enabled);
  if (spec.grad_enabled && !spec.keep_graph) {
    s.inputs[i] = std::move(a.batch);
    s.outputs[i] = std::move(out);
    s.cuts[i] = std::move(cut);
  }
}

namespace {

// I i on a partition: the gradients of its input leaves and of its popped skips' leaves (into
// `input_grads` and `skip_grads`) from `roots` with `grads`, the graph kept for W with W's roots
// and their gradients, one entry per layer where W is split by layer (Note [One executor]).
void backward_input(PartitionState& s, int64_t i, std::vector<at::Tensor> roots,
                    std::vector<at::Tensor> grads, const std::vector<at::Tensor>& input_leaves,
                    std::vector<at::Tensor>& input_grads, std::vector<at::Tensor>& skip_grads) {
  std::vector<at::Tensor> wanted = input_leaves;
  for (const MicroBatchSkips::Cut& c : s.cuts[i]) wanted.push_back(c.leaf);
  // Split by layer: the gradients at every layer's output too, for W.
  const size_t layers = s.part->layers->size();
  const bool by_layer = s.by_layer && s.layer_outputs[i].size() == layers;
  if (by_layer) {
    for (size_t k = 0; k + 1 < layers; ++k) {
      for (const at::Tensor& t : s.layer_outputs[i][k]) wanted.push_back(t);
    }
  }
  std::vector<at::Tensor> got;
  if (!roots.empty() && !wanted.empty()) {
    got = torch::autograd::grad(roots, wanted, grads, /*retain_graph=*/true,
                                /*create_graph=*/false, /*allow_unused=*/true);
  }
  for (size_t k = 0; k < input_leaves.size(); ++k) {
    input_grads.push_back(k < got.size() ? got[k] : at::Tensor());
  }
  for (size_t k = 0; k < s.cuts[i].size(); ++k) {
    const size_t at = input_leaves.size() + k;
    if (at < got.size()) skip_grads[k] = got[at];
  }
  s.w_roots[i].clear();
  s.w_grads[i].clear();
  if (by_layer && !got.empty()) {
    // Layer k's weight gradients start from its outputs: the next layer's inputs, or the
    // partition's outputs for the last.
    size_t next = input_leaves.size() + s.cuts[i].size();
    for (size_t k = 0; k < layers; ++k) {
      std::vector<at::Tensor> layer_roots, layer_grads;
      if (k + 1 < layers) {
        for (const at::Tensor& t : s.layer_outputs[i][k]) {
          if (got[next].defined()) {
            layer_roots.push_back(t);
            layer_grads.push_back(got[next]);
          }
          ++next;
        }
      } else {
        layer_roots = roots;
        layer_grads = grads;
      }
      s.w_roots[i].push_back(std::move(layer_roots));
      s.w_grads[i].push_back(std::move(layer_grads));
    }
  } else {
    s.w_roots[i].push_back(std::move(roots));
    s.w_grads[i].push_back(std::move(grads));
  }
  s.layer_outputs[i].clear();
}

}  // namespace

// B i (whole), or I i (input gradients only; the whole backward when checkpointed).
void run_backward(Step& st, int64_t p, int64_t i, bool split) {
  const ExecutorSpec& spec = st.spec;
  PartitionState& s = st.states[p];
  TORCH_CHECK(i < s.next_forward, spec.who, ": partition ", p, " would run the backward of "
              "micro-batch ", i, " before its forward");
  std::vector<at::Tensor> grads = s.down->receive_gradients(i);
  const c10::Stream stream = st.compute_streams[p];
  const Timeline::Started started = st.start(stream);
  std::vector<at::Tensor> roots = requiring_grad(s.outputs[i]);
  TORCH_CHECK(roots.size() == grads.size(), spec.who, ": partition ", p, " got ", grads.size(),
              " gradients for micro-batch ", i, " but has ", roots.size(),
              " outputs that require grad");
  // The skips this partition stashed and later ones popped: more roots, with the gradients
  // caught there (complete: those partitions ran this micro-batch's backward first).
  {
    absl::MutexLock lock(&st.mu);
    auto it = st.skip_grads[p].find(i);
    if (it != st.skip_grads[p].end()) {
      for (auto& [tensor, grad] : it->second) {
        roots.push_back(std::move(tensor));
        grads.push_back(std::move(grad));
      }
      st.skip_grads[p].erase(it);
    }
  }
  // Only the roots that a gradient reached: where none did, the plain model leaves the gradients
  // behind them undefined, and so does the pipeline.
  {
    size_t kept = 0;
    for (size_t k = 0; k < roots.size(); ++k) {
      if (!grads[k].defined()) continue;
      roots[kept] = std::move(roots[k]);
      grads[kept] = std::move(grads[k]);
      ++kept;
    }
    roots.resize(kept);
    grads.resize(kept);
  }
  const std::vector<at::Tensor> input_leaves = requiring_grad(s.inputs[i]);
  std::vector<at::Tensor> input_grads;
  std::vector<at::Tensor> skip_grads(s.cuts[i].size());
  const bool whole = !split || i < st.stop;
  if (whole) {
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    for (const at::Tensor& leaf : input_leaves) input_grads.push_back(leaf.grad());
    for (size_t k = 0; k < s.cuts[i].size(); ++k) skip_grads[k] = s.cuts[i][k].leaf.grad();
    // A whole B in a step split by layer (DualPipeV's main step beside its I and W) needs no
    // layer outputs; kept, they would hold each layer's activations to the end of the step.
    s.layer_outputs[i].clear();
  } else {
    backward_input(s, i, std::move(roots), std::move(grads), input_leaves, input_grads,
                   skip_grads);
  }
  // The skips this partition popped from earlier ones: their gradients, for the stashing
  // partitions (whose backward of this micro-batch follows, after the gradients pass through).
  // On a GPU the copy stream waits for this backward now (as the link's send below does again),
  // and the stashing partition's backward starts from the skip's copy (Note [Skip copy streams] in
  // skip_tracker.cc).
  if (!s.cuts[i].empty()) {
    bool waited = false;
    absl::MutexLock lock(&st.mu);
    for (size_t k = 0; k < s.cuts[i].size(); ++k) {
      if (!skip_grads[k].defined()) continue;
      MicroBatchSkips::Cut& c = s.cuts[i][k];
      if (c.copied.defined() && !waited) {
        wait_stream((*st.copy_streams)[p][i], stream);
        waited = true;
      }
      st.skip_grads[c.from][i].emplace_back(
          c.copied.defined() ? std::move(c.copied) : std::move(c.tensor), std::move(skip_grads[k]));
    }
  }
  s.cuts[i].clear();
  s.outputs[i] = Batch(std::vector<at::Tensor>{});  // the graph is spent (or kept for W)
  s.inputs[i] = Batch(std::vector<at::Tensor>{});
  st.record(split ? Kind::kBackwardInput : Kind::kBackward, i, p, started, stream);
  if (!s.up->takes_undefined_gradients()) {
    for (size_t k = 0; k < input_grads.size(); ++k) {
      if (!input_grads[k].defined()) input_grads[k] = at::zeros_like(input_leaves[k]);
    }
  }
  s.up->send_gradients(i, std::move(input_grads));
}

// W i: the parameters' gradients, from the graph I i kept.
void run_backward_weight(Step& st, int64_t p, int64_t i) {
  PartitionState& s = st.states[p];
  const c10::Stream stream = st.compute_streams[p];
  const Timeline::Started started = st.start(stream);
  std::vector<std::vector<at::Tensor>> roots = std::move(s.w_roots[i]);
  std::vector<std::vector<at::Tensor>> grads = std::move(s.w_grads[i]);
  s.w_roots[i].clear();
  s.w_grads[i].clear();
  const bool by_layer = roots.size() > 1;  // one entry per layer
  for (size_t k = 0; k < roots.size(); ++k) {
    // By layer: each layer's backward reaches only its own parameters, so the engine computes
    // their gradients and not, again, the activations' (Note [One executor]).
    const std::vector<at::Tensor>& params = by_layer ? s.layer_params[k] : s.params;
    if (roots[k].empty() || params.empty()) continue;
    torch::autograd::backward(roots[k], grads[k], /*retain_graph=*/false,
                              /*create_graph=*/false, params);
  }
  roots.clear();
  grads.clear();
  st.record(Kind::kBackwardWeight, i, p, started, stream);
}

}  // namespace internal
}  // namespace gpipe
