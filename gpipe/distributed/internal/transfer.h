// Transfers between the stages of a pipeline in different processes: a micro-batch's tensors (a
// Batch, with a header saying what they are) forward, their gradients backward, on c10d's
// point-to-point operations. Every send and receive is asynchronous; a Transfer is waited for
// where its tensors are needed.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/Optional.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gpipe/distributed/process_group.h"
#include "gpipe/microbatch.h"

namespace gpipe {
namespace distributed {
namespace internal {

class Cancellation;  // fault.h: aborts a step's transfers when another stage failed

/// What kind of message a tag belongs to; with the micro-batch, it makes the tag.
/// kFault: a stage's failure, told to every rank (Note [Failing fast across processes] in
/// fault.h; its "micro-batch" and channel are drawn at random and agreed by the ranks).
enum class Message : int64_t { kHeader = 0, kActivation = 1, kGradient = 2, kFault = 3 };

/// The most channels a pair of stages may use (transfer_tag): one per link between them, i.e. per
/// virtual stage under the interleaved schedule.
constexpr int64_t kMaxChannels = 64;
/// The most micro-batches a step may have across processes (micro-batch indices are below it):
/// the tags of the last one still fit in an int.
constexpr int64_t kMaxMicrobatches = 100000;
/// The c10d tag of message `kind` for micro-batch `microbatch` and its tensor `index`, on
/// `channel` (one per link between two stages: Note [Interleaving across processes] in
/// pipeline_stage.h).
int transfer_tag(Message kind, int64_t microbatch, int64_t index = 0, int64_t channel = 0);

/// Sends and receives in flight, posted by one thread (the stage's courier, Note [Receiving
/// ahead]) and waited for by another: wait() blocks until they were posted, then until they are
/// done, and says which transfer failed.
class Transfer {
 public:
  /// `stream`: for a group that carries GPU tensors (NCCL), the stream that computes with them;
  /// none for Gloo. The transfer's operations are posted on a stream of their own that waits for
  /// the work queued on `stream` before the Transfer was made (so make it once the tensors to send
  /// are computed), and wait() makes `stream` wait for them. NCCL orders its work after the
  /// posting stream's: posted on `stream` itself, a send would wait for whatever was computed
  /// there by the time the courier posts it, and a receive would hold the computation back.
  /// `cancellation` (may be null): the step's, which aborts the transfer when another stage
  /// failed (then wait() throws its error).
  Transfer(ProcessGroup group, std::string what, c10::optional<c10::Stream> stream = c10::nullopt,
           std::shared_ptr<Cancellation> cancellation = nullptr);

  /// Sends `tensors` (on wire_device, contiguous) to `peer`, tagged `kind`/`microbatch` on
  /// `channel` (one tag per tensor).
  void send(std::vector<at::Tensor> tensors, int peer, Message kind, int64_t microbatch,
            int64_t channel = 0);
  /// Receives into `tensors` (on wire_device, contiguous, the sizes the sender sends) from `peer`.
  void receive(std::vector<at::Tensor> tensors, int peer, Message kind, int64_t microbatch,
               int64_t channel = 0);
  /// Says that every send and receive of this transfer is posted, or that posting failed.
  void set_posted(std::exception_ptr error = nullptr);

  /// Waits until posted, then for every send and receive; the received tensors are then filled
  /// in. Throws c10::Error naming the transfer when one failed.
  void wait();

  const std::vector<at::Tensor>& tensors() const { return tensors_; }

 private:
  ProcessGroup group_;
  std::string what_;
  c10::optional<c10::Stream> stream_;
  c10::optional<c10::Stream> post_stream_;  // see the constructor
  std::shared_ptr<Cancellation> cancellation_;
  absl::Notification posted_;
  std::exception_ptr error_;  // set before posted_ is notified
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<at::Tensor> tensors_;  // kept alive until waited for
};

/// The header of a micro-batch's activations: how many micro-batches the step has, whether the
/// batch is a tuple, and each tensor's dtype, sizes and whether it requires grad.
struct BatchHeader {
  int64_t microbatches = 0;
  bool atomic = true;
  bool grad_enabled = true;  // whether the sender runs backward (it waits for gradients)
  bool training = true;      // the sender's train (or eval) mode
  struct Entry {
    at::ScalarType dtype = at::kFloat;
    bool requires_grad = false;
    std::vector<int64_t> sizes;
  };
  std::vector<Entry> entries;

