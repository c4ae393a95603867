// The example trainers across processes (--distributed, under torchrun): each process one stage
// of a pipeline (gpipe::distributed::PipelineStage), pipelines replicated over the rest.
#pragma once

#include "examples/training/trainer.h"

namespace gpipe {
namespace training {

/// Trains `model` with one pipeline stage per process (in builds with gpipe::distributed:
/// GPIPE_WITH_DISTRIBUTED): --partitions stages per pipeline (default:
/// every process), WORLD_SIZE / stages replicas, each on its shard of every mini-batch. Returns
/// the exit code.
int train_distributed(const TrainerModel& model);

}  // namespace training
}  // namespace gpipe
