// Shared memory between the stages of a pipeline on one host (internal, not API): for each
// direction of each link, a ring of messages in a file of /dev/shm that the computing threads of
// the two processes write and read themselves (Note [Shared memory between stages on one host]).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/strings/string_view.h"
#include "gpipe/distributed/process_group.h"

namespace gpipe {
namespace distributed {
namespace internal {

class Cancellation;  // fault.h

// Note [Shared memory between stages on one host]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Over Gloo a micro-batch's hop between processes costs more than its bytes: the sender's courier
// thread wakes to post it, the kernel copies it through a loopback socket, and Gloo's thread in
// the receiver reads it and wakes the stage. On a host whose cores all compute, each of those
// threads takes a core from a computing one (0.2-0.5 ms between two tasks, of which 80-180 us
// were the posting of a send: docs/journal/2026-11-26-benchmarks.md, "measured in rounds, and
// micro-batch groups"), and the interleaved schedule hops v times as often.
// Stages on one host skip all of it: each direction of each link (activations one way, their
// gradients the other) is a ring of messages in a file of /dev/shm that both processes map. The
// computing thread that sends writes its message into the ring (the one copy that packing made
// before) and wakes the reader through a futex in the ring; the computing thread that receives
// waits there and copies the message out. No thread, socket or Gloo in between.
//
// The rings are made with the stage: the ranks tell each other their host (its name, boot id and
// PID namespace: a wait must be able to see whether the other process is alive), each makes the
// rings it writes, and after a collective each opens the rings it reads and removes their names,
// so that nothing is left in /dev/shm when a process dies. The stages use them only if every
// rank made and opened all of its rings; otherwise (no /dev/shm, or too little room there: Docker
// gives a container 64 MiB) every link stays on Gloo, and the rank that could not says why in a
// warning. The ring's memory is allocated when it is made, so a full /dev/shm refuses it then
// instead of killing a process (SIGBUS) later. A message larger than half a ring, or one that
// finds no room in it, goes over Gloo as before, announced by a small record in the ring so the
// reader keeps the order (an eighth of each ring is kept for those records: thousands of them,
// and only then does such a record wait for room). A wait in a ring gives up with the step's
// cancellation (Note [Failing fast across processes] in fault.h), when the writing or reading
// process is gone, or at the group's timeout.

/// The smallest ring (PipelineStageOptions::shared_memory): 256 KiB.
constexpr int64_t kMinSharedRing = int64_t{256} << 10;

/// What a wait in a ring is for, and when it gives up.
struct RingWait {
  absl::string_view what;  // "activations from rank 0", for errors (outlives the wait)
  pid_t peer = 0;    // the other process: the wait fails when it is gone
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  const Cancellation* cancellation = nullptr;  // checked while waiting (may be null)
};

/// A ring of messages in shared memory from one process (the writer) to one other (the reader).
/// One thread writes and one thread reads at a time.
class SharedRing {
 public:
  /// Makes ring `name` (a /dev/shm name, "/gpipe-...") with `bytes` of room, for writing. Throws
  /// c10::Error with the system's reason when it cannot.
  static std::unique_ptr<SharedRing> create(const std::string& name, int64_t bytes);
  /// Opens ring `name`, made by another process, for reading, and removes its name. Throws
  /// c10::Error when it cannot.
  static std::unique_ptr<SharedRing> open(const std::string& name);
  ~SharedRing();
  SharedRing(const SharedRing&) = delete;
  SharedRing& operator=(const SharedRing&) = delete;

  /// The largest message the ring takes: half its room.
  int64_t max_message() const;
  /// Writer: room for a message of `bytes` (64-byte aligned), or null when `block` is false and the
  /// ring has no room now (or never: beyond max_message()). With `block`, waits for room as `wait`
  /// says. commit() sends what was written there.
  uint8_t* reserve(int64_t bytes, bool block, const RingWait& wait);
  void commit();
  /// Reader: the next message (64-byte aligned) and its size, waiting for it as `wait` says.
  /// release() frees it for the writer.
  const uint8_t* next(int64_t* bytes, const RingWait& wait);
  void release();

  /// The process that made the ring.
  pid_t writer() const;

 private:
  struct Control;
  SharedRing(std::string name, bool owner, void* base, int64_t mapped);

  std::string name_;
  bool owner_;  // made it: removes the name if still there
  void* base_;
  int64_t mapped_;
  Control* control_;
  uint8_t* data_;
  int64_t room_;
  int64_t pending_ = 0;  // the reserved or taken record's end position
};

/// One link's rings: the one this stage writes and the one it reads.
struct SharedLink {
  SharedRing* out = nullptr;
  SharedRing* in = nullptr;
  int peer = 0;
  pid_t peer_pid = 0;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};

  /// A wait for `what` from or to this link's peer, given up by `cancellation` too.
  RingWait wait(absl::string_view what, const Cancellation* cancellation) const {
    return {what, peer_pid, timeout, cancellation};
  }

  /// Writes `microbatch`'s record into `out`: `header` (if defined: activations) and `tensors`
  /// (on the CPU, contiguous), packed; or, when they do not fit now, a record saying that they
  /// go over the process group, and then false: the caller sends them there.
  bool write(int64_t microbatch, const at::Tensor& header, const std::vector<at::Tensor>& tensors,
             const RingWait& wait);
  /// A record of `in`: its micro-batch, whether its tensors come over the process group, and
  /// what follows its prefix (the header, if any, then the tensors, packed).
  struct Record {
    int64_t microbatch = 0;
    bool over_group = false;
    const uint8_t* data = nullptr;
    int64_t bytes = 0;
  };
  /// The next record of `in`, once it is there (as `wait` says); release() frees it.
  Record read(const RingWait& wait);
  void release() { in->release(); }
};

/// The rings of one stage's links, made (or not: see ready()) when the stage is.
class SharedLinks {
 public:
  /// One link of the stage: to `peer` (the next stage: activations out, gradients in) or from it
  /// (the previous one: activations in, gradients out), on `channel` (the sending virtual stage's
  /// chunk: transfer_tag).
  struct Spec {
    bool downstream = true;
    int peer = 0;
    int64_t channel = 0;
  };
  /// A collective on `group` (a Gloo group; every rank at the same point, with the same
  /// `ring_bytes`): makes the rings of `links` that join this rank to peers on its host, each of
  /// `ring_bytes`. `who` opens the warning when some rank could not make or open its rings.
  SharedLinks(const ProcessGroup& group, c10::Device local, const std::vector<Spec>& links,
              int64_t ring_bytes, const char* who);
  ~SharedLinks();

  /// The link to (downstream) or from `channel`'s peer; null when it goes over Gloo.
  SharedLink* find(bool downstream, int64_t channel);
  /// How many of the links have rings.
  int64_t size() const { return static_cast<int64_t>(links_.size()); }

 private:
  std::vector<std::unique_ptr<SharedRing>> rings_;
  std::map<std::pair<bool, int64_t>, SharedLink> links_;
};

/// For tests: a message of more than `bytes` that would not wait takes the process group's way,
/// as if it found no room (-1, the default: no such limit). Set before the stages run.
void set_shared_message_limit(int64_t bytes);

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
