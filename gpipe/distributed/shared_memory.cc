// Shared memory between stages on one host; see shared_memory.h.
#include "gpipe/distributed/internal/shared_memory.h"

#include <fcntl.h>
#include <dirent.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "gpipe/distributed/internal/fault.h"

namespace gpipe {
namespace distributed {
namespace internal {
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

// Whether process `pid` has exited (PeerProcess::exited without a pidfd).
bool pid_exited(pid_t pid) {
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

// The bytes this process may still take (Note [Rings without names]): the host's MemAvailable
// (or its memory where /proc/meminfo says nothing), or less where its cgroup, or an ancestor of
// it, leaves less room below its memory.max (cgroup v2).
int64_t available_memory() {
  int64_t available = std::numeric_limits<int64_t>::max();
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (meminfo >> key >> kib && std::getline(meminfo, unit)) {
    if (key == "MemAvailable:") available = kib * 1024;
  }
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (available == std::numeric_limits<int64_t>::max() && pages > 0 && page > 0) {
    available = static_cast<int64_t>(pages) * page;
  }
  std::ifstream cgroups("/proc/self/cgroup");
  std::string line;
  while (std::getline(cgroups, line)) {
    if (line.rfind("0::", 0) != 0) continue;  // cgroup v2's one line
    std::string path = line.substr(3);
    for (;;) {
      const std::string folder = "/sys/fs/cgroup" + (path == "/" ? std::string() : path);
      std::ifstream max_file(folder + "/memory.max"), current_file(folder + "/memory.current");
      int64_t max = 0, current = 0;  // ("max", no limit, reads as no number)
      if (max_file >> max && current_file >> current) {
        available = std::min(available, std::max<int64_t>(0, max - current));
      }
      if (path.size() <= 1) break;
      path = path.substr(0, std::max<size_t>(1, path.rfind('/')));
    }
  }
  return available;
}

int64_t mapped_bytes(int64_t ring_bytes) { return kControlBytes + aligned(ring_bytes); }

// The number of the writer's open file whose link reads "/memfd:<label> (deleted)", or -1.
// Sets `error` to opendir's errno where the folder cannot be read.
int find_memfd(pid_t writer, const std::string& label, int& error) {
  const std::string folder = absl::StrCat("/proc/", writer, "/fd");
  DIR* dir = opendir(folder.c_str());
  error = dir == nullptr ? errno : 0;
  if (dir == nullptr) return -1;
  const std::string wanted = absl::StrCat("/memfd:", label, " (deleted)");
  int found = -1;
  while (const dirent* entry = readdir(dir)) {
    char target[512];
    const std::string path = absl::StrCat(folder, "/", entry->d_name);
    const ssize_t n = readlink(path.c_str(), target, sizeof(target));
    if (n > 0 && std::string(target, static_cast<size_t>(n)) == wanted) {
      found = std::atoi(entry->d_name);
      break;
    }
  }
  closedir(dir);
  return found;
}

// Waits for `word` to change from `seen` (a futex shared between processes), at most 10 ms; before
// that, gives up as `wait` says (checked every 16th call: about every 160 ms).
class Waiter {
 public:
  explicit Waiter(const RingWait& wait) : wait_(wait), start_(Clock::now()) {}

  void pause(std::atomic<uint32_t>& word, uint32_t seen) {
    if (wait_.cancellation) wait_.cancellation->check();
    if (++polls_ % 16 == 0) {
      TORCH_CHECK(wait_.peer == nullptr || !wait_.peer->exited(),
                  "gpipe::distributed: waiting for ", wait_.what, " in shared memory, but the "
                  "other process (pid ", peer_pid(), ") has exited; every rank of a pipeline must "
                  "take the same steps (a rank that died says why in its own output)");
      const auto waited =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start_);
      TORCH_CHECK(waited < wait_.timeout, "gpipe::distributed: waited ", waited.count(), " ms for ",
                  wait_.what, " in shared memory, past the group's timeout (",
                  wait_.timeout.count(), " ms); the other process (pid ", peer_pid(), ") did "
                  "not get there: is it stopped, or does it take other steps?");
    }
    timespec ten_ms{0, 10 * 1000 * 1000};
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &ten_ms, nullptr, 0);
  }

