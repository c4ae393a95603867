// Remote links (internal, not API): a stage's first partition's upstream and its last partition's
// downstream when the neighbour is a stage in another process — activations and gradients on
// c10d, posted by the stage's courier (Note [Receiving ahead] in transfer.h).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/Optional.h>

#include "absl/synchronization/mutex.h"
#include "gpipe/distributed/process_group.h"
#include "gpipe/distributed/internal/shared_memory.h"
#include "gpipe/distributed/internal/transfer.h"
#include "gpipe/internal/link.h"
#include "gpipe/schedule.h"
#include "gpipe/worker.h"

namespace gpipe {
namespace distributed {
namespace internal {

/// What one stage's remote links share: the group, the wire (wire_device) and the courier that
/// posts sends and receives in order.
// Note [The wire's stream]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// On a GPU wire, every transfer of a step is ordered against one stream, the one current on the
// wire's device where step() was called (Wire::stream): a send's Transfer waits for it, a
// receive's consumer makes it wait. The links' copies to and from the wire (to_wire, the
// received tensors' .to(device), the gradients' buffers) are therefore issued on it too, whatever
// thread runs them: a partition on another device runs on a worker whose current stream on the
// wire's device is that thread's own (its default stream), which is the caller's only when the
// caller left the default stream current.
struct Wire {
  ProcessGroup group;
  c10::Device device{c10::kCPU};
  c10::optional<c10::Stream> stream;  // on a GPU wire, the computing stream
  Worker* courier = nullptr;
  /// The step's (may be null): aborts its transfers when another stage failed (fault.h).
  std::shared_ptr<Cancellation> cancellation;
  /// This stage's train or eval mode this step, which its neighbours' must equal (sent in each
  /// activation's header, checked by the receiver).
  bool training = true;

  /// Queues `operations` of `transfer` on the courier; returns the transfer.
  std::shared_ptr<Transfer> post(std::shared_ptr<Transfer> transfer,
                                 std::function<void(Transfer&)> operations) const;
};

/// One of a stage's transfers with one neighbour: the activations of `microbatch` (forward) or
/// their gradients.
struct PairTurn {
  bool forward = true;
  int64_t microbatch = 0;
};

/// The order in which stage `stage` posts its transfers with stage `peer` (stage - 1 or
/// stage + 1) under schedule `kind` of `stages` stages and `m` micro-batches: with_communication's,
/// which both sides agree on (Note [When gradients' receives are posted]).
std::vector<PairTurn> pair_turns(ScheduleKind kind, int64_t stages, int64_t m, int64_t stage,
                                 int64_t peer);

/// The pair's turns for a step of `m` micro-batches.
using TurnsOf = std::function<std::vector<PairTurn>(int64_t m)>;

/// Throws c10::Error naming both ranks unless `record` (from rank `peer`, on rank `rank`) holds
/// micro-batch `expected`.
void check_microbatch(const SharedLink::Record& record, int64_t expected, int rank, int peer);

/// The activations of micro-batch `expected` in a shared-memory record from rank `peer` that holds
/// them (not over_group), on rank `rank`: the header decoded and checked, the tensors unpacked (on
/// the CPU). Throws c10::Error naming both ranks for anything malformed: a peer's bytes are
/// checked before they are used (Note [Fuzzing what a peer sends] in transfer_test.cc).
ActivationReceiver::Received activations_of(const SharedLink::Record& record, int64_t expected,
                                            int rank, int peer);

/// The activations from stage `peer` (the one before), received ahead on a thread of their own;
/// their gradients go back to it.
class RemoteUpstream final : public gpipe::internal::Upstream {
 public:
  /// `grad_enabled`: this step's grad mode, which the sender's must equal. `turns`: the pair's
  /// order, on a group that matches in posting order under a schedule that interleaves forwards
  /// and backwards (null otherwise; Note [When gradients' receives are posted]). `channel`: the
  /// link's, when a pair of stages has several (transfer_tag).
  /// `capacity` (groups that packs_activations; null otherwise): the link's, kept by the stage
  /// between steps (Note [One message per micro-batch] in transfer.h). `shared` (may be null):
  /// the link's rings, when the peer is on this host (Note [Shared memory between stages on one
  /// host] in shared_memory.h); then the activations come and the gradients go through them.
  RemoteUpstream(Wire wire, int peer, c10::Device device, bool grad_enabled,
                 TurnsOf turns = nullptr, int64_t channel = 0, int64_t* capacity = nullptr,
                 SharedLink* shared = nullptr);
  ~RemoteUpstream() override;
  gpipe::internal::Activation receive() override;
  void send_gradients(int64_t microbatch, std::vector<at::Tensor> gradients) override;
  bool takes_undefined_gradients() const override { return false; }
  void fail(const std::string& why) override;
  /// Waits for every gradient sent.
  void finish();

 private:
  // On the receiving thread, in turn: the gradients' sends before micro-batch `next`'s
  // activations (all that are left when next == m). False when the step stops.
  bool sends_before(int64_t next, int64_t m);
  bool computed_or_stopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || computed_.count(awaited_) > 0;
  }

