// Files written whole or not at all; see atomic_file.h and Note [Atomic saves] in
// saved_training.h.
#include "gpipe/internal/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <random>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <utility>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace gpipe {
namespace {

std::function<void(const std::string&)>& commit_hook() {
  static std::function<void(const std::string&)> hook;
  return hook;
}

// The folder that holds `path` ("." for a bare name).
std::string folder_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// A name beside `path` that no other writer uses: this process's id, a count and a random
// number (a restarted process in a container often has the same id and count as the one that
// died, and a temporary file of the dead one may still be there).
std::string temporary_name(const std::string& path) {
  static std::atomic<int64_t> count{0};
  static const uint64_t run = [] {
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device() ^
           static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  return absl::StrCat(path, ".tmp.", ::getpid(), ".", count++, ".", absl::Hex(run));
}

// Flushes the folder `dir`'s entries (the rename of `path` into it) to the disk. A file system
// that cannot flush a folder (EINVAL) keeps its renames as it can. On failure `path` is already in
// place under its name: the error says so, and that it may not survive a crash of the machine.
void sync_folder(const std::string& dir, const std::string& path, const std::string& who) {
  int failed = 0;
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    failed = errno;
  } else {
    if (::fsync(fd) != 0 && errno != EINVAL) failed = errno;
    ::close(fd);
  }
  TORCH_CHECK(failed == 0, who, ": '", path, "' is written, but flushing its folder '", dir,
              "' failed (", std::strerror(failed), "), so the file may not survive a crash of "
              "the machine; save again once the folder can be flushed");
}

}  // namespace

namespace internal {

uint64_t checksum(const void* data, size_t size, uint64_t hash) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t k = 0; k < size; ++k) hash = (hash ^ bytes[k]) * 1099511628211ULL;
  return hash;
}

AtomicFile::AtomicFile(std::string path, std::string who)
    : path_(std::move(path)), temp_(temporary_name(path_)), who_(std::move(who)) {
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  TORCH_CHECK(fd_ >= 0, who_, ": cannot write '", path_, "': cannot make '", temp_, "' beside it: ",
              std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFile::append(const void* data, size_t size) noexcept {
  if (!error_.empty() || fd_ < 0) return;
  const auto* bytes = static_cast<const char*>(data);
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd_, bytes + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      error_ = n < 0 ? std::strerror(errno) : "the disk took no more bytes";
      return;
    }
    done += static_cast<size_t>(n);
  }
  digest_.checksum = checksum(data, size, digest_.checksum);
  digest_.bytes += static_cast<int64_t>(size);
}

FileDigest AtomicFile::commit() {
  TORCH_CHECK(error_.empty(), who_, ": cannot write '", path_, "': ", error_);
  TORCH_CHECK(::fsync(fd_) == 0, who_, ": cannot write '", path_, "': flushing '", temp_,
              "' failed: ", std::strerror(errno));
  const int closed = ::close(fd_);
  fd_ = -1;
  TORCH_CHECK(closed == 0, who_, ": cannot write '", path_, "': closing '", temp_, "' failed: ",
              std::strerror(errno));
  if (commit_hook()) commit_hook()(path_);
  TORCH_CHECK(::rename(temp_.c_str(), path_.c_str()) == 0, who_, ": cannot write '", path_,
              "': renaming '", temp_, "' to it failed: ", std::strerror(errno));
  temp_.clear();  // in place: nothing to remove
  sync_folder(folder_of(path_), path_, who_);
  return digest_;
}

FileDigest write_atomically(const std::string& path, const std::string& text,
                            const std::string& who) {
  AtomicFile file(path, who);
  file.append(text.data(), text.size());
  return file.commit();
}

std::string read_whole_file(const std::string& path, const std::string& who) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, who, ": cannot read '", path, "': ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};  // also when the string cannot grow (bad_alloc)
  std::string bytes;
  struct stat info {};
  if (::fstat(fd, &info) == 0 && info.st_size > 0) bytes.reserve(static_cast<size_t>(info.st_size));
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      TORCH_CHECK(n == 0, who, ": cannot read '", path, "': ", std::strerror(errno));
      return bytes;
    }
    bytes.append(buffer, static_cast<size_t>(n));
  }
}

void set_commit_hook(std::function<void(const std::string& path)> hook) {
  commit_hook() = std::move(hook);
}
}  // namespace internal
}  // namespace gpipe
