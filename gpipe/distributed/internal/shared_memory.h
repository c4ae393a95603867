// Shared memory between the stages of a pipeline on one host (internal, not API): for each
// direction of each link, a ring of messages in shared memory that the computing threads of the
// two processes write and read themselves (Note [Shared memory between stages on one host]).
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

/// Another process on this host, watched for its exit (Note [Rings without names]): through a
/// pidfd where the kernel has them, which a later process with the same pid does not fool.
class PeerProcess {
 public:
  /// Watches process `pid` from now on (a pid that is already gone reads as exited).
  explicit PeerProcess(pid_t pid);
  ~PeerProcess();
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  pid_t pid() const { return pid_; }
  /// Whether it has exited: gone, or a zombie that its parent has not waited for yet.
  bool exited() const;

 private:
  pid_t pid_;
  int pidfd_ = -1;     // -1: no pidfd (an older kernel); the pid is asked
  bool gone_ = false;  // already gone when watched
};

// Note [Shared memory between stages on one host]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Over Gloo a micro-batch's hop between processes costs more than its bytes: the sender's courier
// thread wakes to post it, the kernel copies it through a loopback socket, and Gloo's thread in
// the receiver reads it and wakes the stage. On a host whose cores all compute, each of those
// threads takes a core from a computing one (0.2-0.5 ms between two tasks, of which 80-180 us
// were the posting of a send: docs/journal/2026-11-26-benchmarks.md, "measured in rounds, and
// micro-batch groups"), and the interleaved schedule hops v times as often.
// Stages on one host skip all of it: each direction of each link (activations one way, their
// gradients the other) is a ring of messages in shared memory that both processes map (Note
// [Rings without names]). The computing thread that sends writes its message into the ring (the
// one copy that packing made before) and wakes the reader through a futex in the ring; the
// computing thread that receives waits there and copies the message out. No thread, socket or
// Gloo in between.
//
// The rings are made with the stage: the ranks tell each other their host (its name, boot id and
// PID namespace) and their process ids, each makes the rings it writes, and after a collective
// each opens the rings it reads. The stages use them only if every rank made and opened all of
// its rings; otherwise every link stays on Gloo, and the rank that could not says why in a
// warning. A message larger than half a ring, or one that finds no room in it, goes over Gloo as
// before, announced by a small record in the ring so the reader keeps the order (an eighth of each
// ring is kept for those records: thousands of them, and only then does such a record wait for
// room). A wait in a ring gives up with the step's cancellation (Note [Failing fast across
// processes] in fault.h), when the writing or reading process is gone, or at the group's timeout.
//
// Note [Rings without names]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A ring is a memfd (memfd_create): memory with a label, no name in any file system. The reader
// finds it among the writer's open files (/proc/<pid>/fd, whose links read "/memfd:<label>") and
// opens it there; the label holds the stage's random token and the link. So nothing is ever left
// behind: when both processes are gone, so is the ring, whenever they die (a ring in /dev/shm
// stayed there if its writer was killed before the reader had opened it and removed its name).
// It also takes no room in /dev/shm, whose 64 MiB in a Docker container refused the rings. Its
// pages are allocated when it is made, and nothing but the host's memory bounds them: so before
// a stage makes its rings, all of them together must fit in an eighth of what the process may
// still take (MemAvailable, or less where its cgroup or an ancestor leaves less room below
// memory.max), else every link stays on Gloo (an eighth: a host's ranks each make their own, and
// their rings are a few MiB each by default, far below that).
// Whether the other process is alive, which each wait asks, is a pidfd (pidfd_open, Linux 5.3):
// opened before the ring is looked up, and held, so a new process that reuses the pid cannot
// pass for the peer as it could for kill(pid, 0). The ring found after the pidfd was opened, with
// the peer still alive after, shows that the pidfd is the ring's writer. Where a kernel has no
// pidfd, the pid is asked as before. A reader that cannot see the writer's files (another PID
// namespace, /proc mounted with hidepid, another user) cannot open the ring: every link then
// stays on Gloo, with the warning.

/// The smallest ring (PipelineStageOptions::shared_memory): 256 KiB.
constexpr int64_t kMinSharedRing = int64_t{256} << 10;

/// What a wait in a ring is for, and when it gives up.
struct RingWait {
  absl::string_view what;  // "activations from rank 0", for errors (outlives the wait)
  const PeerProcess* peer = nullptr;  // the other process: the wait fails when it is gone
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  const Cancellation* cancellation = nullptr;  // checked while waiting (may be null)
};

/// A ring of messages in shared memory from one process (the writer) to one other (the reader).
/// One thread writes and one thread reads at a time.
class SharedRing {
 public:
  /// Makes a ring labelled `label` ("gpipe-...", Note [Rings without names]) with `bytes` of room,
  /// for writing. Throws c10::Error with the system's reason when it cannot.
  static std::unique_ptr<SharedRing> create(const std::string& label, int64_t bytes);
  /// Throws c10::Error unless `rings` rings of `bytes` each fit in an eighth of the memory this
  /// process may still take (Note [Rings without names]), before anything is allocated.
  static void check_room(int64_t rings, int64_t bytes);
  /// Opens ring `label`, made by process `writer` (this one too), for reading. Throws c10::Error
  /// when it cannot: not among the writer's open files, or the writer has exited.
  static std::unique_ptr<SharedRing> open(const PeerProcess& writer, const std::string& label);
  ~SharedRing();
  SharedRing(const SharedRing&) = delete;
  SharedRing& operator=(const SharedRing&) = delete;

  /// The largest message the ring takes: half its room.
  int64_t max_message() const;
  /// The largest message that a write which does not wait always finds room for in an empty ring,
  /// wherever the ring's next record starts (less than max_message(): the room kept free, and a
  /// record that would cross the ring's end starts again at its beginning).
  int64_t max_sure_message() const;
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
  SharedRing(int fd, void* base, int64_t mapped);

  int fd_;  // the writer's memfd, open while the ring lives (the reader opens it); -1: the reader
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
  std::shared_ptr<const PeerProcess> peer_process;
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};

  /// A wait for `what` from or to this link's peer, given up by `cancellation` too.
  RingWait wait(absl::string_view what, const Cancellation* cancellation) const {
    return {what, peer_process.get(), timeout, cancellation};
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
  /// The largest header and tensors, packed, that a record of `out` always finds room for in an
  /// empty ring (SharedRing::max_sure_message).
  int64_t max_sure_payload() const;
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
