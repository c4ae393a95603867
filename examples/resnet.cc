// Trains a ResNet with GPipe, on Fashion-MNIST by default (Debian's dataset-fashion-mnist):
// He et al.'s CIFAR ResNets (depth 6n + 2: 8, 20, 32, 44, 56, 110) or the ImageNet family (18, 34,
// 50, 101, 152, with a 3x3 stem for small images; --fine splits its blocks into single layers).
//
//   bazel run -c opt //examples:resnet                      # ResNet-8, 2 partitions on the CPU
//   bazel run -c opt //examples:resnet -- --depth=56 --chunks=8 --trace=/tmp/step.json
//   bazel run -c opt //examples:resnet -- --data=synthetic --steps=20 --balance=size
#include <cstdio>

#include <c10/util/Exception.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "examples/models/resnet.h"
#include "examples/training/trainer.h"

ABSL_FLAG(int64_t, depth, 8,
          "6n + 2 for He et al.'s CIFAR ResNets (8, 20, 32, 44, 56, 110), or 18, 34, 50, 101, 152");
ABSL_FLAG(bool, fine, false,
          "depths 18-152: one layer per convolution, batch norm and ReLU (shortcuts stashed and "
          "popped), so that partitions can cut inside blocks");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t depth = absl::GetFlag(FLAGS_depth);
  const bool fine = absl::GetFlag(FLAGS_fine);
  // 6n + 2 is He et al.'s family (110 too); 18, 34, 50, 101, 152 the ImageNet one.
  const bool cifar = depth != 50 && depth != 101 && depth != 152 && depth % 6 == 2;
  gpipe::training::TrainerModel model;
  model.name = absl::StrCat("ResNet-", depth, cifar ? " (He et al., CIFAR)" : "",
                            fine ? " (fine-grained)" : "");
  model.make = [=](const gpipe::models::ModelInput& input) {
    if (cifar) {
      TORCH_CHECK(!fine, "--fine is for depths 18, 34, 50, 101 and 152");
      return gpipe::models::resnet_cifar(depth, input.classes, input.channels);
    }
    return fine ? gpipe::models::resnet_fine(depth, input.classes, /*imagenet=*/false,
                                             input.channels)
                : gpipe::models::resnet(depth, input.classes, /*imagenet=*/false,
                                        input.channels);
  };
  try {
    return gpipe::training::train(model);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "resnet: %s\n", e.what_without_backtrace());
    return 2;
  }
}
