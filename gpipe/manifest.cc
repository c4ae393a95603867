// A save's manifest: see gpipe/internal/manifest.h and Note [Atomic saves] in saved_training.h.
#include "gpipe/internal/manifest.h"

#include <sys/stat.h>

#include <cerrno>
#include <sstream>

#include <c10/util/Exception.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpipe/internal/atomic_file.h"

namespace gpipe {
namespace internal {
std::string hex(uint64_t value) { return absl::StrCat(absl::Hex(value, absl::kZeroPad16)); }

std::string save_file_name(const std::string& base, int64_t step, int64_t save) {
  return absl::StrFormat("%s.step%06d.save%d.pt", base, step, save);
}

namespace {

// The line that ends a manifest whose text before it is `text`.
std::string checksum_line(const std::string& text) {
  return absl::StrCat("checksum ", hex(checksum(text.data(), text.size())), "\n");
}

}  // namespace

// The manifest as text, one field a line, its own checksum last:
//   gpipe save 1
//   step 300
//   save 4
//   layout stage 0 of 2 (balance {3, 3}, 1 virtual stage(s) each, 2 replica(s))
//   file stage0.step000300.save4.pt 10496 9c3b0d1e5f2a7788
//   checksum 0123456789abcdef
std::string manifest_text(const Manifest& manifest) {
  std::string text =
      absl::StrCat(kManifestFormat, "\nstep ", manifest.step, "\nsave ", manifest.save, "\n");
  for (const std::string& layout : manifest.layouts) {
    absl::StrAppend(&text, "layout ", layout, "\n");
  }
  for (const ManifestFile& f : manifest.files) {
    absl::StrAppend(&text, "file ", f.name, " ", f.bytes, " ", hex(f.checksum), "\n");
  }
  return text + checksum_line(text);
}

namespace {

// One line of a manifest into `manifest`; false when it is not a manifest's line.
bool parse_line(const std::string& line, Manifest& manifest) {
  std::istringstream in(line);
  std::string key;
  in >> key;
  if (key == "layout" && line.size() > key.size() + 1) {
    manifest.layouts.push_back(line.substr(key.size() + 1));
    return true;
  }
  if (key == "file") {
    ManifestFile f;
    in >> f.name >> f.bytes >> std::hex >> f.checksum;
    manifest.files.push_back(f);
  } else if (key == "step") {
    in >> manifest.step;
  } else if (key == "save") {
    in >> manifest.save;
  } else {
    return false;
  }
  return !in.fail() && in.peek() == EOF;
}

}  // namespace

// Parses a manifest's text; throws, naming `path`, on a manifest that is damaged.
Manifest parse_manifest(const std::string& text, const std::string& path) {
  const size_t last = text.rfind("checksum ");
  const bool whole =
      last != std::string::npos && absl::StartsWith(text, kManifestFormat) &&
      text.compare(last, std::string::npos, checksum_line(text.substr(0, last))) == 0;
  TORCH_CHECK(whole, "gpipe::load_training: '", path, "' is damaged (not a manifest of ",
              kManifestFormat, ", or its checksum does not match); load another save");
  Manifest manifest;
  std::istringstream lines(text.substr(0, last));
  std::string line;
  std::getline(lines, line);  // the format
  while (std::getline(lines, line)) {
    TORCH_CHECK(parse_line(line, manifest), "gpipe::load_training: '", path,
                "' is damaged: cannot read its line '", line, "'; load another save");
  }
  return manifest;
}

// The manifest of `dir`; throws when there is none (no save into `dir` finished) or it is
// damaged.
Manifest read_manifest(const std::string& dir) {
  const std::string path = dir + "/" + kManifest;
  struct stat info {};
  TORCH_CHECK(::stat(path.c_str(), &info) == 0 || errno != ENOENT, "gpipe::load_training: '", dir,
              "' holds no ", kManifest,
              ": no save_training into it finished (a save commits by "
              "writing it last); load a folder that save_training wrote");
  return parse_manifest(read_whole_file(path, "gpipe::load_training"), path);
}

// The path and bytes of the file of `base` that the manifest commits, checked against the
// manifest's name, length and checksum for it.
std::pair<std::string, std::string> committed_file(const std::string& dir, const Manifest& manifest,
                                                   const std::string& base) {
  const std::string manifest_path = dir + "/" + kManifest;
  const std::string expected = save_file_name(base, manifest.step, manifest.save);
  const ManifestFile* listed = nullptr;
  for (const ManifestFile& f : manifest.files) {
    if (absl::StartsWith(f.name, base + ".step")) listed = &f;
  }
  TORCH_CHECK(listed != nullptr, "gpipe::load_training: '", manifest_path, "' lists no '", expected,
              "'; load a folder that save_training wrote");
  TORCH_CHECK(listed->name == expected, "gpipe::load_training: '", manifest_path, "' commits step ",
              manifest.step, " (save ", manifest.save, ") but lists '", listed->name,
              "': it mixes saves (its file would be '", expected,
              "'); load a "
              "folder that one save_training wrote");
  const std::string path = dir + "/" + expected;
  std::string bytes = read_whole_file(path, "gpipe::load_training");
  const uint64_t sum = checksum(bytes.data(), bytes.size());
  TORCH_CHECK(static_cast<int64_t>(bytes.size()) == listed->bytes && sum == listed->checksum,
              "gpipe::load_training: '", path, "' is torn or was replaced: it has ", bytes.size(),
              " bytes of checksum ", hex(sum), ", but '", manifest_path, "' commits ",
              listed->bytes, " bytes of checksum ", hex(listed->checksum), " for step ",
              manifest.step, "; load a folder whose save finished, or an earlier save");
  return {path, std::move(bytes)};
}

bool is_folder(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
}

bool is_file(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

}  // namespace internal
}  // namespace gpipe
