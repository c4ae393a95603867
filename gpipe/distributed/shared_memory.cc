// Shared memory between stages on one host; see shared_memory.h.
#include "gpipe/distributed/shared_memory.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>

#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gpipe/distributed/fault.h"

namespace gpipe {
namespace distributed {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x6770697065726e67;  // "gpipe" ring
constexpr int64_t kControlBytes = 4096;         // the control block's page, before the data
constexpr int64_t kAlign = 64;
constexpr int64_t kRecordHeader = 64;           // a record's size, then its message
constexpr uint64_t kWrap = ~uint64_t{0};        // a record's size: the next record is at 0
// Room a message that does not wait leaves free, for the records that say "over Gloo" (which
// wait): a ring never fills with messages so that none of those fits. An eighth of the ring, at
// least 64 KiB: 8192 records of 128 bytes in a ring of 8 MiB, more than any schedule keeps in
// flight on one link unless its micro-batch group (interleaved) runs to thousands.
constexpr int64_t kKeptFree = 64 * 1024;
int64_t kept_free(int64_t room) { return std::max(kKeptFree, room / 8); }

int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

std::atomic<int64_t> message_limit{-1};  // internal::set_shared_message_limit

// Whether process `pid` has exited: gone, or a zombie that its parent has not waited for yet.
bool exited(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t end = text.rfind(')');  // "pid (name) state ..."
  return end != std::string::npos && end + 2 < text.size() &&
         (text[end + 2] == 'Z' || text[end + 2] == 'X');
}

std::string system_error(const char* call, const std::string& name, int error) {
  return absl::StrCat(call, "(\"", name, "\"): ", std::strerror(error));
}

// Waits for `word` to change from `seen` (a futex shared between processes), at most 10 ms; before
// that, gives up as `wait` says (checked every 16th call: about every 160 ms).
class Waiter {
 public:
  explicit Waiter(const RingWait& wait) : wait_(wait), start_(Clock::now()) {}

  void pause(std::atomic<uint32_t>& word, uint32_t seen) {
    if (wait_.cancellation) wait_.cancellation->check();
    if (++polls_ % 16 == 0) {
      TORCH_CHECK(wait_.peer <= 0 || !exited(wait_.peer),
                  "gpipe::distributed: waiting for ", wait_.what, " in shared memory, but the "
                  "other process (pid ", wait_.peer, ") has exited; every rank of a pipeline must "
                  "take the same steps (a rank that died says why in its own output)");
      const auto waited =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start_);
      TORCH_CHECK(waited < wait_.timeout, "gpipe::distributed: waited ", waited.count(),
                  " ms for ", wait_.what, " in shared memory, past the group's timeout (",
                  wait_.timeout.count(), " ms); the other process (pid ", wait_.peer, ") did "
                  "not get there: is it stopped, or does it take other steps?");
    }
    timespec ten_ms{0, 10 * 1000 * 1000};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &ten_ms, nullptr, 0);
  }

 private:
  const RingWait& wait_;
  Clock::time_point start_;
  int64_t polls_ = 0;
};

void wake(std::atomic<uint32_t>& word) {
  word.fetch_add(1, std::memory_order_release);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

// The ring's first page. Positions count bytes since the ring was made; a record starts at
// position p mod room.
struct SharedRing::Control {
  uint64_t magic;
  int64_t room;
  int64_t writer;  // its pid
  alignas(64) std::atomic<uint64_t> written;  // where the committed records end
  std::atomic<uint32_t> commits;              // futex: changes with `written`
  alignas(64) std::atomic<uint64_t> read;     // where the released records end
  std::atomic<uint32_t> releases;             // futex: changes with `read`
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "atomics shared between processes");

SharedRing::SharedRing(std::string name, bool owner, void* base, int64_t mapped)
    : name_(std::move(name)),
      owner_(owner),
      base_(base),
      mapped_(mapped),
      control_(static_cast<Control*>(base)),
      data_(static_cast<uint8_t*>(base) + kControlBytes),
      room_(mapped - kControlBytes) {
  static_assert(sizeof(Control) <= kControlBytes, "the control block is one page");
}

std::unique_ptr<SharedRing> SharedRing::create(const std::string& name, int64_t bytes) {
  static_assert(kMinSharedRing >= 4 * kKeptFree, "room for messages beside kKeptFree");
  TORCH_CHECK(bytes >= kMinSharedRing, "gpipe::distributed: a shared-memory ring needs at least ",
              kMinSharedRing, " bytes, got ", bytes);
  const int64_t mapped = kControlBytes + aligned(bytes);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "gpipe::distributed: cannot make a shared-memory ring: ",
              system_error("shm_open", name, errno));
  // Allocated now: a full /dev/shm refuses it here, not with SIGBUS at a later write.
  const int error = posix_fallocate(fd, 0, mapped);
  void* base = error == 0 ? mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                          : MAP_FAILED;
  const int map_error = errno;
  close(fd);
  if (base == MAP_FAILED) shm_unlink(name.c_str());
  TORCH_CHECK(error == 0, "gpipe::distributed: cannot make a shared-memory ring of ", mapped,
              " bytes: ", system_error("posix_fallocate", name, error), " (is /dev/shm large "
              "enough? PipelineStageOptions::shared_memory sets the size of a ring)");
  TORCH_CHECK(base != MAP_FAILED, "gpipe::distributed: cannot map a shared-memory ring: ",
              system_error("mmap", name, map_error));
  auto* control = new (base) Control();
  control->room = mapped - kControlBytes;
  control->writer = getpid();
  control->written.store(0);
  control->read.store(0);
  control->magic = kMagic;
  return std::unique_ptr<SharedRing>(new SharedRing(name, true, base, mapped));
}

