// Remote links (internal, not API): a stage's first partition's upstream and its last partition's
// downstream when the neighbour is a stage in another process — activations and gradients on
// c10d, posted by the stage's courier (Note [Receiving ahead] in transfer.h).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/Optional.h>

#include "absl/synchronization/mutex.h"
#include "gpipe/distributed/process_group.h"
#include "gpipe/distributed/transfer.h"
#include "gpipe/link.h"
#include "gpipe/worker.h"

namespace gpipe {
namespace distributed {

/// What one stage's remote links share: the group, the wire (wire_device) and the courier that
/// posts sends and receives in order.
struct Wire {
  ProcessGroup group;
  c10::Device device{c10::kCPU};
  c10::optional<c10::Stream> stream;  // on a GPU wire, the computing stream
  Worker* courier = nullptr;
  /// The step's (may be null): aborts its transfers when another stage failed (fault.h).
  std::shared_ptr<Cancellation> cancellation;

  /// Queues `operations` of `transfer` on the courier; returns the transfer.
  std::shared_ptr<Transfer> post(std::shared_ptr<Transfer> transfer,
                                 std::function<void(Transfer&)> operations) const;
};

/// The activations from stage `peer` (the one before), received ahead on a thread of their own;
/// their gradients go back to it.
class RemoteUpstream final : public detail::Upstream {
 public:
  /// `grad_enabled`: this step's grad mode, which the sender's must equal.
  RemoteUpstream(Wire wire, int peer, c10::Device device, bool grad_enabled);
  detail::Activation receive() override;
  void send_gradients(int64_t microbatch, std::vector<at::Tensor> gradients) override;
  bool takes_undefined_gradients() const override { return false; }
  /// Waits for every gradient sent.
  void finish();

 private:
  Wire wire_;
  int peer_;
  c10::Device device_;
  bool grad_enabled_;
  ActivationReceiver receiver_;
  std::vector<std::shared_ptr<Transfer>> sends_;
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
// matches by tag (Gloo, checked at construction), where each gradient's receive is posted right
// after its micro-batch's activations are sent, so the gradient moves as soon as it is sent.
// Posting both directions in one agreed order (with_communication in schedule_check.h gives it)
// would lift that restriction.

/// How a stage posts its gradients' receives (Note [When gradients' receives are posted]).
enum class GradientReceives { kAfterLastSend, kWithSend };

/// The activations to stage `peer` (the one after); their gradients come back from it.
class RemoteDownstream final : public detail::Downstream {
 public:
  RemoteDownstream(Wire wire, int peer, c10::Device device, GradientReceives when);
  void send(int64_t microbatches, int64_t microbatch, const Batch& output,
            bool grad_enabled) override;
  std::vector<at::Tensor> receive_gradients(int64_t microbatch) override;
  /// Waits for every activation sent.
  void finish();

 private:
  void post_receive(int64_t microbatch);

  Wire wire_;
  int peer_;
  c10::Device device_;
  GradientReceives when_;
  std::vector<std::shared_ptr<Transfer>> sends_;
  std::map<int64_t, std::vector<at::Tensor>> buffers_;  // per micro-batch, until posted
  std::map<int64_t, std::shared_ptr<Transfer>> receives_;
};

}  // namespace distributed
}  // namespace gpipe
