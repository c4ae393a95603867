// The example trainers' shared program (//examples:resnet, //examples:amoebanet): data, a GPipe
// over the chosen devices and balance, training with a progress bar, test accuracy per epoch, and
// a summary of what the pipeline did. Its command line is absl flags (--help lists them).
#pragma once

#include <functional>
#include <string>

#include <torch/nn/modules/container/sequential.h>

#include "examples/models/registry.h"

namespace gpipe {
namespace training {

/// What a trainer trains: a name for messages, and the model for the data's images and classes.
struct TrainerModel {
  std::string name;
  std::function<torch::nn::Sequential(const models::ModelInput& input)> make;
};

/// Trains `model` as the command line says (call absl::ParseCommandLine first). Returns the
/// process's exit code; bad flags throw c10::Error naming the flag and what it takes.
int train(const TrainerModel& model);

}  // namespace training
}  // namespace gpipe