std::unique_ptr<SharedRing> SharedRing::open(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  TORCH_CHECK(fd >= 0, "gpipe::distributed: cannot open a shared-memory ring: ",
              system_error("shm_open", name, errno), " (does /dev/shm differ between the "
              "processes, as in two containers?)");
  shm_unlink(name.c_str());  // both processes have it now: nothing is left behind
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    close(fd);
    TORCH_CHECK(false, "gpipe::distributed: cannot open a shared-memory ring: ",
                system_error("fstat", name, error));
  }
  if (st.st_size <= kControlBytes) {
    close(fd);
    TORCH_CHECK(false, "gpipe::distributed: ", name, " holds ", st.st_size, " bytes, not a gpipe "
                "ring");
  }
  void* base = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);
  TORCH_CHECK(base != MAP_FAILED, "gpipe::distributed: cannot map a shared-memory ring: ",
              system_error("mmap", name, error));
  auto ring = std::unique_ptr<SharedRing>(new SharedRing(name, false, base, st.st_size));
  TORCH_CHECK(ring->control_->magic == kMagic && ring->control_->room == ring->room_,
              "gpipe::distributed: ", name, " is not a gpipe ring of ", ring->room_, " bytes");
  return ring;
}

SharedRing::~SharedRing() {
  munmap(base_, mapped_);
  if (owner_) shm_unlink(name_.c_str());  // not opened (the reader removes it): gone either way
}

int64_t SharedRing::max_message() const { return room_ / 2 - kRecordHeader; }

pid_t SharedRing::writer() const { return static_cast<pid_t>(control_->writer); }

uint8_t* SharedRing::reserve(int64_t bytes, bool block, const RingWait& wait) {
  TORCH_INTERNAL_ASSERT(bytes >= 0);
  const int64_t limit_for_tests = message_limit.load(std::memory_order_relaxed);
  if (bytes > max_message() || (!block && limit_for_tests >= 0 && bytes > limit_for_tests)) {
    return nullptr;
  }
  const int64_t record = kRecordHeader + aligned(bytes);
  const uint64_t written = control_->written.load(std::memory_order_relaxed);  // ours
  const int64_t offset = static_cast<int64_t>(written % room_);
  const int64_t skip = offset + record > room_ ? room_ - offset : 0;
  const int64_t limit = block ? room_ : room_ - kept_free(room_);
  Waiter waiter(wait);
  for (;;) {
    const uint32_t seen = control_->releases.load(std::memory_order_acquire);
    const uint64_t read = control_->read.load(std::memory_order_acquire);
    if (static_cast<int64_t>(written - read) + skip + record <= limit) break;
    if (!block) return nullptr;
    waiter.pause(control_->releases, seen);
  }
  if (skip > 0) std::memcpy(data_ + offset, &kWrap, sizeof(kWrap));
  uint8_t* start = data_ + (skip > 0 ? 0 : offset);
  const uint64_t size = static_cast<uint64_t>(bytes);
  std::memcpy(start, &size, sizeof(size));
  pending_ = static_cast<int64_t>(written) + skip + record;
  return start + kRecordHeader;
}

void SharedRing::commit() {
  control_->written.store(static_cast<uint64_t>(pending_), std::memory_order_release);
  wake(control_->commits);
}

const uint8_t* SharedRing::next(int64_t* bytes, const RingWait& wait) {
  uint64_t read = control_->read.load(std::memory_order_relaxed);  // ours
  Waiter waiter(wait);
  for (;;) {
    const uint32_t seen = control_->commits.load(std::memory_order_acquire);
    if (control_->written.load(std::memory_order_acquire) > read) break;
    waiter.pause(control_->commits, seen);
  }
  int64_t offset = static_cast<int64_t>(read % room_);
  uint64_t size;
  std::memcpy(&size, data_ + offset, sizeof(size));
  if (size == kWrap) {  // committed with the record after it, at 0
    read += room_ - offset;
    offset = 0;
    std::memcpy(&size, data_, sizeof(size));
  }
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(size) <= max_message(), "a malformed record");
  *bytes = static_cast<int64_t>(size);
  pending_ = static_cast<int64_t>(read) + kRecordHeader + aligned(*bytes);
  return data_ + offset + kRecordHeader;
}