 private:
  pid_t peer_pid() const { return wait_.peer ? wait_.peer->pid() : 0; }

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

PeerProcess::PeerProcess(pid_t pid) : pid_(pid) {
#ifdef SYS_pidfd_open
  pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  gone_ = pidfd_ < 0 && errno == ESRCH;
#endif
}

PeerProcess::~PeerProcess() {
  if (pidfd_ >= 0) close(pidfd_);
}

bool PeerProcess::exited() const {
  if (gone_) return true;
  if (pidfd_ < 0) return pid_exited(pid_);
  pollfd watch{pidfd_, POLLIN, 0};  // readable once the process has exited, zombie or reaped
  return poll(&watch, 1, 0) > 0 && (watch.revents & POLLIN) != 0;
}

SharedRing::SharedRing(int fd, void* base, int64_t mapped)
    : fd_(fd),
      base_(base),
      mapped_(mapped),
      control_(static_cast<Control*>(base)),
      data_(static_cast<uint8_t*>(base) + kControlBytes),
      room_(mapped - kControlBytes) {
  static_assert(sizeof(Control) <= kControlBytes, "the control block is one page");
}

std::unique_ptr<SharedRing> SharedRing::create(const std::string& label, int64_t bytes) {
  static_assert(kMinSharedRing >= 4 * kKeptFree, "room for messages beside kKeptFree");
  TORCH_CHECK(bytes >= kMinSharedRing, "gpipe::distributed: a shared-memory ring needs at least ",
              kMinSharedRing, " bytes, got ", bytes);
  const int64_t mapped = mapped_bytes(bytes);
  check_room(1, bytes);
  const int fd = memfd_create(label.c_str(), MFD_CLOEXEC);
  TORCH_CHECK(fd >= 0, "gpipe::distributed: cannot make a shared-memory ring: ",
              system_error("memfd_create", label, errno));
  // Allocated now: a host without the memory refuses it here, not at a later write.
  const int error = posix_fallocate(fd, 0, mapped);
  void* base = error == 0 ? mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                          : MAP_FAILED;
  const int map_error = errno;
  if (base == MAP_FAILED) close(fd);
  TORCH_CHECK(error == 0, "gpipe::distributed: cannot make a shared-memory ring of ", mapped,
              " bytes: ", system_error("posix_fallocate", label, error),
              " (PipelineStageOptions::shared_memory sets the size of a ring)");
  TORCH_CHECK(base != MAP_FAILED, "gpipe::distributed: cannot map a shared-memory ring: ",
              system_error("mmap", label, map_error));
  auto* control = new (base) Control();
  control->room = mapped - kControlBytes;
  control->writer = getpid();
  control->written.store(0);
  control->read.store(0);
  control->magic = kMagic;
  return std::unique_ptr<SharedRing>(new SharedRing(fd, base, mapped));
}

std::unique_ptr<SharedRing> SharedRing::open(const PeerProcess& writer, const std::string& label) {
  int unreadable = 0;
  const int number = find_memfd(writer.pid(), label, unreadable);
  TORCH_CHECK(unreadable == 0, "gpipe::distributed: cannot open shared-memory ring ", label, ": ",
              system_error("opendir", absl::StrCat("/proc/", writer.pid(), "/fd"), unreadable),
              " (is the other process gone, another user's, or in another PID namespace, or is "
              "/proc mounted with hidepid?)");
  TORCH_CHECK(number >= 0, "gpipe::distributed: cannot open shared-memory ring ", label,
              ": it is not among the open files of process ", writer.pid(), " (/proc/",
              writer.pid(), "/fd); does this process see the other one's files (the same PID "
              "namespace and user, /proc without hidepid)?");
  const std::string path = absl::StrCat("/proc/", writer.pid(), "/fd/", number);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "gpipe::distributed: cannot open a shared-memory ring: ",
              system_error("open", path, errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    close(fd);
    TORCH_CHECK(false, "gpipe::distributed: cannot open a shared-memory ring: ",
                system_error("fstat", path, error));
  }
  if (st.st_size <= kControlBytes) {
    close(fd);
    TORCH_CHECK(false, "gpipe::distributed: ", label, " holds ", st.st_size, " bytes, not a gpipe "
                "ring");
  }
  void* base = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);
  TORCH_CHECK(base != MAP_FAILED, "gpipe::distributed: cannot map a shared-memory ring: ",
              system_error("mmap", path, error));
  auto ring = std::unique_ptr<SharedRing>(new SharedRing(-1, base, st.st_size));
  TORCH_CHECK(ring->control_->magic == kMagic && ring->control_->room == ring->room_,
              "gpipe::distributed: ", label, " is not a gpipe ring of ", ring->room_, " bytes");
  // (Note [Rings without names]: the pidfd, older than this look, is the ring's writer.)
  TORCH_CHECK(!writer.exited(), "gpipe::distributed: process ", writer.pid(),
              ", which made shared-memory ring ", label, ", has exited");
  return ring;
}

SharedRing::~SharedRing() {
  munmap(base_, mapped_);
  if (fd_ >= 0) close(fd_);
}

void SharedRing::check_room(int64_t rings, int64_t bytes) {
  const int64_t total = rings * mapped_bytes(bytes);
  const int64_t available = available_memory();
  TORCH_CHECK(total <= available / 8, "gpipe::distributed: cannot make ", rings,
              " shared-memory ring(s) of ", bytes, " bytes: ", total, " bytes in all, more than "
              "an eighth of the memory this process may still take (", available, " bytes: the "
              "host's MemAvailable, or its cgroup's room below memory.max); "
              "PipelineStageOptions::shared_memory sets the size of a ring");
}

int64_t SharedRing::max_message() const { return room_ / 2 - kRecordHeader; }

int64_t SharedRing::max_sure_message() const {
  // reserve() takes a record where what is unread, the skip to the ring's start (shorter than the
  // record) and the record fit in the room less what is kept free: in an empty ring, twice the
  // record is enough.
  return std::min(max_message(), ((room_ - kept_free(room_)) / 2 - kRecordHeader) / kAlign * kAlign);
}

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
  TORCH_CHECK(size <= static_cast<uint64_t>(max_message()) &&
                  offset + kRecordHeader + aligned(static_cast<int64_t>(size)) <= room_,
              "gpipe::distributed: a malformed record in shared memory (", wait.what, ": ", size,
              " bytes at ", offset, " in a ring of ", room_, " bytes, messages of at most ",
              max_message(), "); do both processes run the same gpipe?");
  *bytes = static_cast<int64_t>(size);
  pending_ = static_cast<int64_t>(read) + kRecordHeader + aligned(*bytes);
  return data_ + offset + kRecordHeader;
}

void SharedRing::release() {
  control_->read.store(static_cast<uint64_t>(pending_), std::memory_order_release);
  wake(control_->releases);
}

void set_shared_message_limit(int64_t bytes) { message_limit.store(bytes); }

}  // namespace internal
}  // namespace distributed
}  // namespace gpipe
