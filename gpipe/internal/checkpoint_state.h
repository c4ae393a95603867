// What a checkpointed micro-batch keeps between its first forward and its recomputation
// (internal, not API): CheckpointFrame::State, shared by checkpoint.cc (the autograd nodes) and
// checkpoint_frame.cc (the frame that skips meet during a checkpointed forward).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/autograd/function.h>

#include "gpipe/checkpoint.h"
#include "gpipe/microbatch.h"
#include "gpipe/internal/skip_tracker.h"
#include "gpipe/internal/stream.h"
#include "gpipe/thread_state.h"
#include "gpipe/timeline.h"

namespace gpipe {

struct CheckpointFrame::State {
  State(Checkpointing::Function function, Batch input, c10::Device device,
        std::shared_ptr<const ThreadState> thread_state, std::shared_ptr<GradRecord> record,
        uint64_t key)
      : function(std::move(function)),
        input(std::move(input)),
        device(device),
        thread_state(std::move(thread_state)),
        record(std::move(record)),
        key(key) {}

  Checkpointing::Function function;
  Batch input;
  c10::Device device;
  internal::RngState rng;
  std::shared_ptr<const ThreadState> thread_state;

  // Note [Autograd metadata of checkpointed micro-batches].
  std::shared_ptr<GradRecord> record;
  uint64_t key;
  bool learning = false;  // the first forward runs with grad to fill `learnt`
  std::shared_ptr<const GradRecord::Entry> known;
  GradRecord::Entry learnt;
  const GradRecord::Entry& entry() const { return known ? *known : learnt; }

  // Skips popped from other partitions in the first forward: extra inputs (in pop order).
  std::vector<std::pair<SkipKey, internal::SkipTensor>> popped;
  // Whether CheckpointBackward has the dependency's edge as its last next edge
  // (attach_dependency). `node` is CheckpointBackward (weak: the node owns this state).
  bool has_dependency = false;
  std::weak_ptr<torch::autograd::Node> node;

  // Where the recomputation and the backward are recorded, if anywhere.
  std::shared_ptr<Timeline> timeline;
  int64_t microbatch = 0;
  int64_t partition = 0;
  // When recorded work started (Note [Device times] in timeline.cc).
  Timeline::Started start() const {
    return timeline ? timeline->start(internal::current_stream(device)) : Timeline::Started{};
  }
  void record_event(TimelineEvent::Kind kind, const Timeline::Started& started) const {
    if (timeline) {
      TimelineEvent event{kind, microbatch, partition};
      event.checkpointed = true;
      timeline->finish(event, started, internal::current_stream(device));
    }
  }

  // Set by RecomputeBackward, used by CheckpointBackward.
  bool recomputed = false;
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> leaves;
  std::vector<internal::SkipTensor> popped_leaves;  // parallel to `popped`
  std::vector<std::pair<SkipKey, internal::SkipTensor>> restashed;
  // Stashes of the first forward that need a gradient: given the checkpoint's history once its
  // node exists (`rehome` installs that version in the skip's slot), in this order after the
  // outputs among the node's inputs.
  std::vector<std::tuple<SkipKey, at::Tensor, std::function<void(at::Tensor)>>> pending_stashes;
  std::vector<SkipKey> stash_inputs;
  size_t outputs_count = 0;  // the checkpoint's outputs among the node's inputs

  void release() {
    input = Batch(std::vector<at::Tensor>{});
    outputs.clear();
    leaves.clear();
    popped.clear();
    popped_leaves.clear();
    restashed.clear();
    pending_stashes.clear();
  }
};

}  // namespace gpipe
