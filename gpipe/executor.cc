// The executor; see executor.h and Note [One executor].
#include "gpipe/internal/executor.h"
#include "gpipe/internal/executor_step.h"

#include <algorithm>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include <ATen/ops/zeros_like.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gpipe/internal/partition.h"
#include "gpipe/internal/skip_tracker.h"
#include "gpipe/internal/stream.h"

namespace gpipe {
namespace internal {
namespace {

void run_lane(Step& st, const std::vector<Action>& actions) {
  for (const Action& a : actions) {
    if (st.failed()) return;
    // The partition's device and the caller's stream on it (Step::compute_streams).
    const c10::StreamGuard guard(st.compute_streams[a.stage]);
    switch (a.type) {
      case ActionType::kForward:
        run_forward(st, a.stage, a.microbatch);
        break;
      case ActionType::kBackward:
        if (st.spec.grad_enabled) run_backward(st, a.stage, a.microbatch, /*split=*/false);
        break;
      case ActionType::kBackwardInput:
        if (st.spec.grad_enabled) run_backward(st, a.stage, a.microbatch, /*split=*/true);
        break;
      case ActionType::kBackwardWeight:
        if (st.spec.grad_enabled && a.microbatch >= st.stop) {
          run_backward_weight(st, a.stage, a.microbatch);
        }
        break;
      default:  // transfers are the links' (Note [One executor])
        break;
    }
  }
}

// The spec's copy streams when it has enough for `m` micro-batches, else `own` filled from the
// devices' pools (cheap: a pool hands out its streams in turn).
const CopyStreams* copy_streams_for(const ExecutorSpec& spec, int64_t m, CopyStreams& own) {
  const std::vector<ExecutorPartition>& partitions = *spec.partitions;
  if (spec.copy_streams != nullptr && spec.copy_streams->size() == partitions.size()) {
    bool enough = true;
    for (const auto& streams : *spec.copy_streams) {
      enough &= static_cast<int64_t>(streams.size()) >= m;
    }
    if (enough) return spec.copy_streams;
  }
  own.resize(partitions.size());
  for (size_t p = 0; p < partitions.size(); ++p) {
    for (int64_t i = 0; i < m; ++i) own[p].push_back(new_stream(partitions[p].device));
  }
  return &own;
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

namespace {

// Partition p's state for a step of st.m micro-batches: its links, the parameters its W
// reaches, and whether its W is split by layer.
void init_partition(Step& st, int64_t p) {
  const ExecutorSpec& spec = st.spec;
  const int64_t n = static_cast<int64_t>(spec.partitions->size());
  PartitionState& s = st.states[p];
  s.part = &(*spec.partitions)[p];
  if (!spec.upstreams.empty()) {
    // (A null end: the neighbour's partition in this process, joined by a LocalLink.)
    s.up = spec.upstreams[p] ? spec.upstreams[p] : st.links[p - 1].get();
    s.down = spec.downstreams[p] ? spec.downstreams[p] : st.links[p].get();
  } else {
    s.up = p == 0 ? spec.upstream : st.links[p - 1].get();
    s.down = p + 1 == n ? spec.downstream : st.links[p].get();
  }
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
  if (!st.by_layer) return;
  // Not where layers share a parameter (tied weights): a layer's backward would then reach it
  // through the other layer too.
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

// The LocalLinks between neighbouring partitions, or GraphLinks for a forward() (Note [forward()
// on the executor]); with links of their own (ExecutorSpec::upstreams), only between the
// partitions whose ends are null.
void make_links(Step& st, const std::vector<std::vector<Action>>& lanes) {
  const ExecutorSpec& spec = st.spec;
  const std::vector<ExecutorPartition>& partitions = *spec.partitions;
  const bool own_links = !spec.upstreams.empty();
  std::vector<size_t> lane_of(partitions.size(), 0);
  for (size_t lane = 0; lane < lanes.size(); ++lane) {
    for (const Action& a : lanes[lane]) lane_of[a.stage] = lane;
  }
  for (size_t p = 0; p + 1 < partitions.size(); ++p) {
    const int64_t from = static_cast<int64_t>(p);
    if (own_links) {
      TORCH_INTERNAL_ASSERT((spec.downstreams[p] == nullptr) == (spec.upstreams[p + 1] == nullptr),
                            "gpipe: partition ", p, "'s downstream and ", p + 1,
                            "'s upstream must both be local or both have links of their own");
      if (spec.downstreams[p] != nullptr) {
        st.links.push_back(nullptr);
        continue;
      }
    }
    const c10::Device here = partitions[p].device;
    const c10::Device there = partitions[p + 1].device;
    if (spec.keep_graph) {
      st.links.push_back(std::make_unique<GraphLink>(
          spec.who, from, here, there, st.copy_streams, lane_of[p] != lane_of[p + 1],
          spec.timeline.get(), spec.timeline_partition_offset));
    } else {
      st.links.push_back(std::make_unique<LocalLink>(spec.who, from, here, there,
                                                     st.copy_streams, spec.timeline.get(),
                                                     spec.timeline_partition_offset));
    }
  }
}

// Runs every lane, each on its worker (or the calling thread), until all have stopped.
void run_lanes(Step& st, const std::vector<std::vector<Action>>& lanes) {
  const ExecutorSpec& spec = st.spec;
  // The CPU lanes share the cores, less one for each lane that only issues a GPU's work (Note
  // [Dividing the cores] in worker.h).
  std::vector<bool> on_cpu(lanes.size(), false);
  int64_t gpu_lanes = 0;
  for (size_t lane = 0; lane < lanes.size(); ++lane) {
    bool on_gpu = false;
    for (const Action& a : lanes[lane]) {
      const c10::Device device = (*spec.partitions)[a.stage].device;
      on_cpu[lane] = on_cpu[lane] || device.is_cpu();
      on_gpu = on_gpu || has_streams(device);
    }
    gpu_lanes += on_gpu && !on_cpu[lane];
  }
  const CoreShare cores(std::count(on_cpu.begin(), on_cpu.end(), true), gpu_lanes);
  // Lanes on workers run under this thread's state (grad mode, autocast: Note [Thread-local
  // state in workers]).
  const auto worker_state = std::make_unique<ThreadState>();
  const auto run = [&](size_t lane) {
    try {
      std::optional<ThreadStateGuard> guard;
      if (spec.workers[lane] != nullptr) guard.emplace(*worker_state);
      std::optional<CoreShare::Lane> share;
      if (on_cpu[lane]) share.emplace(cores);
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
}

}  // namespace

std::vector<Worker*> lane_workers(std::vector<std::unique_ptr<Worker>>& pool, size_t lanes) {
  while (pool.size() + 1 < lanes) {
    pool.push_back(std::make_unique<Worker>(absl::StrCat("rank ", pool.size() + 1)));
  }
  std::vector<Worker*> workers{nullptr};
  for (size_t lane = 1; lane < lanes; ++lane) workers.push_back(pool[lane - 1].get());
  return workers;
}

void run_schedule(const ExecutorSpec& spec) {
  std::vector<ExecutorPartition>& partitions = *spec.partitions;
  const int64_t n = static_cast<int64_t>(partitions.size());
  Step st(spec);
  const bool own_links = !spec.upstreams.empty();
  TORCH_INTERNAL_ASSERT(!own_links ||
                        (static_cast<int64_t>(spec.upstreams.size()) == n &&
                         static_cast<int64_t>(spec.downstreams.size()) == n &&
                         spec.upstreams[0] != nullptr && spec.downstreams[n - 1] != nullptr));
  st.m = spec.microbatches;
  if (st.m == 0) {
    st.first = (own_links ? spec.upstreams[0] : spec.upstream)->receive();
    st.m = st.first->microbatches;
    TORCH_CHECK(st.m >= 1, spec.who, ": the stage before announced ", st.m, " micro-batches; a "
                "step has at least 1");
    TORCH_CHECK(spec.max_microbatches == 0 || st.m <= spec.max_microbatches, spec.who,
                ": the stage before announced ", st.m, " micro-batches, but this stage takes 1 "
                "to ", spec.max_microbatches, " (its chunks); make every stage with the same "
                "chunks");
  }
  st.copy_streams = copy_streams_for(spec, st.m, st.own_copy_streams);
  for (const ExecutorPartition& p : partitions) {
    st.compute_streams.push_back(current_stream(p.device));
  }
  const std::vector<std::vector<Action>> lanes = spec.plan(st.m);
  make_links(st, lanes);
  st.stop = spec.grad_enabled ? spec.checkpoint_stop(st.m) : 0;
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
  for (int64_t p = 0; p < n; ++p) init_partition(st, p);
  run_lanes(st, lanes);
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

}  // namespace internal
}  // namespace gpipe
