// Saving and resuming training across processes: each pipeline stage (or the replicas of a
// DataParallel) in a file of its own in one folder, each rank's random generators in another.
#pragma once

#include <cstdint>
#include <string>

#include <torch/optim/optimizer.h>

#include "gpipe/distributed/data_parallel.h"
#include "gpipe/distributed/pipeline_stage.h"
#include "gpipe/saved_training.h"

namespace gpipe {
namespace distributed {

/// Saves a pipeline stage's training to the folder `dir` (made if missing; Note [Saving and
/// resuming] in gpipe/saved_training.h): the stage's layers, `optimizer` (over its parameters;
/// may be null) and `step` in "stage<s>.pt", written by the stage's replica 0, and this rank's
/// random generators in "random_stage<s>_replica<k>.pt". Every rank calls it; it returns once its
/// stage's file is written (a barrier over the stage's replicas).
///
///   gpipe::distributed::save_training("run/step_1000", *stage, &sgd, step);
///   ...  // later, the same processes, stages and options
///   step = gpipe::distributed::load_training("run/step_1000", *stage, &sgd);
void save_training(const std::string& dir, const PipelineStageImpl& stage,
                   const torch::optim::Optimizer* optimizer, int64_t step);
/// Loads what save_training saved for this stage (the same stages, balance and replicas) and this
/// rank's random generators; returns the step.
int64_t load_training(const std::string& dir, PipelineStageImpl& stage,
                      torch::optim::Optimizer* optimizer);

/// The same for the replicas of a DataParallel: the module, `optimizer` and `step` in
/// "replicas.pt" (written by rank 0: the replicas are equal) and each rank's random generators
/// in "random_rank<r>.pt".
void save_training(const std::string& dir, const DataParallelImpl& model,
                   const torch::optim::Optimizer* optimizer, int64_t step);
/// Loads what save_training saved for the replicas (as many of them) and this rank's random
/// generators; returns the step.
int64_t load_training(const std::string& dir, DataParallelImpl& model,
                      torch::optim::Optimizer* optimizer);

}  // namespace distributed
}  // namespace gpipe
