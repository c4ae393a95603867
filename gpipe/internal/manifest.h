// A save's manifest (internal, not API): the file that commits a save of several files, listing
// each with its length and checksum (Note [Atomic saves] in gpipe/saved_training.h). Written by
// the saves across processes, read by every load of such a save (a stage's, a DataParallel's,
// and one process's load of a save made across processes: Note [Saves that outlive their
// layout]).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gpipe {
namespace internal {

inline constexpr const char* kManifest = "manifest.txt";
inline constexpr const char* kManifestFormat = "gpipe save 1";

struct ManifestFile {
  std::string name;
  int64_t bytes = 0;
  uint64_t checksum = 0;
};

// What a save committed: its step, the folder's count of saves, what wrote it, its files.
struct Manifest {
  int64_t step = 0;
  int64_t save = 0;
  std::vector<std::string> layouts;
  std::vector<ManifestFile> files;
};

// A checksum as manifests write it: 16 hexadecimal digits.
std::string hex(uint64_t value);
// A file of a save: "<base>.step<step>.save<save>.pt" (Note [Atomic saves]).
std::string save_file_name(const std::string& base, int64_t step, int64_t save);
// The manifest as text, one field a line, its own checksum last.
std::string manifest_text(const Manifest& manifest);
// Parses a manifest's text; throws, naming `path`, on a manifest that is damaged.
Manifest parse_manifest(const std::string& text, const std::string& path);
// The manifest of `dir`; throws when there is none (no save into `dir` finished) or it is
// damaged.
Manifest read_manifest(const std::string& dir);
// Whether `path` is a folder; a file (a regular one).
bool is_folder(const std::string& path);
bool is_file(const std::string& path);
// The path and bytes of the file of `base` that the manifest commits, checked against the
// manifest's name, length and checksum for it.
std::pair<std::string, std::string> committed_file(const std::string& dir, const Manifest& manifest,
                                                   const std::string& base);

}  // namespace internal
}  // namespace gpipe
