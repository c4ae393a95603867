// The reference's U-Net memory benchmark (torchgpipe's benchmarks/unet-memory): the plain U-Net
// (6, 72) against GPipes of ever larger U-Nets (B convolutions per level, C base channels) over 1,
// 2, 4, 8 partitions with the reference's balances, 32 micro-batches (128 for 8 partitions; a
// batch of 32 gives 32), SGD, two iterations; peak memory less the model's (parameters and
// gradients: 2 x the parameter bytes). Full size on CUDA (192 x 192); on the CPU a reduced size
// (C divided by 8, 64 x 64 images, a batch of 8; every partition on the CPU).
//
//   bazel run -c opt //benchmarks:unet_memory -- --size=reduced
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "benchmarks/reference_runner.h"
#include "examples/models/unet_reference.h"


int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  namespace bench = gpipe::bench;
  const std::string size = absl::GetFlag(FLAGS_size);
  const bool cuda = bench::use_cuda(size, 1);
  const int64_t divide = cuda ? 1 : 8;
  const int64_t image = cuda ? 192 : 64;
  const int64_t batch = cuda ? 32 : 8;
  std::vector<bench::Experiment> experiments;
  auto add = [&](const char* name, int64_t convs, int64_t channels, std::vector<int64_t> balance,
                 int64_t chunks) {
    const int64_t c = channels / divide;
    experiments.push_back({name, [convs, c] { return gpipe::models::unet_reference(5, convs, c); },
                           std::move(balance), batch, chunks, gpipe::Checkpoint::kExceptLast,
                           {3, image, image}, /*classes=*/0});
  };
  // The reference's experiments (benchmarks/unet-memory/main.py).
  add("baseline", 6, 72, {}, 1);  // the plain model: no micro-batches
  add("pipeline-1", 11, 128, {505}, 32);
  add("pipeline-2", 24, 128, {526, 551}, 32);
  add("pipeline-4", 24, 160, {472, 54, 36, 515}, 32);
  add("pipeline-8", 48, 160, {800, 140, 62, 36, 36, 36, 36, 987}, 128);
  return bench::memory_main(absl::StrFormat("U-Net memory (C / %d, %dx%d images, batch %d)", divide, image,
                                    image, batch),
                            experiments, cuda, 2.0, size, absl::GetFlag(FLAGS_child),
                            absl::GetFlag(FLAGS_experiments), absl::GetFlag(FLAGS_json_out));
}

