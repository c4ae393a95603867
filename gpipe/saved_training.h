// Saving a training run and resuming it: a module's parameters and buffers, its optimizer's state,
// the step and the random generators, in one file written atomically, loaded back for
// bit-identical next steps (or refused, changing nothing).
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

#include "gpipe/grad_scaler.h"

namespace gpipe {

// Note [Saving and resuming]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A run resumed from a save must take the steps the saved run would have taken, bit for bit: the
// same parameters and buffers (running statistics too), the optimizer's state (momentum, Adam's
// moments and step counts), the step number, and the random generators that dropout and the
// like draw from (the CPU's and each CUDA device's), which checkpointed micro-batches also
// replay. Tensors are loaded into the module's own, by name, in place (copy_): each keeps its
// device (a GPipe's partitions stay where they are), its identity (an optimizer made before the
// load still refers to it) and its dtype; a name, shape or dtype that differs is refused, naming
// it. A load checks everything before it changes anything: every name, shape and dtype, the
// optimizer's parameter groups and each parameter's moments (their shapes), the generators'
// states, the GradScaler's; a refused load leaves the module, the optimizer, the generators and
// the scaler as they were (internal::LoadedFile reads and checks, apply() copies). The optimizer's
// state comes back on the device it was saved from, so a run resumes on the same layout of
// devices. Across processes (gpipe/distributed/saved_training.h) each stage writes its own file
// and each rank its own generators, committed together by a manifest (Note [Atomic saves]).
//
// Note [Atomic saves]
// ~~~~~~~~~~~~~~~~~~~
// A process killed during a save (or a full disk) must leave the previous save loadable, and a
// load must never mix pieces of two saves. So every file is written under a temporary name in
// its folder, flushed (fsync), renamed into place and the folder flushed (internal::AtomicFile):
// a reader finds the old file or the new one, whole; a failed write removes its temporary file.
// One process's save is one file, so that is all it needs. A save across processes is several
// files from several ranks, so a rename per file is not enough: a crash between two renames
// would leave stages of different steps. There, the data files are named for their save
// ("stage1.step000300.save4.pt": the step and the folder's count of saves, so that saving the
// same step again never overwrites a committed file), each writer's lengths and checksums
// (64-bit FNV-1a) reach one rank through the process groups (no rank reads another's files),
// and that rank writes "manifest.txt" last, atomically: its rename commits the save. Only then
// does each rank remove its files of older saves. A load reads the manifest, finds the file it
// needs listed under the manifest's step, checks its length and checksum and the step inside
// it, and refuses a missing manifest, a torn or replaced file, or a file of another step, naming
// the file and what the manifest says. A crash at any point before the manifest's rename leaves
// the previous manifest and every file it lists in place. (internal::set_commit_hook injects
// such a crash in the tests.)

// Note [Saves that outlive their layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A job that loses a machine, or gets more, resumes on another layout: other partitions or
// balance, another number of stages, interleaved or not, one process or several (Varuna's "job
// morphing"). So every file of a save also names each tensor by its place in the whole
// Sequential, "<layer index>.<name in the layer>" (as the plain Sequential's named_parameters()
// names them when its layers are named "0", "1", ...), and each parameter's optimizer state by
// its parameter's such name, with the optimizer's kind. A load into the layout that saved it
// reads the files as they are, bit for bit, random generators too (Note [Saving and resuming]).
// A load into another layout (internal::ReshardedLoad) reads every data file of the save (the
// one file of one process, or every stage's file that the folder's manifest commits, each
// checked against it) and takes each of its own tensors and optimizer states by those names: a
// GPipe or a plain Sequential the whole model, a PipelineStage its layers. It checks everything
// before it changes anything, as the other load: every tensor there, of its shape and dtype, the
// optimizer of the saved kind (Adam, AdamW, SGD, Adagrad or RMSprop; each moment of its
// parameter's shape, moved to its device), one step in every file, the GradScaler's state when
// asked for. A tie's state is found under any of its places (a stage holds its own copy of a tie
// that spans stages; a GPipe steps it under its first place). The optimizer's options (learning
// rate, betas) are the optimizer's own: make it as the saved run made it. Not restored across
// layouts: the random generators (each layout draws its own: dropout masks differ from the
// saved run's, as they would between the layouts anyway). The trained arithmetic is the same
// but for summation order where the layout changes it (micro-batches, replicas): float64 runs
// resume to 1e-12. Tested: tests/gpipe/resharded_save_test.cc (GPipe <-> GPipe of another
// balance <-> Sequential, ties, Adam and SGD; refusals) and
// tests/distributed/saved_training_test.cc (stages of one balance -> stages of another,
// interleaved, and one process).

/// Saves what resuming `module`'s training needs to the file `path`: its parameters and buffers
/// by name, `optimizer`'s state (if not null), `step`, this process's random generators, and
/// `scaler`'s state (if not null: gpipe::GradScaler). The file is written beside `path` and
/// renamed into place once on the disk (Note [Atomic saves]): a crash leaves the old file whole.
/// Throws c10::Error naming `path` when it cannot be written, leaving the old file (if any) as
/// it was and no temporary file.
///
///   gpipe::save_training("run/step_1000.pt", *model, &adam, step);
///   ...
///   step = gpipe::load_training("run/step_1000.pt", *model, &adam);  // continues exactly
void save_training(const std::string& path, const torch::nn::Module& module,
                   const torch::optim::Optimizer* optimizer, int64_t step,
                   const GradScaler* scaler = nullptr);

/// Loads what save_training saved into `module` (in place: the same names, shapes and dtypes)
/// and `optimizer` (made over the module's parameters as when saved), restores the random
/// generators and `scaler` (if not null), and returns the step. Throws c10::Error naming what
/// does not match, and then has changed nothing: the module, optimizer, generators and scaler
/// are as they were. `path` may also be a save of another layout (Note [Saves that outlive their
/// layout]): a file of one process's save of a GPipe of another balance, or of the plain
/// Sequential, or a folder that gpipe::distributed::save_training wrote, loaded into a GPipe or
/// a Sequential of the same model (without the random generators).
///
///   gpipe::save_training("run/step_1000.pt", *gpipe_2_partitions, &adam, step);
///   step = gpipe::load_training("run/step_1000.pt", *plain_sequential, &adam2);
int64_t load_training(const std::string& path, torch::nn::Module& module,
                      torch::optim::Optimizer* optimizer, GradScaler* scaler = nullptr);

/// The step of the save at `path` (a file save_training wrote), or -1 when there is no file
/// there: which of several saves is the newest, without applying one (it reads the file). Throws
/// c10::Error naming `path` when the file there is not a save of one process.
///
///   if (gpipe::saved_step("run/latest.pt") > gpipe::saved_step("run/epoch_3.pt")) ...
int64_t saved_step(const std::string& path);

namespace internal {

struct FileDigest;  // gpipe/internal/atomic_file.h

// Writes a file of a save (atomically: Note [Atomic saves]) and returns its length and checksum:
// `layout` says what wrote it; `module` (if not null) with each tensor's name in the whole
// Sequential (`layer_names`: the module's names to those; null: found for a Sequential or a
// GPipe), `optimizer` (if not null), `step`, this process's random generators when `random`,
// and `scaler` (if not null).
FileDigest save_file(const std::string& path, const std::string& layout,
                     const torch::nn::Module* module, const torch::optim::Optimizer* optimizer,
                     int64_t step, bool random, const GradScaler* scaler = nullptr,
                     const std::unordered_map<std::string, std::string>* layer_names = nullptr);

// A file of a save, read from its bytes and checked against what it loads into (the same
// arguments as save_file's, and a scaler only if given): every name, shape and dtype, the
// optimizer's groups and moments, the generators, the scaler. Nothing changes until apply()
// (Note [Saving and resuming]), which first loads the optimizer (the one step that may still
// refuse, for an optimizer whose state LibTorch's format does not describe) and then copies.
class LoadedFile {
 public:
  LoadedFile(const std::string& path, const std::string& bytes, const std::string& layout,
             torch::nn::Module* module, torch::optim::Optimizer* optimizer, bool random,
             GradScaler* scaler);
  // The step the file holds.
  int64_t step() const { return step_; }
  // Copies the file's state into the module, optimizer, generators and scaler.
  void apply();

 private:
  std::string what_;  // "'<path>'"
  torch::serialize::InputArchive archive_;  // kept: the optimizer's state is read from it
  int64_t step_ = 0;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies_;  // (the module's, the saved)
  torch::optim::Optimizer* optimizer_ = nullptr;
  torch::serialize::InputArchive optimizer_state_;
  std::vector<at::Tensor> random_;  // each generator's state; empty: not restored
  GradScaler* scaler_ = nullptr;
  std::optional<GradScaler> scaler_state_;
};

}  // namespace internal
}  // namespace gpipe