  /// The header of `batch`, part of a step of `microbatches`; throws c10::Error when it does not
  /// fit in a header message (too many tensors or dimensions).
  static BatchHeader of(const Batch& batch, int64_t microbatches, bool grad_enabled);
  /// As an int64 tensor of the fixed header size, and back.
  at::Tensor encode() const;
  static BatchHeader decode(const at::Tensor& encoded);
  /// decode, on `rank` of a header from `peer`: its errors say so.
  static BatchHeader decode(const at::Tensor& encoded, int rank, int peer);
  /// The fixed header size, in int64.
  static int64_t size();
  /// Empty tensors on `device` in the header's dtypes and sizes.
  std::vector<at::Tensor> empty_tensors(c10::Device device) const;
};

// Note [Receiving ahead]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Gloo moves a message only once its receive is posted: the receiver tells the sender that it
// is ready, and the sender's Gloo thread writes the tensors. An activation's receive can be
// posted only after its header (the sizes) has arrived. Done on the computing thread, each
// micro-batch would cost that round trip in its turn, and on a machine whose cores are all busy
// computing, every hop waits for a Gloo thread to be scheduled: about 4 ms a micro-batch on the
// 2-core machine (docs/journal/2026-11-23-benchmarks.md, "Pipeline stages across processes").
// So a stage receives its activations on a thread of its
// own, which asks for micro-batch i+1's header as soon as micro-batch i has arrived, while the
// stage computes: the round trips overlap the compute and the stage finds its inputs waiting.
// Gradients need no such thread: their sizes are known when the activations are sent, and
// their receives are posted then. Posting itself can block too: Gloo's send and receive take the
// connection's lock, which Gloo's own thread holds while it reads, and that thread may be waiting
// for a core (the computing thread waited 1–6 ms in a send this way). So the stage posts its
// sends and its gradients' receives from a second thread of its own, the courier, and the
// computing thread only queues them and, when it needs a result, waits for it.

// Note [One message per micro-batch]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Even received ahead, a micro-batch's activations cost two trips across processes beyond their
// header's: the receive for the tensors is posted only once the header has told their sizes, so
// the sender's tensors wait for the receiver's "ready" before they move. Under the interleaved
// schedule, which crosses processes v times as often, these round trips were most of a task's
// overhead (docs/journal/2026-11-26-benchmarks.md, "one message per micro-batch"). Over Gloo a
// message may land in any posted receive at least as
// large. So there a micro-batch travels as one message, its header and then each tensor's bytes
// (at 64-byte offsets), into a receive posted with the header's, as large as the header plus the
// largest data of the link's micro-batches in the earlier steps (its capacity, which both sides
// know: each keeps the largest it sent or received per link, between steps). When the data fits,
// it arrives with its header, in one hop; when it does not (every micro-batch of the first step,
// or a larger one later), the header travels alone and the data follows as a second message,
// whose receive is posted once the header is read. Since every receive's size is known before
// its message comes, the receiving thread only posts them, a few micro-batches ahead of the one
// the stage takes (after micro-batch 0's header has told how many there are), and the stage's
// own thread waits for each: Gloo's thread wakes it directly, one thread hop less per hop. NCCL
// needs exact sizes: a GPU wire keeps one message per tensor and the receiving thread of Note
// [Receiving ahead]. (The bytes are copied in and out of the message: a memcpy of each activation
// on each side, small beside the trip it saves. A link's capacity only grows: after one large
// step, later ones post receives that large, a few micro-batches at a time.) Between stages on one
// host, rings of shared memory replace all of this: Note [Shared memory between stages on one
// host] in shared_memory.h.

/// Whether activations between the stages of `group` travel as one message per micro-batch (Note
/// [One message per micro-batch]): over Gloo.
bool packs_activations(const ProcessGroup& group);
/// The bytes of the data part of a packed micro-batch with `header`'s tensors.
int64_t packed_data_bytes(const BatchHeader& header);
/// `tensors` (on the CPU, contiguous: to_wire) packed as one uint8 message: `encoded_header`'s
/// bytes first when it is defined, then the tensors' at 64-byte offsets.
at::Tensor pack_activations(const std::vector<at::Tensor>& tensors,
                            const at::Tensor& encoded_header = at::Tensor());
/// `header`'s tensors, copied out of `data` (the data part of a packed micro-batch).
std::vector<at::Tensor> unpack_activations(const BatchHeader& header, const at::Tensor& data);
/// The bytes `tensors` (on the CPU, contiguous) take packed at 64-byte offsets; copies them there
/// into `out`, and back out of `data` into `tensors` (of the sizes packed).
int64_t packed_bytes(const std::vector<at::Tensor>& tensors);
void pack_into(const std::vector<at::Tensor>& tensors, uint8_t* out);
void unpack_into(const uint8_t* data, const std::vector<at::Tensor>& tensors);
/// The size of an encoded BatchHeader, in bytes.
constexpr int64_t kHeaderBytes = 512 * 8;

/// Receives one step's activations from `peer` on a thread of its own (Note [Receiving ahead]):
/// the header and tensors of micro-batch 0, 1, … until the step's last, each queued as it
/// arrives.
class ActivationReceiver {
 public:
  struct Received {
    BatchHeader header;
    std::vector<at::Tensor> tensors;  // on the receiver's device
    c10::optional<c10::Stream> stream;  // on a GPU, the stream they were received on
    // On a GPU, their receives, which next() makes the consuming stream wait for.
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
  };
  /// Receives on `device` (the wire's: wire_device); on a GPU, each micro-batch on a stream of its
  /// own, for which next() makes `stream` (the one that computes with them) wait. `cancellation`
  /// as Transfer's. `between` (may be null) runs on the receiving thread before each micro-batch
  /// i = 1 .. m - 1 is received and once after the last (i = m), with the step's m; it returns
  /// false to stop (Note [When gradients' receives are posted] in remote_link.h). `channel`:
  /// the link's (transfer_tag). `capacity` (packs_activations groups; null otherwise): the link's
  /// largest data received in earlier steps, updated at the end of this one (Note [One message
  /// per micro-batch]).
  ActivationReceiver(ProcessGroup group, int peer, c10::Device device = c10::Device(c10::kCPU),
                     c10::optional<c10::Stream> stream = c10::nullopt,
                     std::shared_ptr<Cancellation> cancellation = nullptr,
                     std::function<bool(int64_t i, int64_t m)> between = nullptr,
                     int64_t channel = 0, int64_t* capacity = nullptr);
  /// Stops receiving (aborting a receive in flight) and joins the thread.
  ~ActivationReceiver();
  ActivationReceiver(const ActivationReceiver&) = delete;
  ActivationReceiver& operator=(const ActivationReceiver&) = delete;

