// The executor; see executor.h and Note [One executor].
#include "gpipe/executor.h"

#include <exception>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gpipe/partition.h"
#include "gpipe/skip_tracker.h"
#include "gpipe/stream.h"

namespace gpipe {
namespace detail {
namespace {

using Kind = TimelineEvent::Kind;

// One partition's micro-batches in flight.
struct PartitionState {
  ExecutorPartition* part = nullptr;
  Upstream* up = nullptr;
  Downstream* down = nullptr;
  uint64_t params_key = 0;
  std::vector<at::Tensor> params;  // those that require grad (W's inputs)
  int64_t next_forward = 0;
  std::vector<Batch> inputs, outputs;  // from F i to its backward
  std::vector<std::vector<MicroBatchSkips::Cut>> cuts;  // skips from earlier partitions
  // Kept from I i to W i: the backward's roots and their gradients, per layer when the
  // backward is split by layer (Note [One executor]), else one entry.
  std::vector<std::vector<std::vector<at::Tensor>>> w_roots, w_grads;
  // Per micro-batch, F i's layer outputs that require grad (split schedules, no skips).
  std::vector<std::vector<std::vector<at::Tensor>>> layer_outputs;
  std::vector<std::vector<at::Tensor>> layer_params;  // each layer's, requiring grad
  bool by_layer = false;  // W split by layer (Note [One executor])
};

// One step's state, shared by the lanes.
struct Step {
  const ExecutorSpec& spec;
  int64_t m = 0;
  int64_t stop = 0;
  bool by_layer = false;  // W split by layer (Note [One executor])
  std::optional<Activation> first;  // the first partition's first input, when it told m
  std::vector<PartitionState> states;
  std::vector<std::unique_ptr<LocalLink>> links;  // links[p]: partitions p and p + 1
  absl::Mutex mu;
  std::exception_ptr error ABSL_GUARDED_BY(mu);
  // Skips between partitions: each micro-batch's tracker, and for each stashing partition and
  // micro-batch the popped tensors with the gradients the popping partitions caught (Note
  // [Partitions within a stage] in distributed/pipeline_stage.h).
  std::map<int64_t, std::shared_ptr<MicroBatchSkips>> skips ABSL_GUARDED_BY(mu);
  std::vector<std::map<int64_t, std::vector<std::pair<at::Tensor, at::Tensor>>>> skip_grads
      ABSL_GUARDED_BY(mu);

  explicit Step(const ExecutorSpec& s) : spec(s) {}

  bool failed() {
    absl::MutexLock lock(&mu);
    return error != nullptr;
  }

  std::shared_ptr<MicroBatchSkips> skips_of(int64_t microbatch) {
    absl::MutexLock lock(&mu);
    std::shared_ptr<MicroBatchSkips>& tracker = skips[microbatch];
    if (!tracker) tracker = std::make_shared<MicroBatchSkips>(spec.skip_layout);
    return tracker;
  }

  // Keeps the first error and fails every link, so that no lane waits for what will not come.
  void fail(std::exception_ptr e, const std::string& why) {
    {
      absl::MutexLock lock(&mu);
      if (!error) error = std::move(e);
    }
    for (auto& link : links) link->fail(why);
    spec.upstream->fail(why);
    spec.downstream->fail(why);
  }

