// A local link: how two neighbouring partitions of one pipeline stage, each on a thread of its
// own in one process, pass a step's micro-batches forward and their gradients back.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "gpipe/microbatch.h"

namespace gpipe {
namespace distributed {

// Note [Partitions within a stage]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stage may split its layers into several partitions on this process's devices
// (PipelineStageOptions::local_balance and local_devices). Each partition then works as a stage
// of its own would, on a thread of its own: it runs every micro-batch's forward in order, then
// each micro-batch's backward in reverse as soon as the gradients of its outputs arrive
// (Note [Stage-local backward]); only the hop to its neighbour is a LocalLink instead of c10d.
// What crosses a link is cut from the sender's graph: the receiver gets each tensor detached
// (moved to its device), as a leaf that requires grad where the sender's tensor did, and sends
// the leaves' gradients back. So every micro-batch's graph on a partition is its own, and each
// partition's backward is an engine call on its own thread: partitions overlap in backward as in
// forward, on CPU cores as on GPUs. The first partition runs on the thread that called step();
// the others on workers of the stage.
//
// A skip stashed in partition a and popped in a later partition b of the same stage goes through
// the skip tracker that the partitions share for each micro-batch (as a GPipe's do: Note [Skips
// and checkpointing] in skip_tracker.h), which moves it to b's device; then it is cut the same
// way (MicroBatchSkips::cut): b pops a detached leaf, and after b's backward of the micro-batch
// the leaf's gradient waits for a, whose backward starts from its outputs and from the stashed
// tensors together — one engine call, so that a checkpointed stash's recomputation gets both
// gradients at once. a's backward of a micro-batch always follows b's (the gradients pass through
// the partitions in between), so the skips' gradients are there when a needs them.
//
// A link fails when either side fails: the other side's next wait then throws, naming the
// partition, instead of waiting for a micro-batch that never comes.

/// The activations and gradients between partition `from` and partition `from + 1` of a stage.
class LocalLink {
 public:
  LocalLink(int64_t from, c10::Device from_device, c10::Device to_device)
      : from_(from), from_device_(from_device), to_device_(to_device) {}

  struct Activation {
    int64_t microbatches = 0;  // of the step
    Batch batch{std::vector<at::Tensor>{}};
  };

  /// Sends the next micro-batch's output forward: detached, on the next partition's device, a
  /// leaf requiring grad where `output`'s tensor did (Note [Partitions within a stage]).
  void send_activation(int64_t microbatches, const Batch& output);
  /// The next micro-batch's input, once sent; throws c10::Error when the link failed.
  Activation next_activation();

  /// Sends the gradients of micro-batch `microbatch`'s input leaves back, moved to the previous
  /// partition's device.
  void send_gradients(int64_t microbatch, const std::vector<at::Tensor>& gradients);
  /// The gradients of micro-batch `microbatch`'s outputs, once sent; throws c10::Error when the
  /// link failed.
  std::vector<at::Tensor> gradients(int64_t microbatch);

  /// Fails the link: the other side's waits throw a c10::Error with `why`.
  void fail(const std::string& why);

 private:
  void check_not_failed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t from_;
  const c10::Device from_device_, to_device_;
  absl::Mutex mu_;
  std::deque<Activation> activations_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::vector<at::Tensor>> gradients_ ABSL_GUARDED_BY(mu_);
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::string why_ ABSL_GUARDED_BY(mu_);
};

}  // namespace distributed
}  // namespace gpipe