  Wire wire_;
  int peer_;
  c10::Device device_;
  bool grad_enabled_;
  TurnsOf turns_of_;
  int64_t channel_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<Transfer>> sends_ ABSL_GUARDED_BY(mu_);
  // In turn: the gradients computed, until their turn; the turns and the next one.
  std::map<int64_t, std::pair<std::shared_ptr<Transfer>, std::vector<at::Tensor>>> computed_
      ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t awaited_ ABSL_GUARDED_BY(mu_) = 0;  // the gradient sends_before waits for
  std::vector<PairTurn> turns_;  // the receiving thread's
  size_t next_turn_ = 0;
  SharedLink* shared_;
  // Over shared memory: what its waits are for (for errors), made once per step.
  std::string waiting_for_activations_, waiting_for_room_;
  int64_t received_ = 0;  // over shared memory, the activations taken
  // Over the group (not shared_): last, its thread runs sends_before.
  std::unique_ptr<ActivationReceiver> receiver_;
};

// Note [When gradients' receives are posted]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A group that ignores tags (NCCL) matches the operations between two ranks in the order they
// are posted, on one stream per pair (Note [Point-to-point order] in process_group.h). GPipe's
// schedule keeps that order on both sides: all activations, received ahead, then the gradients,
// whose receives are posted after the last activation in the order the next stage's backwards
// send them (micro-batches in reverse). 1F1B and zero bubble interleave the two directions, and
// a stage that receives its activations ahead (Note [Receiving ahead] in transfer.h) would post
// them before a gradient its peer sends first; so across processes they run only on a group that
// matches by tag (Gloo), each gradient's receive is posted right after its micro-batch's
// activations are sent, so the gradient moves as soon as it is sent. On a group that matches in
// posting order they post in turn: both sides of a pair follow the order of with_communication
// (schedule_check.h), which derives it from one simulated run of the schedule, so that it agrees
// on both sides and cannot deadlock (pair_turns). The stage that receives the activations posts
// on its receiving thread, in that order: each header and its tensors, and between them the
// gradients' sends whose turn comes first, waiting for the backward that computes them; the
// stage that sends them posts each activation and each gradient's receive on its courier as its
// turn comes (a receive once its micro-batch's activations are sent).

/// How a stage posts its gradients' receives (Note [When gradients' receives are posted]):
/// kInTurn posts every transfer with the neighbour in the pair's agreed order (TurnsOf).
enum class GradientReceives { kAfterLastSend, kWithSend, kInTurn };

/// The activations to stage `peer` (the one after); their gradients come back from it.
class RemoteDownstream final : public gpipe::internal::Downstream {
 public:
  /// `turns`: the pair's order, for GradientReceives::kInTurn. `channel`, `capacity` and `shared`
  /// as RemoteUpstream's.
  RemoteDownstream(Wire wire, int peer, c10::Device device, GradientReceives when,
                   TurnsOf turns = nullptr, int64_t channel = 0, int64_t* capacity = nullptr,
                   SharedLink* shared = nullptr);
  /// Keeps the largest data sent for the next step's capacity.
  ~RemoteDownstream() override;
  void send(int64_t microbatches, int64_t microbatch, const Batch& output,
            bool grad_enabled) override;
  std::vector<at::Tensor> receive_gradients(int64_t microbatch) override;
  /// Waits for every activation sent.
  void finish();

 private:
  void post_receive(int64_t microbatch);
  void post_send(int64_t microbatch, at::Tensor header, std::vector<at::Tensor> tensors);
  // Note [One message per micro-batch]: header and tensors in one message when `bytes` of data
  // fit the capacity, else the header alone and then the data.
  void post_packed(int64_t microbatch, at::Tensor header, std::vector<at::Tensor> tensors,
                   int64_t bytes);
  // kInTurn: posts every transfer whose turn has come and that is ready.
  void post_in_turn();

  Wire wire_;
  int peer_;
  c10::Device device_;
  GradientReceives when_;
  TurnsOf turns_of_;
  int64_t channel_;
  int64_t* capacity_;
  int64_t capacity_at_start_;
  int64_t largest_sent_;
  std::vector<PairTurn> turns_;
  size_t next_turn_ = 0;
  bool grad_enabled_ = true;
  std::map<int64_t, std::pair<at::Tensor, std::vector<at::Tensor>>> ready_;  // sends, in turn
  std::vector<std::shared_ptr<Transfer>> sends_;
  std::map<int64_t, std::vector<at::Tensor>> buffers_;  // per micro-batch, until posted
  std::map<int64_t, std::shared_ptr<Transfer>> receives_;
  SharedLink* shared_;
  // Over shared memory: what its waits are for (for errors), made once per step.
  std::string waiting_for_gradients_, waiting_for_room_;
  // Over shared memory: gradients read from the ring before they were asked for.
  std::map<int64_t, std::vector<at::Tensor>> arrived_;
};

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
