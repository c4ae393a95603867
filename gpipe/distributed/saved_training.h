// Saving and resuming training across processes: each pipeline stage (or the replicas of a
// DataParallel) in a file of its own in one folder, each rank's random generators in another, a
// manifest with every file's checksum written last to commit the save.
#pragma once

#include <cstdint>
#include <string>

#include <torch/optim/optimizer.h>

#include "gpipe/distributed/data_parallel.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/grad_scaler.h"
#include "gpipe/saved_training.h"

namespace gpipe {
namespace distributed {

// Note [Resuming on fewer or more replicas]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A save holds each stage once (its replica 0's file: the replicas are equal) and each rank's
// random generators. So a save loads into the same stages and balance with any number of
// replicas R' (a lost machine, a smaller allocation: 4 processes of 2 stages x 2 replicas resumed
// by 2): every replica takes its stage's file, and replica k takes the generators of the saved
// run's replica k mod R. What differs from the saved run is only what the number of replicas
// decides: how a batch is split, the order in which replicas' gradients are summed, and, with
// more replicas than saved, replicas k and k + R drawing the same random numbers (dropout) on
// different samples. A trainer that keeps the global batch resumes at the same step and sample
// count, but a DistributedRandomSampler draws each replica's shard of an epoch for R' replicas:
// resumed in the middle of an epoch, the rest of that epoch is not exactly the samples the saved
// run had left (some come twice in it, some not at all); from the next epoch on, each sample
// once an epoch. Tested: 2 stages x 2 replicas saved, resumed by 2 x 1,
// take the saved parameters exactly and train on as the 2 replicas did to 1e-9 (float64). With
// other stages or another balance, a load goes by layer instead (Note [Saves that outlive their
// layout] in gpipe/saved_training.h), without the random generators.

/// Saves a pipeline stage's training to the folder `dir` (made if missing; Note [Saving and
/// resuming] and Note [Atomic saves] in gpipe/saved_training.h): the stage's layers, `optimizer`
/// (over its parameters; may be null), `step` and `scaler`'s state (if not null) in
/// "stage<s>.step<step>.save<n>.pt", written by the stage's replica 0, and this rank's random
/// generators in "random_stage<s>_replica<k>.step<step>.save<n>.pt". Every rank calls it, with
/// the same step. The files' lengths and checksums reach stage 0's replica 0 through the process
/// groups; it then writes "manifest.txt", which commits the save, and only then are the files
/// of the folder's earlier save removed. It returns once the save is committed; when any
/// rank could not write its files, or the ranks save different steps, it throws c10::Error on
/// every rank and the folder keeps its last committed save. Saving into the same folder again
/// (every N steps) replaces the save atomically: a process killed during a save leaves the
/// previous one loadable.
///
///   gpipe::distributed::save_training("run/latest", *stage, &sgd, step, &scaler);
///   ...  // later, the same processes, stages and options
///   step = gpipe::distributed::load_training("run/latest", *stage, &sgd, &scaler);
void save_training(const std::string& dir, const PipelineStageImpl& stage,
                   const torch::optim::Optimizer* optimizer, int64_t step,
                   const GradScaler* scaler = nullptr);
/// Loads what save_training committed in `dir` for this stage (the same stages and balance; any
/// number of replicas: Note [Resuming on fewer or more replicas]) and this rank's random
/// generators, and `scaler`'s state (if not null); returns the step. A save of another layout
/// (other stages, balance or interleaving, a folder or file of one process's save) loads by
/// layer: this stage's tensors and optimizer states, without the generators (Note [Saves that
/// outlive their layout] in gpipe/saved_training.h). Throws c10::Error, changing nothing, when `dir` has no manifest (no save finished),
/// when a file is torn or replaced (its checksum is not the manifest's), when the folder mixes
/// saves of different steps, or when the save does not fit the stage, the optimizer or the
/// scaler; each error names the file and what the manifest says. A collective: every rank calls
/// it, and every rank applies the save or none does (a rank whose files are whole throws too,
/// naming the one that refused).
int64_t load_training(const std::string& dir, PipelineStageImpl& stage,
                      torch::optim::Optimizer* optimizer, GradScaler* scaler = nullptr);

/// The step of the save committed in `dir` (by either save_training), or -1 when none is (no
/// manifest there): which of several save folders is the newest, from their manifests alone.
/// Throws c10::Error naming the manifest when it is damaged. Any process may call it; it is not
/// a collective.
///
///   const bool newer = saved_step("run/latest") > saved_step("run/epoch_3");
int64_t saved_step(const std::string& dir);

/// The same for the replicas of a DataParallel: the module, `optimizer`, `step` and `scaler` in
/// "replicas.step<step>.save<n>.pt" (written by rank 0: the replicas are equal), each rank's
/// random generators in "random_rank<r>.step<step>.save<n>.pt", and "manifest.txt" by rank 0.
///
///   gpipe::distributed::save_training("run/latest", *model, &sgd, step);
///   step = gpipe::distributed::load_training("run/latest", *model, &sgd);
void save_training(const std::string& dir, const DataParallelImpl& model,
                   const torch::optim::Optimizer* optimizer, int64_t step,
                   const GradScaler* scaler = nullptr);
/// Loads what save_training committed for the replicas (any number of them, as for stages: Note
/// [Resuming on fewer or more replicas]; tested for stages only), this rank's random
/// generators and `scaler`'s state (if not null); returns the step. When the replicas are of a
/// Sequential or a GPipe, a save of another layout (a one-process file, stages, replicas of
/// another module or balance) loads by layer, without the generators, and their own save loads
/// into any layout (Note [Saves that outlive their layout] in gpipe/saved_training.h). Refuses
/// as the stages' load, and is a collective as it is: every replica loads, or none.
int64_t load_training(const std::string& dir, DataParallelImpl& model,
                      torch::optim::Optimizer* optimizer, GradScaler* scaler = nullptr);

}  // namespace distributed
}  // namespace gpipe
