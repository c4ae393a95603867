// Saving and resuming training across processes; see saved_training.h and Notes [Saving and
// resuming] and [Atomic saves] in gpipe/saved_training.h.
#include "gpipe/distributed/saved_training.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <sstream>
#include <system_error>
#include <vector>

#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gpipe/internal/atomic_file.h"
#include "gpipe/internal/error_text.h"
#include "gpipe/internal/manifest.h"
#include "gpipe/internal/resharding.h"

namespace gpipe {
namespace distributed {
namespace {

using gpipe::internal::committed_file;
using gpipe::internal::hex;
using gpipe::internal::kManifest;
using gpipe::internal::Manifest;
using gpipe::internal::manifest_text;
using gpipe::internal::ManifestFile;
using gpipe::internal::parse_manifest;
using gpipe::internal::read_manifest;

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

// Who writes what in a save across processes. The ranks form a grid: `outer` (the stages of a
// pipeline; one for a DataParallel) × `inner` (the replicas). Each outer index's module file is
// written by its inner index 0, each rank's random generators by itself, the manifest by (0, 0).
struct Grid {
  ProcessGroup inner, outer;  // null: one rank
  int inner_size = 1, outer_size = 1;
  int inner_index = 0, outer_index = 0;
  std::function<std::string(int outer, int inner_size)> layout;  // what wrote outer's files
  std::function<std::string(int outer)> module_base;  // its module file's name, up to ".step"
  std::function<std::string(int outer, int inner)> random_base;
  std::function<std::string(int outer, int inner)> who;  // a rank, for errors
  c10::Device local{c10::kCPU};                           // for collectives on NCCL
  // The module's tensors' names in the whole Sequential, and its ties (Note [Saves that outlive
  // their layout]); none for a DataParallel of a module that is not a Sequential or a GPipe.
  gpipe::internal::LayerNames names;
  std::vector<Tie> ties;
  int64_t layers = -1;  // the whole model's (-1: not known)
  bool whole = false;   // the module holds the whole model (a DataParallel's replica)
  // The layout does not say what the module is: a DataParallel of a Sequential and one of a
  // GPipe have the same layout, so a save loads exactly only where it holds the same names.
  bool layout_hides_names = false;

