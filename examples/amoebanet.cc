// Trains AmoebaNet-D (L, D) with GPipe, on Fashion-MNIST by default (Debian's
// dataset-fashion-mnist): the reference's benchmark model, L normal cells and D filters.
//
//   bazel run -c opt //examples:amoebanet                    # AmoebaNet-D (6, 64), 2 partitions
//   bazel run -c opt //examples:amoebanet -- --layers=18 --channels=256 --data=synthetic:3x224
#include <cstdio>

#include <c10/util/Exception.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "examples/models/amoebanet.h"
#include "examples/training/trainer.h"

ABSL_FLAG(int64_t, layers, 6, "L: normal cells, a multiple of 3 (the model has L + 6 layers)");
ABSL_FLAG(int64_t, channels, 64, "D: filters (the reference's benchmarks use 208 to 544)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t layers = absl::GetFlag(FLAGS_layers);
  const int64_t channels = absl::GetFlag(FLAGS_channels);
  gpipe::training::TrainerModel model;
  model.name = absl::StrCat("AmoebaNet-D (", layers, ", ", channels, ")");
  model.make = [=](const gpipe::models::ModelInput& input) {
    return gpipe::models::amoebanet_d(layers, channels, input.classes, input.channels);
  };
  try {
    return gpipe::training::train(model);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "amoebanet: %s\n", e.what_without_backtrace());
    return 2;
  }
}
