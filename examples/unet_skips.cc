// Skip connections in a pipeline: the small U-Net of examples/models/unet.h learns to denoise
// images, pipelined over CPU partitions, and the schedule of its last step is drawn.
// docs/skip-connections.md walks through the model and this file.
//
//   bazel run //examples:unet_skips -- --partitions=3 --chunks=4 --steps=60
#include <cstdio>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adam.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "examples/models/unet.h"
#include "gpipe/gpipe.h"

ABSL_FLAG(int, partitions, 3, "number of pipeline partitions (1 to 7)");
ABSL_FLAG(int, chunks, 4, "micro-batches per mini-batch");
ABSL_FLAG(int, steps, 60, "training steps");
ABSL_FLAG(bool, timeline, true, "print the schedule of the last step");

namespace nn = torch::nn;

static int run(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  at::manual_seed(0);
  nn::Sequential model = gpipe::models::unet();
  const int partitions = absl::GetFlag(FLAGS_partitions);
  TORCH_CHECK(partitions >= 1 && partitions <= static_cast<int>(model->size()),
              "--partitions must be between 1 and ", model->size(), ", got ", partitions);
  std::vector<int64_t> balance(partitions, model->size() / partitions);
  balance.back() += model->size() % partitions;

  // [gpipe]
  // Skips cross partitions directly: the outer "skip" goes from the first partition to the last
  // without passing through the ones in between.
  gpipe::GPipe pipe(model, gpipe::GPipeOptions(balance)
                               .devices(std::vector<c10::Device>(partitions, at::kCPU))
                               .chunks(absl::GetFlag(FLAGS_chunks)));
  pipe->record_timeline(absl::GetFlag(FLAGS_timeline));
  // [gpipe]
  for (const auto& key : pipe->skip_layout().crossing()) {
    std::printf("skip '%s' crosses partitions\n", key.str().c_str());
  }

  torch::optim::Adam optimizer(pipe->parameters(), torch::optim::AdamOptions(3e-3));
  for (int step = 1; step <= absl::GetFlag(FLAGS_steps); ++step) {
    // Blurry squares; the model learns to remove the noise.
    at::Tensor clean = at::zeros({16, 1, 16, 16});
    for (int64_t k = 0; k < 16; ++k) {
      const int64_t r = at::randint(0, 10, {1}).item<int64_t>();
      const int64_t c = at::randint(0, 10, {1}).item<int64_t>();
      clean[k][0].slice(0, r, r + 6).slice(1, c, c + 6).fill_(1.0);
    }
    at::Tensor noisy = clean + at::randn_like(clean) * 0.3;
    optimizer.zero_grad();
    at::Tensor loss = (pipe->forward(noisy) - clean).pow(2).mean();
    loss.backward();
    optimizer.step();
    if (step == 1 || step % 10 == 0) {
      std::printf("step %3d  loss %.4f\n", step, loss.item<double>());
    }
  }
  if (absl::GetFlag(FLAGS_timeline)) {
    std::printf("\nthe last step's forward (micro-batch per clock tick, * = checkpointed):\n%s",
                gpipe::render_timeline(pipe->last_timeline()).c_str());
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {  // the message, without LibTorch's backtrace
    std::fprintf(stderr, "unet_skips: %s\n", e.what_without_backtrace());
    return 2;
  }
}
