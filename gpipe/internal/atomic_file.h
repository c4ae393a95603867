// Files written whole or not at all, and their checksums (internal, not API): what save_training
// writes and load_training reads (Note [Atomic saves] in saved_training.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace gpipe {
namespace internal {

// The 64-bit FNV-1a hash of `size` bytes at `data`, going on from `hash` (kChecksumStart for a
// new one): a save's checksum of each file.
constexpr uint64_t kChecksumStart = 14695981039346656037ULL;
uint64_t checksum(const void* data, size_t size, uint64_t hash = kChecksumStart);

// A file's length and checksum.
struct FileDigest {
  int64_t bytes = 0;
  uint64_t checksum = kChecksumStart;
};

// A file written under a temporary name in its folder ("<path>.tmp.<pid>.<n>") and renamed to
// `path` by commit() once it, and then the folder, are flushed to the disk: a reader finds the
// old file or the new one, whole, even after a crash. Destroyed uncommitted (a failed write), it
// removes the temporary file. Errors are c10::Errors that start with `who` and name `path`.
//
//   internal::AtomicFile file("run/manifest.txt", "gpipe::save_training");
//   file.append(text.data(), text.size());
//   file.commit();
class AtomicFile {
 public:
  AtomicFile(std::string path, std::string who);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Appends `size` bytes. Never throws, and reports nothing: an error is kept (the bytes after
  // it dropped) and thrown by commit(). (LibTorch's archive writer calls it through C code, and
  // would end the process if a short write made its destructor throw.)
  void append(const void* data, size_t size) noexcept;
  // Flushes the file, renames it to `path` and flushes the folder; returns what was written.
  FileDigest commit();
  // The error of a failed append(), or empty.
  const std::string& error() const { return error_; }

 private:
  std::string path_, temp_, who_, error_;
  int fd_ = -1;
  FileDigest digest_;
};

// Writes `text` to `path` through an AtomicFile.
FileDigest write_atomically(const std::string& path, const std::string& text,
                            const std::string& who);
// The bytes of the file at `path`. Throws c10::Error "<who>: cannot read '<path>': <reason>".
std::string read_whole_file(const std::string& path, const std::string& who);

/// Fault injection for tests: `hook` (or nothing, when empty) runs with the path of each file a
/// save is about to rename into place, after its bytes are on the disk; a hook that throws stands
/// for a process killed there (the file stays out of place). Not for use while saves run.
void set_commit_hook(std::function<void(const std::string& path)> hook);
}  // namespace internal
}  // namespace gpipe