  bool writes_module() const { return inner_index == 0; }
  bool writes_manifest() const { return inner_index == 0 && outer_index == 0; }
};

// Where a group that carries GPU tensors (NCCL) takes this process's: its first GPU tensor's
// device, else the CPU.
c10::Device local_device(const torch::nn::Module& module) {
  for (const at::Tensor& t : module.parameters()) {
    if (t.is_cuda()) return t.device();
  }
  for (const at::Tensor& t : module.buffers()) {
    if (t.is_cuda()) return t.device();
  }
  return c10::Device(c10::kCPU);
}

// A stage's layers, each with its index in the whole Sequential: stage s of S owns the layers
// of balance entry s (with virtual stages, of the entries it holds, held_partitions(), in that
// order in layers()).
gpipe::internal::LayerNames stage_layer_names(const PipelineStageImpl& stage) {
  const std::vector<int64_t>& balance = stage.options().balance();
  std::vector<int64_t> start(balance.size() + 1, 0);
  for (size_t k = 0; k < balance.size(); ++k) start[k + 1] = start[k] + balance[k];
  std::vector<int64_t> indices;
  for (int64_t entry : stage.held_partitions()) {
    for (int64_t i = 0; i < balance[entry]; ++i) indices.push_back(start[entry] + i);
  }
  const auto children = stage.layers()->named_children();
  TORCH_CHECK(children.size() == indices.size(), "gpipe::save_training: stage ", stage.stage(),
              " holds ", children.size(), " layers, but its balance gives it ", indices.size());
  std::vector<gpipe::internal::PlacedLayer> layers;
  for (size_t k = 0; k < indices.size(); ++k) {
    layers.push_back({"layers." + children[k].key() + ".", indices[k], children[k].value()});
  }
  return gpipe::internal::layer_names(layers);
}

Grid stage_grid(const PipelineStageImpl& stage) {
  Grid grid;
  grid.inner = stage.replica_group();
  grid.outer = stage.group();
  grid.inner_size = grid.inner ? grid.inner->getSize() : 1;
  grid.inner_index = grid.inner ? grid.inner->getRank() : 0;
  grid.outer_size = grid.outer ? grid.outer->getSize() : 1;
  grid.outer_index = static_cast<int>(stage.stage());
  const auto& options = stage.options();
  // (A V holds other entries of the same balance than interleaving: Note [V-shaped placement].)
  grid.layout = [stages = stage.stages(), balance = absl::StrJoin(options.balance(), ", "),
                 virtual_stages = options.schedule().virtual_stages(),
                 v = v_shaped(options.schedule().kind())](int s, int replicas) {
    return absl::StrCat("stage ", s, " of ", stages, " (balance {", balance, "}, ", virtual_stages,
                        " virtual stage(s) each", v ? " in a V" : "", ", ", replicas,
                        " replica(s))");
  };
  grid.module_base = [](int s) { return absl::StrCat("stage", s); };
  grid.random_base = [](int s, int k) { return absl::StrCat("random_stage", s, "_replica", k); };
  grid.who = [](int s, int k) { return absl::StrCat("stage ", s, "'s replica ", k); };
  grid.local = stage.device();
  grid.names = stage_layer_names(stage);
  grid.ties = stage.ties();
  grid.layers = 0;
  for (int64_t n : stage.options().balance()) grid.layers += n;
  return grid;
}

Grid replica_grid(const DataParallelImpl& model) {
  Grid grid;
  grid.inner = model.group();
  grid.inner_size = model.group()->getSize();
  grid.inner_index = model.group()->getRank();
  grid.layout = [](int, int replicas) {
    return absl::StrCat("a DataParallel of ", replicas, " replicas");
  };
  grid.module_base = [](int) { return std::string("replicas"); };
  grid.random_base = [](int, int r) { return absl::StrCat("random_rank", r); };
  grid.who = [](int, int r) { return absl::StrCat("rank ", r); };
  grid.local = local_device(model);
  // A Sequential's or a GPipe's tensors by layer, under the DataParallel's "module." (Note [Saves
  // that outlive their layout]); none for another module.
  for (const auto& [name, global] : gpipe::internal::layer_names(*model.module())) {
    const bool buffer = absl::StartsWith(name, "buffer ");
    grid.names.emplace(buffer ? "buffer module." + name.substr(7) : "module." + name, global);
  }
  grid.ties = gpipe::internal::ties_of(*model.module());
  grid.whole = true;
  grid.layout_hides_names = true;
  return grid;
}

// Every rank's `mine` (int64, the same size everywhere) as [outer][inner][...]: gathered over
// the inner group, then those over the outer, so that every rank has every rank's.
at::Tensor everyone(const Grid& grid, const at::Tensor& mine, const std::string& what) {
  const at::Tensor row = grid.inner && grid.inner_size > 1
                             ? at::stack(all_gather(grid.inner, mine, grid.local, what))
                             : mine.unsqueeze(0);
  return grid.outer && grid.outer_size > 1
             ? at::stack(all_gather(grid.outer, row, grid.local, what))
             : row.unsqueeze(0);
}

// The save count of the manifest in `dir`, or 0 where there is none. A manifest that is there
// but cannot be read or parsed throws: numbering from 0 again could overwrite committed files.
int64_t last_save(const std::string& dir) {
  const std::string path = dir + "/" + kManifest;
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0 && errno == ENOENT) return 0;
  return parse_manifest(gpipe::internal::read_whole_file(path, "gpipe::save_training"), path).save;
}

// ----- Saving

// What each rank tells the others after writing its files.
enum Field : int64_t {
  kOk,  // 1: its files are on the disk
  kStep,
  kModuleBytes,  // of its module file (the inner index 0 only)
  kModuleChecksum,
  kRandomBytes,
  kRandomChecksum,
  kFields
};

// The save's count in its folder: one more than the manifest's there (Note [Atomic saves]), as
// the manifest's writer reads it.
int64_t agree_on_save(const std::string& dir, const Grid& grid) {
  int64_t mine = 0;
  std::string why;  // the manifest writer's, when it cannot read the manifest: -1 for everyone
  if (grid.writes_manifest()) {
    try {
      mine = last_save(dir) + 1;
    } catch (const std::exception& e) {
      mine = -1;
      why = gpipe::internal::without_backtrace(e);
    }
  }
  const at::Tensor all = everyone(grid, at::tensor(std::vector<int64_t>{mine}, at::kLong),
                                  "the agreement on the save's files");
  TORCH_CHECK(all.min().item<int64_t>() >= 0, "gpipe::save_training: the manifest in '", dir,
              "' is there but cannot be read",
              why.empty() ? std::string(" (said the rank that writes it)") : ": " + why,
              "; numbering this save from 0 could overwrite the committed files, so nothing was "
              "written: mend or move the folder");
  return all.max().item<int64_t>();
}

// Writes this rank's files of save `save`; returns its kFields, and in `error` what failed.
at::Tensor write_files(const std::string& dir, const Grid& grid, const torch::nn::Module& module,
                       const torch::optim::Optimizer* optimizer, int64_t step, int64_t save,
                       const GradScaler* scaler, std::exception_ptr& error) {
  std::vector<int64_t> fields(kFields, 0);
  fields[kStep] = step;
  const std::string layout = grid.layout(grid.outer_index, grid.inner_size);
  try {
    make_folders(dir);
    if (grid.writes_module()) {
      const gpipe::internal::FileDigest d = gpipe::internal::save_file(
          dir + "/" +
              gpipe::internal::save_file_name(grid.module_base(grid.outer_index), step, save),
          layout, &module, optimizer, step, /*random=*/false, scaler, &grid.names);
      fields[kModuleBytes] = d.bytes;
      fields[kModuleChecksum] = static_cast<int64_t>(d.checksum);
    }
    const gpipe::internal::FileDigest d = gpipe::internal::save_file(
        dir + "/" +
            gpipe::internal::save_file_name(grid.random_base(grid.outer_index, grid.inner_index),
                                            step, save),
        layout, nullptr, nullptr, step, /*random=*/true);
    fields[kRandomBytes] = d.bytes;
    fields[kRandomChecksum] = static_cast<int64_t>(d.checksum);
    fields[kOk] = 1;
  } catch (const std::exception&) {
    error = std::current_exception();
  }
  return at::tensor(fields, at::kLong);
}

// Throws, on every rank alike, when a rank could not write its files or saves another step.
void check_written(const Grid& grid, const at::Tensor& all, const std::string& dir,
                   const std::exception_ptr& error) {
  if (error) std::rethrow_exception(error);
  const int64_t step = all[0][0][kStep].item<int64_t>();
  for (int s = 0; s < grid.outer_size; ++s) {
    for (int k = 0; k < grid.inner_size; ++k) {
      TORCH_CHECK(all[s][k][kOk].item<int64_t>() == 1, "gpipe::save_training: ", grid.who(s, k),
                  " could not write its files into '", dir, "' (its error says why); the save "
                  "is not committed, and the folder keeps its last committed save");
      const int64_t theirs = all[s][k][kStep].item<int64_t>();
      TORCH_CHECK(theirs == step, "gpipe::save_training: ", grid.who(s, k), " saves step ",
                  theirs, ", but ", grid.who(0, 0), " saves step ", step, "; every rank saves "
                  "the same step (the save into '", dir, "' is not committed)");
    }
  }
}

// The manifest of the save whose ranks wrote `all`.
Manifest manifest_of(const Grid& grid, const at::Tensor& all, int64_t step, int64_t save) {
  Manifest manifest{step, save, {}, {}};
  const auto value = [&](int s, int k, Field f) { return all[s][k][f].item<int64_t>(); };
  for (int s = 0; s < grid.outer_size; ++s) {
    manifest.layouts.push_back(grid.layout(s, grid.inner_size));
    manifest.files.push_back({gpipe::internal::save_file_name(grid.module_base(s), step, save),
                              value(s, 0, kModuleBytes),
                              static_cast<uint64_t>(value(s, 0, kModuleChecksum))});
    for (int k = 0; k < grid.inner_size; ++k) {
      manifest.files.push_back({gpipe::internal::save_file_name(grid.random_base(s, k), step, save),
                                value(s, k, kRandomBytes),
                                static_cast<uint64_t>(value(s, k, kRandomChecksum))});
    }
  }
  return manifest;
}

// Writes the manifest (on its writer), which commits the save, and tells every rank whether it
// did; throws on every rank when it did not.
void commit(const std::string& dir, const Grid& grid, const Manifest& manifest) {
  const std::string path = dir + "/" + kManifest;
  std::string error;
  if (grid.writes_manifest()) {
    try {
      gpipe::internal::write_atomically(path, manifest_text(manifest), "gpipe::save_training");
    } catch (const std::exception& e) {
      error = gpipe::internal::without_backtrace(e);
    }
  }
  const at::Tensor done = everyone(
      grid, at::tensor(std::vector<int64_t>{error.empty() ? 1 : 0}, at::kLong),
      "the commit of the save");
  TORCH_CHECK(error.empty(), "gpipe::save_training: the save of step ", manifest.step, " into '",
              dir, "' is not committed: ", error, "; the folder keeps its last committed save");
  TORCH_CHECK(done.min().item<int64_t>() == 1, "gpipe::save_training: the save of step ",
              manifest.step, " into '", dir, "' is not committed: ", grid.who(0, 0),
              " could not write '", path, "' (its error says why); the folder keeps its last "
              "committed save");
}

// Removes this rank's files of other saves from `dir` (and temporary files a crash left), now
// that the manifest no longer lists them. Best effort: the save is committed already.
void remove_older(const std::string& dir, const Grid& grid, int64_t step, int64_t save) {
  std::vector<std::pair<std::string, std::string>> mine;  // (prefix, the file to keep)
  if (grid.writes_module()) {
    const std::string base = grid.module_base(grid.outer_index);
    mine.emplace_back(base + ".step", gpipe::internal::save_file_name(base, step, save));
  }
  const std::string base = grid.random_base(grid.outer_index, grid.inner_index);
  mine.emplace_back(base + ".step", gpipe::internal::save_file_name(base, step, save));
  if (grid.writes_manifest()) mine.emplace_back(std::string(kManifest) + ".tmp.", "");
  try {
    std::vector<std::filesystem::path> old;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      for (const auto& [prefix, keep] : mine) {
        if (absl::StartsWith(name, prefix) && name != keep) old.push_back(entry.path());
      }
    }
    std::error_code ignored;
    for (const auto& path : old) std::filesystem::remove(path, ignored);
  } catch (const std::exception&) {
    // Left for the next save to remove.
  }
}

void save(const std::string& dir, const Grid& grid, const torch::nn::Module& module,
          const torch::optim::Optimizer* optimizer, int64_t step, const GradScaler* scaler) {
  const int64_t number = agree_on_save(dir, grid);
  std::exception_ptr error;
  const at::Tensor mine = write_files(dir, grid, module, optimizer, step, number, scaler, error);
  const at::Tensor all = everyone(grid, mine, "the gathering of the save's checksums");
  check_written(grid, all, dir, error);
  commit(dir, grid, manifest_of(grid, all, step, number));
  remove_older(dir, grid, step, number);
}

// ----- Loading

// The number of replicas the save had, where it was saved by this rank's outer index in the
// same layout but for the number of replicas (Note [Resuming on fewer or more replicas]); 0
// when it was saved by another layout.
int saved_replicas(const Manifest& manifest, const Grid& grid) {
  const std::string mine = grid.layout(grid.outer_index, grid.inner_size);
  for (const std::string& saved : manifest.layouts) {
    if (saved == mine) return grid.inner_size;
    // The replicas are the layout's number after its last "of " or ", ".
    const size_t of = saved.rfind("of ");
    size_t at = saved.rfind(", ");
    if (of != std::string::npos && (at == std::string::npos || of > at)) at = of;
    if (at == std::string::npos) continue;
    const std::string tail = saved.substr(at + (at == of ? 3 : 2));
    int replicas = 0;
    if (absl::SimpleAtoi(tail.substr(0, tail.find(' ')), &replicas) && replicas >= 1 &&
        saved == grid.layout(grid.outer_index, replicas)) {
      return replicas;
    }
  }
  return 0;
}

// A committed file of the save, read and checked, its step the manifest's.
std::unique_ptr<gpipe::internal::LoadedFile> load_file(
    const std::string& dir, const Manifest& manifest, const std::string& base,
    const std::string& layout, torch::nn::Module* module, torch::optim::Optimizer* optimizer,
    bool random, GradScaler* scaler) {
  const auto [path, bytes] = committed_file(dir, manifest, base);
  auto file = std::make_unique<gpipe::internal::LoadedFile>(path, bytes, layout, module, optimizer,
                                                            random, scaler);
  TORCH_CHECK(file->step() == manifest.step, "gpipe::load_training: '", path, "' holds step ",
              file->step(), ", but '", dir, "/", kManifest, "' commits step ", manifest.step,
              ": the folder mixes saves of different steps; load a folder that one "
              "save_training wrote");
  return file;
}

// A load of a save of another layout into this rank's module (Note [Saves that outlive their
// layout]), refused for a DataParallel's.
std::unique_ptr<gpipe::internal::ReshardedLoad> resharded_load(const Grid& grid,
                                                               torch::nn::Module& module,
                                                               torch::optim::Optimizer* optimizer,
                                                               GradScaler* scaler) {
  TORCH_CHECK(!grid.names.empty(),
              "gpipe::load_training: the save was made by another layout; a DataParallel of a "
              "module that is not a Sequential or a GPipe resumes only from a save of a "
              "DataParallel of the same module");
  return std::make_unique<gpipe::internal::ReshardedLoad>(module, grid.names, grid.ties, optimizer,
                                                          scaler, grid.whole, grid.layers);
}

// Whether `outer`'s module file of the save holds exactly `module`'s tensor names (where the
// layout does not say: Grid::layout_hides_names). A file that cannot be read counts as the same:
// the exact load then says why it cannot read it.
bool same_names(const std::string& dir, const Manifest& manifest, const std::string& base,
                const torch::nn::Module& module) {
  c10::IValue names;
  try {
    const auto [path, bytes] = committed_file(dir, manifest, base);
    torch::serialize::InputArchive archive;
    archive.load_from(bytes.data(), bytes.size(), c10::Device(c10::kCPU));
    if (!archive.try_read(gpipe::internal::kNames, names) || !names.isList()) return true;
  } catch (const std::exception&) {
    return true;
  }
  return gpipe::internal::same_tensor_names(names, module);
}

int64_t load(const std::string& dir, const Grid& grid, torch::nn::Module& module,
             torch::optim::Optimizer* optimizer, GradScaler* scaler) {
  // Both files read and checked before either changes anything (Note [Saving and resuming]).
  std::unique_ptr<gpipe::internal::LoadedFile> module_file, random_file;
  std::unique_ptr<gpipe::internal::ReshardedLoad> resharded;
  int64_t step = 0, save = 0;
  std::string refused;
  try {
    // Reads and checks the files: the module's and the generators', or those of another layout.
    [&] {
      if (gpipe::internal::is_file(dir)) {  // a save of one process
        resharded = resharded_load(grid, module, optimizer, scaler);
        save = resharded->read(dir);
        step = resharded->check();
        return;
      }
      const Manifest manifest = read_manifest(dir);
      const int replicas = saved_replicas(manifest, grid);
      if (replicas == 0 ||  // another layout
          (grid.layout_hides_names &&
           !same_names(dir, manifest, grid.module_base(grid.outer_index), module))) {
        resharded = resharded_load(grid, module, optimizer, scaler);
        save = resharded->read(dir);
        step = resharded->check();
        return;
      }
      const std::string layout = grid.layout(grid.outer_index, replicas);
      module_file = load_file(dir, manifest, grid.module_base(grid.outer_index), layout, &module,
                              optimizer, /*random=*/false, scaler);
      // Replica k takes the generators of the saved run's replica k mod R.
      random_file =
          load_file(dir, manifest, grid.random_base(grid.outer_index, grid.inner_index % replicas),
                    layout, nullptr, nullptr, /*random=*/true, nullptr);
      step = manifest.step;
      save = manifest.save;
    }();
  } catch (const std::exception& e) {
    refused = gpipe::internal::without_backtrace(e);
  }
  // Every rank applies the save, or none does (Note [Atomic saves]): a rank that refused, or
  // read another save, would otherwise leave the others to wait for it in their next step.
  const at::Tensor all = everyone(
      grid, at::tensor(std::vector<int64_t>{refused.empty() ? 1 : 0, step, save}, at::kLong),
      "the agreement on the load");
  TORCH_CHECK(refused.empty(), refused);
  for (int o = 0; o < all.size(0); ++o) {
    for (int i = 0; i < all.size(1); ++i) {
      TORCH_CHECK(all[o][i][0].item<int64_t>() == 1, "gpipe::load_training: ", grid.who(o, i),
                  " refused to load '", dir, "' (its error says why); no rank loads it, and "
                  "this one stays as it was");
      TORCH_CHECK(all[o][i][1].item<int64_t>() == step && all[o][i][2].item<int64_t>() == save,
                  "gpipe::load_training: ", grid.who(o, i), " read save ",
                  all[o][i][2].item<int64_t>(), " (step ", all[o][i][1].item<int64_t>(),
                  ") of '", dir, "', but this rank read save ", save, " (step ", step, "): a save "
                  "was committed while the ranks loaded; load again");
    }
  }
  if (resharded) {
    resharded->apply();
  } else {
    module_file->apply();
    random_file->apply();
  }
  return step;
}

}  // namespace

