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

// Where a save across processes goes in its folder: the module's file (written by one rank) and
// this rank's generators, both marked with the layout.
struct SaveFiles {
  std::string layout;
  std::string module;  // relative to the folder
  std::string random;
  bool writer;             // this rank writes the module's file
  ProcessGroup readers;    // the ranks that read it, met at a barrier after saving (may be null)
};

SaveFiles stage_files(const PipelineStageImpl& stage) {
  const auto& options = stage.options();
  const ProcessGroup& replicas = stage.replica_group();
  const int replica = replicas ? replicas->getRank() : 0;
  return {absl::StrCat("stage ", stage.stage(), " of ", stage.stages(), " (balance {",
                       absl::StrJoin(options.balance(), ", "), "}, ", options.schedule().virtual_stages(),
                       " virtual stage(s) each, ", replicas ? replicas->getSize() : 1,
                       " replica(s))"),
          absl::StrCat("stage", stage.stage(), ".pt"),
          absl::StrCat("random_stage", stage.stage(), "_replica", replica, ".pt"), replica == 0,
          replicas};
}

SaveFiles replica_files(const DataParallelImpl& model) {
  const int rank = model.group()->getRank();
  return {absl::StrCat("a DataParallel of ", model.group()->getSize(), " replicas"),
          "replicas.pt", absl::StrCat("random_rank", rank, ".pt"), rank == 0, model.group()};
}

void save(const std::string& dir, const SaveFiles& files, const torch::nn::Module& module,
          const torch::optim::Optimizer* optimizer, int64_t step) {
  make_folders(dir);
  if (files.writer) {
    detail::save_file(dir + "/" + files.module, files.layout, &module, optimizer, step,
                      /*random=*/false);
  }
  detail::save_file(dir + "/" + files.random, files.layout, nullptr, nullptr, step,
                    /*random=*/true);
  barrier(files.readers, "the barrier after saving");
}

int64_t load(const std::string& dir, const SaveFiles& files, torch::nn::Module& module,
             torch::optim::Optimizer* optimizer) {
  const int64_t step = detail::load_file(dir + "/" + files.module, files.layout, &module,
                                         optimizer, /*random=*/false);
  const int64_t random_step = detail::load_file(dir + "/" + files.random, files.layout, nullptr,
                                                nullptr, /*random=*/true);
  TORCH_CHECK(step == random_step, "gpipe::load_training: '", dir, "' mixes saves of steps ",
              step, " and ", random_step, "; load a folder one save_training wrote");
  return step;
}

}  // namespace

void save_training(const std::string& dir, const PipelineStageImpl& stage,
                   const torch::optim::Optimizer* optimizer, int64_t step) {
  save(dir, stage_files(stage), stage, optimizer, step);
}

int64_t load_training(const std::string& dir, PipelineStageImpl& stage,
                      torch::optim::Optimizer* optimizer) {
  return load(dir, stage_files(stage), stage, optimizer);
}

void save_training(const std::string& dir, const DataParallelImpl& model,
                   const torch::optim::Optimizer* optimizer, int64_t step) {
  save(dir, replica_files(model), model, optimizer, step);
}

int64_t load_training(const std::string& dir, DataParallelImpl& model,
                      torch::optim::Optimizer* optimizer) {
  return load(dir, replica_files(model), model, optimizer);
}

}  // namespace distributed
}  // namespace gpipe
