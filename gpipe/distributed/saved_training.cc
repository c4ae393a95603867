// Saving and resuming training across processes; see saved_training.h and Note [Saving and
// resuming] in gpipe/saved_training.h.
#include "gpipe/distributed/saved_training.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gpipe {
namespace distributed {
namespace {

// Makes folder `dir` and the folders above it that are missing.
void make_folders(const std::string& dir) {
  for (size_t at = dir.find('/', 1);; at = dir.find('/', at + 1)) {
    const std::string part = dir.substr(0, at);
    if (!part.empty() && ::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, "gpipe::save_training: cannot make the folder '", part, "': ",
                  std::strerror(errno));
    }
    if (at == std::string::npos) break;
  }
}

// Waits until every rank of `group` (if any) got here.
void barrier(const ProcessGroup& group, const std::string& what) {
  if (!group || group->getSize() == 1) return;
  check_collective(group, what, [&] { group->barrier()->wait(); });
}

std::string stage_layout(const PipelineStageImpl& stage) {
  const auto& options = stage.options();
  return absl::StrCat("stage ", stage.stage(), " of ", stage.stages(), " (balance {",
                      absl::StrJoin(options.balance(), ", "), "}, ", options.virtual_stages(),
                      " virtual stage(s) each, ",
                      stage.replica_group() ? stage.replica_group()->getSize() : 1,
                      " replica(s))");
}

std::string stage_random_file(const std::string& dir, const PipelineStageImpl& stage) {
  const int replica = stage.replica_group() ? stage.replica_group()->getRank() : 0;
  return absl::StrCat(dir, "/random_stage", stage.stage(), "_replica", replica, ".pt");
}

}  // namespace

void save_training(const std::string& dir, const PipelineStageImpl& stage,
                   const torch::optim::Optimizer* optimizer, int64_t step) {
  make_folders(dir);
  const std::string layout = stage_layout(stage);
  const bool writer = !stage.replica_group() || stage.replica_group()->getRank() == 0;
  if (writer) {
    detail::save_file(absl::StrCat(dir, "/stage", stage.stage(), ".pt"), layout, &stage,
                      optimizer, step, /*random=*/false);
  }
  detail::save_file(stage_random_file(dir, stage), layout, nullptr, nullptr, step,
                    /*random=*/true);
  barrier(stage.replica_group(), "the barrier after saving the stage");
}

int64_t load_training(const std::string& dir, PipelineStageImpl& stage,
                      torch::optim::Optimizer* optimizer) {
  const std::string layout = stage_layout(stage);
  const int64_t step = detail::load_file(absl::StrCat(dir, "/stage", stage.stage(), ".pt"),
                                         layout, &stage, optimizer, /*random=*/false);
  const int64_t random_step =
      detail::load_file(stage_random_file(dir, stage), layout, nullptr, nullptr, /*random=*/true);
  TORCH_CHECK(step == random_step, "gpipe::load_training: '", dir, "' mixes saves of steps ",
              step, " and ", random_step, "; load a folder one save_training wrote");
  return step;
}

void save_training(const std::string& dir, const DataParallelImpl& model,
                   const torch::optim::Optimizer* optimizer, int64_t step) {
  make_folders(dir);
  const std::string layout = absl::StrCat("a DataParallel of ", model.group()->getSize(),
                                          " replicas");
  if (model.group()->getRank() == 0) {
    detail::save_file(dir + "/replicas.pt", layout, &model, optimizer, step, /*random=*/false);
  }
  detail::save_file(absl::StrCat(dir, "/random_rank", model.group()->getRank(), ".pt"), layout,
                    nullptr, nullptr, step, /*random=*/true);
  barrier(model.group(), "the barrier after saving the replicas");
}

int64_t load_training(const std::string& dir, DataParallelImpl& model,
                      torch::optim::Optimizer* optimizer) {
  const std::string layout = absl::StrCat("a DataParallel of ", model.group()->getSize(),
                                          " replicas");
  const int64_t step =
      detail::load_file(dir + "/replicas.pt", layout, &model, optimizer, /*random=*/false);
  const int64_t random_step =
      detail::load_file(absl::StrCat(dir, "/random_rank", model.group()->getRank(), ".pt"),
                        layout, nullptr, nullptr, /*random=*/true);
  TORCH_CHECK(step == random_step, "gpipe::load_training: '", dir, "' mixes saves of steps ",
              step, " and ", random_step, "; load a folder one save_training wrote");
  return step;
}

}  // namespace distributed
}  // namespace gpipe