void SharedRing::release() {
  control_->read.store(static_cast<uint64_t>(pending_), std::memory_order_release);
  wake(control_->releases);
}

namespace {

// This host, as a number: its name, boot id and PID namespace. Processes in two containers of
// one host differ in name, or, sharing the host's name and /dev/shm (--ipc=host --network=host),
// in PID namespace, where a ring's waits could not tell whether the other process is alive.
int64_t host_key() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  struct stat pid_namespace = {};
  stat("/proc/self/ns/pid", &pid_namespace);
  return static_cast<int64_t>(
      std::hash<std::string>()(absl::StrCat(name, "/", boot, "/", pid_namespace.st_ino)) >> 1);
}

std::string message_of(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error ? error->what_without_backtrace() : e.what();
}

std::chrono::milliseconds timeout_of(const ProcessGroup& group) {
  if (auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(group.get())) {
    return gloo->getOptions()->timeout;
  }
  return std::chrono::minutes(5);
}

}  // namespace

SharedLinks::SharedLinks(const ProcessGroup& group, c10::Device local,
                         const std::vector<Spec>& links, int64_t ring_bytes, const char* who) {
  const int rank = group->getRank();
  const int size = group->getSize();
  // Who is where, and a name for this stage's rings (rank 0's draw).
  int64_t token = 0;
  if (rank == 0) {
    try {
      std::random_device random;
      token = static_cast<int64_t>(((uint64_t{random()} << 32) ^ random()) >> 1);
    } catch (const std::exception&) {  // no random device: the clock and the pid
      token = (Clock::now().time_since_epoch().count() ^ (int64_t{getpid()} << 40)) & INT64_MAX;
    }
  }
  const std::vector<at::Tensor> where =
      all_gather(group, at::tensor({host_key(), int64_t{getpid()}, token}, at::kLong), local,
                 "agreeing on shared memory between stages");
  token = where[0][2].item<int64_t>();
  const auto name = [&](char kind, int from, int to, int64_t channel) {
    return absl::StrFormat("/gpipe-%x-%c%d-%d-%d", token, kind, from, to, channel);
  };
  // Whether every rank succeeded so far: an all-gather of each one's answer.
  const auto every_rank = [&](bool mine, const char* what) {
    std::vector<int> failed;
    const std::vector<at::Tensor> all =
        all_gather(group, at::tensor({int64_t{mine}}, at::kLong), local, what);
    for (int r = 0; r < size; ++r) {
      if (all[r].item<int64_t>() == 0) failed.push_back(r);
    }
    return failed;
  };
  std::string error;
  for (const Spec& spec : links) {
    if (where[spec.peer][0].item<int64_t>() != where[rank][0].item<int64_t>()) continue;
    SharedLink& link = links_[{spec.downstream, spec.channel}];
    link.peer = spec.peer;
    link.peer_pid = static_cast<pid_t>(where[spec.peer][1].item<int64_t>());
    link.timeout = timeout_of(group);
    if (!error.empty()) continue;
    try {
      rings_.push_back(SharedRing::create(
          name(spec.downstream ? 'a' : 'g', rank, spec.peer, spec.channel), ring_bytes));
      link.out = rings_.back().get();
    } catch (const std::exception& e) {  // every rank goes on to the next collective
      error = message_of(e);
    }
  }
  std::vector<int> failed = every_rank(error.empty(), "making shared memory between stages");
  if (failed.empty()) {
    for (auto& [key, link] : links_) {
      const bool downstream = key.first;
      try {
        rings_.push_back(SharedRing::open(
            name(downstream ? 'g' : 'a', link.peer, rank, key.second)));
        link.in = rings_.back().get();
        TORCH_CHECK(link.in->writer() == link.peer_pid &&
                        (kill(link.peer_pid, 0) == 0 || errno != ESRCH),
                    "gpipe::distributed: rank ", link.peer, " (pid ", link.peer_pid, ") shares "
                    "/dev/shm with rank ", rank, " but not its process ids (another PID "
                    "namespace?)");
      } catch (const std::exception& e) {
        error = message_of(e);
        break;
      }
    }
    failed = every_rank(error.empty(), "opening shared memory between stages");
  } else {
    every_rank(false, "opening shared memory between stages");
  }
  if (failed.empty()) return;
  if (!error.empty()) {
    TORCH_WARN(who, ": rank ", rank, " could not set up shared memory with the stages on its "
               "host, so the stages' links go over the process group: ", error);
  } else {
    TORCH_WARN(who, ": rank(s) ", absl::StrJoin(failed, ", "), " could not set up shared "
               "memory with the stages on their host (their warning says why), so the stages' "
               "links go over the process group");
  }
  links_.clear();
  rings_.clear();
}

SharedLinks::~SharedLinks() = default;

void internal::set_shared_message_limit(int64_t bytes) { message_limit.store(bytes); }

SharedLink* SharedLinks::find(bool downstream, int64_t channel) {
  auto it = links_.find({downstream, channel});
  return it == links_.end() ? nullptr : &it->second;
}

}  // namespace distributed
}  // namespace gpipe
