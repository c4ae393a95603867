// Failing fast across processes (internal, not API): a stage that fails tells every other rank of
// its pipeline at once, and each of them stops its step with that stage's error instead of
// waiting for the group's timeout (Note [Failing fast across processes]).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "gpipe/distributed/process_group.h"

namespace gpipe {
namespace distributed {
namespace internal {

// Note [Failing fast across processes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stage whose step fails (a layer throws, a bad input, the grad modes differ) leaves its
// neighbours waiting for transfers that will not come, and their neighbours waiting for them:
// with nothing more, every other rank fails only when the group's timeout (GPIPE_TIMEOUT_S, 5
// minutes by default) passes, with an error that does not say what went wrong. So each stage
// keeps one receive posted for its whole life that any rank of the pipeline may match
// (FaultChannel: Gloo's receive from any source, on a tag the ranks agree on when the stage is
// made). A step that fails sends its error to every other rank before it throws. A rank that
// hears it aborts the transfers its step has in flight (Cancellation): each wait on them, and
// every later one, throws the failed stage's error, which the step throws in turn; a rank
// between steps throws it from its next step. A rank fails once for good either way: aborted
// receives stay posted in Gloo and would take the next step's messages, so the pipeline's
// groups and stages must be made anew. Their buffers must outlive the stage's use of the group:
// a Gloo connection that receives a message for a buffer that is gone stops reading, and the
// failure could not reach that rank (the stage keeps the failed step's Cancellation). A rank that
// stops because it heard of a failure tells no one, so every error names the stage where the
// failure began.
//
// A failure is told with the index of the step it ended (each stage counts its steps, and every
// rank of a pipeline takes the same ones), and cancels only a step of that index or later. A
// rank that fails step k has finished step k - 1, so every transfer of step k - 1 it had with the
// others is done, but another rank may still be finishing that step (zero bubble's last weight
// gradients, a replica's last wait on the all-reduce): it must not throw, or ranks would disagree
// on whether step k - 1 happened (CI once saw it). It hears the failure then, and throws it from
// its next step.
//
// The receive waits without a timeout: Gloo's wait that times out closes every connection of
// the group. Two limits: a rank hears only the first failure, so a second rank failing at the
// same time waits up to 5 s for it to take its message, then gives up; and a failure sent to a
// rank whose stage is already destroyed (it finished its steps first) lands in a receive whose
// buffer is gone, which stops that connection (a stage made later on the same group then fails
// at the group's timeout). A replicated stage keeps a second channel on its replica group: a
// failed step is told there too (unless that is where it came from), and the other replicas' same
// stage throws the error instead of waiting for the timeout: its step is attached to both
// channels, so a replica's failure aborts its transfers too, and in the gradients' all-reduce it
// polls the channel (the all-reduce is left to the broken group). Both are needed: a stage that
// heard of a replica's failure before its step began throws at once and tells its own pipeline
// nothing (its neighbours hear it from their replicas, waiting for a transfer with it; a test
// run saw one wait for the timeout when only the all-reduce listened). Groups that cannot
// receive from any source (NCCL, or a group gpipe does not know) have no channel, and their peers
// wait for the group's timeout as before (docs/distributed.md).

/// Aborts `work` on the way out of a failed step; where the backend cannot (NCCL in LibTorch 1.x
/// throws), the work is left to the backend's timeout.
void abort_quietly(const c10::intrusive_ptr<c10d::Work>& work);

/// A step's transfers in flight, aborted at once when another rank's failure is heard.
class Cancellation {
 public:
  /// Keeps `work` to abort on cancel() until it was waited for (for good once cancelled: a
  /// receive aborted in Gloo stays posted, and the connection wedges when a message comes for a
  /// buffer that is gone); aborts it at once when cancelled already.
  void add(const c10::intrusive_ptr<c10d::Work>& work);
  /// Aborts every work added, and makes check() throw c10::Error with `message` (the first one
  /// given, when called again).
  void cancel(const std::string& message);
  bool cancelled() const;
  /// Throws c10::Error with cancel()'s message when cancelled.
  void check() const;

 private:
  mutable absl::Mutex mu_;
  std::optional<std::string> message_ ABSL_GUARDED_BY(mu_);
  std::vector<c10::intrusive_ptr<c10d::Work>> works_ ABSL_GUARDED_BY(mu_);
};

/// Tells the other ranks of `group` of this rank's failure, and hears theirs.
class FaultChannel {
 public:
  /// The channel of `group`, where it can have one (can_hear_any); a collective on `group`: every
  /// rank makes its channel at the same point. `who` opens the errors of failures heard.
  FaultChannel(ProcessGroup group, std::string who);
  /// Stops listening.
  ~FaultChannel();
  FaultChannel(const FaultChannel&) = delete;
  FaultChannel& operator=(const FaultChannel&) = delete;

  /// Whether `group` can receive from any rank (Gloo), which a channel needs.
  static bool can_hear_any(const ProcessGroup& group);

  /// Sends `failure` (what failed on this rank, and why), which ended step `index` of this rank's,
  /// to every other rank; waits a few seconds at most for them to take it. Never throws.
  void raise(const std::string& failure, int64_t index);
  /// Cancels `step`, this rank's step `index`, when a failure of a step up to `index` is heard
  /// while it is attached (at once when one was heard before); detach() ends that.
  void attach(std::shared_ptr<Cancellation> step, int64_t index);
  void detach();
  /// The error of the failure heard, if any, of a step up to `index` (who, the failed rank's
  /// message, what to do).
  std::optional<std::string> heard(
      int64_t index = std::numeric_limits<int64_t>::max()) const;
  /// Throws the failure `channel` heard of a step up to `index`, if any: a collective's check
  /// while it waits. Does nothing without a channel (a group that cannot hear any rank).
  static void throw_if_heard(const FaultChannel* channel,
                             int64_t index = std::numeric_limits<int64_t>::max());

 private:
  void listen();

  ProcessGroup group_;
  std::string who_;
  int tag_ = 0;
  at::Tensor inbox_;
  c10::intrusive_ptr<c10d::Work> receive_;
  mutable absl::Mutex mu_;
  std::optional<std::string> heard_ ABSL_GUARDED_BY(mu_);
  int64_t heard_index_ ABSL_GUARDED_BY(mu_) = 0;  // the failed step's
  std::shared_ptr<Cancellation> step_ ABSL_GUARDED_BY(mu_);
  int64_t step_index_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread listener_;  // last: starts once the rest is made
};

/// Fault injection for tests: `hook` (or nothing, when empty) runs in each PipelineStage step
/// between its schedule and the waits for its last transfers, with the step's index. Not for
/// concurrent use with running steps.
void set_step_end_hook(std::function<void(int64_t)> hook);
/// Runs the hook, if any (the step's part).
void run_step_end_hook(int64_t index);

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