int64_t saved_step(const std::string& dir) {
  const std::string path = dir + "/" + kManifest;
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0 && (errno == ENOENT || errno == ENOTDIR)) return -1;
  return parse_manifest(gpipe::internal::read_whole_file(path, "gpipe::distributed::saved_step"),
                        path)
      .step;
}

void save_training(const std::string& dir, const PipelineStageImpl& stage,
                   const torch::optim::Optimizer* optimizer, int64_t step,
                   const GradScaler* scaler) {
  stage.check_ties();  // Note [Ties across stages]: a parted tie is refused, not saved
  save(dir, stage_grid(stage), stage, optimizer, step, scaler);
}

int64_t load_training(const std::string& dir, PipelineStageImpl& stage,
                      torch::optim::Optimizer* optimizer, GradScaler* scaler) {
  return load(dir, stage_grid(stage), stage, optimizer, scaler);
}

void save_training(const std::string& dir, const DataParallelImpl& model,
                   const torch::optim::Optimizer* optimizer, int64_t step,
                   const GradScaler* scaler) {
  save(dir, replica_grid(model), model, optimizer, step, scaler);
}

int64_t load_training(const std::string& dir, DataParallelImpl& model,
                      torch::optim::Optimizer* optimizer, GradScaler* scaler) {
  return load(dir, replica_grid(model), model, optimizer, scaler);
}

}  // namespace distributed
}  // namespace gpipe
