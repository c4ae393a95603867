// The example trainers' saves and restarts; see saves.h.
#include "examples/training/saves.h"

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gpipe/internal/atomic_file.h"
#include "gpipe/saved_training.h"

namespace gpipe {
namespace training {
namespace {

// The step of the save in `folder`, or -1 where none is complete.
int64_t step_of(const std::string& folder) { return saved_step(save_in(folder)); }

int64_t env_int(const char* name) {
  const char* value = std::getenv(name);
  int64_t out = 0;
  return value != nullptr && absl::SimpleAtoi(value, &out) ? out : 0;
}

}  // namespace

std::string save_in(const std::string& folder) {
  std::error_code error;
  const std::string file = folder + "/model.pt";
  return std::filesystem::exists(file, error) ? file : folder;
}

std::string newest_save(const std::string& folder) {
  if (step_of(folder) >= 0) return folder;
  std::vector<std::string> folders;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(folder, error)) {
    if (entry.is_directory(error)) folders.push_back(entry.path().string());
  }
  std::sort(folders.begin(), folders.end());
  std::string newest;
  int64_t newest_step = -1;
  for (const std::string& f : folders) {
    const int64_t step = step_of(f);
    if (step > newest_step) newest = f, newest_step = step;
  }
  return newest;
}

std::string save_to_resume(const std::string& save, const std::string& resume) {
  // A restarted process goes on from its own saves, when it made one: they are newer than
  // --resume's (empty: the first attempt failed before its first save).
  if (!save.empty() && env_int("TORCHELASTIC_RESTART_COUNT") > 0) {
    const std::string found = newest_save(save);
    if (!found.empty()) return save_in(found);
  }
  if (resume.empty()) return "";
  const std::string found = newest_save(resume);
  TORCH_CHECK(!found.empty(), "--resume=", resume,
              " holds no complete save: give a folder that a save wrote (an epoch_k or the "
              "latest of --save) or a --save folder");
  return save_in(found);
}

void kill_if_asked(int rank, int64_t step) {
  const char* asked = std::getenv("GPIPE_TRAINER_KILL");
  if (asked == nullptr || env_int("TORCHELASTIC_RESTART_COUNT") > 0) return;
  const std::vector<std::string> parts = absl::StrSplit(asked, '@');
  int64_t r = -1, s = -1;
  TORCH_CHECK(parts.size() == 2 && absl::SimpleAtoi(parts[0], &r) && absl::SimpleAtoi(parts[1], &s),
              "GPIPE_TRAINER_KILL=", asked, ": give <rank>@<step>, such as 1@5");
  if (r == rank && s == step) {
    std::printf("GPIPE_TRAINER_KILL: rank %d kills itself in step %lld\n", rank,
                static_cast<long long>(step));
    std::fflush(stdout);
    ::raise(SIGKILL);
  }
}

std::string parameters_digest(const torch::nn::Module& module) {
  uint64_t hash = gpipe::internal::kChecksumStart;
  const auto add = [&hash](const at::Tensor& t) {
    const at::Tensor c = t.detach().to(at::kCPU).contiguous();
    hash = gpipe::internal::checksum(c.data_ptr(), c.nbytes(), hash);
  };
  for (const at::Tensor& p : module.parameters()) add(p);
  for (const at::Tensor& b : module.buffers()) add(b);
  return absl::StrCat(absl::Hex(hash, absl::kZeroPad16));
}

}  // namespace training
}  // namespace gpipe