  /// The next micro-batch, once it is here (on a GPU: once it is posted, with the consuming
  /// stream made to wait for it); throws the receiving thread's c10::Error. (With a capacity,
  /// waits for its receive itself: one consuming thread at a time.)
  Received next();
  /// Waits until the thread is done (the last micro-batch received, `between` run for the end);
  /// throws its c10::Error.
  void finish();

 private:
  void run();
  // Posts a receive of `tensor` from the peer (kept by the cancellation).
  c10::intrusive_ptr<c10d::Work> post(at::Tensor tensor, Message kind, int64_t i, int64_t t);
  // With a capacity (Note [One message per micro-batch]): the thread's posting, and next().
  void post_packed();
  Received next_packed();
  // Receives posted ahead of the micro-batch next() takes.
  static constexpr int64_t kPostedAhead = 4;

  ProcessGroup group_;
  int peer_;
  c10::Device device_;
  c10::optional<c10::Stream> stream_;
  std::shared_ptr<Cancellation> cancellation_;
  std::function<bool(int64_t, int64_t)> between_;
  int64_t channel_;
  int64_t* capacity_;
  absl::Mutex mu_;
  std::deque<Received> ready_ ABSL_GUARDED_BY(mu_);
  std::exception_ptr error_ ABSL_GUARDED_BY(mu_);
  c10::intrusive_ptr<c10d::Work> in_flight_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // With a capacity: each micro-batch's message and its receive, posted and not yet taken; how
  // many there are (m, once micro-batch 0's header is read; -1 before), the next to post and to
  // take; a larger micro-batch's data receive in flight; the largest data taken.
  struct Posted {
    at::Tensor message;
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::map<int64_t, Posted> posted_ ABSL_GUARDED_BY(mu_);
  int64_t microbatches_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t next_post_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t taken_ ABSL_GUARDED_BY(mu_) = 0;
  c10::intrusive_ptr<c10d::Work> data_in_flight_ ABSL_GUARDED_BY(mu_);
  int64_t largest_ = 0;  // the consuming thread's
  std::thread thread_;  // last: starts once the rest is made
};

/// Waits for `work`, a transfer of `what`. When it was aborted (its wait returns false, without
/// its tensors) or failed and `cancellation` (may be null) was cancelled, throws the
/// cancellation's error, another stage's failure, rather than what that failure did to the work;
/// a work that completed is not undone by a failure heard later.
void wait_unless_cancelled(const ProcessGroup& group, const c10::intrusive_ptr<c10d::Work>& work,
                           const std::string& what, const Cancellation* cancellation);

/// Posts a send or receive on `group`: one thread at a time in this process (c10d's Gloo group
/// counts its operations without a lock), so that the courier and the activation receiver can
/// both post.
c10::intrusive_ptr<c10d::Work> post_send(const ProcessGroup& group, at::Tensor tensor, int peer,
                                         int tag);
c10::intrusive_ptr<c10d::Work> post_receive(const ProcessGroup& group, at::Tensor tensor,
                                            int peer, int tag);
/// A receive that any rank's send of `tag` matches (Gloo).
c10::intrusive_ptr<c10d::Work> post_receive_from_any(const ProcessGroup& group, at::Tensor tensor,
                                                     int tag);

/// `tensors` detached, on `device` (wire_device) and contiguous, for sending (copies only where
/// needed).
std::vector<at::Tensor> to_wire(const std::vector<at::Tensor>& tensors, c10::Device device);

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
