// One step's state in the executor (internal, not API): each partition's micro-batches in flight
// and what the lanes share, and the compute actions F, B (or I) and W that the lanes run on it
// (Note [One executor] in executor.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "gpipe/internal/executor.h"
#include "gpipe/internal/link.h"
#include "gpipe/internal/skip_tracker.h"
#include "gpipe/timeline.h"

namespace gpipe {
namespace internal {

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
  at::Tensor phony;  // keep_graph: the last forward's, for the next (Note [Backward order])
};

// One step's state, shared by the lanes.
struct Step {
  const ExecutorSpec& spec;
  int64_t m = 0;
  int64_t stop = 0;
  bool by_layer = false;  // W split by layer (Note [One executor])
  std::optional<Activation> first;  // the first partition's first input, when it told m
  std::vector<PartitionState> states;
  std::vector<std::unique_ptr<Link>> links;  // links[p]: partitions p and p + 1 (or null)
  // copy_streams[p][i]: partition p's for micro-batch i (the spec's, or own_copy_streams).
  const CopyStreams* copy_streams = nullptr;
  // Each partition's compute stream: the calling thread's current stream on its device, made
  // current (with the device) for every action of the partition, on whatever lane it runs.
  std::vector<c10::Stream> compute_streams;
  CopyStreams own_copy_streams;
  absl::Mutex mu;
  std::exception_ptr error ABSL_GUARDED_BY(mu);
  // Skips between partitions: each micro-batch's tracker, and for each stashing partition and
  // micro-batch the popped tensors with the gradients the popping partitions caught (Note
  // [Partitions within a stage] in distributed/pipeline_stage.h).
  std::map<int64_t, std::shared_ptr<MicroBatchSkips>> skips ABSL_GUARDED_BY(mu);
  std::vector<std::map<int64_t, std::vector<std::pair<at::Tensor, at::Tensor>>>> skip_grads
      ABSL_GUARDED_BY(mu);

  explicit Step(const ExecutorSpec& s) : spec(s) {}

  // Read before every action: an atomic, not the mutex.
  std::atomic<bool> has_failed{false};
  bool failed() const { return has_failed.load(std::memory_order_acquire); }

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
    has_failed.store(true, std::memory_order_release);
    for (auto& link : links) {
      if (link) link->fail(why);
    }
    if (spec.upstream) spec.upstream->fail(why);
    if (spec.downstream) spec.downstream->fail(why);
    for (Upstream* up : spec.upstreams) {
      if (up) up->fail(why);
    }
    for (Downstream* down : spec.downstreams) {
      if (down) down->fail(why);
    }
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

// F i on partition p: receives its input, computes (checkpointed or not), sends its output.
void run_forward(Step& st, int64_t p, int64_t i);
// B i on partition p, or with `split` only I i (the input gradients; W later).
void run_backward(Step& st, int64_t p, int64_t i, bool split);
// W i on partition p: the parameters' gradients of what I i kept.
void run_backward_weight(Step& st, int64_t p, int64_t i);

}  // namespace internal
}  // namespace gpipe