  void record(Kind kind, int64_t i, int64_t p, const Timeline::Started& started,
              const c10::Stream& stream) {
    if (!spec.timeline) return;
    TimelineEvent event{kind, i, spec.timeline_partition_offset + p};
    event.checkpointed = i < stop;
    spec.timeline->finish(event, started, stream);
  }
  Timeline::Started start(const c10::Stream& stream) {
    return spec.timeline ? spec.timeline->start(stream) : Timeline::Started{};
  }
};

void forward(Step& st, int64_t p, int64_t i) {
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
  const c10::Stream stream = current_stream(part.device);
  const Timeline::Started started = st.start(stream);
  TaskContext task;
  task.microbatch = MicroBatch{spec.run, i};
  std::vector<MicroBatchSkips::Cut> cut;
  if (spec.skip_layout != nullptr && !spec.skip_layout->empty()) {
    std::shared_ptr<MicroBatchSkips> shared = st.skips_of(i);
    if (!spec.skip_layout->routes_into(p).empty()) {
      // The skips from earlier partitions move to this one's device (every stream is the
      // device's current one: each lane computes and copies on its thread's streams).
      std::vector<c10::Stream> streams;
      for (const PartitionState& q : st.states) streams.push_back(current_stream(q.part->device));
      std::vector<std::vector<c10::Stream>> copy_streams;
      for (const c10::Stream& c : streams) copy_streams.emplace_back(i + 1, c);
      shared->fence(i, p, streams, copy_streams);
    }
    if (spec.grad_enabled) cut = shared->cut(p);
    task.skips = std::move(shared);
  }
  std::vector<std::vector<at::Tensor>>* layer_outputs =
      s.by_layer && spec.grad_enabled && i >= st.stop ? &s.layer_outputs[i] : nullptr;
  auto run_layers = [layers = part.layers, batch_norms = part.batch_norms, task,
                     layer_outputs](const Batch& b) {
    TaskScope scope(task);
    if (batch_norms->size() > 0 && is_recomputing()) {
      // Note [Recomputation leaves running statistics alone] in batchnorm.h.
      BatchNormLayers::Redirect redirect = batch_norms->redirect();
      return run_partition(layers, b);
    }
    return run_partition(layers, b, layer_outputs);
  };
  Batch out{std::vector<at::Tensor>{}};
  if (i < st.stop) {
    Checkpointing checkpointing(run_layers, a.batch, part.device, spec.recompute_state,
                                part.grad_record, s.params_key);
    out = checkpointing.checkpoint();
    checkpointing.recompute(out);
  } else {
    out = run_layers(a.batch);
  }
  st.record(Kind::kCompute, i, p, started, stream);
  s.down->send(st.m, i, out, spec.grad_enabled);
  if (spec.grad_enabled) {
    s.inputs[i] = std::move(a.batch);
    s.outputs[i] = std::move(out);
    s.cuts[i] = std::move(cut);
  }
}

// B i (whole), or I i (input gradients only; the whole backward when checkpointed).
void backward(Step& st, int64_t p, int64_t i, bool split) {
  const ExecutorSpec& spec = st.spec;
  PartitionState& s = st.states[p];
  TORCH_CHECK(i < s.next_forward, spec.who, ": partition ", p, " would run the backward of "
              "micro-batch ", i, " before its forward");
  std::vector<at::Tensor> grads = s.down->receive_gradients(i);
  const c10::Stream stream = current_stream(s.part->device);
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
  } else {
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
  // The skips this partition popped from earlier ones: their gradients, for the stashing
  // partitions (whose backward of this micro-batch follows, after the gradients pass through).
  if (!s.cuts[i].empty()) {
    absl::MutexLock lock(&st.mu);
    for (size_t k = 0; k < s.cuts[i].size(); ++k) {
      if (skip_grads[k].defined()) {
        st.skip_grads[s.cuts[i][k].from][i].emplace_back(std::move(s.cuts[i][k].tensor),
                                                         std::move(skip_grads[k]));
      }
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
void backward_weight(Step& st, int64_t p, int64_t i) {
  PartitionState& s = st.states[p];
  const c10::Stream stream = current_stream(s.part->device);
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

void run_lane(Step& st, const std::vector<Action>& actions) {
  for (const Action& a : actions) {
    if (st.failed()) return;
    switch (a.type) {
      case ActionType::kForward:
        forward(st, a.stage, a.microbatch);
        break;
      case ActionType::kBackward:
        if (st.spec.grad_enabled) backward(st, a.stage, a.microbatch, /*split=*/false);
        break;
      case ActionType::kBackwardInput:
        if (st.spec.grad_enabled) backward(st, a.stage, a.microbatch, /*split=*/true);
        break;
      case ActionType::kBackwardWeight:
        if (st.spec.grad_enabled && a.microbatch >= st.stop) {
          backward_weight(st, a.stage, a.microbatch);
        }
        break;
      default:  // transfers are the links' (Note [One executor])
        break;
    }
  }
}

}  // namespace

bool forwards_before_backwards(const std::vector<std::vector<Action>>& lanes, int64_t last) {
  for (const std::vector<Action>& lane : lanes) {
    bool backward_seen = false;
    for (const Action& a : lane) {
      if (a.stage != last) continue;
      if (a.type == ActionType::kForward && backward_seen) return false;
      if (a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) {
        backward_seen = true;
      }
    }
  }
  return true;
}

void run_schedule(const ExecutorSpec& spec) {
  std::vector<ExecutorPartition>& partitions = *spec.partitions;
  const int64_t n = static_cast<int64_t>(partitions.size());
  Step st(spec);
  for (int64_t p = 0; p + 1 < n; ++p) {
    st.links.push_back(std::make_unique<LocalLink>(spec.who, p, partitions[p].device,
                                                   partitions[p + 1].device));
  }
  st.m = spec.microbatches;
  if (st.m == 0) {
    st.first = spec.upstream->receive();
    st.m = st.first->microbatches;
  }
  st.stop = spec.grad_enabled ? spec.checkpoint_stop(st.m) : 0;
  const std::vector<std::vector<Action>> lanes = spec.plan(st.m);
  // Weight gradients split by layer: for split schedules, where no skip ties layers together.
  for (const std::vector<Action>& lane : lanes) {
    for (const Action& a : lane) st.by_layer |= a.type == ActionType::kBackwardWeight;
  }
  st.by_layer &= spec.skip_layout == nullptr || spec.skip_layout->empty();
  TORCH_INTERNAL_ASSERT(lanes.size() == spec.workers.size(), "gpipe: ", lanes.size(),
                        " lanes but ", spec.workers.size(), " workers");
  st.states.resize(n);
  {
    absl::MutexLock lock(&st.mu);
    st.skip_grads.resize(n);
  }
  for (int64_t p = 0; p < n; ++p) {
    PartitionState& s = st.states[p];
    s.part = &partitions[p];
    s.up = p == 0 ? spec.upstream : st.links[p - 1].get();
    s.down = p + 1 == n ? spec.downstream : st.links[p].get();
    s.params_key = requires_grad_key(s.part->layers);
    for (const at::Tensor& t : s.part->layers->parameters()) {
      if (t.requires_grad()) s.params.push_back(t);
    }
    s.inputs.assign(st.m, Batch(std::vector<at::Tensor>{}));
    s.outputs.assign(st.m, Batch(std::vector<at::Tensor>{}));
    s.cuts.resize(st.m);
    s.w_roots.resize(st.m);
    s.w_grads.resize(st.m);
    s.layer_outputs.resize(st.m);
    if (st.by_layer) {
      // Not where layers share a parameter (tied weights): a layer's backward would then reach
      // it through the other layer too.
      std::set<const void*> seen;
      s.by_layer = true;
      for (const auto& layer : s.part->layers->children()) {
        std::vector<at::Tensor> params;
        for (const at::Tensor& t : layer->parameters()) {
          s.by_layer &= seen.insert(t.unsafeGetTensorImpl()).second;
          if (t.requires_grad()) params.push_back(t);
        }
        s.layer_params.push_back(std::move(params));
      }
    }
  }

  // Lanes on workers run under this thread's state (grad mode, autocast, the deferred
  // statistics' callback: Note [Thread-local state in workers]).
  const auto worker_state = std::make_unique<ThreadState>();
  const auto run = [&](size_t lane) {
    try {
      std::optional<ThreadStateGuard> guard;
      if (spec.workers[lane] != nullptr) guard.emplace(*worker_state);
      run_lane(st, lanes[lane]);
    } catch (...) {
      st.fail(std::current_exception(), absl::StrCat("lane ", lane, " failed"));
    }
  };
  std::vector<absl::Notification> done(lanes.size());
  std::vector<bool> submitted(lanes.size(), false);
  try {
    for (size_t lane = 0; lane < lanes.size(); ++lane) {
      if (spec.workers[lane] == nullptr) continue;
      spec.workers[lane]->submit([&, lane] {
        run(lane);
        done[lane].Notify();
      });
      submitted[lane] = true;
    }
  } catch (...) {
    // A lane that could not start (out of memory): the started ones must not wait for it.
    st.fail(std::current_exception(), "a lane could not start");
  }
  for (size_t lane = 0; lane < lanes.size(); ++lane) {
    if (spec.workers[lane] == nullptr && !st.failed()) run(lane);
  }
  for (size_t lane = 0; lane < lanes.size(); ++lane) {
    if (submitted[lane]) done[lane].WaitForNotification();
  }
  std::exception_ptr error;
  {
    absl::MutexLock lock(&st.mu);
    error = st.error;
    if (error) {
      // Unpopped skips of checkpointed stashes would keep their graphs alive
      // (MicroBatchSkips::clear).
      for (auto& entry : st.skips) entry.second->clear();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace detail
}  // namespace gpipe
